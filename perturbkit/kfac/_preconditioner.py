"""K-FAC as an optax transformation: running factors, damped inverses, preconditioning.

The factors of a batch come from :func:`kfac_estimator` and enter ``update``
as the extra argument ``kfac_stats``; the transformation keeps their running
average (EMA) of the batches taken every ``stats_every`` steps, refreshes the
damped inverses every ``inverse_every`` steps and maps each layer's gradient
``Θ = [∇W; ∇b]`` to ``(A + λI)⁻¹ Θ (G + λI)⁻¹`` (a norm's scale and bias
``∇θ`` to ``∇θ / (F + λ)``, its diagonal Fisher). The learning rate and momentum
come after it in an ``optax.chain``.

Taking the statistics less often than every step costs little accuracy where
it matters: the preconditioner only sees the factors through inverses that are
refreshed every ``inverse_every`` steps, so by default the statistics are taken
on the steps that refresh them (``stats_every = inverse_every``); the EMA then
averages over refreshes instead of over steps.
"""
from typing import Any, NamedTuple

import jax
import jax.scipy.linalg
import jax.numpy as jnp
import optax
from flax import traverse_util

from perturbkit.core._boxes import in_containers_of, plain
from perturbkit.core._precision import widened
from perturbkit.errors import KFACShapeError, KFACUpdateArgsError, NotAnOptimizerError
from perturbkit.kfac._checks import check_layers_given
from perturbkit.kfac._layers import KFACLayers
from perturbkit.kfac._rules import (LayerFactors, LayerInfo, factor_shapes, filled_factors,
                                    params_dtype, precondition)
from perturbkit.core._validate import fraction, positive, positive_int
from perturbkit.core._varying import check_unchecked
from perturbkit.errors import KFACFactorShapeError



class KFACState(NamedTuple):
  """State of :func:`kfac_preconditioner`.

  Attributes:
    count: Updates done so far.
    factors: ``{layer: LayerFactors}``, the running averages of ``A`` and ``G``.
    inverses: ``{layer: LayerFactors}``, ``(A + λI)⁻¹`` and ``(G + λI)⁻¹`` as of
      the last refresh (the diagonal of the first for an Embed; both diagonals,
      ``1 / (F + λ)``, for a norm).
    fallback: The state of the transformation of the other params.
    stats_due: Whether the next ``update`` folds ``kfac_stats`` into the
      factors (a boolean scalar). Pass it to the estimator,
      ``estimate(..., with_stats=state.stats_due)``, so that the statistics
      are computed only on those steps.
  """
  count: jax.Array
  factors: dict[str, LayerFactors]
  inverses: dict[str, LayerFactors]
  fallback: Any
  stats_due: jax.Array


def damped_inverse(factor: jax.Array, damping: float | jax.Array) -> jax.Array:
  """``(F + damping·I)⁻¹`` of a symmetric PSD ``F`` (Cholesky; where ``F``'s rounding
  makes ``F + damping·I`` indefinite, its eigendecomposition with the eigenvalues clamped
  at 0), or ``1 / (F + damping)`` of a diagonal given as a vector, in ``factor``'s dtype
  (JAX's default float dtype for integers), whatever the type of ``damping``.

  Raises:
    InvalidOptionError: a concrete ``damping`` that is not a finite number > 0 (the
      damped factor would not be positive definite).
    KFACFactorShapeError: ``factor`` is neither a vector nor a square matrix (stacked
      factors: ``jax.lax.map`` it).

  Example:
    >>> import jax.numpy as jnp
    >>> from perturbkit import damped_inverse
    >>> damped_inverse(jnp.diag(jnp.array([1.0, 3.0])), 1.0).diagonal().tolist()
    [0.5, 0.25]
  """
  positive('damping', damping)
  factor = jnp.asarray(factor)  # a nested list or a NumPy array too
  if not jnp.issubdtype(factor.dtype, jnp.inexact):
    factor = factor.astype(jnp.result_type(float))
  # The inverse keeps the factor's dtype: a NumPy float64 damping (with jax_enable_x64)
  # does not promote a float32 factor's inverse to float64.
  damping = jnp.asarray(damping, factor.dtype)
  if factor.ndim == 1:
    return 1.0 / (jnp.maximum(factor, 0.0) + damping)
  if factor.ndim != 2 or factor.shape[0] != factor.shape[1]:
    raise KFACFactorShapeError(factor.shape)
  # F is PSD, so F + damping·I is positive definite: Cholesky is enough, and several
  # times cheaper than an eigendecomposition. In floating point F's rounding (about
  # eps·|F|) can be a negative eigenvalue below -damping (a factor of rank less than its
  # size and large entries: the layer before an L2 normalization); Cholesky then gives
  # NaN, and the eigendecomposition with F's eigenvalues clamped at 0 is used instead.
  eye = jnp.eye(factor.shape[0], dtype=factor.dtype)
  cholesky = jax.scipy.linalg.cho_factor(factor + damping * eye, lower=True)
  inverse = jax.scipy.linalg.cho_solve(cholesky, eye)
  inverse = jax.lax.cond(jnp.all(jnp.isfinite(inverse)) | ~jnp.all(jnp.isfinite(factor)),
                         lambda: inverse, lambda: _clamped_inverse(factor, damping))
  return 0.5 * (inverse + inverse.T)


def _clamped_inverse(factor: jax.Array, damping: jax.Array) -> jax.Array:
  """``(F₊ + damping·I)⁻¹``, ``F₊`` the symmetric ``factor`` with its eigenvalues clamped at 0."""
  values, vectors = jnp.linalg.eigh(0.5 * (factor + factor.T))
  return (vectors / (jnp.maximum(values, 0.0) + damping)[None, :]) @ vectors.T


def layer_inverses(info: LayerInfo, factors: LayerFactors, damping: float | jax.Array
                   ) -> LayerFactors:
  """The damped inverses of one layer's factors (each iteration's for a stacked layer).

  A stacked layer's are inverted one iteration after the other (``lax.map``), not as one
  batched Cholesky: jaxlib's CPU kernels for batched Cholesky and triangular solves
  wait for their batch on the thread pool that runs them, and several of them at once
  (a model's layers are independent) hung a 2-core CPU for good.
  """
  invert = lambda f: damped_inverse(f, damping)
  if info.iterations:
    return LayerFactors(*(jax.lax.map(invert, f) for f in factors))
  return LayerFactors(*(invert(f) for f in factors))


def _split(tree: Any, layers: KFACLayers) -> tuple[dict, dict]:
  """``({layer: {leaf: array}}, {path: value})``: the layers' leaves, out of their metadata
  boxes (``nn.with_partitioning``), then the rest as it is (the fallback keeps the boxes)."""
  flat = traverse_util.flatten_dict(tree)
  owned = {info.path: name for name, info in layers.layers.items()}
  per_layer: dict[str, dict] = {name: {} for name in layers.layers}
  rest = {}
  for key, value in flat.items():
    if key[:-1] in owned:
      per_layer[owned[key[:-1]]][key[-1]] = plain(value)
    else:
      rest[key] = value
  return per_layer, rest


def _check_params(layers: KFACLayers, per_layer: dict[str, dict]) -> None:
  for name, info in layers.layers.items():
    leaves = per_layer[name]
    if info.param not in leaves:
      raise KFACShapeError(
          name, f'the params have no {info.param!r} at this path (an optimizer training only '
          "some params, as nnx.Optimizer with a `wrt` filter, gives the preconditioner only "
          'those: find only their layers, `kfac_layers(..., filter=...)`)')
    shape = tuple(jnp.shape(leaves[info.param]))
    if shape != info.kernel_shape:
      raise KFACShapeError(name, f'{info.param!r} has shape {shape}, the layer was found with '
                           f'{info.kernel_shape}')
    if info.use_bias and 'bias' not in leaves:
      raise KFACShapeError(name, "the params have no 'bias' at this path")


def _check_stats(layers: KFACLayers, stats: Any) -> None:
  if not isinstance(stats, dict) or set(stats) != set(layers.layers):
    names = sorted(stats) if isinstance(stats, dict) else type(stats).__name__
    raise KFACShapeError('*', f'kfac_stats has layers {names}, expected '
                         f'{sorted(layers.layers)}')
  for name, info in layers.layers.items():
    expected = factor_shapes(info)
    got = LayerFactors(tuple(jnp.shape(stats[name].a)), tuple(jnp.shape(stats[name].g)))
    if got != expected:
      raise KFACShapeError(name, f'factor shapes {got} do not match the layer ({expected})')


def constrained(preconditioned: dict, grads: dict, norm_constraint: float) -> dict:
  """``preconditioned`` (``v``, by layer and leaf) times ``min(1, sqrt(c / <v, g>))``.

  ``<v, g>`` is summed in at least float32 over every layer; where it is at most ``c``
  (also where rounding makes it slightly negative) the scale is exactly 1.
  """
  inner = sum(jnp.sum(widened(v) * widened(grads[name][leaf]))
              for name, leaves in preconditioned.items() for leaf, v in leaves.items())
  scale = jnp.where(inner > norm_constraint,
                    jnp.sqrt(norm_constraint / jnp.maximum(inner, norm_constraint)), 1.0)
  return jax.tree.map(lambda v: (v * scale).astype(v.dtype), preconditioned)


def kfac_preconditioner(layers: KFACLayers, *, damping: float = 1e-3, decay: float = 0.95,
                        inverse_every: int = 10, stats_every: int | None = None,
                        axis_name: str | None = None,
                        fallback: optax.GradientTransformation | None = None,
                        norm_constraint: float | None = None
                        ) -> optax.GradientTransformationExtraArgs:
  """K-FAC preconditioning of the gradients of ``layers``, as an optax transformation.

  For the conventions (the loss, skipped layers, amortised statistics, per-segment
  K-FAC, how the factors relate to kfac-jax's) see ``help(perturbkit.kfac)``.

  ``update(grads, state, params=None, *, kfac_stats)`` takes the batch's factors
  (the third output of :func:`kfac_estimator`) on the first update and then
  every ``stats_every`` updates (``state.stats_due`` says when; other updates
  ignore them), averages them over ``axis_name`` (inside
  ``shard_map``/``pmap``), keeps their EMA (``decay·old + (1 - decay)·new``
  per batch taken; the first batch is taken as it is), recomputes the damped
  inverses on the first update and then every ``inverse_every`` updates, and returns ``(A + λI)⁻¹ [∇W; ∇b] (G + λI)⁻¹`` for
  each layer (``diag(A + λ)⁻¹ ∇E (G + λI)⁻¹`` for an Embed, ``∇θ / (F + λ)`` for
  a LayerNorm's or RMSNorm's scale and bias). Every other param's
  gradient goes through ``fallback`` (default: unchanged). Chain it with the
  step: ``optax.chain(kfac_preconditioner(layers, norm_constraint=0.1),
  optax.sgd(lr, momentum=0.9))``; without ``norm_constraint``, a step from
  factors still near zero in some direction can blow up (see that option).

  Args:
    layers: From :func:`kfac_layers`.
    damping: Tikhonov damping ``λ`` added to both factors.
    decay: EMA decay of the factors.
    inverse_every: Refresh the inverses every this many updates.
    stats_every: Fold the batch's factors in every this many updates
      (default: ``inverse_every``; 1 is the classic every-step average). Give
      the estimator ``with_stats=state.stats_due`` so that the other steps
      skip the statistics (they are then a plain gradient step).
    axis_name: Mapped axis to average the factors over, or ``None``.
    fallback: Transformation of the params outside ``layers``.
    norm_constraint: ``c`` or ``None`` (default: no constraint). The layers'
      preconditioned gradients ``v`` are scaled by ``min(1, sqrt(c / <v, g>))``,
      ``g`` their gradients, so that their squared norm in the damped Fisher
      metric, ``<v, (F + λ) v> = <v, g>``, is at most ``c``: a bound on the step
      where the factors are still near zero in some direction (early steps, a
      small ``damping``), which untuned K-FAC steps can otherwise blow up. With a
      learning rate ``η`` chained after it, the step's squared norm is at most
      ``η² c``: KFAC-pytorch's ``kl_clip`` κ is ``c = κ / η²``, and kfac-jax's
      ``norm_constraint`` ``n`` is ``c = n / η²``. The params outside ``layers``
      are not scaled.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`KFACState`.

  Raises:
    InvalidOptionError: ``damping`` is not a finite number > 0, ``decay`` not in
      ``[0, 1)``, ``inverse_every``/``stats_every`` not an integer >= 1, or
      ``norm_constraint`` neither ``None`` nor a finite number > 0.
    KFACLayersTypeError: ``layers`` is not the ``KFACLayers`` (e.g. ``layers.layers``).
    NotAnOptimizerError: ``fallback`` is not an optax transformation (e.g. ``'adam'``).
    KFACShapeError: the params, gradients or factors do not match ``layers``.
    KFACUpdateArgsError: ``update`` is called without ``kfac_stats=``.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, optax
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(3)])
    >>> x, y = jnp.ones((8, 5)), jnp.zeros((8,), jnp.int32)
    >>> variables = model.init(jax.random.key(0), x)
    >>> predict = lambda v, x: model.apply(v, x)
    >>> layers = perturbkit.kfac_layers(predict, variables, x)
    >>> estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers)
    >>> tx = optax.chain(perturbkit.kfac_preconditioner(layers), optax.sgd(0.1))
    >>> opt_state = tx.init(variables['params'])
    >>> loss, grads, stats = estimate(variables, x, y, jax.random.key(1),
    ...                               with_stats=opt_state[0].stats_due)
    >>> updates, opt_state = tx.update(grads, opt_state, variables['params'], kfac_stats=stats)
    >>> opt_state[0].factors['layers_2'].g.shape, bool(opt_state[0].stats_due)
    ((3, 3), False)
  """
  check_layers_given(layers, 'perturbkit.kfac_preconditioner')
  if fallback is not None and not (callable(getattr(fallback, 'init', None))
                                   and callable(getattr(fallback, 'update', None))):
    raise NotAnOptimizerError(f'fallback is {fallback!r:.60} ({type(fallback).__name__})',
                              'Pass an optax transformation, e.g. fallback=optax.adam(1e-3) '
                              '(chained after the preconditioner, the learning rate is '
                              'applied once by the chain).', per_segment=False)
  positive('damping', damping)
  if norm_constraint is not None:
    positive('norm_constraint', norm_constraint)
  fraction('decay', decay)
  positive_int('inverse_every', inverse_every)
  stats_every = inverse_every if stats_every is None else positive_int('stats_every', stats_every)
  fallback = optax.identity() if fallback is None else fallback

  def fold(factors, stats, first):
    if axis_name is not None:
      stats = jax.lax.pmean(stats, axis_name)
    return jax.tree.map(lambda old, new: jnp.where(first, new, decay * old + (1 - decay) * new),
                        factors, stats)

  def init(params: Any) -> KFACState:
    per_layer, rest = _split(params, layers)
    _check_params(layers, per_layer)
    # Each layer's factors in its params' precision (float64 for a float64 layer). The
    # factors and the inverses are arrays of their own: a step that donates the state
    # (`jax.jit(step, donate_argnums=...)`) cannot donate one buffer twice.
    zeros = lambda: {name: filled_factors(info, 0.0, params_dtype(info, per_layer[name]))
                     for name, info in layers.layers.items()}
    return KFACState(jnp.zeros((), jnp.int32), zeros(), zeros(),
                     fallback.init(traverse_util.unflatten_dict(rest)), jnp.ones((), bool))

  def update(updates: Any, state: KFACState, params: Any = None, *, kfac_stats: Any = None,
             **extra_args: Any) -> tuple[Any, KFACState]:
    del extra_args
    check_unchecked(axis_name, 'perturbkit.kfac_preconditioner')
    if kfac_stats is None:
      raise KFACUpdateArgsError('The K-FAC preconditioner needs the batch factors: call '
                                'tx.update(grads, state, params, kfac_stats=stats), with stats '
                                'from perturbkit.kfac_estimator.')
    _check_stats(layers, kfac_stats)
    per_layer, rest = _split(updates, layers)
    _check_params(layers, per_layer)
    # The batch's factors are kept in the state's dtype, the layer's params' precision.
    stats = {name: LayerFactors(*(jnp.asarray(new).astype(old.dtype) for new, old in zip(
                 (kfac_stats[name].a, kfac_stats[name].g), state.factors[name])))
             for name in layers.layers}
    factors = jax.lax.cond(state.stats_due,
                           lambda: fold(state.factors, stats, state.count == 0),
                           lambda: state.factors)
    inverses = jax.lax.cond(
        state.count % inverse_every == 0,
        lambda: {name: layer_inverses(info, factors[name], damping)
                 for name, info in layers.layers.items()},
        lambda: state.inverses)
    preconditioned = {name: precondition(info, per_layer[name], inverses[name])
                      for name, info in layers.layers.items()}
    if norm_constraint is not None:
      preconditioned = constrained(preconditioned, per_layer, norm_constraint)
    out = {}
    for name, info in layers.layers.items():
      for leaf, value in preconditioned[name].items():
        out[info.path + (leaf,)] = value
    rest_params = None
    if params is not None:
      rest_params = traverse_util.unflatten_dict(_split(params, layers)[1])
    rest_updates, fallback_state = fallback.update(
        traverse_util.unflatten_dict(rest), state.fallback, rest_params)
    out.update(traverse_util.flatten_dict(rest_updates))
    count = state.count + 1
    return (in_containers_of(updates, traverse_util.unflatten_dict(out)),
            KFACState(count, factors, inverses, fallback_state, count % stats_every == 0))

  return optax.GradientTransformationExtraArgs(init, update)
