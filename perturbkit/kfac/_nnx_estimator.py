"""The training gradient and every layer's Kronecker factors of an NNX model, from one pass.

The NNX counterpart of ``_kfac_estimator``, with the same lanes: the output
cotangents (``cotangents``: lane 0 the gradient of the mean loss, then the
Fisher's lanes) go through one forward pass, ``jax.vmap`` over the lanes
leaves that pass unbatched, and :func:`perturbkit.nnx.value_and_grad` with
``return_inputs=True`` gives each layer's inputs next to the gradient at its
output. The model is split once (``nnx.split``) so that the lanes and the
``lax.cond`` of a traced ``with_stats`` run on pure state; the state the
forward pass changes (batch statistics, RNG counts) is written back to the
model, as ``nnx.value_and_grad`` does.
"""
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from perturbkit.core._loss import check_loss_fn
from perturbkit.core._validate import flag
from perturbkit.kfac._checks import (check_kernel_shapes, check_layer_info, check_layers_given,
                                     refuse_outside_reads,
                                     refuse_override, signature)
from perturbkit.kfac._examples import batch_examples
from perturbkit.kfac._estimator import (absent_like, absent_stats, check_estimate_args,
                                        lane_loss_fn, lane_stats, require_key, split_output)
from perturbkit.kfac._layers import KFACLayers
from perturbkit.kfac._losses import as_output_loss, mean_loss
from perturbkit.nnx._calls import path_of, submodules
from perturbkit.errors import KFACNoLayersError
from perturbkit.nnx._driver import check_module, value_and_grad
from perturbkit.kfac._nnx_layers import call_model, nnx_override_reason, outside_reads


def kfac_estimator(loss: Any, layers: KFACLayers, *,
                   predict: Callable[[nnx.Module, Any], Any] | None = None,
                   fisher: str = 'sampled', has_aux: bool = False) -> Callable[..., Any]:
  """A function giving the loss, its NNX param gradients and the K-FAC factors of a batch.

  The factors are those of :func:`perturbkit.kfac_estimator` (the same rules,
  the same lanes), so an NNX model and its Linen twin with the same weights
  give the same factors for the same key.

  Args:
    loss: The predictive distribution, as for :func:`perturbkit.kfac_estimator`:
      ``'softmax_cross_entropy'``, ``'gaussian'`` (``½(y - t)²``), ``'squared_error'``
      (``(y - t)²``, as ``optax.squared_error``),
      :func:`perturbkit.categorical_output`, :func:`perturbkit.gaussian_output`,
      the matching optax losses; with ``fisher='empirical'`` also any
      ``(output, targets) -> (batch,)`` per-example loss.
    layers: From :func:`perturbkit.nnx.kfac_layers`.
    predict: ``(model, inputs) -> output`` (default ``model(inputs)``).
    fisher: ``'sampled'``, ``'empirical'`` or ``'exact'``.
    has_aux: ``predict`` returns ``(output, aux)``; ``aux`` is returned as a
      fourth value. (BatchNorm's statistics need no ``aux`` in NNX: they are
      updated in the model.)

  Returns:
    ``estimate(model, inputs, targets, key=None, *, with_stats=True) ->
    (loss, grads, stats)``: the mean loss at ``targets``, its gradient with
    respect to the model's ``nnx.Param``s (an ``nnx.State``, as ``nnx.grad``
    gives, for ``optimizer.update(model, grads, kfac_stats=stats)``) and
    ``{layer: LayerFactors}``. ``with_stats`` is a Python bool or a traced
    boolean (the preconditioner state's ``stats_due``), as in the Linen
    estimator. The model's non-param state (batch statistics, RNG counts) is
    updated once, as by one ``nnx.value_and_grad`` step. Works eagerly and
    under ``nnx.jit``.

  Raises:
    KFACNoLayersError: ``layers`` has no layer (e.g. a bare ``nnx.Linear`` as the
      whole model: wrap it in a module).
    KFACLayersTypeError: ``layers`` is not the ``KFACLayers`` (e.g. ``layers.layers``).
    PRNGKeyError, InvalidOptionError: ``estimate`` was given a ``key`` that is not a
      PRNG key, or a ``with_stats`` that is neither a bool nor a boolean JAX scalar.
    KFACLayerInfoError: a ``LayerInfo`` built by hand without what its rule needs (a
      known ``kind``, a Conv's or a norm's geometry).
    WrongFrontEndError: ``estimate`` was given a Linen module or variables.
    KFACLossError: ``loss`` has no distribution to sample from.
    KFACOutputError: ``predict`` returns something else than one
      floating-point array (or ``(output, aux)`` with ``has_aux``).
    KFACInputsError: the arrays of ``inputs`` have different first axes (pass an
      array every example shares through ``predict`` instead).
    KFACShapeError, KFACUnsupportedLayerError: ``layers`` do not describe the
      model (as for :func:`perturbkit.kfac_estimator`).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Sequential(nnx.Linear(5, 4, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(4, 3, rngs=nnx.Rngs(1)))
    >>> x, y = jnp.ones((8, 5)), jnp.zeros((8,), jnp.int32)
    >>> layers = perturbkit.nnx.kfac_layers(model, x)
    >>> estimate = perturbkit.nnx.kfac_estimator('softmax_cross_entropy', layers)
    >>> loss, grads, stats = nnx.jit(estimate)(model, x, y, jax.random.key(1))
    >>> stats['layers/0'].a.shape, stats['layers/0'].g.shape, grads['layers'][2]['bias'].shape
    ((6, 6), (4, 4), (3,))
  """
  check_layers_given(layers, 'perturbkit.nnx.kfac_estimator')
  flag('has_aux', has_aux)
  output_loss = as_output_loss(loss, fisher)
  predict = call_model if predict is None else predict
  check_loss_fn(predict, 'perturbkit.nnx.kfac_estimator', '(model, inputs) -> output',
                'prediction function', 'predict')
  paths = {info.path for info in layers.layers.values()}
  if not paths:
    raise KFACNoLayersError('perturbkit.nnx.kfac_estimator', layers.skipped)
  for name, info in layers.layers.items():
    check_layer_info(name, info)
  select = lambda module, method_name: method_name == '__call__' and path_of(module) in paths
  checked = set()

  def check_layers(model, inputs):
    """The layers' kernels and calls against the model, once per input signature."""
    key = signature((nnx.graphdef(model), nnx.state(model), inputs))
    if key in checked:
      return
    batch_examples(inputs, 'perturbkit.nnx.kfac_estimator')
    modules = dict(submodules(model))
    shapes = {}
    for name, info in layers.layers.items():
      weight = getattr(modules.get(info.path), info.param, None)
      shapes[name] = None if weight is None else jnp.shape(weight[...])
    check_kernel_shapes(layers, shapes)
    for name, info in layers.layers.items():
      # Layers built by hand may name a subclass whose __call__ computes something else.
      refuse_override(name, nnx_override_reason(modules[info.path]), 'perturbkit.nnx.kfac_layers')
    reads = outside_reads(model, inputs, predict,
                          {info.path: name for name, info in layers.layers.items()})
    refuse_outside_reads(reads, 'perturbkit.nnx.kfac_layers')
    checked.add(key)

  def output(model, inputs):
    return split_output(predict(model, inputs), has_aux)

  grad_fn = value_and_grad(lane_loss_fn(predict, output_loss, fisher, has_aux),
                           filter=select, has_aux=True, return_inputs=True)

  def loss_of_model(model, inputs, targets):
    out, aux = output(model, inputs)
    return mean_loss(output_loss, out, targets), aux

  def without_stats(model, inputs, targets):
    (value, aux), param_grads = nnx.value_and_grad(loss_of_model, has_aux=True)(
        model, inputs, targets)
    return value, param_grads, absent_stats(layers, nnx.to_pure_dict(param_grads)), aux

  def with_stats_fn(graphdef, state, inputs, targets, key, fisher_only=False):
    """``(value, param_grads, stats, aux, new_state)`` from the pure ``state``."""
    def run_lane(lane):
      model = nnx.merge(graphdef, state)
      (_, value_aux), grads, captured = grad_fn(model, inputs, targets, key, lane)
      return value_aux, grads, captured, nnx.state(model)

    shape = nnx.eval_shape(lambda m: output(m, inputs)[0], nnx.merge(graphdef, state)).shape
    return lane_stats(run_lane, layers, fisher, shape, fisher_only)

  def estimate(model: nnx.Module, inputs: Any, targets: Any, key: jax.Array | None = None,
               *, with_stats: bool | jax.Array = True):
    check_module(model, 'perturbkit.nnx.kfac_estimator')
    check_estimate_args(key, with_stats)
    if with_stats is not False:
      require_key(fisher, key, 'model')
    check_layers(model, inputs)
    # Plain arrays: Variables made outside would be at another trace level than the
    # lanes' vmap and the conditional, where the model is rebuilt from them.
    graphdef, state = nnx.split(model)
    state = nnx.as_pure(state)
    if isinstance(with_stats, bool):
      if with_stats:
        value, param_grads, stats, aux, new_state = with_stats_fn(
            graphdef, state, inputs, targets, key)
        nnx.update(model, new_state)
      else:
        value, param_grads, stats, aux = without_stats(model, inputs, targets)
    else:
      # As in the Linen estimator: the gradient stays outside the conditional, and the
      # statistics' forward pass runs on the state from before this step.
      value, param_grads, absent, aux = without_stats(model, inputs, targets)
      taken = lambda: with_stats_fn(graphdef, state, inputs, targets, key, fisher_only=True)[2]
      stats = jax.lax.cond(jnp.asarray(with_stats, bool), taken,
                           lambda: absent_like(absent, taken))
    out = value, param_grads, stats, aux
    return out if has_aux else out[:3]

  return estimate
