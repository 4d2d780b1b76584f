"""DP-SGD from one backward pass: clip each example's gradient, sum, add noise, average.

The clipped sum ``sum_i c_i ∇term_i``, ``c_i = min(1, C / ‖∇term_i‖)``, is never
formed from per-example gradients: for each use of each param-owning module it
is one VJP of that call with the output gradient scaled per example by ``c_i``
(book-keeping: for a Dense layer exactly ``sum_i c_i a_iᵀ g_i``, one matmul;
other layers replay only their own call). The norms come from
``per_example_grad_norms``'s rules, in the same pass.

Data parallel (``shard_map``): each device clips its own examples; the clipped
sums and example counts are ``psum``-ed over ``axis_name``, and the Gaussian
noise ``σC·ξ`` is drawn AFTER the psum from the ``key`` argument of the first
device along ``axis_name`` (pass it replicated, e.g. ``in_specs=P()``). Every
device then draws the same ``ξ``, so the noise enters once, not once per device, and the
result is replicated.

The interleaved schedule is not supported: clipping needs each example's norm
over ALL layers before any layer's update, but the interleaved sweep updates
the top segments before the gradients of the lower ones exist. Combining them
either way (a ``dp_sgd`` trainer as the optimizer of ``interleaved``, or an
``interleaved`` trainer as the optimizer of ``dp_sgd``) raises
:class:`InterleavedClippingError`.
"""
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from perturbkit.core._boxes import in_containers_of, plain
from perturbkit.core._values import is_array, values_closed_over
from perturbkit.core._keys import check_key
from perturbkit.linen._driver import check_variables
from perturbkit.per_example._batch import BatchAxes, check_batch_axes
from perturbkit.core._lookahead import refuse_lookahead
from perturbkit.core._optax_privacy import refuse_optax_privacy
from perturbkit.per_example._accumulation import refuse_accumulation, refuse_accumulation_state
from perturbkit.per_example._check import reduction_checker
from perturbkit.errors import InterleavedClippingError
from perturbkit.per_example._norms import all_layer_norms, check_dense_method, flat_squares
from perturbkit.per_example._pass import Pass, run_pass
from perturbkit.per_example._reads import at_path
from perturbkit.per_example._replay import Pair, weighted_grad
from perturbkit.per_example._rules import LayerNorms
from perturbkit.core._sweep import guarded_step
from perturbkit.core._types import Path
from perturbkit.core._validate import non_negative, positive
from perturbkit.core._varying import check_unchecked, summed_like
from perturbkit.core._naming import named_after
from perturbkit.errors import NotAnOptimizerError, UninitializedStateError
from perturbkit.core._loss import check_loss_fn, describe


def clip_factors(norms: jax.Array, clip_norm: float) -> jax.Array:
  """``min(1, C / norm)`` per example (1 for a zero gradient; 0 for a non-finite norm)."""
  return jnp.where(jnp.isfinite(norms), clip_norm / jnp.maximum(norms, clip_norm), 0.0)


def _rows(kept: jax.Array, x: jax.Array) -> jax.Array:
  return kept.reshape((-1,) + (1,) * (x.ndim - 1))


def _finite_rows(x: jax.Array, kept: jax.Array) -> jax.Array:
  """``x`` with the non-finite entries of the rows not ``kept`` set to zero."""
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return x
  return jnp.where(_rows(kept, x) | jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def without_dropped(pair: Pair, kept: jax.Array) -> Pair:
  """``pair`` with the dropped examples' rows made finite, so that weight 0 removes them.

  Their output-gradient rows become zero and the non-finite entries of their rows
  of the per-example inputs zero (``0 · NaN`` would be NaN in the weighted VJP).
  """
  leaves, treedef = jax.tree.flatten((pair.args, pair.kwargs))
  kinds = iter(pair.use.sources)
  leaves = [_finite_rows(jnp.asarray(x), kept) if is_array(x) and next(kinds) == 'example'
            else x for x in leaves]
  args, kwargs = jax.tree.unflatten(treedef, leaves)
  grad = jax.tree.map(lambda g: jnp.where(_rows(kept, g), g, jnp.zeros((), g.dtype)),
                      pair.grad)
  return pair._replace(args=tuple(args), kwargs=dict(kwargs), grad=grad)


def weighted_sum(result: Pass, norms: dict[Path, LayerNorms], weights: jax.Array,
                 params: Any) -> Any:
  """``sum_i weights[i] ∇term_i``, shaped like ``params``; an example of weight 0 adds nothing.

  From the per-example gradients where a rule kept them, else by one VJP per use
  with the output gradient scaled per example (for Dense, one matmul). An
  example of weight 0 adds nothing even where its gradient is not finite.
  """
  kept_rows = weights != 0
  pair_weights = weights * result.scale  # the pairs hold the loss's gradients
  flat = {}
  for layer in result.layers:
    kept = norms[layer.path].per_example
    if kept is not None:
      # Like the VJPs below, summed over the devices where the params are the same on each.
      total = {k: summed_like(jnp.tensordot(weights.astype(v.dtype), _finite_rows(v, kept_rows),
                                            axes=1), layer.direct[k])
               for k, v in kept.items()}
    else:
      total = {k: jnp.zeros_like(v) for k, v in layer.direct.items()}
      for pair in layer.pairs:
        grads = weighted_grad(without_dropped(pair, kept_rows), layer.params, pair_weights)
        total = {k: total[k] + grads[k] for k in total}
      for read in layer.reads:  # a tied head: its weighted gradient, pulled back
        given = weighted_grad(without_dropped(read.pair, kept_rows), read.params,
                              pair_weights)
        grads = at_path(read.pullback(given), layer.path)
        total = {k: total[k] + grads[k].astype(total[k].dtype) for k in total}
    flat.update({layer.path + (k,): v.astype(layer.direct[k].dtype) for k, v in total.items()})
  order = traverse_util.flatten_dict(dict(params))
  return traverse_util.unflatten_dict({k: flat[k] for k in order})


def finite_step(optimizer: optax.GradientTransformation, grads: Any, opt_state: Any,
                params: Any) -> tuple[Any, Any, jax.Array]:
  """One optimizer step, kept only where the gradient is finite: ``(params, opt_state, finite)``.

  A non-finite gradient keeps the old params and optimizer state. The choice is
  an elementwise select, which XLA fuses into the update, so the guarded step
  needs no memory beyond the unguarded one (a ``lax.cond`` holds the new params
  and state apart from the old: 0.7 MB more for a 333k-param MLP, 1.6x the
  plain step's memory instead of 1.4x).
  """
  new_params, new_opt_state, finite = guarded_step(optimizer, grads, opt_state, params,
                                                   jnp.ones(()), guard=False)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  return keep(new_params, params), keep(new_opt_state, opt_state), finite


NOISE_CHUNK = 2 ** 14  # elements: the smallest draw a leaf is split into
NOISE_CHUNKS = 16  # the most draws one leaf is split into


def noise_rows(size: int) -> int:
  """Into how many equal draws a leaf of ``size`` elements is split (1: drawn whole).

  The largest divisor of ``size`` that is at most ``NOISE_CHUNKS`` and leaves
  draws of at least ``NOISE_CHUNK`` elements.
  """
  most = min(NOISE_CHUNKS, size // NOISE_CHUNK)
  return max((m for m in range(1, most + 1) if size % m == 0), default=1)


def add_noise(key: jax.Array, tree: Any, stddev: jax.Array) -> Any:
  """``tree`` plus independent ``N(0, stddev²)`` noise in every entry.

  The stream: ``key`` is split into one key per leaf (in ``jax.tree.leaves``
  order); a leaf of ``n`` entries is flattened into ``m = noise_rows(n)`` equal
  rows, and row ``j`` gets ``jax.random.normal(jax.random.split(leaf_key, m)[j],
  (n // m,))``. The rows are drawn one after the other and added in place, so a
  large leaf holds the random bits of one row at a time rather than of the whole
  leaf (a param-sized buffer or more, next to the clipped sum).
  """
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, len(leaves))
  out = []
  for leaf_key, x in zip(keys, leaves):
    rows = noise_rows(x.size)
    if rows == 1:
      out.append(x + stddev.astype(x.dtype) * jax.random.normal(leaf_key, x.shape, x.dtype))
      continue
    row_keys = jax.random.split(leaf_key, rows)

    def add_row(j, flat, row_keys=row_keys):
      draw = jax.random.normal(row_keys[j], flat.shape[1:], flat.dtype)
      return flat.at[j].add(stddev.astype(flat.dtype) * draw)

    out.append(jax.lax.fori_loop(0, rows, add_row, x.reshape(rows, -1)).reshape(x.shape))
  return jax.tree.unflatten(treedef, out)


def first_device_key(key: jax.Array, axis_name: Any) -> jax.Array:
  """The key of the first device along ``axis_name``, on every device.

  The noise of a data-parallel step is drawn once for the whole batch, after
  the psum, so every device must draw the same; a key that differs per device
  (folded with the device index, as for dropout) would give each device other
  noise and let the replicated params drift apart.
  """
  typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
  data = jax.random.key_data(key) if typed else key
  first = jax.lax.all_gather(data, axis_name)
  first = first.reshape((-1,) + data.shape)[0]
  return jax.random.wrap_key_data(first, impl=jax.random.key_impl(key)) if typed else first


def gaussian_noise(key: jax.Array, like: Any, stddev: jax.Array) -> Any:
  """The noise :func:`add_noise` adds to a tree shaped like ``like``."""
  return add_noise(key, jax.tree.map(jnp.zeros_like, like), stddev)


def private_grad(loss_fn: Callable[..., Any], *, clip_norm: float, noise_multiplier: float,
                 reduction: str = 'mean', batch_axes: BatchAxes = 0,
                 axis_name: str | None = None,
                 dense_method: str = 'auto') -> Callable[..., Any]:
  """The DP-SGD gradient of an unmodified model, to feed any optax optimizer.

  See ``help(perturbkit.per_example)`` for the conventions.

  ``(sum_i min(1, C/‖∇term_i‖) ∇term_i + N(0, σ²C²)) / B``, with ``term_i`` the
  loss term of example ``i`` (see :func:`per_example_grad_norms` for the
  requirements on ``loss_fn`` and ``reduction``), ``C = clip_norm``,
  ``σ = noise_multiplier`` and ``B`` the number of examples (over every device
  with ``axis_name``). One forward and one backward pass; layers without a fast
  path replay their own call once more.

  An example whose gradient norm is not finite (a NaN or an infinity in its
  input or its loss term) is dropped: its clip factor is 0, so it adds nothing
  to the sum, and ``metrics['dropped']`` counts such examples. The other
  examples' gradients are unaffected (each example's gradient is its own).
  Privacy accounting: dropping an example only lowers the sum's sensitivity
  (each example still moves it by at most ``C``), so the noise ``σC`` stays
  calibrated and the accounting for ``σ`` and the sampling rate is unchanged.
  The denominator stays ``B``, the number of examples given, dropped ones
  included (a dropped example counts as a zero gradient), so it does not depend
  on the data's values; the mean gradient is then that of the kept examples
  times ``(B - dropped) / B``. Which examples were dropped (and how many) is a
  function of the private data: ``metrics['dropped']`` and
  ``'per_example_norms'`` are not privatized and must not be released.

  Args:
    loss_fn: ``(variables, *args, **kwargs) -> scalar loss``, a sum or mean over examples.
    clip_norm: ``C``, the largest norm an example's gradient may have.
    noise_multiplier: ``σ``; the noise's standard deviation is ``σC``.
    reduction: ``'mean'`` or ``'sum'``.
    batch_axes: The examples axis of each positional argument (see
      :func:`per_example_grad_norms`).
    axis_name: The data-parallel axis under ``shard_map``/``pmap``; the noise is
      then drawn from the first device's ``key`` on every device (pass the same
      key everywhere; one folded with the device index is replaced by the first
      device's, so the replicated params stay the same on every device).
    dense_method: ``'auto'``, ``'ghost'`` or ``'direct'`` for Dense/Conv norms.

  Returns:
    A function ``(variables, key, *args, **kwargs) -> (grads, metrics)``: ``grads``
    shaped like ``variables['params']``; ``metrics`` with ``'loss'``,
    ``'per_example_norms'`` (this device's examples, before clipping),
    ``'fraction_clipped'`` and ``'dropped'`` (the number of examples with a
    non-finite gradient norm, over every device with ``axis_name``).

  Raises:
    InvalidOptionError: ``clip_norm`` is not a finite number > 0, or
      ``noise_multiplier`` not a finite number >= 0.
    ReductionMismatchError: the loss is a sum over the examples and ``reduction``
      is ``'mean'``, or the other way round (see :func:`per_example_grad_norms`).
    ExamplesCoupledError: an example's term is computed from other examples' data
      (a token mean over the whole batch, inputs normalized by their batch).
    PRNGKeyError: (from the returned function) ``key`` is not a JAX random key,
      e.g. an integer seed.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(1)])
    >>> x = jnp.ones((4, 2))
    >>> v = model.init(jax.random.key(0), x)
    >>> loss_fn = lambda v, x: jnp.mean(model.apply(v, x) ** 2)
    >>> dp = perturbkit.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=0.0)
    >>> grads, metrics = jax.jit(dp)(v, jax.random.key(1), x)
    >>> jax.tree.structure(grads) == jax.tree.structure(v['params'])
    True
  """
  check_loss_fn(loss_fn, 'perturbkit.private_grad', '(variables, *args) -> loss')
  positive('clip_norm', clip_norm)
  non_negative('noise_multiplier', noise_multiplier)
  check_dense_method(dense_method)
  batch_axes = check_batch_axes(batch_axes)
  check_reduction = reduction_checker(loss_fn, reduction, batch_axes)

  @named_after(loss_fn)
  def run(variables, key, *args, **kwargs):
    check_variables(variables, 'perturbkit.private_grad')
    check_key(key, 'The DP-SGD step (its `key` argument)')
    given, variables = variables, plain(variables)
    on_arrays, array_args = values_closed_over(loss_fn, args)
    result = run_pass(on_arrays, variables, array_args, kwargs, reduction=reduction,
                      batch_axes=batch_axes, private=True)
    check_reduction(variables, args, kwargs, result.num_examples)
    grads, metrics = privatize(result, variables['params'], key, clip_norm=clip_norm,
                               noise_multiplier=noise_multiplier, axis_name=axis_name,
                               dense_method=dense_method, reduction=reduction)
    return in_containers_of(given['params'], grads), metrics

  return run


def privatize(result: Pass, params: Any, key: jax.Array, *, clip_norm: float,
              noise_multiplier: float, axis_name: str | None, dense_method: str,
              as_grads: Callable[[Any], Any] = lambda tree: tree,
              reduction: str = 'mean') -> tuple[Any, dict]:
  """The DP-SGD gradient and metrics of one pass (either front end's).

  Args:
    result: The pass.
    params: The params as nested dicts, keyed like the pass's layer paths.
    key: The noise key.
    clip_norm: ``C``.
    noise_multiplier: ``σ``.
    axis_name: The data-parallel axis, if any.
    dense_method: For the norms.
    as_grads: Turns the clipped sum (shaped like ``params``) into the tree the
      front end returns (an ``nnx.State`` for NNX) before the noise is added, so
      that the noise's keys follow that tree's leaves.
    reduction: The loss's, so that ``metrics['loss']`` over the devices is the whole
      batch's: the devices' mean for a mean, their sum for a sum.

  Returns:
    ``(grads, metrics)`` as :func:`private_grad` documents them.
  """
  check_unchecked(axis_name, 'perturbkit.private_grad')
  layers = all_layer_norms(result, dense_method)
  norms = jnp.sqrt(functools.reduce(jnp.add, flat_squares(layers).values()))
  factors = clip_factors(norms, clip_norm)
  summed = as_grads(weighted_sum(result, layers, factors, params))
  count = jnp.asarray(result.num_examples, jnp.float32)
  clipped = jnp.mean((norms > clip_norm).astype(jnp.float32))
  dropped = jnp.sum(jnp.logical_not(jnp.isfinite(norms)).astype(jnp.int32))
  loss = result.loss
  if axis_name is not None:
    summed, count, dropped = jax.lax.psum((summed, count, dropped), axis_name)
    clipped = jax.lax.pmean(clipped, axis_name)
    key = first_device_key(key, axis_name)
    whole = jax.lax.psum if reduction == 'sum' else jax.lax.pmean
    loss = whole(loss, axis_name)
  noised = add_noise(key, summed, jnp.asarray(noise_multiplier * clip_norm, jnp.float32))
  grads = jax.tree.map(lambda s: (s / count).astype(s.dtype), noised)
  return grads, {'loss': loss, 'per_example_norms': norms, 'fraction_clipped': clipped,
                 'dropped': dropped}


class PrivateState(NamedTuple):
  """DP-SGD training state, a pytree.

  Attributes:
    step: Number of steps taken.
    variables: The model's collections (``params``, ...).
    opt_state: The optimizer's state.
  """
  step: jax.Array
  variables: dict
  opt_state: Any


class PrivateTraining(NamedTuple):
  """A pair of pure functions, like ``optax.GradientTransformation``.

  It is a trainer, not an optimizer: passed where ``interleaved`` expects an
  optimizer (which it calls with a segment name), it raises
  :class:`InterleavedClippingError`.

  Attributes:
    init: ``(variables) -> PrivateState``.
    step: ``(state, key, *args, **kwargs) -> (state, metrics)``; jittable.
  """
  init: Callable[..., PrivateState]
  step: Callable[..., tuple[PrivateState, dict]]

  def __call__(self, *args, **kwargs):
    raise InterleavedClippingError(
        'A dp_sgd trainer was used as an optimizer (called with '
        f'{", ".join(map(repr, args)) or "no arguments"}), e.g. as the optimizer of '
        '`perturbkit.interleaved`')


def check_optimizer(optimizer: Any, where: str = 'perturbkit.dp_sgd') -> None:
  """Raises unless ``optimizer`` is an optax gradient transformation, other than
  ``optax.MultiSteps``.

  Raises:
    InterleavedClippingError: ``optimizer`` is a trainer (``perturbkit.interleaved(...)``).
    PrivateAccumulationError: ``optimizer`` is an ``optax.MultiSteps``.
    NotAnOptimizerError: anything else without ``init`` and ``update``.
  """
  refuse_accumulation(optimizer, where)
  if not (callable(getattr(optimizer, 'init', None))
          and callable(getattr(optimizer, 'update', None))):
    if callable(getattr(optimizer, 'step', None)) and hasattr(optimizer, 'init'):
      raise InterleavedClippingError(
          f'dp_sgd was given a trainer ({type(optimizer).__name__}, e.g. '
          '`perturbkit.interleaved(...)`) as its optimizer')
    # flax.nnx.Optimizer holds the model's optimizer state beside its optax transformation.
    hint = (f'Pass the optax transformation this {type(optimizer).__name__} was built with '
            '(its `tx`): DP-SGD keeps the optimizer state in its own training state.'
            if hasattr(getattr(optimizer, 'tx', None), 'update') else '')
    raise NotAnOptimizerError(f'it is a {type(optimizer).__name__}', hint, per_segment=False)


def dp_sgd(loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation, *,
           clip_norm: float, noise_multiplier: float, reduction: str = 'mean',
           batch_axes: BatchAxes = 0, axis_name: str | None = None,
           dense_method: str = 'auto') -> PrivateTraining:
  """DP-SGD training (any optax optimizer) as an ``init``/``step`` pair.

  The conventions (non-finite examples and steps, data parallel DP-SGD, refused
  combinations, privacy accounting, and the per-example rules it shares with
  :func:`per_example_grad_norms`) are in ``help(perturbkit.per_example)``.

  Each step takes :func:`private_grad`'s clipped, noised mean gradient and
  applies ``optimizer`` to it. ``key`` must differ from step to step (e.g.
  ``jax.random.fold_in(key, state.step)``); with ``axis_name``, the first
  device's key draws the noise for every device.

  Examples with a non-finite gradient are dropped from the clipped sum
  (``metrics['dropped']``; see :func:`private_grad` for what that means for the
  privacy accounting). If the noised gradient is still not finite, the step
  keeps the params and the optimizer state and ``metrics['skipped']`` is true,
  as the interleaved trainer does; ``state.step`` still counts the step (the
  batch was looked at, so it counts for the accounting).

  Args:
    loss_fn: ``(variables, *args, **kwargs) -> scalar loss``, a sum or mean over examples.
    optimizer: Any optax gradient transformation.
    clip_norm: ``C``.
    noise_multiplier: ``σ``.
    reduction: ``'mean'`` or ``'sum'``.
    batch_axes: The examples axis of each positional argument.
    axis_name: The data-parallel axis under ``shard_map``/``pmap``.
    dense_method: ``'auto'``, ``'ghost'`` or ``'direct'``.

  Returns:
    A :class:`PrivateTraining`.

  Raises:
    InvalidOptionError: ``clip_norm`` or ``noise_multiplier`` is out of range.
    ReductionMismatchError: (from ``step``) the loss's reduction is not ``reduction``.
    PRNGKeyError: (from ``step``) ``key`` is not a JAX random key.
    InterleavedClippingError: ``optimizer`` is a trainer such as
      ``perturbkit.interleaved(...)``: per-example clipping and the interleaved
      schedule do not combine.
    OptaxPrivacyError: (from ``init``) ``optimizer`` contains
      ``optax.contrib.differentially_private_aggregate``, which expects
      per-example gradients.
    PrivateAccumulationError: ``optimizer`` is ``optax.MultiSteps`` (or, from
      ``init``, contains its ``gradient_transformation()``): each step's batch is
      noised on its own, so the accumulated update has ``√k`` times the noise of
      a DP-SGD step on the ``k``-times larger batch.
    LookaheadParamsError: (from ``init``) ``optimizer`` contains ``optax.lookahead``,
      whose params must be ``optax.LookaheadParams``.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, optax
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(1)])
    >>> x = jnp.ones((4, 2))
    >>> loss_fn = lambda v, x: jnp.mean(model.apply(v, x) ** 2)
    >>> tx = perturbkit.dp_sgd(loss_fn, optax.sgd(0.1), clip_norm=1.0, noise_multiplier=1.0)
    >>> state = tx.init(model.init(jax.random.key(0), x))
    >>> state, metrics = jax.jit(tx.step)(state, jax.random.key(1), x)
    >>> int(state.step), metrics['per_example_norms'].shape, int(metrics['dropped'])
    (1, (4,), 0)
  """
  check_loss_fn(loss_fn, 'perturbkit.dp_sgd', '(variables, *args) -> loss')
  check_optimizer(optimizer)
  grad_fn = private_grad(loss_fn, clip_norm=clip_norm, noise_multiplier=noise_multiplier,
                         reduction=reduction, batch_axes=batch_axes, axis_name=axis_name,
                         dense_method=dense_method)

  def init(variables) -> PrivateState:
    check_variables(variables, 'perturbkit.dp_sgd')
    opt_state = optimizer.init(variables['params'])
    refuse_optax_privacy(opt_state, '`perturbkit.dp_sgd`',
                         'the mean gradient dp_sgd has already clipped and noised')
    refuse_accumulation_state(opt_state, 'perturbkit.dp_sgd')
    refuse_lookahead(opt_state, '`perturbkit.dp_sgd`')
    return PrivateState(jnp.zeros((), jnp.int32), dict(variables), opt_state)

  def step(state: PrivateState, key: jax.Array, *args, **kwargs):
    if not isinstance(state, PrivateState):
      raise UninitializedStateError(describe(state), 'trainer.init(variables)')
    grads, metrics = grad_fn(state.variables, key, *args, **kwargs)
    params, opt_state, finite = finite_step(optimizer, grads, state.opt_state,
                                            state.variables['params'])
    variables = {**state.variables, 'params': params}
    metrics = {**metrics, 'skipped': jnp.logical_not(finite)}
    return PrivateState(state.step + 1, variables, opt_state), metrics

  return PrivateTraining(init, step)
