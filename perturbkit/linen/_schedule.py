"""``interleaved``: update-then-propagate training of an unmodified Linen model.

Walking backward through the model, each segment (a submodule call) gets its
gradient, averaged over devices, and its optimizer step at once; the gradient
for everything the segment consumed is then computed with the UPDATED weights.
Which calls are segments is ``_segmentation``; how a segment updates itself in
the backward pass is ``_segment_vjp``; the optimizer bookkeeping is ``_sweep``.
This file wires them into a pure ``init``/``step`` pair.
"""
from typing import Any, Callable, Mapping, Sequence

import flax
import jax
import jax.numpy as jnp

from perturbkit.linen import _segmentation
from perturbkit.linen._driver import check_variables
from perturbkit.core._boxes import in_containers_of, plain
from perturbkit.core._examples import step_examples
from perturbkit.core._keywords import given, keywords_last, with_keywords
from perturbkit.core._loss import check_loss, check_loss_fn, describe
from perturbkit.errors import (PerturbkitError, SegmentationError, StateMismatchError,
                                UninitializedStateError)
from perturbkit.core._hooks import Hook, hooks_tuple
from perturbkit.core._input_types import TypesSeen
from perturbkit.linen._hooks import with_hooks
from perturbkit.linen._interceptor import suspended
from perturbkit.core._points import COLLECTION
from perturbkit.linen._segments import segmented_loss, with_iteration_state
from perturbkit.core._sweep import Interleaved
from perturbkit.core._sweep import (REST, InterleavedState, Optimizer, Sweep, backward_for, carrier,
                               check_opt_state, check_optimizer, clip_scale, device_mean,
                               finish, group, init_opt_state, input_mismatch, input_shapes,
                               warn_whole_gradient)
from perturbkit.core._types import CallFilter, Variables
from perturbkit.core._validate import interleaved_options
from perturbkit.core._values import jax_arrays
from perturbkit.core._varying import check_unchecked, explaining_unbound_axes

__all__ = ['REST', 'Interleaved', 'InterleavedState', 'interleaved']


def _checked_key(variables: Variables, args: tuple, names) -> tuple:
  """What a segment check depends on: the inputs (by type) and the segments, in any order."""
  return variables, args, tuple(sorted(names))


_INIT_CALL = 'trainer.init(variables, *args)'


def _is_variables(value: Any) -> bool:
  return isinstance(value, Mapping) and 'params' in value


def _kept(variables: Variables) -> dict:
  """The variables a state keeps: unfrozen, without perturbations, and params in the
  metadata boxes they were given in (``nn.with_partitioning``); the sweep sees them
  ``plain``."""
  check_variables(variables, 'perturbkit.interleaved')
  variables = flax.core.unfreeze(variables)
  return {c: v for c, v in variables.items() if c != COLLECTION}


def interleaved(loss_fn: Callable[..., Any], optimizer: Optimizer, *,
                segments: int | CallFilter | None = None, propagate: str = 'updated',
                axis_name: str | None = None, has_aux: bool = False,
                clip_global_norm: float | None = None,
                skip_nonfinite: bool = True, hooks: Sequence[Hook] = ()) -> Interleaved:
  """Interleaved update-then-propagate training for an unmodified Linen model.

  Segments are submodule calls, processed in reverse order of execution. For
  segment k, its output cotangent is the sum of what every later consumer sent
  back (each computed with that consumer's already-updated weights) plus the
  loss's direct contribution; ``dw_k`` is taken at the old ``w_k`` (then
  ``pmean``-ed over ``axis_name``), ``w_k`` takes its optimizer step, and the
  cotangents for everything segment k consumed are computed at the new ``w_k``.
  Glue code, skip connections and outputs used several times are exact.
  Params owned by no segment get their ordinary gradient and are updated at the
  end. Mutable collections (``batch_stats``) are updated as the model's own
  ``apply(..., mutable=...)`` would; rng users see the same random numbers in
  the weight-gradient and input-gradient replays of a segment.

  A segment's params must be read only by its own call, since the step taken
  inside the sweep sees only what flows back through the call. This is
  checked on the traced computation (every equation reading a segment's
  params): tied weights, ``attend`` calls and loss terms on the weights are
  found, never silently dropped from the step.

  Each segment has its own optimizer state, so transformations that look at
  the whole gradient (``optax.clip_by_global_norm``) act per segment (one
  optimizer holding one warns, ``PerSegmentTransformWarning``), and a mask or
  label tree built for the whole params (``optax.adamw(mask=tree)``,
  ``optax.multi_transform``) raises ``SegmentOptimizerError``: give it as a
  function of the params it is given. For a global norm, ``clip_global_norm=c`` scales every gradient of a step by
  ``min(1, c / n)`` where ``n`` is the PREVIOUS step's global norm (no second
  backward pass; the first step is not clipped). A learning-rate schedule counts the
  steps in each segment's state, as in optax; to set a hyperparameter by hand with
  ``optax.inject_hyperparams``, set it in every segment's state (``REST``'s too):
  ``for s in state.opt_state.values(): s.hyperparams['learning_rate'] = lr``.

  Args:
    loss_fn: ``(variables, *args, **kwargs) -> loss`` (or ``(loss, aux)`` with
      ``has_aux``), calling ``model.apply(variables, ...)``. Its arguments after the
      variables, positional and keyword, are those given to ``init``/``step``; as under
      ``jax.grad``, a leaf that is no array (a flag, a string) reaches it as it is.
    optimizer: An ``optax.GradientTransformation`` used for every segment, or a
      function ``segment_name -> GradientTransformation`` (per-segment learning
      rates; the unsegmented params are named ``perturbkit.REST``). A
      segment's ``GradientTransformationExtraArgs`` (or a wrapper whose update
      takes ``**extra_args``, ``optax.MultiSteps(...).gradient_transformation()``)
      also gets, as extra arguments, ``segment_inputs`` (the floating-point leaves of the call's
      inputs), ``segment_output_grad`` (the cotangent at its output) and
      ``segment_examples`` (the first axis of the step's first array argument,
      a raw PRNG key ``uint32[2]`` passed before the batch not counted; keyword
      arguments come after the positional ones, in the order of their names),
      e.g. for :func:`kfac_segment`; with either ``propagate`` the segments'
      steps are taken in the sweep, where these are known.
    segments: ``None`` (default) for layer-wise segments: every call of a
      module that owns params directly (Dense, Conv, Embed, LayerNorm, ...),
      also inside ``nn.scan`` (see "Blocks in ``nn.scan``"), and the call of
      an NNX module run through ``nnx.bridge.ToLinen`` (whose own layers are
      no Linen calls); params that
      cannot be updated inside the sweep (a module called twice, tied weights
      read outside their call, params stacked other than along their first
      axis, a call running a module handed to it as an attribute, a call in
      the branches of ``nn.cond``/``nn.switch`` or the body of
      ``nn.while_loop``) go to ``REST`` or to the nearest enclosing call,
      with the reason
      listed by ``segments(...)`` (if none is left, :class:`NoSegmentError`
      says what to change). An ``int`` depth or a call filter (e.g.
      ``filters.by_type(Block)``) chooses coarser segments; for those a shared
      or outside-read segment raises :class:`SharedSegmentError`.
    propagate: ``'updated'`` (propagate with the new weights) or ``'original'``
      (old weights: the result equals ``jax.grad`` + ``optimizer.update``).
    axis_name: Mapped axis to average gradients over (``shard_map``/``pmap``).
    has_aux: Whether ``loss_fn`` returns ``(loss, aux)``; aux goes to metrics.
    clip_global_norm: Optional global-norm clip using the previous step's norm.
    skip_nonfinite: A segment (or the unsegmented group) whose gradient has a
      non-finite entry keeps its params and optimizer state for the step, and
      ``metrics['segment_skipped'][name]`` / ``metrics['skipped']`` report it
      (default); if false, the step is applied as it is and only
      ``metrics['nonfinite'][name]`` reports it.
    hooks: Backward hooks (:func:`perturbkit.backward_hook`, one or a list), the same as
      passing ``with_hooks(loss_fn, *hooks)`` as the loss (with ``axis_name``,
      a hook sees its device's gradient of its own loss: for a mean loss over
      ``D`` devices, ``D`` times the whole batch's, so a hook that is not
      linear, a clip, acts at that scale): a hooked call's hook
      transforms the cotangent its segment's ``dw`` and input cotangent see,
      also for calls inside a segment (matched by their full path) and in the
      ``'updated'`` replay.

  Returns:
    An :class:`Interleaved` with pure ``init`` and ``step``.

  Raises:
    NotAnOptimizerError: ``optimizer`` is not an optax transformation (or a
      function returning one); for ``optax.MultiSteps`` pass its
      ``.gradient_transformation()``.
    WrongFrontEndError: ``init`` was given an NNX model (use
      ``perturbkit.nnx.interleaved``).
    UninitializedStateError: ``step`` was given something other than the
      state ``init`` returns (the variables themselves).
    InputMismatchError: ``step``'s inputs differ from ``init``'s beyond the
      batch size and the model cannot run on them.
    StateMismatchError: the state's params do not fit the loss's model.
    NoSegmentError: no call of the loss can be a segment (``init``,
      ``segments``).
    NotAHookError: ``hooks`` holds something else than hooks.
    LookaheadParamsError: (from ``init``) the optimizer contains ``optax.lookahead``,
      whose params must be ``optax.LookaheadParams``.
    UnmatchedFilterError: a hook's filter selects no call of the loss.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, optax
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(1)])
    >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
    >>> loss_fn = lambda v, x, y: jnp.mean((model.apply(v, x) - y) ** 2)
    >>> tx = perturbkit.interleaved(loss_fn, optax.sgd(0.1))
    >>> state = tx.init(model.init(jax.random.key(0), x), x, y)
    >>> state, metrics = jax.jit(tx.step)(state, x, y)
    >>> sorted(metrics['grad_norm'])
    ['layers_0', 'layers_2']

  The pair:
    ``init(variables, *args, **kwargs) -> state`` and ``step(state, *args, **kwargs) ->
    (state, metrics)`` are pure and jittable; ``segments(variables, *args, **kwargs)`` returns the
    segments in execution order (``Segmentation(segments=('Dense_0', ...),
    rest={...})``) and, in ``rest``, the modules left to ``perturbkit.REST``
    with the reason. ``init`` and ``segments`` take example arguments, since
    segments are the calls the loss makes. The step walks backward segment by
    segment: the gradient dL/dw of the segment, ``pmean`` across devices, the
    optimizer step right away, and only then the gradient for the segment
    below, computed with the UPDATED weights.

  ``propagate='updated'`` and ``propagate='original'``:
    * ``'updated'`` (default): each segment is a ``jax.custom_vjp`` replay of
      the call, and JAX differentiates everything between segments, so skip
      connections, glue code and outputs used twice are exact.
    * ``'original'`` computes the cotangents below at the old weights, and so
      equals ``jax.grad`` + ``optimizer.update`` (tested for sgd, adam,
      clip+adamw, nesterov, BatchNorm + Dropout).
    * With plain SGD at a large step, ``'updated'`` can diverge where the
      standard step does not (seen at learning rates 0.05 and 0.1 on the demo
      CNN; an independent hand-written version of the rule diverges at the same
      step), so keep SGD's step small.

  Segments:
    * The default is a layer-by-layer schedule: every call of a module that
      owns params directly (Dense, Conv, Embed, LayerNorm, BatchNorm, attention
      projections) is its own segment. ``segments=1`` makes the top-level calls
      the segments. A coarse segment costs more:
      its forward runs again at its new weights (a Transformer block as one
      segment, about 1.4-1.5x the standard step).
    * A segment's params are read only by its own call: each segment is one
      named ``custom_vjp`` equation, and any other equation taking its params
      (a tied LM head using the embedding matrix, ``Embed.attend``, a loss term
      on the weights, a module called twice) is a read outside it. The default
      segments leave such modules to ``REST`` (listed in ``rest``); segments
      you choose raise ``SharedSegmentError`` naming the segment and what reads
      it. A read that reaches the loss only through ``jax.lax.stop_gradient``
      adds nothing to the gradient and does not exclude a segment
      (``tests/test_stop_gradient_reads.py``).
    * A module that owns params directly around modules that own params too
      (ViT's embeddings: a class token around the patch convolution) is one
      segment with them. Own params the loss does not read on the example
      arguments (Hugging Face Wav2Vec2's ``masked_spec_embed``, read only with
      ``mask_time_indices``) do not make it one: they go to ``REST`` (listed
      in ``rest``), where weight decay updates them as in the standard step,
      and the layers inside are segments. A later step that reads them gives
      them their ordinary gradient there.
    * A call a module makes inside its own call (a method calling another of
      its methods, or ``super().__call__(x)`` in a subclass such as a LoRA
      ``nn.Dense``) is part of that call, not a second use of its params.
    * A segment's call may run only modules inside it: one handed a module
      that lies elsewhere in the model as an attribute (BART's encoder and
      decoder run the model's shared embedding ``model/shared``) would replay
      without that module's params and could not update them, so the default
      leaves it to ``REST`` and choosing it raises ``SharedSegmentError``
      naming both; its layers can still be segments.
    * When no module is left to be a segment, ``NoSegmentError`` says why and
      what to change: a loss that applies the model twice (siamese) calls
      every layer twice, so apply it once on the inputs concatenated along the
      batch axis; a weight penalty in the loss reads every param outside its
      call, so give it to the optimizer (``optax.add_decayed_weights``).
    * Params owned by no segment (``perturbkit.REST``) get their ordinary
      gradient and are updated at the end of the sweep.

  Blocks in ``nn.scan``:
    A scan with ``variable_axes={'params': 0}`` hands each iteration a slice of
    params stacked ``(L, ...)``. Each of its segments (every layer by default;
    the whole block with ``segments=1`` or a filter selecting the scanned
    module) is a segment per iteration: walking backward through the scan,
    iteration ``i``'s slice takes its step before the gradient goes on to
    iteration ``i - 1``, computed with the updated slice, exactly as for the
    same blocks unrolled (``tests/test_interleaved_scan.py``, with dropout,
    BatchNorm and ``nn.remat`` inside the scan, and ``kfac_segment``). Its
    optimizer state is one per iteration, stacked along the first axis
    (``jax.vmap`` of ``init``), as the unrolled blocks would each have their
    own, and ``listing.iterations`` (from ``segments(...)``) gives ``L``;
    ``metrics['activation_grad_norm'][name]`` has shape ``(L,)``. The carrier
    of each iteration's step rides in the params, so the scan needs nothing
    more than its usual ``variable_axes``. ``nn.vmap`` over params stacked
    the same way (an ensemble) makes a segment per member.
    ``perturbkit.nnx.interleaved`` does the same for ``nnx.scan`` over modules
    made with ``nnx.vmap``.

  Optimizers, clipping, BatchNorm, dropout, metrics:
    * ``optimizer`` as a function ``segment_name -> GradientTransformation``
      (names as in ``tx.segments(...)``, and ``perturbkit.REST``) gives
      per-segment learning rates or per-segment K-FAC
      (``perturbkit.kfac_segment``).
    * Mutable collections (``batch_stats``) are updated once per step; rng
      users (dropout) draw the same numbers in every replay of a segment, and
      the same as the plain model.
    * ``metrics`` holds ``'loss'``, ``'grad_norm'[name]`` (the norm of the
      segment's gradient) and ``'activation_grad_norm'[name]`` (the norm of the
      loss's gradient at the segment's output) per segment,
      ``'global_grad_norm'`` (all params, ``REST`` included), the skipped
      non-finite steps (``'segment_skipped'[name]``, ``'skipped'``, or
      ``'nonfinite'[name]`` with ``skip_nonfinite=False``), and ``'aux'`` with
      ``has_aux``.
    * With ``axis_name``, every metric but ``'aux'`` is the whole batch's,
      equal to one device on it (the step minimises the mean of the devices' losses, which
      for a mean loss over equal shards is the whole batch's loss): ``'loss'``
      is averaged over the devices, the gradient norms are those of the
      averaged gradients, the flags come from these (every device skips the
      same steps), and ``'activation_grad_norm'`` is the norm of the whole
      batch's activation gradient, ``sqrt(psum(|g_d|^2)) / D`` for ``D``
      devices with output cotangents ``g_d`` of their own losses, not a
      device's own norm. ``'aux'`` is each device's own, from its shard (what
      it means over the devices is the loss's to say: ``jax.lax.pmean`` a mean
      in the loss, or return what ``out_specs`` should gather).
    * Per-example clipping (DP-SGD) cannot be combined with it: see
      ``perturbkit.dp_sgd`` (``InterleavedClippingError``); optax's own DP
      transformation as the optimizer raises ``OptaxPrivacyError``.
    * Other errors: ``SegmentationError``, ``SharedSegmentError``,
      ``NoSegmentError``,
      ``StateMismatchError`` (a state from another trainer or model),
      ``OptimizerStateError``.

  Many devices, many hosts:
    ``step`` is an ordinary JAX function. Data-parallel on one host, with
    ``axis_name``::

      from jax.sharding import Mesh, PartitionSpec as P
      mesh = Mesh(jax.devices(), ('data',))
      tx = perturbkit.interleaved(loss_fn, optax.adam(1e-3), axis_name='data')
      step = jax.jit(jax.shard_map(tx.step, mesh=mesh,
                                   in_specs=(P(), P('data'), P('data')),
                                   out_specs=(P(), P()), check_vma=False))

    Each segment's gradient is all-reduced (``pmean``) before its update, and
    for a loss that is a mean over the batch the result, metrics included,
    equals one device on the whole batch (``tests/test_interleaved_multidevice.py``,
    8 host CPU devices). The step minimises the mean of the devices' losses: for a
    loss summed over the examples, that is the whole batch's sum divided by the
    number of devices (and the ``loss`` metric is the mean of the devices' sums). On a
    cluster, run the same script on every host after
    ``jax.distributed.initialize()`` (coordinator address, number of processes
    and process id from the environment or your launcher); ``jax.devices()``
    then lists every host's devices, the mesh spans them, and each host feeds
    its own slice of the batch (``jax.make_array_from_process_local_data``).
    Nothing in perturbkit changes. Two ``jax.distributed`` processes on
    localhost (4 CPU devices each) run the interleaved step under
    ``shard_map`` and equal one process (``tests/test_multiprocess.py``). The
    same holds for ``perturbkit.nnx.interleaved``, and the same ``axis_name``
    argument exists on ``kfac_preconditioner``, ``kfac_segment`` (factors
    ``pmean``-ed over devices) and ``private_grad`` / ``dp_sgd`` (clipped sums
    ``psum``-ed, noise drawn once). With ``axis_name``, ``shard_map`` needs
    ``check_vma=False``: with JAX's default ``check_vma=True`` its reverse mode
    already sums the params' gradient over the devices, and these functions
    raise ``CheckedShardMapError`` rather than count the devices twice.
    Without ``axis_name`` under ``check_vma=True``, each segment steps with its
    gradient summed over the devices, as ``jax.grad`` gives the params' there (a
    mean loss per device then takes steps as large as the number of devices
    times the mean's); the loss and activation gradient norms in the metrics
    are each device's own, so they need an ``out_specs`` that keeps them per
    device.

    Without ``axis_name``, ``jax.jit(tx.step)`` on sharded inputs and params
    (the batch over a ``'data'`` axis, kernels over a ``'model'`` axis, as
    ``nn.with_partitioning`` lays them out) is partitioned by XLA like a
    standard step: the same result, each param keeps its sharding, and
    nothing of an activation's size is sent beyond what the standard step
    sends, only the metrics' scalars (``tests/test_multidevice_grads.py``).

  Tests:
    ``propagate='original'`` is compared with ``jax.grad`` + optax;
    ``'updated'`` with a hand-coded per-layer backward (on GPT-2, per block);
    data parallel on 8 host CPU devices with one device on the whole batch
    (``tests/test_interleaved_multidevice.py``). A perturbkit function called
    inside the loss: "Threads and nesting" in ``help(perturbkit)``.
  """
  segments = interleaved_options(segments, clip_global_norm, propagate, has_aux,
                                 skip_nonfinite)
  check_loss_fn(loss_fn, 'perturbkit.interleaved', '(variables, *args) -> loss')
  check_optimizer(optimizer)
  warn_whole_gradient(optimizer, 'perturbkit.interleaved')
  hooks = hooks_tuple(hooks, 'perturbkit.interleaved')
  if hooks:
    loss_fn = with_hooks(loss_fn, *hooks)
  # Every function below passes the loss's arguments as one tuple, the keywords last.
  loss_fn = keywords_last(loss_fn)
  # What `init` was last given, only to word the error of a step that fails on other inputs.
  at_init: dict = {}
  # (variables, args, segment names) whose segments passed their checks, by type.
  checked = TypesSeen()
  # Segment names -> those that run inside a scan and their number of iterations.
  scanned: dict[tuple[str, ...], Mapping[str, int]] = {}

  def segmentation(variables: Variables, *args, **kwargs) -> _segmentation.Segmentation:
    return _segmentation_of(plain(_kept(variables)), with_keywords(args, kwargs))

  def _segmentation_of(variables: dict, args: tuple) -> _segmentation.Segmentation:
    """The segmentation on ``plain`` variables."""
    if not given(args):
      raise SegmentationError(
          'Segments are calls, which are only known by tracing the loss: pass example '
          'arguments, `init(variables, *args)` / `segments(variables, *args)`, the same '
          'arguments as `step` takes after the state.')
    with suspended(), explaining_unbound_axes('perturbkit.interleaved(...).init'):
      return _segmentation.choose(loss_fn, variables, args, segments)

  def init(variables: Variables, *args, **kwargs) -> InterleavedState:
    kept = _kept(variables)
    variables = plain(kept)
    args = with_keywords(args, kwargs)
    chosen = _segmentation_of(variables, args)
    names = list(chosen.segments)
    checked.add(_checked_key(variables, args, names))
    scanned[tuple(sorted(names))] = chosen.iterations
    at_init['shapes'] = input_shapes(args)
    # The optimizer states of boxed params are boxed as optax makes them (each segment's
    # moments sharded like its params); the sweep sees them plain.
    return InterleavedState(jnp.zeros((), jnp.int32), kept,
                            init_opt_state(optimizer, kept['params'], names, chosen.iterations),
                            jnp.zeros((), jnp.float32))

  def step(state: InterleavedState, *args, **kwargs) -> tuple[InterleavedState, dict]:
    if not isinstance(state, InterleavedState):
      raise UninitializedStateError(
          describe(state) + (' (the model variables?)' if _is_variables(state) else ''),
          _INIT_CALL)
    with suspended():
      return _step(state, with_keywords(args, kwargs))

  def _step(state: InterleavedState, args: tuple) -> tuple[InterleavedState, dict]:
    check_unchecked(axis_name, 'perturbkit.interleaved')
    kept = _kept(state.variables)
    variables = plain(kept)
    params = variables['params']
    opt_state = plain(state.opt_state)
    names = [n for n in opt_state if n != REST]
    # The state's segments must pass every check on this loss and batch: checked unless
    # they passed on inputs of these types (chosen by `init`, or a step before).
    key = _checked_key(variables, args, names)
    if key not in checked:
      try:
        chosen = _segmentation.choose(loss_fn, variables, args, _segmentation.exactly(names))
        scanned[tuple(sorted(names))] = chosen.iterations
      except (flax.errors.ScopeParamShapeError, TypeError, ValueError) as error:
        if isinstance(error, PerturbkitError):
          raise
        mismatch = input_mismatch(at_init.get('shapes'), args, _INIT_CALL)
        if mismatch is not None:
          raise mismatch from error
        if isinstance(error, flax.errors.ScopeParamShapeError):
          raise StateMismatchError(str(error).split('(https')[0].strip()) from error
        raise
      checked.add(key)
    iterations = scanned[tuple(sorted(names))]
    check_opt_state(optimizer, params, opt_state, iterations)
    # A state restored from a checkpoint holds NumPy arrays, a hyperparameter set by hand a
    # Python number: the sweep splits the optimizer state into its floating-point JAX arrays.
    sweep = Sweep(optimizer, jax_arrays(opt_state),
                  clip_scale(clip_global_norm, state.grad_norm), propagate, skip_nonfinite,
                  step_examples(args), iterations)
    swept: dict[str, dict] = {}
    groups = group(params, names)
    carriers = {name: carrier(sweep, name, groups[name]) for name in names}
    forward = segmented_loss(loss_fn, variables, args,
                             {_segmentation.path_of(n): n for n in names},
                             lambda name, opt: backward_for(sweep, name, swept, opt), axis_name,
                             iterations)

    def differentiable(params, carriers):
      # Each scanned segment's carrier and optimizer state ride beside its params,
      # stacked, so that the scan hands each iteration its own.
      params = with_iteration_state(params, {
          _segmentation.path_of(n): (carriers[n], opt_state[n]) for n in iterations})
      out, mutated = forward(params, carriers)
      return check_loss(out, has_aux), (out[1] if has_aux else None, mutated)

    (loss, (aux, mutated)), (grads, carried) = jax.value_and_grad(
        differentiable, argnums=(0, 1), has_aux=True)(params, carriers)
    new_params, new_opt_state, metrics = finish(sweep, params, grads, carried, swept, axis_name)
    loss = device_mean(loss, axis_name)
    global_norm = metrics['global_grad_norm']
    kept_norm = jnp.where(jnp.isfinite(global_norm), global_norm, state.grad_norm)
    new_variables = in_containers_of(kept, {**variables, **mutated, 'params': new_params})
    metrics = {'loss': loss, **metrics}
    if has_aux:
      metrics['aux'] = aux
    return InterleavedState(state.step + 1, new_variables,
                            in_containers_of(state.opt_state, new_opt_state), kept_norm), metrics

  return Interleaved(init, step, segmentation)
