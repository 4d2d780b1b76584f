"""Which positions a sweep covers, and checks that clean and corrupted runs make the same calls."""
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from perturbkit.core._input_types import input_types, same_types
from perturbkit.core._traced_points import TracedPoints, point_name
from perturbkit.errors import (AxisLengthMismatchError, CallStructureMismatchError,
                               InvalidOptionError, PositionOutOfRangeError)
from perturbkit.interpret._edits import AS_INDICES, viewed_shape
from perturbkit.interpret._leaves import check_leaves, swept
from perturbkit.interpret._points import Tracer, trace


def checked_positions(positions: Sequence[int] | None, axis: int | None
                      ) -> tuple[int, ...] | None:
  """``positions`` as a tuple of ints, checked where they are given (``None`` passes).

  Raises:
    InvalidOptionError: ``axis`` is not an int, or ``positions`` are given
      without ``axis``, are empty, nested (``[[0, 1]]``), or are not integers
      (``1.5`` is no index).
  """
  if axis is not None and (isinstance(axis, bool) or not isinstance(axis, (int, np.integer))):
    raise InvalidOptionError('axis', axis, 'an int (1 for the tokens of (batch, tokens, '
                             'features) outputs) or None')
  if positions is None:
    return None
  if axis is None:
    raise InvalidOptionError('axis', axis, 'an int whenever positions are given (e.g. axis=1 '
                             'for the tokens of (batch, tokens, features) outputs)')
  if any(isinstance(p, jax.core.Tracer) for p in jax.tree.leaves(positions)):
    raise InvalidOptionError('positions', positions, 'Python ints, not values traced under '
                             "jax.jit: they label the result's columns, which are static")
  try:
    given = np.asarray(positions)
  except ValueError:  # ragged nesting
    given = np.asarray(positions, dtype=object)
  if given.ndim > 1 or given.size == 0 or not np.issubdtype(given.dtype, np.integer):
    raise InvalidOptionError('positions', positions, 'a non-empty flat sequence of integer '
                             'indices along the axis (e.g. [0, 1], not [[0, 1]]; ' + AS_INDICES +
                             ')')
  return tuple(int(p) for p in given.reshape(-1))


def sweep_positions(traced: TracedPoints, axis: int | None, positions: Sequence[int] | None,
                    view: tuple[int, ...] | None = None,
                    leaves: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
  """The positions along ``axis`` (default: all of them), checked at every call.

  ``positions`` come from :func:`checked_positions`. Without them, every
  selected call's output must have the first call's length along ``axis``
  (every swept array of it), and the sweep covers all of that length.

  With ``view``, ``axis`` and the positions refer to every output viewed so.
  With ``leaves`` (from ``_leaves.checked_leaves``), only those arrays of each
  output are swept and checked (every call must return them).

  Raises:
    EditViewError: ``view`` does not hold some selected call's output.
    PositionOutOfRangeError: a position outside some selected call's output
      along ``axis``, or an output without that axis.
    AxisLengthMismatchError: without ``positions``, a call's output of
      another length along ``axis`` than the first call's.
  """
  check_leaves(traced, leaves)
  # (call, [((array index, arrays the call returns), shape)]): the swept arrays.
  calls = []
  for p in traced.paths:
    arrays = traced.shapes[p].leaves
    calls.append((point_name(p), [((i, len(arrays)), viewed_shape(a.shape, view, point_name(p)))
                                  for i, a in enumerate(arrays) if swept(leaves, i)]))
  if axis is None:
    return None
  given = positions is not None
  if not given:
    first, [(leaf, shape), *_] = calls[0]
    if not -len(shape) <= axis < len(shape):
      raise PositionOutOfRangeError(first, 'all', axis, shape, leaf)
    positions = range(shape[axis])
  positions = tuple(int(p) for p in positions)
  others = []
  for name, arrays in calls:
    for leaf, shape in arrays:
      inside = -len(shape) <= axis < len(shape)
      if inside and not given and shape[axis] != len(positions):
        others.append((name, shape, leaf))
      elif not inside or any(not -shape[axis] <= p < shape[axis] for p in positions):
        raise PositionOutOfRangeError(name, 'all' if not given else list(positions), axis,
                                      shape, leaf)
  if others:
    raise AxisLengthMismatchError(first, len(positions), axis, others)
  return positions


def spread(scalars: jax.Array, axis: int | None, positions: tuple[int, ...] | None,
           shape: tuple[int, ...]) -> jax.Array:
  """``scalars`` put at ``positions`` along ``axis``, to broadcast to ``shape``.

  Returns ``scalars[j]`` at index ``positions[j]`` along ``axis`` (repeated
  positions add up), zero elsewhere; without ``axis``, the one scalar. So the
  gradient of ``sum(spread(s) * v)`` with respect to ``s`` is ``v`` summed over
  every axis but ``axis``, at ``positions`` (everything, without ``axis``).
  """
  if axis is None:
    return scalars[0]
  axis = axis % len(shape)
  size = shape[axis]
  index = [p % size for p in positions]
  if index == list(range(index[0], index[0] + len(index))):
    weights = jnp.pad(scalars, (index[0], size - index[0] - len(index)))
  else:
    weights = jnp.zeros((size,), scalars.dtype).at[np.asarray(index)].add(scalars)
  return weights.reshape([size if a == axis else 1 for a in range(len(shape))])


def _described(traced: TracedPoints, path: tuple | None) -> str:
  if path is None:
    return 'no further call'
  shapes = [(tuple(s.shape), str(s.dtype)) for s in traced.shapes[path].leaves]
  return f'a call {point_name(path)} with output {shapes[0] if len(shapes) == 1 else shapes}'


def check_same_calls(clean: TracedPoints, corrupted: TracedPoints):
  """Raises a named error, naming the first difference, unless both make the same calls.

  Raises:
    CallStructureMismatchError: a call one makes and the other does not, or
      outputs of other shapes or dtypes.
  """
  for i in range(max(len(clean.paths), len(corrupted.paths))):
    a = clean.paths[i] if i < len(clean.paths) else None
    b = corrupted.paths[i] if i < len(corrupted.paths) else None
    # Shapes and dtypes: inside shard_map one input may vary over the devices, the other not.
    if a != b or clean.shapes[a][:2] != corrupted.shapes[b][:2]:
      raise CallStructureMismatchError(f'call {i} ({point_name(a or b)})',
                                       _described(clean, a), _described(corrupted, b))


def traced_alike(traced: TracedPoints, given: Any, other: Any, tracer: Tracer,
                 fn: Callable[..., Any], model: Any, filter: Any,
                 function: str) -> TracedPoints:
  """The points of ``fn(model, other)``, ``traced`` being those of ``fn(model, given)``.

  A trace depends on its inputs' types alone (``core/_input_types``), so for an
  ``other`` of ``given``'s types (corrupted tokens beside the clean ones) it is
  ``traced`` itself; else ``other`` is traced too, and both are checked to make the
  same calls.

  Raises:
    CallStructureMismatchError: (from :func:`check_same_calls`) they make other calls.
  """
  if same_types(input_types(given), input_types(other)):
    return traced
  points = trace(tracer, fn, model, (other,), {}, filter, function)
  check_same_calls(traced, points)
  return points
