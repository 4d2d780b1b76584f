"""perturbkit for Flax NNX: activation gradients, backward hooks, interleaved training and
K-FAC for unmodified NNX models.

``perturbkit.nnx.value_and_grad(loss_fn)`` mirrors ``nnx.value_and_grad``:
``loss_fn(model, *args)`` is the ordinary NNX loss, and the result holds the
usual parameter gradients next to dL/d(output) of every submodule call.
Backward hooks are the front-end-neutral ``perturbkit.backward_hook``; path
filters for NNX modules are in ``perturbkit.nnx.filters``.

The same features as for Linen, from the same core: the segment custom VJP and
the sweep are shared; only finding the calls differs. NNX has no method
interceptor, so perturbkit swaps each submodule's class for a cached subclass for
the duration of its own traced call, restored in ``finally``, thread-safe, never
touching the caller's model object.

* ``perturbkit.nnx.value_and_grad(loss_fn)`` / ``grad`` mirror
  ``nnx.value_and_grad``: ``grads['params']`` is an ``nnx.State``, and
  ``grads['perturbations']['layers'][0]['__call__']`` is dL/d(output) of
  ``model.layers[0]``.
* ``perturbkit.nnx.with_hooks`` and ``perturbkit.backward_hook``: backward hooks,
  acting as in ``jax.grad`` of the hooked loss: on segment calls, and on the
  calls inside a segment in every replay of it (the one at the new weights too).
* ``perturbkit.nnx.interleaved(loss_fn, tx, wrt=nnx.Param, ...)`` is the pure
  ``init``/``step`` pair (``init(model, *args)``), with the Linen version's
  options, layer-wise default segments and checks (see
  ``help(perturbkit.interleaved)``, many devices and hosts included).
  ``perturbkit.nnx.InterleavedOptimizer(model, tx, loss_fn, *example_args)``
  wraps it like ``nnx.Optimizer``: ``opt.step(model, *args)`` updates the model
  and the optimizer in place (inside ``nnx.jit``) and returns the metrics.
* Filters: ``perturbkit.filters`` serve NNX modules too (``perturbkit.nnx.filters``
  re-exports them); an NNX module's path reads like ``layers/0``.
* Tests compare every result with the Linen twin of the same model,
  ``nnx.Optimizer`` (``propagate='original'``), a hand-coded per-layer backward,
  explicit perturbation arguments and ``jax.jvp``.
* Transforms and Flax's own layers: inside ``nnx.scan`` over stacked modules
  (their state mapped) the gradients, activations and inputs are per
  iteration; inside ``nnx.remat`` and ``nnx.jit`` they are as without the
  transform. The branches of an ``nnx.cond``/``nnx.switch`` share one point
  per call (``'__call__#1'`` in every branch), holding the gradient of the
  branch that ran; the calls after it count on past every branch, and
  branches that make different calls are a ``BranchCallsMismatchError``.
  Calls that a transform carries from step to step (the cell of ``nnx.RNN``,
  ``nnx.fori_loop``) or broadcasts (``nnx.vmap`` with the state broadcast),
  and calls in branches that cannot share points (``graph=False``, an
  ``nnx.cond`` and an ``nnx.switch`` nested in each other), get no point and
  are named in an ``UnperturbedCallsWarning``; the call that runs the
  transform has its point.
  A Linen module inside an NNX model through ``nnx.bridge.ToNNX`` is one call;
  a whole Linen model wrapped in ``ToNNX`` belongs to the Linen functions
  (``WrongFrontEndError`` says how).
* ``python -m perturbkit.demo --api nnx`` runs the demo on the NNX twin of its
  CNN; ``notebooks/05_nnx.ipynb`` walks through an NNX CNN: the layer-by-layer
  update-then-propagate question asked by an NNX user, answered without
  hand-coding the backward pass.

K-FAC on NNX models
-------------------
``perturbkit.nnx.kfac_layers(model, x)`` (``nnx.Linear``/``Conv``/``Embed`` are
the dense/conv/embed layers; ``predict=`` for anything but ``model(x)``),
``perturbkit.nnx.kfac_estimator(loss, layers, predict=None, fisher='sampled')``,
whose ``estimate(model, x, y, key, with_stats=...)`` gives the param gradients as
the ``nnx.State`` that ``nnx.grad`` gives, and
``perturbkit.nnx.kfac_preconditioner``, the same transformation reading and
returning an ``nnx.State`` (or a pure dict): it serves ``nnx.Optimizer``, which
passes ``kfac_stats`` on to ``tx.update``, as well as plain optax on
``nnx.state(model, nnx.Param)``::

    layers = perturbkit.nnx.kfac_layers(model, x)
    estimate = perturbkit.nnx.kfac_estimator('softmax_cross_entropy', layers)
    optimizer = nnx.Optimizer(model, optax.chain(perturbkit.nnx.kfac_preconditioner(layers),
                                                 optax.sgd(1e-2, momentum=0.9)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y, key):
      loss, grads, stats = estimate(model, x, y, key,
                                    with_stats=optimizer.opt_state[0].stats_due)
      optimizer.update(model, grads, kfac_stats=stats)
      return loss

The NNX factors, gradients and steps equal the Linen twin's on an MLP and a CNN
with the same weights and key, and under ``nnx.shard_map`` with ``axis_name``
three ``nnx.Optimizer`` steps on 8 host devices equal one device
(``tests/test_nnx_kfac.py``). As with Linen, ``kfac_layers`` skips a
Linear/Conv/Embed whose params the model also reads outside its own calls (a tied
head ``h @ self.embed.embedding[...].T``, ``embed.attend(h)``, a kernel reused by
hand, a weight penalty in ``predict``), naming the reads; a filter selecting one
raises ``KFACUnsupportedLayerError``. The estimator's checks are those of the
Linen one (``help(perturbkit.kfac)``). Per-segment K-FAC:
``perturbkit.nnx.kfac_segment(layers.layers[name])`` (the same function as
``perturbkit.kfac_segment``: a segment's rule does not depend on the Flax API) as
the optimizer of a segment of ``perturbkit.nnx.interleaved``, with the layers
from ``perturbkit.nnx.kfac_layers``, whose names are the segments' names.

Per-example gradients and DP-SGD on NNX models
----------------------------------------------
``perturbkit.nnx.per_example_grad_norms``, ``private_grad``, ``dp_sgd`` and
``check_per_example`` take the same arguments as the Linen functions, with the
model in place of the variables (``loss_fn(model, *args)``); gradients are the
``nnx.State`` that ``nnx.grad`` gives, ``dp_sgd``'s ``init(model)`` returns an
``NNXPrivateState`` (``state.model()`` is the trained model). The rules, the
clipping and the noise are the Linen ones (``help(perturbkit.per_example)``):
``nnx.Linear``, ``nnx.Conv``, ``nnx.Embed``, ``nnx.LayerNorm`` and ``nnx.RMSNorm``
have the fast rules, any other module owning params is replayed per example.
Layers called inside ``nnx.scan``/``nnx.remat``, the root module's own params, a
weight used inline and calls on inputs the model makes without the examples (a
position embedding at ``jnp.arange``) get theirs from a per-example replay of the
whole model call (``model(x)``). Refused with a named error: ``nnx.BatchNorm`` in
training mode (``ExamplesMixedError``), params read outside every call of the
model (a penalty in the loss; ``ParamsReadOutsideError``), modules owning params
called inside an NNX transform outside any call of the model, and a replayed call
that draws from an ``nnx.Rngs`` stream (``RandomCallError``).
Tested against ``jax.vmap`` of ``nnx.grad`` and the Linen twins
(``tests/test_nnx_per_example.py``).

Caching, interventions and attribution on NNX models
----------------------------------------------------
``perturbkit.nnx.run_with_cache``, ``run_with_edits``, ``activation_patching``,
``attribution_patching``, ``grad_times_activation``, ``layer_integrated_gradients``,
``grad_cam`` (default: every ``nnx.Conv`` call) and ``run_with_interventions`` are the
functions of ``perturbkit.interpret`` (conventions in ``help(perturbkit.interpret)``)
with ``fn(model, *args)``; the edits and interventions are ``perturbkit.interpret``'s
(keyed by the NNX path, ``'layers/0/__call__'``). They run a copy of
the model merged in their own trace, so the model's state does not change; the
results equal the Linen twin's (``tests/test_interpret.py``). Calls inside
``nnx.remat`` and ``nnx.jit`` are read and edited like any other; a call inside
``nnx.scan`` over stacked modules is cached stacked per iteration and edited and
patched per iteration (``'layers/attn/__call__[2]'``); calls inside ``nnx.vmap``
with the module's state broadcast raise ``ActivationsUnavailableError``.

Not yet on NNX
--------------
``wrap``.

Example:
  >>> import perturbkit
  >>> perturbkit.nnx.filters.by_path is perturbkit.filters.by_path
  True
"""
from perturbkit.nnx import filters
from perturbkit.nnx._driver import grad
from perturbkit.nnx._driver import value_and_grad
from perturbkit.nnx._driver import with_hooks
from perturbkit.errors import CaptureConflictError
from perturbkit.interpret._nnx import activation_patching
from perturbkit.interpret._nnx import attribution_patching
from perturbkit.interpret._nnx import grad_cam
from perturbkit.interpret._nnx import grad_times_activation
from perturbkit.interpret._nnx import layer_integrated_gradients
from perturbkit.interpret._nnx import run_with_cache
from perturbkit.interpret._nnx import run_with_edits
from perturbkit.interpret._nnx import run_with_interventions
from perturbkit.errors import NoPerturbationPointsError
from perturbkit.errors import PerturbationsNotAppliedError
from perturbkit.errors import UnperturbedCallsWarning
from perturbkit.errors import UninstrumentableModuleError
from perturbkit.errors import UnmappedPerturbationError
from perturbkit.kfac._nnx_estimator import kfac_estimator
from perturbkit.kfac._nnx_layers import kfac_layers
from perturbkit.kfac._nnx_preconditioner import kfac_preconditioner
from perturbkit.kfac._segment import kfac_segment
from perturbkit.nnx._schedule import InterleavedOptimizer
from perturbkit.nnx._schedule import InterleavedState
from perturbkit.nnx._schedule import interleaved
from perturbkit.nnx._segmentation import SegmentInTransformError
from perturbkit.per_example._nnx import check_per_example
from perturbkit.per_example._nnx import dp_sgd
from perturbkit.per_example._nnx import NNXPrivateState
from perturbkit.per_example._nnx import per_example_grad_norms
from perturbkit.per_example._nnx import private_grad

__all__ = [
    'activation_patching',
    'attribution_patching',
    'CaptureConflictError',
    'check_per_example',
    'dp_sgd',
    'filters',
    'grad',
    'grad_cam',
    'grad_times_activation',
    'interleaved',
    'InterleavedOptimizer',
    'InterleavedState',
    'kfac_estimator',
    'kfac_layers',
    'kfac_preconditioner',
    'kfac_segment',
    'layer_integrated_gradients',
    'NNXPrivateState',
    'NoPerturbationPointsError',
    'per_example_grad_norms',
    'PerturbationsNotAppliedError',
    'private_grad',
    'run_with_cache',
    'run_with_edits',
    'run_with_interventions',
    'SegmentInTransformError',
    'UninstrumentableModuleError',
    'UnmappedPerturbationError',
    'UnperturbedCallsWarning',
    'value_and_grad',
    'with_hooks',
]
