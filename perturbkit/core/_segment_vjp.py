"""How a segment updates itself in the backward pass: one ``jax.custom_vjp``.

A segment call ``y = S(w, x)`` becomes a custom-VJP function of the segment's
params ``w`` and the floating-point leaves ``x`` of its inputs. Its backward
pass, given the cotangent ``g`` of ``y``:

1. ``dw = dS/dw(w, x)^T g`` at the old weights (``pmean``-ed over ``axis_name``);
2. ``w' = update(dw, w)``, the segment's optimizer step;
3. the cotangent of ``x`` is computed at the NEW weights: ``dS/dx(w', x)^T g``.

The cotangent returned for ``w`` is the true ``dw`` of step 1, so an ordinary
``jax.grad`` of the loss gives every segment's gradient under the interleaved
schedule, and glue code, skip connections and multiple consumers between
segments are differentiated by JAX itself. The result of step 2 (new weights
and optimizer state) leaves the backward pass as the cotangent of a zero
*carrier* input, so it is computed once, not again after the sweep.

Nothing here knows which Flax API built the model: a front end supplies the
segment as a pure function ``pure(w, x) -> (y, aux)``.
"""
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import (CustomVJPPrimal, SymbolicZero,
                                     custom_vjp_primal_tree_values)

from perturbkit.core._consumers import segment_function_name
from perturbkit.core._points import is_inexact_array
from perturbkit.core._values import is_array


class Backward(NamedTuple):
  """What a segment does in the backward pass, once it has its gradient.

  Attributes:
    step: ``(g, dw, w, dyn, after, state) -> (new_w, carried)``, called with
      the output cotangent ``g``, the (averaged) gradient ``dw`` at the old
      weights ``w``, the segment's floating-point inputs ``dyn`` (this
      device's) and ``state``; ``carried`` leaves the backward pass as the
      cotangent of the carrier. ``after`` is ``None``, or values the step
      should depend on (the old weights' input cotangent), so that XLA can
      order the step after the old weights' last read.
    propagate_updated: Whether the input cotangent is computed at ``new_w``
      (the call is replayed) or at ``w``.
    state: The arrays ``step`` needs besides those (the optimizer state, the
      clipping scale). They enter the segment as an input and reach ``step``
      through the residuals, never as a closure: a segment inside a scan
      runs its backward pass in another trace than its forward pass.
  """
  step: Callable[[Any, Any, Any, Any, Any, Any], tuple[Any, Any]]
  propagate_updated: bool
  state: Any = ()


FORWARD_ONLY = Backward(lambda *_: (None, ()), propagate_updated=False)
"""The backward step of a segment whose forward pass alone is traced (the reads checks)."""


def _split(tree: Any, *kinds: Callable[[Any], bool]) -> tuple[list[list], Callable[..., Any]]:
  """The leaves of ``tree`` of each kind (one list per predicate in ``kinds``), and a
  function taking one list per kind and putting them back; the other leaves stay as they
  are."""
  leaves, treedef = jax.tree.flatten(tree)
  where = [[i for i, leaf in enumerate(leaves) if kind(leaf)] for kind in kinds]

  def rebuild(*parts: list) -> Any:
    full = list(leaves)
    for indices, values in zip(where, parts):
      for i, value in zip(indices, values):
        full[i] = value
    return jax.tree.unflatten(treedef, full)

  return [[leaves[i] for i in indices] for indices in where], rebuild


def split_floats(tree: Any) -> tuple[list, Callable[[list], Any]]:
  """The floating-point array leaves of ``tree`` and a function putting them back."""
  (floats,), rebuild = _split(tree, is_inexact_array)
  return floats, rebuild


def _other_array(leaf: Any) -> bool:
  return is_array(leaf) and not is_inexact_array(leaf)


def split_arrays(tree: Any) -> tuple[list, list, Callable[[list, list], Any]]:
  """The floating-point array leaves of ``tree``, its other array leaves, and a function
  putting both back.

  A segment's replay takes the other arrays (integer masks, token ids, booleans) as an
  input rather than closing over them: inside ``nn.remat`` or ``nn.scan`` they are tracers
  of the lifted transform's trace, which a later trace (the backward pass) cannot read.
  """
  (floats, others), rebuild = _split(tree, is_inexact_array, _other_array)
  return floats, others, rebuild


def _is_primal(x: Any) -> bool:
  return isinstance(x, CustomVJPPrimal)


def _instantiated(tree: Any) -> Any:
  """``tree`` with each symbolic zero cotangent (an output the loss does not use) as zeros."""
  def zeros(x):
    if not isinstance(x, SymbolicZero):
      return x
    if x.aval.dtype == jax.dtypes.float0:  # an integer output's cotangent
      return np.zeros(x.aval.shape, jax.dtypes.float0)
    return jnp.zeros(x.aval.shape, x.aval.dtype)

  return jax.tree.map(zeros, tree, is_leaf=lambda x: isinstance(x, SymbolicZero))


def segment_call(name: str, pure: Callable[[Any, Any, Any], tuple[Any, Any]], w: Any, dyn: Any,
                 carrier: Any, backward: Backward, axis_name: str | None = None,
                 context: Any = ()) -> tuple[Any, Any]:
  """Runs ``pure(w, dyn, context)`` as a segment with the interleaved custom VJP.

  Args:
    name: The segment's name; the ``custom_vjp_call`` equation carries it, so
      that reads of ``w`` outside the segment can be found in the jaxpr.
    pure: ``(w, dyn, context) -> (output, aux)``; ``aux`` (updated mutable
      collections) is not differentiated.
    w: The segment's params.
    dyn: The floating-point inputs.
    carrier: Zeros shaped like what ``backward`` carries out.
    backward: The segment's step in the backward pass, and at which weights
      its input cotangent is computed.
    axis_name: If given, ``dw`` is averaged over this mapped axis first (data
      parallelism under ``shard_map``/``pmap``).
    context: Arrays ``pure`` reads besides ``w`` and ``dyn`` (other
      collections, rng keys). Like ``backward.state``, they are inputs of the
      segment, not differentiated, and reach the backward pass's replay through
      the residuals.

  Returns:
    ``pure(w, dyn, context)``.
  """
  def segment(w, dyn, carrier, inputs):
    del carrier
    return pure(w, dyn, inputs[0])

  segment.__name__ = segment_function_name(name)
  segment = jax.custom_vjp(segment)

  def fwd(w, dyn, carrier, inputs):
    del carrier
    # An input that is not differentiated (the data into the first layer) needs no
    # cotangent: none is computed, and the step waits for none. Whether one is
    # needed travels to ``bwd`` in the residuals' structure (static).
    needed = {'input_grad': ()} if any(
        leaf.perturbed for leaf in jax.tree.leaves(dyn, is_leaf=_is_primal)) else {}
    w, dyn, (context, state) = custom_vjp_primal_tree_values((w, dyn, inputs))
    out, vjp_old, aux = jax.vjp(lambda w, dyn: pure(w, dyn, context), w, dyn, has_aux=True)
    return (out, aux), (w, dyn, vjp_old, needed, context, state)

  def bwd(residuals, cotangents):
    w, dyn, vjp_old, needed, context, state = residuals
    g = _instantiated(cotangents[0])
    dw, d_dyn = vjp_old(g)
    if axis_name is not None:
      dw = jax.lax.pmean(dw, axis_name)
    # With the old weights' input cotangent as the last read of them, a step that
    # waits for it can write the new weights over the old ones (a donated state);
    # otherwise XLA copies every weight first, as in a plain optax step.
    waits_for = d_dyn if needed and not backward.propagate_updated else None
    new_w, carried = backward.step(g, dw, w, dyn, waits_for, state)
    if not needed:
      return dw, None, carried, None
    if backward.propagate_updated:
      _, vjp_new = jax.vjp(lambda d: pure(new_w, d, context)[0], dyn)
      (d_dyn,) = vjp_new(g)
    return dw, d_dyn, carried, None

  segment.defvjp(fwd, bwd, symbolic_zeros=True)
  return segment(w, dyn, carrier, (context, backward.state))
