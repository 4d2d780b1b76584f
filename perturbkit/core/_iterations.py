"""Calls inside a scan as one point per iteration.

A call inside ``nn.scan``/``nnx.scan`` (or a ``vmap`` mapping the
perturbations) has one point, stacked along the transform's axis: its gradient
and captures come out with one value per iteration. To edit, patch or
attribute one iteration of it (one layer of a scanned transformer), the
interpretability functions see it as ``size`` points, ``'__call__[0]'``,
``'__call__[1]'``, ..., each with the shape of one iteration's output.
:func:`per_iteration` builds that view over a front end's run, which gives the
edit of a stacked call the iteration it runs in (an index the transform slices
like the perturbations, see :func:`iteration_indices`).
"""
import functools
import math
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from perturbkit.core._points import PointShape, stacked_axis, with_stacked_axis
from perturbkit.core._traced_points import PointEdit, TracedPoints


class Stacking(NamedTuple):
  """Where a stacked point's values are stacked: the axes ``sizes`` from ``axis`` on.

  ``sizes`` is ``(iterations,)`` for a scan, ``(outer, inner)`` for a scan inside a
  scan; the iterations are numbered in row-major order of those axes.
  """
  axis: int
  sizes: tuple[int, ...]

  @property
  def size(self) -> int:
    """How many iterations in all."""
    return math.prod(self.sizes)

  def marked_axes(self) -> tuple[int, ...]:
    """The axes a :func:`marker` stacked like this point has other than 1."""
    return tuple(self.axis + i for i, size in enumerate(self.sizes) if size != 1)


def marker_name(key: str) -> str:
  """The name of the axis marker a front end's discovery puts next to point ``key`` inside a
  transform (no point has it)."""
  return f'{key}:axis'


def marker(rank: int) -> jax.Array:
  """An axis marker: zeros of shape ``(1,) * rank``, ``rank`` that of the point's first leaf.

  Made next to a point inside a transform that maps the perturbations, it is
  stacked like the point; outside, its only axes other than 1 are those the
  transform stacked along. The point's own shape cannot always tell: stacked
  along axis 1, a ``(3, 4)`` output of a 3-iteration scan is ``(3, 3, 4)``, as
  stacked along axis 0.
  """
  return jnp.zeros((1,) * rank, jnp.float32)


def marked_axes(shape: tuple[int, ...]) -> tuple[int, ...]:
  """The axes of a :func:`marker`'s outside shape other than 1: where it was stacked."""
  return tuple(i for i, size in enumerate(shape) if size != 1)


def stacking(inside: list[tuple[int, ...]], outside: list[tuple[int, ...]],
             marked: tuple[int, ...] | None = None) -> Stacking | None:
  """How a point's leaf shapes ``outside`` its transform stack those ``inside`` per iteration.

  ``marked``, where given, is the outside shape of the point's :func:`marker`:
  the stacked axes are where it is not 1. Without it (or with one iteration,
  where every reading is the same) they are read from the shapes.
  ``None`` unless every leaf is stacked along the same axes (the same shapes:
  a transform that does not stack, ``nn.remat``).
  """
  if not inside or list(inside) == list(outside):
    return None
  extra = len(outside[0]) - len(inside[0])
  axes = marked_axes(marked or ())
  if axes and extra >= 1:
    found = (axes[0], tuple(outside[0][axes[0]:axes[0] + extra]))
  else:
    found = stacked_axis(inside[0], outside[0])
  if found is None or with_stacked_axis(list(inside), found) != list(outside):
    return None
  return Stacking(*found)


def stackings_of(inside: Mapping[tuple, list[tuple[int, ...]]],
                 outside: Mapping[tuple, PointShape],
                 marked: Mapping[tuple, tuple[int, ...]] | None = None) -> dict[tuple, Stacking]:
  """The stacked points among those whose leaf shapes ``inside`` their transform are given
  (``outside``: every point's shape; ``marked``: the outside shapes of their markers)."""
  marked = marked or {}
  found = {path: stacking(list(shapes), leaf_shapes_of(outside[path]), marked.get(path))
           for path, shapes in inside.items()}
  return {path: s for path, s in found.items() if s is not None}


def edit_output(edit: Callable[..., Any], path: tuple, part: Any,
                index: jax.Array | None) -> Any:
  """``edit(path, part)``; for a scan's call, whose iteration indices the transform sliced
  to ``index``, the edit of that iteration."""
  if index is None:
    return edit(path, part)
  return edit(path, part, iteration=index.reshape(()))


def leaf_shapes_of(shape: PointShape) -> list[tuple[int, ...]]:
  """The leaf shapes a :class:`PointShape` holds."""
  return [tuple(s.shape) for s in shape.leaves]


def iteration_key(key: str) -> str:
  """Where a stacked call's iteration indices sit next to its point (no point has it)."""
  return f'{key}:iteration'


def iteration_indices(stacking: Stacking) -> jax.Array:
  """``0 .. size - 1`` stacked like the point, one ``(1,)`` array per iteration.

  Put next to the call's perturbation, the transforms slice it like the
  perturbation, so inside iteration ``i`` it is ``[i]``.
  """
  shape = with_stacked_axis([(1,)], (stacking.axis, stacking.sizes))[0]
  return jnp.arange(stacking.size, dtype=jnp.int32).reshape(shape)


def index_entries(stackings: Mapping[tuple, Stacking]) -> dict[tuple, jax.Array]:
  """``{path next to each stacked point: its iteration indices}``, for the front ends to put
  next to the perturbations."""
  return {path[:-1] + (iteration_key(path[-1]),): iteration_indices(s)
          for path, s in stackings.items()}


def iteration_path(path: tuple, index: int, stacking: Stacking) -> tuple:
  """The point path of one iteration of a stacked call: ``(..., '__call__[2]')``;
  ``'__call__[1][0]'`` in a scan inside a scan (outer iteration, then inner)."""
  position = ''.join(f'[{i}]' for i in np.unravel_index(index, stacking.sizes))
  return path[:-1] + (f'{path[-1]}{position}',)


def _unstacked_shape(shape: PointShape, stacking: Stacking) -> PointShape:
  start, end = stacking.axis, stacking.axis + len(stacking.sizes)
  return PointShape(shape.treedef, tuple(
      jax.ShapeDtypeStruct(s.shape[:start] + s.shape[end:], s.dtype) for s in shape.leaves),
      shape.varying)


def _take(tree: Any, index: int, stacking: Stacking) -> Any:
  """Iteration ``index`` of values stacked like ``stacking``."""
  axis, n = stacking.axis, len(stacking.sizes)

  def take(x):
    flat = x.reshape(x.shape[:axis] + (stacking.size,) + x.shape[axis + n:])
    return jax.lax.index_in_dim(flat, index, axis, keepdims=False)

  return jax.tree.map(take, tree)


def _stack(values: list, stacking: Stacking) -> Any:
  """One value per iteration stacked like ``stacking``."""
  axis = stacking.axis

  def stack(*xs):
    stacked = jnp.stack(xs, axis)
    return stacked.reshape(stacked.shape[:axis] + stacking.sizes + stacked.shape[axis + 1:])

  return jax.tree.map(stack, *values)


# A front end's run whose edit takes, for a stacked call, the index of the iteration it
# runs in: ``edit(path, output, iteration=i)``.
# ``reads=False``: no outputs or inputs are read (two empty dicts).
StackedRun = Callable[..., tuple[Any, dict, dict]]


def per_iteration(paths: tuple[tuple, ...], shapes: Mapping[tuple, PointShape],
                  stackings: Mapping[tuple, Stacking], run: StackedRun) -> TracedPoints:
  """``TracedPoints`` with each stacked call as one point per iteration.

  Args:
    paths: The selected calls' point paths, in call order.
    shapes: Each point's shape outside its transform (stacked for the stacked calls).
    stackings: The stacked calls and their axis and iteration count.
    run: The front end's run over the real points: stacked perturbations in,
      stacked outputs and inputs out; for a stacked call it calls the edit as
      ``edit(path, output, iteration=i)`` with the iteration's index ``i``.

  Returns:
    The same calls, each stacked one replaced by ``iteration_path(path, i)`` for
    every iteration ``i``, in place.
  """
  if not stackings:
    return TracedPoints(paths, dict(shapes), run)
  expanded: list[tuple] = []
  own_shapes: dict[tuple, PointShape] = {}
  origin: dict[tuple, tuple[tuple, int]] = {}
  iterations: dict[tuple, list[tuple]] = {}
  for path in paths:
    if path not in stackings:
      expanded.append(path)
      own_shapes[path] = shapes[path]
      continue
    s = stackings[path]
    iterations[path] = [iteration_path(path, i, s) for i in range(s.size)]
    one_shape = _unstacked_shape(shapes[path], s)
    for i, one in enumerate(iterations[path]):
      expanded.append(one)
      own_shapes[one] = one_shape
      origin[one] = (path, i)

  def stacked_edit(edit: PointEdit) -> Callable[..., Any]:
    def dispatch(path: tuple, output: Any, iteration: jax.Array | None = None) -> Any:
      if iteration is None:
        return edit(path, output)
      branches = [functools.partial(edit, one) for one in iterations[path]]
      edited = [(i, branch(output)) for i, branch in enumerate(branches)]
      edited = [(i, value) for i, value in edited if value is not output]
      if not edited:
        return output
      if len(edited) == 1:  # one iteration edited: no branch, the edit masked elsewhere
        i, value = edited[0]
        return jax.tree.map(lambda e, o: jnp.where(iteration == i, e, o), value, output)
      return jax.lax.switch(iteration, branches, output)
    return dispatch

  def own_run(perturbations, args, kwargs, edit: PointEdit | None = None, reads: bool = True):
    given: dict[tuple, Any] = {}
    per_stack: dict[tuple, dict[int, Any]] = {}
    for path, value in perturbations.items():
      if path in origin:
        stacked, i = origin[path]
        per_stack.setdefault(stacked, {})[i] = value
      else:
        given[path] = value
    for stacked, values in per_stack.items():
      given[stacked] = _stack([values[i] if i in values else own_shapes[one].zeros()
                               for i, one in enumerate(iterations[stacked])],
                              stackings[stacked])
    out, outputs, inputs = run(given, args, kwargs,
                               None if edit is None else stacked_edit(edit), reads=reads)
    if not reads:
      return out, {}, {}

    def split(flat: dict) -> dict:
      parts = {}
      for path in expanded:
        if path in origin:
          stacked, i = origin[path]
          parts[path] = _take(flat[stacked], i, stackings[stacked])
        else:
          parts[path] = flat[path]
      return parts

    return out, split(outputs), split(inputs)

  return TracedPoints(tuple(expanded), own_shapes, own_run)
