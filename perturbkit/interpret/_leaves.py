"""Which arrays of a call's output a sweep covers (``leaves=``): an attention's output, say.

A call's output is its floating-point arrays in ``jax.tree.leaves`` order, as a
point holds them. ``leaves`` picks some of them by index; the sweeps patch,
attribute and check the positions of those only, and leave the others as the
run makes them.
"""
import operator
from typing import Any, Callable

import jax
import numpy as np

from perturbkit.core._traced_points import TracedPoints, point_name
from perturbkit.errors import InvalidOptionError

_WHAT = ("an int >= 0 or a non-empty sequence of distinct ones: which of the arrays a call "
         "returns are swept, e.g. 0 for an attention's output beside its weights")


def checked_leaves(leaves: Any) -> tuple[int, ...] | None:
  """``leaves`` as a sorted tuple of distinct ints >= 0 (``None``: every array).

  Raises:
    InvalidOptionError: anything else (a negative index, a bool, an empty list).
  """
  if leaves is None:
    return None
  given = [leaves] if not isinstance(leaves, (list, tuple, np.ndarray)) else list(leaves)
  try:
    if any(isinstance(i, (bool, np.bool_)) for i in given):
      raise TypeError
    indices = [operator.index(i) for i in given]
  except TypeError:
    raise InvalidOptionError('leaves', leaves, _WHAT) from None
  if not indices or min(indices) < 0 or len(set(indices)) != len(indices):
    raise InvalidOptionError('leaves', leaves, _WHAT)
  return tuple(sorted(indices))


def check_leaves(traced: TracedPoints, leaves: tuple[int, ...] | None) -> None:
  """Raises ``InvalidOptionError`` unless every selected call returns the arrays ``leaves`` names.
  """
  if leaves is None:
    return
  for path in traced.paths:
    count = len(traced.shapes[path].leaves)
    if leaves[-1] >= count:
      raise InvalidOptionError(
          'leaves', leaves, f'indices of arrays every selected call returns, but '
          f'{point_name(path)} returns {count}; leave it out with the filter')


def swept(leaves: tuple[int, ...] | None, index: int) -> bool:
  return leaves is None or index in leaves


def chosen(tree: Any, leaves: tuple[int, ...] | None) -> Any:
  """The swept arrays of an output: ``tree`` itself, or a tuple of the ones ``leaves`` names."""
  if leaves is None:
    return tree
  flat = jax.tree.leaves(tree)
  return tuple(flat[i] for i in leaves)


def on_leaves(edit: Callable[[tuple, Any], Any],
              leaves: tuple[int, ...] | None) -> Callable[[tuple, Any], Any]:
  """``edit(path, output)`` applied to the swept arrays only (their tuple, :func:`chosen`).

  The other arrays of the output are left exactly as they are.
  """
  if leaves is None:
    return edit

  def edited(path: tuple, output: Any) -> Any:
    flat, treedef = jax.tree.flatten(output)
    for i, leaf in zip(leaves, edit(path, chosen(output, leaves))):
      flat[i] = leaf
    return jax.tree.unflatten(treedef, flat)

  return edited
