"""Segments: submodule calls replayed as pure functions with a custom VJP.

A segment call ``y = S(w, x)`` is replaced by a ``jax.custom_vjp`` function of
the segment's params ``w`` and the floating-point leaves of its arguments
``x``. Its forward pass is the ordinary call (same rng streams, so the same
dropout masks; mutable collections such as ``batch_stats`` are written back).
Its backward pass, given the cotangent ``g`` of ``y``:

1. ``dw = dS/dw(w, x)^T g`` at the old weights (``pmean``-ed over ``axis_name``);
2. ``w' = update(dw, w)``, the segment's optimizer step;
3. the cotangent of ``x`` is computed at the NEW weights: ``dS/dx(w', x)^T g``.

The cotangent returned for ``w`` is the true ``dw`` of step 1, so an ordinary
``jax.grad`` of the loss gives every segment's gradient under the interleaved
schedule, and glue code, skip connections and multiple consumers between
segments are differentiated by JAX itself. The result of step 2 (new weights
and optimizer state) leaves the backward pass as the cotangent of a zero
*carrier* input, so it is computed once, not again after the sweep.
"""
from typing import Any, Callable

import flax
import jax

from perturbkit._interceptor import Call, suspended
from perturbkit._points import COLLECTION, _is_inexact_array

# (g, dw, w) -> (weights to propagate with or None, values carried out)
Backward = Callable[[Any, Any, Any], tuple[Any, Any]]


def _split(tree: Any) -> tuple[list, Callable[[list], Any]]:
  """The floating-point array leaves of ``tree`` and a function putting them back."""
  leaves, treedef = jax.tree.flatten(tree)
  where = [i for i, leaf in enumerate(leaves) if _is_inexact_array(leaf)]

  def rebuild(dynamic: list) -> Any:
    full = list(leaves)
    for i, value in zip(where, dynamic):
      full[i] = value
    return jax.tree.unflatten(treedef, full)

  return [leaves[i] for i in where], rebuild


def _write_back(scope, collection: str, tree: Any):
  """Stores ``tree`` (a collection's nested dict) into ``scope`` and its children."""
  for name, value in tree.items():
    if scope.has_variable(collection, name):
      scope.put_variable(collection, name, value)
    else:
      _write_back(scope.push(name, reuse=True), collection, value)


def run_segment(call: Call, backward: Backward, carrier: Any,
                axis_name: str | None = None) -> Any:
  """Runs one segment call with the interleaved custom VJP.

  Args:
    call: The intercepted call (a module whose params form the segment).
    backward: ``(g, dw, w) -> (w_propagate, carried)``, called in the backward
      pass with the output cotangent ``g`` and the (averaged) gradient ``dw`` at
      the old weights ``w``. The input cotangent is computed at
      ``w_propagate`` (``None``: at ``w``, no replay), and ``carried`` leaves the
      backward pass as the cotangent of ``carrier``.
    carrier: Zeros shaped like ``carried``.
    axis_name: If given, ``dw`` is averaged over this mapped axis first (data
      parallelism under ``shard_map``/``pmap``).

  Returns:
    The call's output.
  """
  module = call.module
  unbound, variables = module.unbind()
  # A copy: the write-back below mutates the scope's own dicts, and the backward
  # replay must see the collections as they were when the segment ran.
  others = jax.tree.map(lambda leaf: leaf, {
      c: flax.core.unfreeze(v) for c, v in variables.items() if c not in ('params', COLLECTION)})
  mutable = [c for c in others if module.is_mutable_collection(c)]
  rngs = dict(module.scope.rngs)
  dynamic, rebuild = _split((call.args, call.kwargs))

  def pure(w, dyn):
    args, kwargs = rebuild(dyn)
    with suspended():
      out, state = unbound.apply({'params': w, **others}, *args, rngs=rngs, mutable=mutable,
                                 method=call.method_name, **kwargs)
    return out, dict(state)

  @jax.custom_vjp
  def segment(w, dyn, carrier):
    del carrier
    return pure(w, dyn)

  def fwd(w, dyn, carrier):
    del carrier
    out, vjp_old, state = jax.vjp(pure, w, dyn, has_aux=True)
    return (out, state), (w, dyn, vjp_old)

  def bwd(residuals, cotangents):
    w, dyn, vjp_old = residuals
    g, _ = cotangents
    dw, d_dyn = vjp_old(g)
    if axis_name is not None:
      dw = jax.lax.pmean(dw, axis_name)
    w_propagate, carried = backward(g, dw, w)
    if w_propagate is not None:
      _, vjp_new = jax.vjp(lambda d: pure(w_propagate, d)[0], dyn)
      (d_dyn,) = vjp_new(g)
    return dw, d_dyn, carried

  segment.defvjp(fwd, bwd)
  params = variables.get('params', {})
  out, state = segment(flax.core.unfreeze(params), dynamic, carrier)
  for collection, tree in state.items():
    _write_back(module.scope, collection, tree)
  return out
