"""Caching, interventions, patching and attribution for Linen models: ``fn(variables, *args)``.

Thin: each function hands the Linen front end's ``traced_points`` to the
front-end-neutral version; ``perturbkit.nnx`` has the same functions for NNX models.
"""
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax

from perturbkit.core import filters
from perturbkit.core._types import CallFilter
from perturbkit.interpret import (_attribution, _cache, _grad_cam, _integrated, _interventions,
                                  _learnable, _patching)
from perturbkit.interpret._cache import Cache
from perturbkit.interpret._learnable import Intervention
from perturbkit.interpret._result import IntegratedGradientsResult, PatchingResult
from perturbkit.linen._traced_points import traced_points


def run_with_cache(fn: Callable[..., Any], *, filter: CallFilter | bool | None = None,
                   return_inputs: bool = False,
                   grads: bool = False) -> Callable[..., tuple[Any, Cache]]:
  """The output of every selected call, from one run of the unmodified model.

  ``fn(variables, *args, **kwargs)`` runs the model (``model.apply(variables,
  ...)``) and returns anything. The returned function takes the same arguments
  and returns ``(fn's output, cache)``; ``cache.outputs`` holds each selected
  call's output at its module path under its point key, like
  ``grads['perturbations']`` of :func:`perturbkit.value_and_grad`
  (``cache.outputs['Dense_0']['__call__']``; ``'__call__#1'`` for a second
  call). Nothing is differentiated unless ``grads=True``. Jittable.

  Args:
    fn: ``(variables, *args, **kwargs) -> output``.
    filter: Which calls to cache (default: all; see ``perturbkit.filters``).
    return_inputs: Also cache each call's ``(args, kwargs)`` in
      ``cache.inputs`` (array leaves; ``None`` for the rest).
    grads: ``fn`` returns a real scalar metric, and ``cache.grads`` holds
      d(metric)/d(output) of every selected call, from the same run and one
      backward pass.

  Returns:
    A function ``(variables, *args, **kwargs) -> (output, Cache)``.

  Raises:
    NonScalarMetricError: ``grads=True`` and ``fn`` returned no real scalar.
    NoPerturbationPointsError: the filter selects no call.
    NotVariablesError: the first argument is not Linen variables.
    WrongFrontEndError: the first argument is an NNX model (use
      ``perturbkit.nnx.run_with_cache``).
    ActivationsUnavailableError: a selected call runs inside a lifted
      transform its values cannot leave (one that does not map the
      perturbations carries none out, and the call is then no point at all,
      with an ``UnperturbedCallsWarning``); leave it out
      with the filter. Calls inside ``nn.remat`` and ``nn.jit`` are cached
      like any other; inside ``nn.scan``/``nn.vmap`` with ``'perturbations'``
      in ``variable_axes``, stacked per iteration like their gradients.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)])
    >>> x = jnp.ones((2, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> out, cache = perturbkit.run_with_cache(model.apply)(variables, x)
    >>> cache.outputs['layers_0']['__call__'].shape
    (2, 4)
    >>> metric = lambda v, x: model.apply(v, x).mean()
    >>> value, cache = perturbkit.run_with_cache(metric, grads=True)(variables, x)
    >>> cache.grads['layers_2']['__call__'].tolist()
    [[0.5], [0.5]]
  """
  return _cache.run_with_cache(traced_points, fn, filter=filter, return_inputs=return_inputs,
                               grads=grads, function='perturbkit.run_with_cache')


def run_with_edits(fn: Callable[..., Any], *,
                   filter: CallFilter | bool | None = None) -> Callable[..., Any]:
  """Runs the unmodified model with edits of the outputs of chosen calls.

  The returned function takes ``(variables, edits, *args, **kwargs)`` and
  returns what ``fn(variables, *args, **kwargs)`` returns when each call named
  in ``edits`` has its output edited (the calls after it see the edited
  value). ``edits`` maps a call's path and point key to an edit, nested like
  the cache (``{'Dense_0': {'__call__': edit}}``) or joined
  (``{'Dense_0/__call__': edit}``; ``'layers/Dense_0/__call__[2]'``: that call
  in the third iteration of an ``nn.scan``); the edits are ``perturbkit.interpret``'s
  ``replace``, ``add``, ``scale``, ``zero_ablate`` and ``mean_ablate``, each
  optionally only at ``positions`` along an ``axis``. Edits are pytrees of
  arrays: ``jax.vmap`` over a stack of them runs many interventions at once,
  and ``jax.grad`` differentiates through their values (under ``jax.jit`` or
  ``jax.vmap``, a position outside the axis gives NaN, see Raises). Replacing an output
  by its cached value gives exactly the unedited run.

  Args:
    fn: ``(variables, *args, **kwargs) -> output``.
    filter: The calls that may be edited (default: all).

  Returns:
    A function ``(variables, edits, *args, **kwargs) -> output``.

  Raises:
    UnknownEditPathError: an edit at a path no selected call has.
    DuplicateEditError: one call given two edits (a joined and a nested key).
    EditShapeError: an edit's value does not broadcast to the call's output.
    PositionOutOfRangeError: a position outside the call's output along the
      axis. Traced positions (edits passed through ``jax.jit``, or a stack of
      positions under ``jax.vmap``) cannot be checked while tracing: one
      outside the axis makes that call's output, and so the returned output,
      NaN instead of silently dropping the edit.
    EditViewError: an edit's ``view`` does not hold its call's output.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import perturbkit
    >>> from perturbkit import interpret
    >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)])
    >>> x = jnp.ones((2, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> edited = perturbkit.run_with_edits(model.apply)
    >>> out = edited(variables, {'layers_0/__call__': interpret.zero_ablate()}, x)
    >>> out.tolist()   # the last layer's bias, zeros at init
    [[0.0], [0.0]]
  """
  return _interventions.run_with_edits(traced_points, fn, filter=filter,
                                       function='perturbkit.run_with_edits')


def activation_patching(fn: Callable[..., Any], *, filter: CallFilter | bool | None = None,
                        axis: int | None = None, positions: Sequence[int] | None = None,
                        view: tuple[int, ...] | None = None,
                        leaves: int | Sequence[int] | None = None,
                        batch_size: int | None = 8,
                        progress: bool = False) -> Callable[..., PatchingResult]:
  """The effect on a metric of putting each call's clean output into the corrupted run.

  ``fn(variables, inputs)`` runs the model and returns a real scalar metric
  (several inputs: pass a tuple and unpack it in ``fn``). The returned function
  takes ``(variables, clean, corrupted)``, caches every selected call's output
  on ``clean``, and for each call (and, with ``axis``, each position along
  that axis) runs ``corrupted`` with that output replaced by its clean value:
  ``effects[i, j] = metric(patched) - metric(corrupted)``. The patched runs
  are cut into at most 8 groups of neighbouring calls: in each, the model up
  to the group's first call runs once, unbatched, and the rest as a
  ``jax.vmap`` over the group's (call, position) pairs, ``batch_size`` pairs
  at a time, which bounds the memory. A patch whose clean value equals the
  corrupted one bit for bit (each position before the first changed token of
  a causal model) is the corrupted run itself: its effect is exactly 0, and in
  batches it does not run (the needed runs go first, and the loop stops after
  the last of them). The compiled sweep holds the model after each group's
  first call once per group. Called outside ``jax.jit``, it compiles itself on
  the first call and reuses the program (see ``help(perturbkit.interpret)``).
  Jittable, and the effects are differentiable
  (``jax.grad``, ``jax.jvp``, under ``jax.jit`` too). Differentiated, every
  patched run runs, the skipped ones too: a patch that changes nothing at
  these inputs still has derivatives (moving the clean input changes what it
  patches in). ``jax.grad`` in batches recomputes each batch in the backward
  pass, which keeps the memory about a batch's.

  Args:
    fn: ``(variables, inputs) -> metric``.
    filter: The calls to patch (default: all).
    axis: Patch one index along this axis of each output at a time (1 for the
      tokens of ``(batch, length, features)`` outputs); ``None``: whole outputs.
    positions: The indices along ``axis`` (default: all, the same number at every
      selected call).
    view: Read ``axis`` and ``positions`` on every selected output reshaped to
      this shape (``-1`` for one axis), e.g. ``(-1, tokens, heads, head_dim)``
      with ``axis=2`` for one row per attention head (see :class:`interpret.Edit`).
    leaves: Which of the arrays each call returns are swept, by index among its
      floating-point arrays: ``0`` for an attention's output beside the weights
      it also returns (Hugging Face's ``(output, weights)``), whose axis 1 is
      heads, not tokens; the others are left as the run makes them. Default:
      every array.
    batch_size: Patched runs per step of the sweep; the memory is about that
      many forward passes' (default 8). ``None``: each group's runs as one
      ``jax.vmap``, the fewest steps and the most memory. On a GPU, larger
      batches or ``None`` are faster where memory allows (a 4-block GPT-2's
      128-run sweep on one H200: 2.4 ms in batches of 8, 0.4 ms with ``None``).
    progress: Show a progress bar (tqdm) of the patched runs done, moved after
      each batch of ``batch_size`` as the compiled sweep runs (also under
      ``jax.jit``, on one device or a batch sharded over several, and under a
      ``jax.vmap`` of the returned function, one sweep per example, where it
      counts the runs of one sweep; not inside ``jax.shard_map``, where every
      device would report its own batches).

  Returns:
    A function ``(variables, clean, corrupted) -> PatchingResult``.

  Raises:
    CallStructureMismatchError: the clean and corrupted inputs make different
      calls, or outputs of other shapes.
    NonScalarMetricError: ``fn`` returned no real scalar.
    PositionOutOfRangeError: a position outside some selected call's output
      (``AxisLengthMismatchError``, its subclass: without ``positions``, calls of
      other lengths along ``axis``).
    EditViewError: ``view`` does not hold some selected call's output.
    InvalidOptionError: ``batch_size`` is not a positive int, or ``progress``
      not a bool.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)])
    >>> clean, corrupted = jnp.ones((2, 3)), jnp.zeros((2, 3))
    >>> variables = model.init(jax.random.key(0), clean)
    >>> metric = lambda v, x: model.apply(v, x).mean()
    >>> result = perturbkit.activation_patching(metric)(variables, clean, corrupted)
    >>> result.paths, result.effects.shape
    (('layers_0/__call__', 'layers_2/__call__'), (2, 1))
    >>> bool(jnp.allclose(result.effects[1, 0], result.clean_metric - result.corrupted_metric))
    True
  """
  return _patching.activation_patching(traced_points, fn, filter=filter, axis=axis,
                                       positions=positions, view=view, leaves=leaves,
                                       batch_size=batch_size,
                                       progress=progress, function='perturbkit.activation_patching')


def attribution_patching(fn: Callable[..., Any], *, filter: CallFilter | bool | None = None,
                         axis: int | None = None,
                         positions: Sequence[int] | None = None,
                         view: tuple[int, ...] | None = None,
                         leaves: int | Sequence[int] | None = None
                         ) -> Callable[..., PatchingResult]:
  """The first-order estimate of :func:`activation_patching`, from one backward pass.

  ``effects[i, j] = (a_clean - a_corrupted) . d metric / d a`` for each call's
  output ``a``, the gradient taken on the corrupted run, the product summed
  over everything but position ``j`` along ``axis`` (everything without
  ``axis``). One forward pass on ``clean``, one forward and backward pass on
  ``corrupted``, whatever the number of calls and positions; the same
  arguments and result as :func:`activation_patching`, so the two compare
  directly. Exact for a metric linear in the activations; close to activation
  patching where the clean and corrupted activations are close.

  Infinite entries: where both runs hold the same infinity (a masked ``-inf``
  attention score in both) the difference is 0 and adds nothing. Where only
  one run masks an entry (the runs are padded differently), the difference
  there is infinite, and times its zero gradient makes every effect of that
  call NaN (activation patching, which runs the patch, stays finite). Pad the
  clean and corrupted inputs alike, or leave such calls out with the filter;
  gradient x activation and integrated gradients, whose directions are the
  output itself, take such entries as 0, at the cost of a longer backward pass.

  Args:
    fn: ``(variables, inputs) -> metric``.
    filter: The calls to attribute (default: all).
    axis: Attribute each index along this axis separately; ``None``: whole outputs.
    positions: The indices along ``axis`` (default: all, the same number at every
      selected call).
    view: Read ``axis`` and ``positions`` on every selected output reshaped to
      this shape (``-1`` for one axis), e.g. ``(-1, tokens, heads, head_dim)``
      with ``axis=2`` for one row per attention head (see :class:`interpret.Edit`).
    leaves: Which of the arrays each call returns are swept, by index among its
      floating-point arrays: ``0`` for an attention's output beside the weights
      it also returns (Hugging Face's ``(output, weights)``), whose axis 1 is
      heads, not tokens; the others are left as the run makes them. Default:
      every array.

  Returns:
    A function ``(variables, clean, corrupted) -> PatchingResult``.

  Raises:
    CallStructureMismatchError: the clean and corrupted inputs make different calls.
    NonScalarMetricError: ``fn`` returned no real scalar.
    PositionOutOfRangeError: a position outside some selected call's output
      (``AxisLengthMismatchError``, its subclass: without ``positions``, calls of
      other lengths along ``axis``).
    EditViewError: ``view`` does not hold some selected call's output.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Dense(4), nn.Dense(1)])   # linear: the estimate is exact
    >>> clean, corrupted = jnp.ones((2, 3)), jnp.zeros((2, 3))
    >>> variables = model.init(jax.random.key(0), clean)
    >>> metric = lambda v, x: model.apply(v, x).mean()
    >>> estimate = perturbkit.attribution_patching(metric)(variables, clean, corrupted)
    >>> measured = perturbkit.activation_patching(metric)(variables, clean, corrupted)
    >>> bool(jnp.allclose(estimate.effects, measured.effects, atol=1e-6))
    True
  """
  return _attribution.attribution_patching(traced_points, fn, filter=filter, axis=axis,
                                           positions=positions, view=view, leaves=leaves,
                                           function='perturbkit.attribution_patching')


def grad_times_activation(fn: Callable[..., Any], *, filter: CallFilter | bool | None = None,
                          axis: int | None = None,
                          positions: Sequence[int] | None = None,
                          view: tuple[int, ...] | None = None,
                          leaves: int | Sequence[int] | None = None
                          ) -> Callable[..., PatchingResult]:
  """Gradient x activation, ``a . d metric / d a``, of every selected call's output.

  The first-order effect of zero-ablating each call's output (at each
  position along ``axis``), with the sign flipped: attribution patching from
  a zero baseline, the gradient taken at ``inputs``. One forward and one
  backward pass. An entry whose gradient is exactly 0 contributes 0, also
  where the output is infinite (a masked ``-inf`` attention score: its
  gradient is 0, and ``0 * inf`` is not taken); an infinite entry with a
  nonzero gradient makes the effect infinite (or NaN).

  Args:
    fn: ``(variables, inputs) -> metric``.
    filter: The calls to attribute (default: all).
    axis: Attribute each index along this axis separately; ``None``: whole outputs.
    positions: The indices along ``axis`` (default: all, the same number at every
      selected call).
    view: Read ``axis`` and ``positions`` on every selected output reshaped to
      this shape (``-1`` for one axis), e.g. ``(-1, tokens, heads, head_dim)``
      with ``axis=2`` for one row per attention head (see :class:`interpret.Edit`).
    leaves: Which of the arrays each call returns are swept, by index among its
      floating-point arrays: ``0`` for an attention's output beside the weights
      it also returns (Hugging Face's ``(output, weights)``), whose axis 1 is
      heads, not tokens; the others are left as the run makes them. Default:
      every array.

  Returns:
    A function ``(variables, inputs) -> PatchingResult`` (``clean_metric`` and
    ``corrupted_metric`` are both the metric at ``inputs``).

  Raises:
    NonScalarMetricError: ``fn`` returned no real scalar.
    PositionOutOfRangeError: a position outside some selected call's output
      (``AxisLengthMismatchError``, its subclass: without ``positions``, calls of
      other lengths along ``axis``).
    EditViewError: ``view`` does not hold some selected call's output.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Dense(4), nn.Dense(1)])
    >>> x = jnp.ones((2, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> metric = lambda v, x: model.apply(v, x).mean()
    >>> result = perturbkit.grad_times_activation(metric, axis=0)(variables, x)
    >>> result.positions, result.effects.shape
    ((0, 1), (2, 2))
  """
  return _attribution.grad_times_activation(traced_points, fn, filter=filter, axis=axis,
                                            positions=positions, view=view, leaves=leaves,
                                            function='perturbkit.grad_times_activation')


def layer_integrated_gradients(fn: Callable[..., Any], *, filter: CallFilter | bool | None = None,
                               axis: int | None = None, positions: Sequence[int] | None = None,
                               view: tuple[int, ...] | None = None,
                               leaves: int | Sequence[int] | None = None,
                               steps: int = 16, method: str = 'gauss_legendre',
                               batch_size: int | None = 8, progress: bool = False,
                               gaps: bool = False
                               ) -> Callable[..., IntegratedGradientsResult]:
  """Integrated gradients of a metric at each selected call's output (layer IG).

  For each call, with output ``a`` on ``inputs`` and baseline ``b`` (zeros, or
  its output on ``baseline`` inputs), the call's output is replaced by ``b +
  alpha * (a - b)`` and the metric differentiated there; ``effects[i, j] =
  (a - b) . integral_0^1 d metric / d output d alpha``, summed over everything
  but position ``j`` along ``axis``. Completeness: a call's effects sum (over
  all positions) to ``metric(inputs) - metric(inputs with that call's output
  replaced by b)``, up to the quadrature's error. That error can be large:
  from a zero baseline through a LayerNorm, whose input is ~0 near the
  baseline, the integrand peaks sharply at the path's start, and 16 nodes may
  attribute a fraction of the change. ``gaps=True`` measures it: one more
  forward run per call, with its output at ``b`` (the path's other end, run
  as :func:`activation_patching` runs its patches), gives
  ``endpoint_metrics`` and ``gaps = effects.sum(positions) - (clean_metric -
  endpoint_metrics)``; take more steps, or a baseline nearer the inputs,
  where a gap is not small against the change. The other calls are not
  edited: each call's path is its own. The (call, node) pairs run as
  :func:`activation_patching`'s runs do: per group of neighbouring calls, the
  model before the group once and the rest as a ``jax.vmap``, ``batch_size``
  at a time. Jittable.

  Infinite entries: where ``a`` and ``b`` are the same infinity (a masked
  ``-inf`` score on ``inputs`` and on ``baseline``), ``a - b`` is 0 and the
  entry does not move. Where only one is infinite (masked scores against the
  zero baseline), the path jumps there from ``b`` to infinity at once: an entry
  whose gradient is 0 at every node contributes 0 (a masked score, at
  ``'gauss_legendre'``'s nodes, all inside ``(0, 1)``), and completeness then
  holds with those entries kept infinite at the baseline, i.e. the jump is not
  counted. A nonzero gradient at some node (``'riemann_trapezoid'``'s first
  node is ``b`` itself, where ``0 * inf`` enters the model) makes the call's
  effects infinite or NaN. For completeness against a baseline, pass baseline
  inputs whose run masks the same entries. (The endpoint run of ``gaps=True``
  puts such entries at ``b`` itself, so there the uncounted jump is part of the
  gap.)

  Args:
    fn: ``(variables, inputs) -> metric``.
    filter: The calls to attribute (default: all).
    axis: Attribute each index along this axis separately; ``None``: whole outputs.
    positions: The indices along ``axis`` (default: all, the same number at every
      selected call).
    view: Read ``axis`` and ``positions`` on every selected output reshaped to
      this shape (``-1`` for one axis), e.g. ``(-1, tokens, heads, head_dim)``
      with ``axis=2`` for one row per attention head (see :class:`interpret.Edit`).
    leaves: Which of the arrays each call returns are swept, by index among its
      floating-point arrays: ``0`` for an attention's output beside the weights
      it also returns (Hugging Face's ``(output, weights)``), whose axis 1 is
      heads, not tokens; the others are left as the run makes them. Default:
      every array.
    steps: Quadrature nodes along the path.
    method: ``'gauss_legendre'`` (numpy's nodes and weights; few steps for a
      smooth metric) or ``'riemann_trapezoid'`` (equally spaced, both ends).
    batch_size: (call, node) pairs per step of the sweep; the memory is about
      that many forward and backward passes' (default 8). ``None``: each
      group's pairs as one ``jax.vmap``.
    progress: Show a progress bar (tqdm) of the (call, node) pairs done, moved
      after each batch of ``batch_size`` (also under ``jax.jit`` and
      ``jax.vmap``; not inside ``jax.shard_map``, as for :func:`activation_patching`).
    gaps: Also run each call at its baseline and return ``endpoint_metrics``
      and ``gaps``, one per call: one forward run per call, few beside the
      ``steps`` backward runs per call, and the model compiled once more,
      forward only (5-15% more compile time for a 2-block GPT-2's 37 calls
      on a CPU). With ``axis``, every position must be swept (a gap is about
      the sum over all of them).

  Returns:
    A function ``(variables, inputs, baseline=None) -> IntegratedGradientsResult``,
    a :class:`PatchingResult` (``clean_metric``: the metric at ``inputs``;
    ``corrupted_metric``: at ``baseline``, or at ``inputs`` for the zero
    baseline) with ``endpoint_metrics`` and ``gaps`` (``None`` without ``gaps``).

  Raises:
    InvalidOptionError: ``steps`` not a positive int (at least 2 for the
      trapezoid rule), an unknown ``method`` or ``batch_size``, ``gaps`` not
      a bool, or ``gaps=True`` with ``positions`` that leave out (or repeat)
      some index along ``axis``.
    CallStructureMismatchError: ``baseline`` makes other calls than ``inputs``.
    NonScalarMetricError: ``fn`` returned no real scalar.
    PositionOutOfRangeError: a position outside some selected call's output
      (``AxisLengthMismatchError``, its subclass: without ``positions``, calls of
      other lengths along ``axis``).
    EditViewError: ``view`` does not hold some selected call's output.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Dense(4), nn.LayerNorm(), nn.Dense(1)])
    >>> x = jnp.ones((2, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> metric = lambda v, x: jnp.tanh(model.apply(v, x)).mean()
    >>> ig = perturbkit.layer_integrated_gradients(metric, gaps=True)
    >>> result = jax.jit(ig)(variables, x)
    >>> zeroed = perturbkit.run_with_edits(metric)(
    ...     variables, {'layers_1/__call__': perturbkit.interpret.zero_ablate()}, x)
    >>> bool(jnp.allclose(result.endpoint_metrics[1], zeroed))
    True
    >>> bool(jnp.allclose(result.effects[1, 0], result.clean_metric - zeroed, atol=1e-6))
    True

    ``layers_0``'s effect is not complete: from zeros, LayerNorm's input is ~0
    near the baseline, where the integrand peaks, and 16 nodes miss most of it.
    The gap says so:

    >>> change = result.clean_metric - result.endpoint_metrics
    >>> (jnp.abs(result.gaps) < 1e-3 * jnp.abs(change)).tolist()
    [False, True, True]
  """
  return _integrated.layer_integrated_gradients(
      traced_points, fn, filter=filter, axis=axis, positions=positions, view=view, leaves=leaves,
      steps=steps, method=method, batch_size=batch_size, progress=progress, gaps=gaps,
      function='perturbkit.layer_integrated_gradients')


def grad_cam(fn: Callable[..., Any], *, filter: CallFilter | bool | None = None,
             upsample: bool | tuple[int, int] = False
             ) -> Callable[..., tuple[Any, dict[str, Any]]]:
  """Grad-CAM maps of convolutions: where in the image their feature maps move the metric.

  For each selected call with feature map ``A`` of shape ``(batch, height,
  width, channels)`` and ``G = d metric / d A``: the channel weights are the
  spatial means of ``G`` and the map is ``relu(sum_c w_c A_c)``, one
  ``(height, width)`` map per example (take the metric as the sum over the
  batch of each example's class score for maps on each example's own scale).
  One forward and one backward pass. Jittable.

  Args:
    fn: ``(variables, images) -> metric``.
    filter: The convolutions (default: every ``nn.Conv`` call;
      ``perturbkit.filters.by_path('Conv_1')`` for one).
    upsample: Resize each map (bilinear) to the images' height and width,
      axes 1 and 2 of channels-last ``(batch, height, width, channels)``
      images (as Flax convolutions take them); or to a given ``(height,
      width)``, whatever the inputs (channels-first pixel values, several
      inputs).

  Returns:
    A function ``(variables, images) -> (metric, maps)``; ``maps`` maps each
    call's path and point key (``'Conv_1/__call__'``) to its ``(batch, height,
    width)`` map.

  Raises:
    FeatureMapShapeError: a selected call's output is not one ``(batch,
      height, width, channels)`` array.
    NonScalarMetricError: ``fn`` returned no real scalar.
    InvalidOptionError: ``upsample`` is no bool or ``(height, width)``, or
      ``upsample=True`` with inputs that are not one image batch.
    ImageLayoutError: ``upsample=True`` and a map larger than the inputs'
      axes 1 and 2: those are not the images' height and width (channels-first
      ``(batch, channels, height, width)`` pixel values, as Hugging Face's
      image processors make them, transposed inside ``fn``).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Conv(3, (3, 3)), lambda h: h.mean(axis=(1, 2)), nn.Dense(2)])
    >>> images = jnp.ones((1, 4, 4, 1))
    >>> variables = model.init(jax.random.key(0), images)
    >>> metric = lambda v, x: model.apply(v, x)[:, 1].sum()
    >>> _, maps = perturbkit.grad_cam(metric, upsample=True)(variables, images)
    >>> maps['layers_0/__call__'].shape
    (1, 4, 4)
  """
  return _grad_cam.grad_cam(traced_points, fn,
                            filter=filters.by_type(nn.Conv) if filter is None else filter,
                            upsample=upsample, function='perturbkit.grad_cam')


def run_with_interventions(fn: Callable[..., Any], interventions: Mapping[str, Intervention], *,
                           filter: CallFilter | bool | None = None) -> Callable[..., Any]:
  """Runs the model with learnable interventions; differentiable in their params only.

  ``interventions`` names each :class:`perturbkit.interpret.Intervention`
  (``steering_vector``, ``gates``, or your own ``(path, init, apply)``); the
  returned function takes ``(variables, params, *args, **kwargs)``, ``params``
  being ``{name: that intervention's params}``
  (:func:`perturbkit.interpret.init_interventions`), and returns what
  ``fn(variables, *args, **kwargs)`` returns with each intervention applied to
  its call's output (in the dict's order where several edit one call). The
  variables are frozen (``jax.lax.stop_gradient``), so ``jax.grad`` with
  respect to ``params`` trains the interventions alone, e.g. with ``optax``.
  Jittable.

  Args:
    fn: ``(variables, *args, **kwargs) -> output``.
    interventions: ``{name: Intervention}``.
    filter: The calls that may be edited (default: all).

  Returns:
    A function ``(variables, params, *args, **kwargs) -> output``.

  Raises:
    InterventionParamsError: ``params`` has other keys than ``interventions``.
    UnknownEditPathError: an intervention at a path no selected call has.
    EditShapeError: an intervention's params do not broadcast to the output.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import perturbkit
    >>> from perturbkit import interpret
    >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)])
    >>> x = jnp.ones((2, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> steer = {'steer': interpret.steering_vector('layers_0/__call__', (4,))}
    >>> run = perturbkit.run_with_interventions(model.apply, steer)
    >>> params = interpret.init_interventions(steer)
    >>> loss = lambda p: jnp.mean((run(variables, p, x) - 1.0) ** 2)
    >>> jax.grad(loss)(params)['steer'].shape
    (4,)
  """
  return _learnable.run_with_interventions(traced_points, fn, interventions, filter=filter,
                                           freeze=jax.lax.stop_gradient,
                                           function='perturbkit.run_with_interventions')
