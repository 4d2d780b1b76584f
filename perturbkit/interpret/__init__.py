"""Caching, interventions, activation patching and attribution patching for unmodified models.

A perturbation point is an additive intervention: perturbkit already places one
after every selected submodule call of an unmodified Flax model, and the same
point can cache the call's output, edit it, or take the gradient of a metric at
it. The functions here are written once over those points; the Linen ones take
``fn(variables, *args)`` (also exported from ``perturbkit``), and
``perturbkit.nnx`` has the same functions, with the same arguments, for
``fn(model, *args)``.

* ``run_with_cache(fn, filter=..., return_inputs=False, grads=False)``:
  ``(output, Cache)`` from one run; ``cache.outputs['Dense_0']['__call__']``
  is that call's output, keyed like ``grads['perturbations']`` of
  :func:`perturbkit.value_and_grad`; with ``grads=True`` (``fn`` returns a
  scalar metric) ``cache.grads`` holds d(metric)/d(output) of every call from
  the same run.
* ``run_with_edits(fn)(variables, edits, *args)``: the model's output with
  each call in ``edits`` edited. Edits (:class:`Edit`) are ``replace``,
  ``add``, ``scale``, ``zero_ablate``, ``mean_ablate``, each optionally only at
  ``positions`` along an ``axis`` (one token), of the output or of a ``view``
  of it (``view=(-1, tokens, heads, head_dim)``, ``axis=2``: one attention
  head of a ``(batch, tokens, heads * head_dim)`` output; ``mean_ablate``'s
  ``where=attention_mask[:, :, None].astype(bool)`` leaves a padded reference
  batch's padding out of the mean); they are pytrees of arrays, so
  ``jax.vmap`` runs a stack of them at once and ``jax.grad`` differentiates
  through them. Positions outside the axis raise ``PositionOutOfRangeError``,
  except traced ones (under ``jax.jit``, or stacked under ``jax.vmap``): there
  one outside the axis turns the edited output, and so the result, into NaN.
* ``activation_patching(fn, axis=..., batch_size=...)(variables, clean,
  corrupted)``: for each call (and position), the metric of the corrupted run
  with that output patched from the clean run, minus the corrupted metric;
  per group of neighbouring calls, the model before the group once and the
  rest one ``vmap`` over (call, position) pairs, ``batch_size`` at a time;
  ``progress=True`` shows a progress bar moved after each batch. With
  ``view=(-1, tokens, heads, head_dim)`` and ``axis=2`` (here and in the
  attribution functions below), the positions are attention heads.
* ``attribution_patching(fn, axis=...)(variables, clean, corrupted)``: the
  first-order estimate ``(a_clean - a_corrupted) . d metric / d a`` at the
  corrupted run, from one backward pass; ``grad_times_activation(fn,
  axis=...)(variables, inputs)``: ``a . d metric / d a``.
* ``layer_integrated_gradients(fn, axis=..., steps=16,
  method='gauss_legendre')(variables, inputs, baseline=None)``: each call's
  output moved from a baseline (zeros, or its output on ``baseline``) to its
  value, ``(a - b) . mean d metric / d a`` along the path (``quadrature``'s
  nodes, swept as the patched runs are); a call's effects sum to
  ``metric(inputs) - metric(that call at b)`` up to the quadrature's error,
  which ``gaps=True`` measures (an :class:`IntegratedGradientsResult` with
  each call's ``endpoint_metrics`` and ``gaps``).
* ``grad_cam(fn, filter=..., upsample=False)(variables, images)``: ``(metric,
  maps)``, ``relu(sum_c mean_hw(d metric / d A)_c A_c)`` per convolution
  (default: every ``nn.Conv``), one ``(batch, height, width)`` map each;
  ``upsample=True`` resizes them to axes 1 and 2 of channels-last images
  (``ImageLayoutError`` where a map cannot come from those: channels-first
  pixel values), ``upsample=(height, width)`` to that size.
* ``run_with_interventions(fn, interventions)(variables, params, *args)``:
  learnable interventions, :class:`Intervention` ``(path, init, apply)``;
  ``steering_vector`` (added, optionally at positions) and ``gates``
  (``output * sigmoid(logits)``, with ``gate_penalty`` for a sparse mask).
  ``params = init_interventions(interventions)`` is a pytree for ``jax.grad``
  and ``optax``; the model's variables are frozen.

Both patching functions return a :class:`PatchingResult`: ``paths`` (rows),
``positions`` (columns), ``effects`` of shape ``(calls, positions)``, and the
clean and corrupted metrics; the labels are static, so everything is jittable.
``result.normalized()`` divides the effects by the clean - corrupted gap (1: the
whole gap recovered), ``result.top(k)`` lists the largest as ``(path, position,
effect)`` and ``result.plot(ax)`` draws the heat map with matplotlib.

Conventions
-----------
* A call's output is its floating-point part, as in ``value_and_grad``: a call
  returning a tuple has a tuple of arrays (``None`` for other leaves); an edit's
  ``scale`` and ``shift`` are then arrays applied to every leaf, or pytrees of
  that structure. Positions index ``axis`` of every leaf. Without
  ``positions`` a sweep covers every position, so every selected call's
  output (each leaf) must have the same length along ``axis``
  (``AxisLengthMismatchError`` lists those that do not: a pooler's
  ``(batch, features)`` output among ``(batch, tokens, features)`` ones, or
  attention weights ``(batch, heads, tokens, tokens)`` returned beside the
  attention's output); leave such calls out with the filter. The sweeps'
  ``leaves=`` picks arrays of each output by index (``leaves=0``: an
  attention's output, not the weights it also returns); the others are
  neither patched nor attributed, and keep what the run makes.
* The cache holds each call's own output, before any edit of that call; the
  calls after an edited one see the edited value.
* Where an edit applies, the result is computed without the old value
  (``jnp.where``): replacing an output by its cached value is exactly the
  unedited run, and ``replace`` gives exactly the value given, also where the
  old value is infinite (a masked ``-inf`` attention score: no ``0 * inf``).
* In gradient x activation and integrated gradients, an entry whose gradient
  is exactly 0 contributes 0, also where its output (or its difference from
  the baseline) is infinite, as at masked ``-inf`` scores; in attribution
  patching, an entry that is the same infinity in both runs (a score masked
  in both) contributes 0. An infinite entry with a nonzero gradient gives an
  infinite or NaN effect (``layer_integrated_gradients`` explains its paths
  through infinite entries).
* The metric is ``fn``'s output and must be a real scalar (reduce the batch,
  e.g. the mean logit difference); patching changes every example of the batch
  at once, and the attributions sum over the batch and every axis but ``axis``.
  For effects per example, ``jax.vmap`` the returned function over examples
  with a metric of one example: ``jax.vmap(activation_patching(metric,
  axis=1), in_axes=(None, 0, 0))(variables, clean, corrupted)``, effects of
  shape ``(examples, calls, positions)``; the sweeps run in lockstep, in one
  computation.
* Effects and Grad-CAM maps are computed in at least float32: a bfloat16
  model's outputs are subtracted, multiplied by their gradients and summed in
  float32, activation patching subtracts the metrics in float32, and every
  ``effects`` array is float32.
* Clean and corrupted inputs must make the same calls with outputs of the same
  shapes (``CallStructureMismatchError`` names the first call that differs).
* Called outside any JAX transform (as in a notebook), the sweeps
  (``activation_patching``, ``attribution_patching``, ``grad_times_activation``,
  ``layer_integrated_gradients``, ``grad_cam``) compile themselves with
  ``jax.jit`` on the first call and reuse the program while the arguments keep
  their shapes: activation patching of a 2-layer GPT-2 took 13 s per call op by
  op, its loops compiled anew each time, and takes 0.03 s compiled. So ``fn``'s
  Python runs when the program is traced, not on every call. Python and NumPy
  scalars and strings among the arguments are constants of the program (another
  value compiles another); an NNX model's state is its input. ``jax.disable_jit()``
  runs a sweep op by op. Under the caller's ``jax.jit``, ``jax.vmap`` or
  ``jax.grad``, a sweep is part of the caller's computation.
* NNX: the functions run a copy of the model merged in their own trace; the
  model's state (batch statistics, RNG counts) is not changed. With dropout
  on, every call therefore draws the same masks (those the model's next own
  call would draw): use ``model.eval()``, or give the model new RNG streams
  (``nnx.reseed``) between calls that should differ.
* Calls inside ``nn.remat`` and ``nn.jit`` (a Hugging Face model with
  gradient checkpointing) or ``nnx.remat`` and ``nnx.jit`` are cached, edited
  and patched like any other: their outputs leave the transform in a mutable
  collection (Linen) or the modules' capture state (NNX).
* Scanned layers: a call inside ``nn.scan`` (with ``'perturbations': 0`` in
  ``variable_axes``, as for ``value_and_grad``), ``nnx.scan`` over stacked
  modules, or a ``vmap`` that maps the perturbations runs once per iteration.
  The cache holds its outputs, inputs and gradients stacked along the scan
  axis, like ``value_and_grad``'s (``cache.outputs['layers']['attn']
  ['__call__'][2]``: the third layer's); the edits, patching and attribution
  address each iteration as its own call, ``'layers/attn/__call__[2]'``, with
  the shape of one iteration's output (positions and ``axis`` as for any
  call). In a scan inside a scan (both mapping the perturbations along axis
  0) a call is stacked along two leading axes and addressed
  ``'__call__[outer][inner]'``. Perturbations stacked along another axis
  (``'perturbations': 1``) are read where the scan put them, also where the
  shapes alone could be read either way (as many examples as iterations).
  Rows of a result list a call's iterations one after another. The edit
  of an iteration is computed inside the scan only where the iteration index
  matches (a ``jnp.where`` for one edited iteration, a ``jax.lax.switch``
  for several), so the scan stays one loop; activation patching's runs of a
  scanned call each run the whole scan, the iterations before the patched one
  included (unrolled layers share them). Calls inside a transform whose
  values cannot come out (``nnx.vmap`` with the module's state broadcast,
  an ``nnx.StateAxes`` that stacks ``nnx.Perturbation`` along another axis
  than the rest of the module's state) raise ``ActivationsUnavailableError``: leave them out
  with the filter, or run a copy of the model built without the transform.
* Hugging Face's ``generate`` (``fn`` returning ``model.generate(ids,
  params=variables['params'], ...).sequences``): the prompt's calls come first
  (``'transformer/h/0/__call__'``), then the calls of the new tokens, inside
  ``generate``'s ``lax.while_loop`` (``'transformer/h/0/__call__#1'``), whose
  edit applies at every new token: a steering vector at both keys steers the
  whole generation. The KV cache ``generate`` makes with ``module.init``
  counts as no call (a model's ``init`` inside ``fn`` never does). The outputs
  of calls inside the loop cannot be cached (``CaptureInJaxTransformError``):
  cache a step of the model instead.

Errors: ``UnknownEditPathError``, ``EditShapeError``, ``EditViewError``,
``PositionOutOfRangeError``, ``AxisLengthMismatchError``, ``NonScalarMetricError``,
``CallStructureMismatchError``, ``FeatureMapShapeError``, ``ImageLayoutError``,
``InterventionParamsError``, ``ActivationsUnavailableError`` (in ``perturbkit.errors``).

Tested against (``tests/test_interpret.py``): Linen's ``capture_intermediates``
(outputs); the model written out by hand, with explicit additive deltas for
``jax.vjp`` (metric gradients, attribution) and with each edit written into it
(edits, each patch of activation patching); an unchunked sweep (the chunked one);
the NNX model against its Linen twin; a tiny Hugging Face GPT-2, whose blocks
return tuples, steered in ``generate`` as by an interceptor written by hand.
``tests/test_interpret_scan.py``: scanned models (and scans inside scans)
against the same layers as a Python loop (edits written in, each patched run,
``jax.grad`` at explicit deltas), and a transformer scanned over ``remat``
against its layers unrolled, on both front ends.
``tests/test_interpret_attribution.py``: integrated gradients against
completeness and ``jax.grad`` of the hand-written model at the same
nodes; Grad-CAM against ``jax.vjp`` of the CNN written out; a steering vector's
gradient against the model with the vector as an explicit parameter, and optax
lowering a loss with it; gates at 1 against the unedited run; NNX against Linen.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn
  >>> from perturbkit import interpret
  >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)])
  >>> x = jnp.ones((2, 3))
  >>> variables = model.init(jax.random.key(0), x)
  >>> _, cache = interpret.run_with_cache(model.apply)(variables, x)
  >>> patch_back = {'layers_0/__call__': interpret.replace(cache.outputs['layers_0']['__call__'])}
  >>> bool((interpret.run_with_edits(model.apply)(variables, patch_back, x)
  ...       == model.apply(variables, x)).all())
  True
"""
from perturbkit.interpret._cache import Cache
from perturbkit.interpret._edits import add
from perturbkit.interpret._edits import apply_edit
from perturbkit.interpret._edits import Edit
from perturbkit.interpret._edits import mean_ablate
from perturbkit.interpret._edits import replace
from perturbkit.interpret._edits import scale
from perturbkit.interpret._edits import zero_ablate
from perturbkit.interpret._integrated import quadrature
from perturbkit.interpret._learnable import gate_penalty
from perturbkit.interpret._learnable import gates
from perturbkit.interpret._learnable import init_interventions
from perturbkit.interpret._learnable import Intervention
from perturbkit.interpret._learnable import steering_vector
from perturbkit.interpret._linen import activation_patching
from perturbkit.interpret._linen import attribution_patching
from perturbkit.interpret._linen import grad_cam
from perturbkit.interpret._linen import grad_times_activation
from perturbkit.interpret._linen import layer_integrated_gradients
from perturbkit.interpret._linen import run_with_cache
from perturbkit.interpret._linen import run_with_edits
from perturbkit.interpret._linen import run_with_interventions
from perturbkit.interpret._result import IntegratedGradientsResult
from perturbkit.interpret._result import PatchingResult

__all__ = [
    'activation_patching',
    'add',
    'apply_edit',
    'attribution_patching',
    'Cache',
    'Edit',
    'gate_penalty',
    'gates',
    'grad_cam',
    'grad_times_activation',
    'init_interventions',
    'IntegratedGradientsResult',
    'Intervention',
    'layer_integrated_gradients',
    'mean_ablate',
    'PatchingResult',
    'quadrature',
    'replace',
    'run_with_cache',
    'run_with_edits',
    'run_with_interventions',
    'scale',
    'steering_vector',
    'zero_ablate',
]
