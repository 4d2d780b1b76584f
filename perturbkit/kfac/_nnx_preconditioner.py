"""K-FAC preconditioning of NNX param gradients: ``kfac_preconditioner`` on ``nnx.State``.

The transformation itself is the framework-neutral one
(``_kfac_preconditioner``), which works on nested dicts. NNX hands gradients
and params over as an ``nnx.State``: with ``nnx.Param`` leaves from
``nnx.grad``/``nnx.state(model, nnx.Param)``, with plain arrays from
``nnx.Optimizer.update`` (``nnx.as_pure``). This adapter reads either as a
pure dict (``nnx.to_pure_dict``) and gives the updates back in the container
and leaf types of the gradients it was given.
"""
from typing import Any

import optax
from flax import nnx, traverse_util

from perturbkit.kfac._checks import check_layers_given
from perturbkit.kfac._layers import KFACLayers
from perturbkit.kfac._preconditioner import kfac_preconditioner as _kfac_preconditioner


def _pure(tree: Any) -> Any:
  return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def _like(template: Any, pure: dict) -> Any:
  """``pure`` laid out as ``template`` (an ``nnx.State``, or a pure dict already)."""
  if not isinstance(template, nnx.State):
    return pure
  values = traverse_util.flatten_dict(pure)
  return nnx.from_flat_state(
      [(path, leaf.replace(values[path]) if isinstance(leaf, nnx.Variable) else values[path])
       for path, leaf in nnx.to_flat_state(template)])


def kfac_preconditioner(layers: KFACLayers, **options: Any
                        ) -> optax.GradientTransformationExtraArgs:
  """:func:`perturbkit.kfac_preconditioner` for NNX param gradients.

  ``init`` and ``update(grads, state, params=None, *, kfac_stats)`` take the
  params and gradients as an ``nnx.State`` (``Param`` leaves or plain arrays)
  or as a pure dict (``nnx.to_pure_dict``), and return the updates in the
  gradients' own layout. So both work: ``nnx.Optimizer(model, tx,
  wrt=nnx.Param)`` with ``optimizer.update(model, grads, kfac_stats=stats)``
  (it passes ``kfac_stats`` on to ``tx.update``), and plain optax on
  ``params = nnx.state(model, nnx.Param)`` followed by ``nnx.update(model,
  optax.apply_updates(params, updates))``.

  Args:
    layers: From :func:`perturbkit.nnx.kfac_layers`.
    **options: ``damping``, ``decay``, ``inverse_every``, ``stats_every``,
      ``axis_name``, ``fallback``, ``norm_constraint``, as for
      :func:`perturbkit.kfac_preconditioner`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`perturbkit.KFACState`.

  Raises:
    InvalidOptionError: a numeric option is out of range (as for
      :func:`perturbkit.kfac_preconditioner`).
    KFACShapeError: the params, gradients or factors do not match ``layers``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Sequential(nnx.Linear(5, 4, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(4, 3, rngs=nnx.Rngs(1)))
    >>> x, y = jnp.ones((8, 5)), jnp.zeros((8,), jnp.int32)
    >>> layers = perturbkit.nnx.kfac_layers(model, x)
    >>> estimate = perturbkit.nnx.kfac_estimator('softmax_cross_entropy', layers)
    >>> tx = optax.chain(perturbkit.nnx.kfac_preconditioner(layers), optax.sgd(0.1))
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> loss, grads, stats = estimate(model, x, y, jax.random.key(1))
    >>> _ = optimizer.update(model, grads, kfac_stats=stats)
    >>> optimizer.opt_state[0].factors['layers/2'].g.shape
    (3, 3)
  """
  check_layers_given(layers, 'perturbkit.nnx.kfac_preconditioner')
  inner = _kfac_preconditioner(layers, **options)

  def init(params: Any) -> Any:
    return inner.init(_pure(params))

  def update(updates: Any, state: Any, params: Any = None, **extra_args: Any
             ) -> tuple[Any, Any]:
    out, state = inner.update(_pure(updates), state, _pure(params), **extra_args)
    return _like(updates, out), state

  return optax.GradientTransformationExtraArgs(init, update)
