"""Perturbation points: the zero arrays added to a call's output.

A point holds one zero array per floating-point leaf of the output; integer,
boolean and ``None`` leaves pass through untouched. The arrays live in the
``'perturbations'`` collection at the module's path, under the call's point key,
and are added with Flax's own ``Module.perturb``.
"""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from perturbkit._errors import NonDifferentiableOutputError, PerturbationStructureError

COLLECTION = 'perturbations'


def _is_inexact_array(leaf: Any) -> bool:
  return isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.inexact)


def differentiable_part(tree: Any) -> Any:
  """``tree`` with every leaf that is not a floating-point array replaced by ``None``."""
  return jax.tree.map(lambda leaf: leaf if _is_inexact_array(leaf) else None, tree)


def has_differentiable_leaf(tree: Any) -> bool:
  """Whether ``tree`` has at least one floating-point array leaf."""
  return any(_is_inexact_array(leaf) for leaf in jax.tree.leaves(tree))


def merge(tree: Any, part: Any) -> Any:
  """Puts the leaves of ``part`` (from ``differentiable_part``) back into ``tree``."""
  return jax.tree.map(lambda leaf, p: leaf if p is None else p, tree, part,
                      is_leaf=lambda x: x is None)


def leaf_dtypes(tree: Any) -> list[str]:
  return [str(getattr(leaf, 'dtype', type(leaf).__name__)) for leaf in jax.tree.leaves(tree)]


def inside_lifted_transform(module: nn.Module) -> bool:
  """Whether the call runs inside a lifted transform (``nn.remat``, ``nn.scan``, ...).

  Flax binds a transformed module's body directly to a scope rather than to a
  parent module; the root (and ``wrap``'s inner module) is the only other
  module bound that way, at the empty path.
  """
  while isinstance(module.parent, nn.Module):
    module = module.parent
  return bool(module.path)


def collection_visible(module: nn.Module) -> bool:
  """Whether a perturbation added in ``module`` reaches the caller's collection.

  Inside a lifted transform (``nn.scan``, ``nn.vmap``) that does not map the
  ``'perturbations'`` collection, a variable created there would be dropped;
  this is the test Flax's ``perturb`` itself uses.
  """
  if module.is_mutable_collection(COLLECTION):
    return True
  return COLLECTION in module.scope.root._variables  # pylint: disable=protected-access


def _check_matches(module: nn.Module, key: str, part: Any, where: str):
  if not module.has_variable(COLLECTION, key):
    raise PerturbationStructureError(f'there is no perturbation for the call {where}')
  given = module.get_variable(COLLECTION, key)
  want = jax.tree.map(lambda leaf: (leaf.shape, leaf.dtype), part)
  got_struct = jax.tree.structure(given)
  if got_struct != jax.tree.structure(part):
    raise PerturbationStructureError(
        f'the perturbation for {where} has structure {got_struct}, the call output '
        f'{jax.tree.structure(part)}')
  got = jax.tree.map(lambda leaf: (tuple(jnp.shape(leaf)), jnp.result_type(leaf)), given)
  if jax.tree.leaves(got, is_leaf=lambda x: isinstance(x, tuple)) != jax.tree.leaves(
      want, is_leaf=lambda x: isinstance(x, tuple)):
    raise PerturbationStructureError(
        f'the perturbation for {where} has shapes/dtypes {got}, the call output {want}')


def add_perturbation(module: nn.Module, key: str, output: Any, where: str,
                     *, strict: bool) -> tuple[Any, bool]:
  """Adds the point's perturbation to ``output`` (creating zeros when initializing).

  Args:
    module: The bound module that made the call.
    key: The call's point key.
    output: The call's output.
    where: The call's name, for messages.
    strict: Raise if the output has no floating-point leaf (otherwise skip it).

  Returns:
    ``(output plus the perturbation, True)``; ``(output, False)`` when the
    collection is absent (a plain ``apply``) or the call has nothing to perturb.

  Raises:
    NonDifferentiableOutputError: ``strict`` and no floating-point leaf.
    PerturbationStructureError: the collection is there but does not fit.
  """
  if not has_differentiable_leaf(output):
    if strict:
      raise NonDifferentiableOutputError(where, leaf_dtypes(output))
    return output, False
  if not collection_visible(module):
    return output, False
  part = differentiable_part(output)
  if not module.is_mutable_collection(COLLECTION):
    _check_matches(module, key, part, where)
  return merge(output, module.perturb(key, part)), True


def zeros_like_points(shapes: Any) -> Any:
  """Zero arrays for a tree of ``jax.ShapeDtypeStruct`` (made inside the trace)."""
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
