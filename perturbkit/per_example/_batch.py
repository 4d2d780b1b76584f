"""Where the examples are in a loss's arguments, and how many there are.

``batch_axes`` follows ``jax.vmap``'s ``in_axes``, one level deep: an int (the
examples axis of every array argument), ``None`` (an argument shared by all
examples), or a tuple with one such entry per positional argument.
"""
from typing import Any

import jax
import numpy as np

from perturbkit.core._values import is_array
from perturbkit.errors import BatchNotArrayError, ExamplesAxisError, InvalidOptionError

BatchAxes = int | None | tuple


def check_batch_axes(batch_axes: Any) -> BatchAxes:
  """``batch_axes`` as Python ints (NumPy integers read as theirs, a list as a tuple), or
  :class:`InvalidOptionError` unless it is an int, ``None``, or a tuple (or list) of them;
  checked where it is given (the number of entries is checked against the arguments when
  they come)."""
  entry = lambda a: a is None or (isinstance(a, (int, np.integer))
                                  and not isinstance(a, (bool, np.bool_)))
  as_int = lambda a: None if a is None else int(a)
  if entry(batch_axes):
    return as_int(batch_axes)
  if isinstance(batch_axes, (tuple, list)) and all(entry(a) for a in batch_axes):
    return tuple(as_int(a) for a in batch_axes)
  raise InvalidOptionError('batch_axes', batch_axes,
                           "an int (the examples' axis of every argument), None, or a tuple "
                           'with one int or None per positional argument, as in jax.vmap')


def check_reduction_option(reduction: Any) -> None:
  """Raises :class:`InvalidOptionError` unless ``reduction`` is ``'mean'`` or ``'sum'``."""
  if reduction not in ('mean', 'sum') or not isinstance(reduction, str):
    raise InvalidOptionError('reduction', reduction, "'mean' or 'sum'")


def per_argument(batch_axes: BatchAxes, num_args: int) -> tuple:
  """``batch_axes`` as one entry (int or None) per positional argument."""
  if batch_axes is None or isinstance(batch_axes, int):
    return (batch_axes,) * num_args
  axes = tuple(batch_axes)
  if len(axes) != num_args or not all(a is None or isinstance(a, int) for a in axes):
    raise ExamplesAxisError(
        f'batch_axes={batch_axes!r} must be an int, None, or a tuple of ints/None with one '
        f'entry per positional argument ({num_args} given)')
  return axes


def count_examples(args: tuple, batch_axes: BatchAxes) -> int:
  """The number of examples: the common size of every batched array along its axis.

  Raises:
    BatchNotArrayError: a batched argument is a Python list or tuple of numbers.
    ExamplesAxisError: no argument is batched, or the sizes disagree.
  """
  sizes: dict[int, str] = {}
  for index, (arg, axis) in enumerate(zip(args, per_argument(batch_axes, len(args)))):
    if axis is None:
      continue
    for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
      if not is_array(leaf):
        continue
      where = f'argument {index}{jax.tree_util.keystr(path)}'
      if leaf.ndim == 0:  # perhaps one number of a list, under jax.jit
        _refuse_numbers(index, arg)
      if not -leaf.ndim <= axis < max(leaf.ndim, 1) or leaf.ndim == 0:
        raise ExamplesAxisError(f'{where} has shape {leaf.shape}, with no axis {axis}')
      sizes.setdefault(int(leaf.shape[axis]), where)
  if not sizes:
    for index, (arg, axis) in enumerate(zip(args, per_argument(batch_axes, len(args)))):
      if axis is not None:
        _refuse_numbers(index, arg)
  if len(sizes) != 1:
    found = ', '.join(f'{w}: {n}' for n, w in sizes.items()) or 'no batched array argument'
    raise ExamplesAxisError(f'the batched arguments disagree on the number of examples '
                            f'({found})')
  return next(iter(sizes))


def _numbers_only(arg: Any) -> bool:
  """Whether ``arg`` is a non-empty Python list or tuple of numbers (a batch written as
  nested lists): Python or NumPy numbers, 0-d arrays (under ``jax.jit``, which makes each
  number an array), or no leaves at all (where the caller took the numbers out as static
  values)."""
  number = lambda leaf: (isinstance(leaf, (int, float, complex, np.number))
                         or (is_array(leaf) and leaf.ndim == 0))
  return type(arg) in (list, tuple) and len(arg) > 0 and all(map(number, jax.tree.leaves(arg)))


def _refuse_numbers(index: int, arg: Any) -> None:
  """:class:`BatchNotArrayError` if the batched argument at ``index`` is a list of numbers."""
  if _numbers_only(arg):
    raise BatchNotArrayError(f'argument {index} of the loss', type(arg).__name__)


def reduction_scale(reduction: str, num_examples: int) -> float:
  """The factor from the loss's activation gradients to per-example gradients.

  For ``loss = mean_i term_i`` the gradient at example ``i``'s activations is
  ``term_i``'s gradient divided by the number of examples, so it is multiplied
  back; for ``sum`` it is the per-example gradient already.
  """
  check_reduction_option(reduction)
  return float(num_examples) if reduction == 'mean' else 1.0


def reduce(values: Any, reduction: str) -> Any:
  """``mean`` or ``sum`` over axis 0."""
  return values.mean(axis=0) if reduction == 'mean' else values.sum(axis=0)
