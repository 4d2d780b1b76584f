"""What a trace of a function sees of its inputs: their types.

Two traces of one function on inputs of the same types make the same calls, so what
one found (the calls a metric makes, the segments that passed their checks) stands
for the other, without tracing again.
"""
from typing import Any

import jax

from perturbkit.core._values import is_array


def _type(leaf: Any) -> tuple:
  # The arrays a trace takes as arrays (``is_array``): a NumPy scalar (``np.bool_(True)``
  # as a flag) reaches the function as it is, like a Python number, so its value decides
  # the trace too.
  if is_array(leaf):
    aval = jax.typeof(leaf)
    return 'array', aval, aval.weak_type
  return 'value', type(leaf), leaf


def input_types(tree: Any) -> tuple:
  """``tree``'s structure and what a trace sees of each leaf.

  An array leaf (a JAX or NumPy array, a tracer too) is its type: shape, dtype, weak
  type and, inside ``shard_map``, the devices it varies over. Any other leaf (a Python
  or NumPy number, a string) is its value.
  """
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(_type(leaf) for leaf in leaves)


def same_types(a: tuple, b: tuple) -> bool:
  """Whether two :func:`input_types` are equal (not where a value does not compare to a bool)."""
  try:
    return bool(a == b)
  except Exception:  # e.g. an object whose == gives an array
    return False


class TypesSeen:
  """The input types a check passed on (the last ``size`` of them), so that it runs once each.

  For checks that depend on a function and its inputs' types only: the segments
  an interleaved step is given pass on inputs of the types ``init`` chose them on.
  """

  def __init__(self, size: int = 8):
    self._seen: list[tuple] = []
    self._size = size

  def __contains__(self, inputs: Any) -> bool:
    return self._holds(input_types(inputs))

  def add(self, inputs: Any) -> None:
    types = input_types(inputs)
    if not self._holds(types):
      self._seen = [*self._seen, types][-self._size:]

  def _holds(self, types: tuple) -> bool:
    return any(same_types(types, seen) for seen in self._seen)
