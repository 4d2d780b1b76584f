"""The training gradient and every layer's Kronecker factors from one forward pass.

The model runs once. Its output cotangents are stacked in lanes: lane 0 is the
gradient of the mean loss at the true targets (the training gradient), the
other lanes carry the Fisher: the gradient of the per-example loss at labels
sampled from the model (``'sampled'``) or the columns of the output Fisher's
square root (``'exact'``). ``jax.vmap`` over the lanes leaves the forward pass
unbatched, so the backward pass is the only part done once per lane. With
``'empirical'`` the training gradient's own backward pass gives the factors.

The statistics can be skipped on most steps (``with_stats=False``, or a traced
flag such as the preconditioner state's ``stats_due``): such a step is a plain
``jax.value_and_grad`` of the loss, with no interception, no Fisher lane and no
factor products, and its stats are NaN: the preconditioner does not use them on
the steps where its ``stats_due`` is false, and folded in by mistake (a step
without statistics where they were due) they turn the factors NaN at once
rather than quietly pulling them towards zero.
"""
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from perturbkit.core._boxes import in_containers_of, plain
from perturbkit.linen._driver import check_variables, value_and_grad
from perturbkit.kfac._checks import (abstract, check_calls, check_kernel_shapes, check_layer_info,
                                     check_layers_given,
                                     check_norm_call, refuse_outside_reads, refuse_override,
                                     signature)
from perturbkit.core._keys import check_key
from perturbkit.errors import (InvalidOptionError, KFACExactFisherError, KFACNoLayersError,
                               KFACOutputError, PRNGKeyError)
from perturbkit.kfac._examples import batch_examples
from perturbkit.kfac._layers import KFACLayers
from perturbkit.kfac._losses import OutputLoss, as_output_loss, mean_loss
from perturbkit.kfac._reads import outside_reads
from perturbkit.kfac._rules import (LayerFactors, batch_factors, call_input, filled_factors,
                                    linen_override_reason, params_dtype)
from perturbkit.core._loss import check_loss_fn
from perturbkit.core._trees import find_in, get_in
from perturbkit.core._types import Variables
from perturbkit.core._validate import flag
from perturbkit.core._varying import typed_like, varying_axes


def absent_stats(layers: KFACLayers, grads: Any) -> dict[str, LayerFactors]:
  """The stats of a step that took none: NaN factors of every layer's shapes, in the
  precision of its params (``grads``, the param gradients as a nested dict, say which).

  The preconditioner folds stats only where its ``stats_due`` is true; NaN makes
  a step without statistics on such a step show at once (NaN factors and
  updates) instead of quietly pulling the running factors towards zero.
  """
  flat = traverse_util.flatten_dict(flax.core.unfreeze(grads))
  leaves = lambda info: {leaf: flat[info.path + (leaf,)]
                         for leaf in (info.param, 'bias') if info.path + (leaf,) in flat}
  return {name: filled_factors(info, jnp.nan, params_dtype(info, leaves(info)))
          for name, info in layers.layers.items()}


def absent_like(absent: dict[str, LayerFactors], taken: Callable[[], Any]) -> Any:
  """``absent`` as the other branch of a ``lax.cond`` whose first is ``taken()``: in the
  dtypes of its stats and varying over the devices as they do. Where float64 is enabled
  (``jax_enable_x64``) ``taken`` is traced abstractly for the dtypes: a layer with float32
  params run on float64 activations has float64 factors; otherwise every factor is float32."""
  if jax.config.jax_enable_x64:
    absent = jax.tree.map(lambda a, s: a.astype(s.dtype), absent, jax.eval_shape(taken))
  return typed_like(absent, taken)


def layer_stats(layers: KFACLayers, captured: Any, output_grads: Any, examples: int
                ) -> dict[str, LayerFactors]:
  """Each layer's batch factors from its calls' captured inputs and output gradients.

  ``captured`` is ``return_inputs``' tree of each call's ``(args, kwargs)`` and
  ``output_grads`` the activation gradients with the lanes leading, both keyed
  by module path and per-call key; ``examples`` is the batch's (the output's
  first axis).
  """
  stats = {}
  for name, info in layers.layers.items():
    calls = find_in(captured, info.path)
    check_calls(name, info.calls, calls)
    inputs = [call_input(*calls[c]) for c in info.calls]
    if info.kind == 'norm':
      for c, x in zip(info.calls, inputs):
        # a stacked layer's calls are checked per iteration
        check_norm_call(name, calls[c][1], jnp.shape(x)[bool(info.iterations):], examples)
    point_grads = get_in(output_grads, info.path)
    stats[name] = batch_factors(info, inputs, [point_grads[c] for c in info.calls], examples)
  return stats


def split_output(result: Any, has_aux: bool) -> tuple[jax.Array, Any]:
  """``(output, aux)`` of what ``predict_fn`` returned (``aux`` is ``None`` without
  ``has_aux``)."""
  output, aux = result, None
  if has_aux:
    if not (isinstance(result, tuple) and len(result) == 2):
      raise KFACOutputError(f'{type(result).__name__} {jax.tree.map(jnp.shape, result)!r}',
                            has_aux)
    output, aux = result
  if not (isinstance(output, jax.Array) and jnp.issubdtype(output.dtype, jnp.inexact)):
    raise KFACOutputError(repr(jax.tree.map(jnp.shape, output)), has_aux)
  return output, aux


def own_key(key: jax.Array, output: jax.Array) -> jax.Array:
  """``key`` folded with this device's index along each ``jax.shard_map`` axis ``output``
  varies over (its shard of the batch), so that devices holding other examples draw their
  labels from other random bits; unchanged outside ``shard_map`` or with ``check_vma=False``,
  where no value says which axes split the batch."""
  for axis in sorted(varying_axes(output)):
    key = jax.random.fold_in(key, jax.lax.axis_index(axis))
  return key


def cotangents(loss: OutputLoss, fisher: str, output: jax.Array, targets: Any,
                key: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """``(mean loss, (1 + L, *output.shape) cotangents)``: the training lane, then the
  Fisher lanes."""
  value, true_grad = jax.value_and_grad(lambda z: mean_loss(loss, z, targets))(output)
  if fisher == 'empirical':
    return value, true_grad[None]
  if fisher == 'sampled':
    require_key(fisher, key, 'variables')
    sampled = jax.lax.stop_gradient(loss.sample(own_key(key, output), output))
    lanes = jax.grad(lambda z: jnp.sum(loss.nll(z, sampled)))(output)[None]
  else:
    if output.ndim != 2:
      raise KFACExactFisherError(output.shape)
    lanes = loss.fisher_sqrt(output)
  return value, jnp.concatenate([true_grad[None], lanes.astype(true_grad.dtype)])


def lane_loss_fn(predict: Callable[..., Any], output_loss: OutputLoss, fisher: str,
                 has_aux: bool) -> Callable[..., Any]:
  """``(model, inputs, targets, key, lane) -> (<output, lane's cotangent>, (loss, aux))``.

  ``model`` is whatever ``predict`` takes first (Linen variables, an NNX module);
  differentiating the result gives the lane's gradients, the training gradient
  on lane 0.
  """
  def lane_loss(model, inputs, targets, key, lane):
    output, aux = split_output(predict(model, inputs), has_aux)
    value, table = cotangents(output_loss, fisher, jax.lax.stop_gradient(output), targets, key)
    cotangent = jax.lax.stop_gradient(table[lane])
    return jnp.sum(output * cotangent.astype(output.dtype)), (value, aux)

  return lane_loss


def lane_stats(run_lane: Callable[[jax.Array], tuple], layers: KFACLayers, fisher: str,
               output_shape: tuple[int, ...], fisher_only: bool = False) -> tuple:
  """``(loss, param_grads, stats, aux, extra)`` from the lanes one forward pass carries.

  ``run_lane(lane) -> ((loss, aux), grads, captured, extra)`` is one backward
  lane of the front end's ``value_and_grad`` with ``return_inputs``; ``extra``
  is what the front end carries out of it (the NNX model's new state), the same
  for every lane. With ``fisher_only`` the training lane is left out, and the
  param gradients are those of the first Fisher lane (not to be used).
  """
  if fisher == 'empirical':
    (value, aux), grads, captured, extra = run_lane(0)
    # lane 0 is the gradient of the MEAN loss; K-FAC wants per-example gradients.
    output_grads = jax.tree.map(lambda g: g[None] * output_shape[0], grads['perturbations'])
    param_grads = grads['params']
  else:
    lanes = jnp.arange(int(fisher_only), 2 if fisher == 'sampled' else 1 + output_shape[-1])
    (value, aux), grads, captured, extra = jax.vmap(
        run_lane, out_axes=((None, None), 0, None, None))(lanes)
    param_grads = jax.tree.map(lambda g: g[0], grads['params'])
    output_grads = jax.tree.map(lambda g: g[1 - int(fisher_only):], grads['perturbations'])
  return (value, param_grads, layer_stats(layers, captured, output_grads, output_shape[0]), aux,
          extra)


def check_estimate_args(key: Any, with_stats: Any) -> None:
  """Raises a named error for an ``estimate`` key that is no PRNG key (an integer seed) or
  a ``with_stats`` that is neither a bool nor a boolean JAX scalar.

  Raises:
    PRNGKeyError: ``key`` is given and is not a PRNG key.
    InvalidOptionError: ``with_stats`` is not a bool or a boolean scalar array.
  """
  if key is not None:
    check_key(key, "estimate's key (for fisher='sampled')")
  if isinstance(with_stats, bool):
    return
  # Any boolean scalar array, traced or not, or holding one (an NNX optimizer's stats_due).
  if (not isinstance(with_stats, (str, bytes)) and getattr(with_stats, 'shape', None) == ()
      and getattr(with_stats, 'dtype', None) == np.bool_):
    return
  raise InvalidOptionError('with_stats', with_stats,
                           "a Python bool or a boolean JAX scalar (the preconditioner "
                           "state's stats_due)")


def require_key(fisher: str, key: jax.Array | None, first: str):
  """Raises :class:`PRNGKeyError` for ``fisher='sampled'`` without a PRNG key."""
  if fisher == 'sampled' and key is None:
    raise PRNGKeyError(f"fisher='sampled' (drawing the Fisher's labels from the model) in "
                       f'estimate({first}, inputs, targets, key)', 'no key')


def kfac_estimator(predict_fn: Callable[[Variables, Any], jax.Array], loss: Any,
                   layers: KFACLayers, *, fisher: str = 'sampled',
                   has_aux: bool = False) -> Callable[..., Any]:
  """A function giving the loss, its gradient and the K-FAC factors of one batch.

  For the conventions (the loss, skipped layers, amortised statistics, per-segment
  K-FAC, how the factors relate to kfac-jax's) see ``help(perturbkit.kfac)``.

  The factors are the ones in ``perturbkit.kfac._rules``: per layer
  ``A = E[ã ãᵀ]`` (summed over locations; diagonal token counts for an Embed)
  and ``G = E[g gᵀ]`` (averaged over locations), with ``g`` the gradient of the
  per-example loss at the layer's output; for a LayerNorm or RMSNorm, the
  diagonal Fisher of its scale (``a``) and bias (``g``).

  Args:
    predict_fn: ``(variables, inputs) -> output`` of the unmodified model.
    loss: The predictive distribution: :func:`categorical_output`,
      :func:`gaussian_output`, ``'softmax_cross_entropy'``,
      ``optax.softmax_cross_entropy_with_integer_labels``, ``'gaussian'`` or
      ``optax.l2_loss`` (``½(y - t)²``, variance 1), ``'squared_error'`` or
      ``optax.squared_error`` (``(y - t)²``, variance ½); with ``fisher='empirical'``
      also any ``(output, targets) -> (batch,)`` per-example loss.
    layers: From :func:`kfac_layers`.
    fisher: ``'sampled'`` (labels drawn from the model: the Fisher; one more
      backward lane; inside ``jax.shard_map`` with ``check_vma=True`` each
      device folds its index into ``key``, so its examples draw their own
      labels; with ``check_vma=False`` pass each device its own key,
      ``jax.random.fold_in(key, jax.lax.axis_index('data'))``),
      ``'empirical'`` (the true targets; no extra work) or
      ``'exact'`` (the expectation over labels, one lane per output unit; for
      ``(batch, k)`` outputs).
    has_aux: ``predict_fn`` returns ``(output, aux)``, e.g. ``model.apply(v, x,
      train=True, mutable=['batch_stats'])`` for BatchNorm in train mode; ``aux``
      is returned as a fourth value. (BatchNorm's params have no rule and go
      to the fallback; the batch statistics couple the examples, and the
      factors are formed from the true per-example output gradients of that
      coupled batch, as kfac-jax does.)

  Returns:
    ``estimate(variables, inputs, targets, key=None, *, with_stats=True) ->
    (loss, grads, stats)`` (``(loss, grads, stats, aux)`` with ``has_aux``):
    the mean loss at ``targets``, its gradient with
    respect to ``variables['params']``, and ``{layer: LayerFactors}`` of this
    batch. ``with_stats`` may be a Python bool or a traced boolean scalar;
    without stats the step is a plain ``jax.value_and_grad`` and the stats are
    NaN (never to be folded in). With a traced flag the gradient is always that plain one and only
    the statistics are under ``lax.cond`` (so a step that takes them runs the
    forward pass twice; the Python ``True`` shares one pass). Pass the
    preconditioner state's ``stats_due`` to take them exactly on the steps
    where :func:`kfac_preconditioner` (``stats_every``) folds them in. Pure and
    jittable; under ``shard_map`` the stats are per device (the preconditioner
    averages them over its ``axis_name``).

  Raises:
    KFACNoLayersError: ``layers`` has no layer (every module that owns params was
      skipped, e.g. a bare ``nn.Dense`` as the whole model: wrap it in a module).
    KFACLayersTypeError: ``layers`` is not the ``KFACLayers`` (e.g. ``layers.layers``).
    InvalidOptionError: ``fisher`` is none of the three; ``estimate``'s
      ``with_stats`` is neither a bool nor a boolean JAX scalar.
    NotVariablesError: ``estimate`` was given ``variables['params']`` or something
      else that is not the variables dict (WrongFrontEndError: an NNX model).
    KFACLayerInfoError: a ``LayerInfo`` built by hand without what its rule needs (a
      known ``kind``, a Conv's or a norm's geometry).
    KFACExactFisherError: ``fisher='exact'`` for an output that is not ``(batch, k)``.
    KFACInputsError: the arrays of ``inputs`` have different first axes (pass an
      array every example shares through ``predict_fn`` instead).
    PRNGKeyError: ``fisher='sampled'`` and no ``key``, or a ``key`` that is not a
      JAX PRNG key (an integer seed).
    KFACLossError: ``loss`` has no distribution to sample from (says what to pass).
    KFACOutputError: ``predict_fn`` returns something else than one
      floating-point array (or ``(output, aux)`` with ``has_aux``).
    KFACShapeError: ``layers`` name a weight the model does not have, of
      another shape, or other calls than the model makes (checked once per
      input signature, while tracing).
    KFACUnsupportedLayerError: a layer's params are also read outside its
      calls by this ``predict_fn``, or its class overrides the ``__call__`` of
      ``nn.Dense``, ``nn.Conv`` or ``nn.Embed`` (layers built by hand or for
      another predict function; ``kfac_layers`` skips such layers).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(3)])
    >>> x, y = jnp.ones((8, 5)), jnp.zeros((8,), jnp.int32)
    >>> variables = model.init(jax.random.key(0), x)
    >>> predict = lambda v, x: model.apply(v, x)
    >>> layers = perturbkit.kfac_layers(predict, variables, x)
    >>> estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers)
    >>> loss, grads, stats = jax.jit(estimate)(variables, x, y, jax.random.key(1))
    >>> stats['layers_0'].a.shape, stats['layers_0'].g.shape
    ((6, 6), (4, 4))
  """
  check_loss_fn(predict_fn, 'perturbkit.kfac_estimator', '(variables, inputs) -> output',
                'prediction function', 'predict_fn')
  check_layers_given(layers, 'perturbkit.kfac_estimator')
  flag('has_aux', has_aux)
  output_loss = as_output_loss(loss, fisher)
  paths = {info.path for info in layers.layers.values()}
  if not paths:
    raise KFACNoLayersError('perturbkit.kfac_estimator', layers.skipped)
  for name, info in layers.layers.items():
    check_layer_info(name, info)
  names = {info.path: name for name, info in layers.layers.items()}
  checked = set()

  def select(module, method_name):
    path = tuple(module.path)
    if method_name != '__call__' or path not in names:
      return False
    # Layers built by hand may name a subclass whose __call__ computes something else.
    refuse_override(names[path], linen_override_reason(module), 'perturbkit.kfac_layers')
    return True

  def check_layers(variables, inputs):
    """The layers' kernels and calls against the model, once per input signature."""
    key = signature((variables, inputs))
    if key in checked:
      return
    batch_examples(inputs, 'perturbkit.kfac_estimator')
    flat = traverse_util.flatten_dict(flax.core.unfreeze(variables['params']))
    check_kernel_shapes(layers, {
        name: getattr(flat.get(info.path + (info.param,)), 'shape', None)
        for name, info in layers.layers.items()})
    reads = outside_reads(predict_fn, abstract(variables), abstract(inputs),
                          {info.path: name for name, info in layers.layers.items() if info.path})
    refuse_outside_reads(reads, 'perturbkit.kfac_layers')
    checked.add(key)

  def output_shape(variables, inputs):
    return jax.eval_shape(lambda v, x: split_output(predict_fn(v, x), has_aux)[0],
                          variables, inputs).shape

  grad_fn = value_and_grad(lane_loss_fn(predict_fn, output_loss, fisher, has_aux),
                           filter=select, has_aux=True, return_inputs=True)

  def loss_of_params(params, variables, inputs, targets):
    output, aux = split_output(predict_fn({**variables, 'params': params}, inputs), has_aux)
    return mean_loss(output_loss, output, targets), aux

  def without_stats(variables, inputs, targets):
    (value, aux), param_grads = jax.value_and_grad(loss_of_params, has_aux=True)(
        variables['params'], variables, inputs, targets)
    return value, param_grads, absent_stats(layers, param_grads), aux

  def estimate(variables: Variables, inputs: Any, targets: Any, key: jax.Array | None = None,
               *, with_stats: bool | jax.Array = True):
    check_variables(variables, 'perturbkit.kfac_estimator')
    check_estimate_args(key, with_stats)
    given, variables = variables, plain(variables)
    check_layers(variables, inputs)
    if isinstance(with_stats, bool):
      if with_stats:
        out = with_stats_fn(variables, inputs, targets, key)
      else:
        out = without_stats(variables, inputs, targets)
    else:
      require_key(fisher, key, 'variables')
      # The gradient stays outside the conditional: XLA:CPU runs convolutions inside
      # control flow several times slower, and most steps take no statistics.
      value, param_grads, absent, aux = without_stats(variables, inputs, targets)
      taken = lambda: with_stats_fn(variables, inputs, targets, key, fisher_only=True)[2]
      stats = jax.lax.cond(jnp.asarray(with_stats, bool), taken,
                           lambda: absent_like(absent, taken))
      out = value, param_grads, stats, aux
    out = (out[0], in_containers_of(given['params'], out[1])) + tuple(out[2:])
    return out if has_aux else out[:3]

  def with_stats_fn(variables, inputs, targets, key, fisher_only=False):
    def run_lane(lane):
      (_, value_aux), grads, captured = grad_fn(variables, inputs, targets, key, lane)
      return value_aux, grads, captured, None

    return lane_stats(run_lane, layers, fisher, output_shape(variables, inputs),
                      fisher_only)[:4]

  return estimate

