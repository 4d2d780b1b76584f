"""Activation patching: each call's clean output put into the corrupted run, one at a time."""
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from perturbkit.core._precision import widened
from perturbkit.core._traced_points import point_name
from perturbkit.core._naming import named_after
from perturbkit.interpret._compiled import compiled_when_eager
from perturbkit.interpret._edits import Edit, checked_view, edit_function, viewed
from perturbkit.interpret._leaves import checked_leaves, chosen, on_leaves
from perturbkit.interpret._points import Tracer, check_given, check_metric, trace
from perturbkit.interpret._positions import checked_positions, sweep_positions, traced_alike
from perturbkit.interpret._result import PatchingResult
from perturbkit.interpret._sweep import check_batch_size, check_progress, sweep


def patching_edits(outputs: dict[tuple, Any], paths: Sequence[tuple], call: jax.Array,
                   position: jax.Array | None, axis: int | None,
                   view: tuple[int, ...] | None = None) -> dict[str, Edit]:
  """Edits of ``paths`` replacing call number ``call`` of them (at ``position``) by its clean value.

  Every path gets an edit, all but one inactive, so that the edits of different
  calls have one structure and stack along ``jax.vmap``.
  """
  at = None if position is None else position[None]
  clean = lambda p: jax.tree.map(lambda x: viewed(x, view, point_name(p)), outputs[p])
  return {point_name(p): Edit(jnp.zeros(()), clean(p), at, call == i, axis, view)
          for i, p in enumerate(paths)}


def _differs(a: jax.Array, b: jax.Array, axis: int | None) -> jax.Array:
  """Whether ``a`` and ``b`` differ anywhere (per index along ``axis``), ``-0.0`` from ``0.0`` too."""
  differ = a != b
  if jnp.issubdtype(a.dtype, jnp.floating):
    differ = differ | (jnp.signbit(a) != jnp.signbit(b))
  if axis is None:
    return differ.any()[None]
  return jnp.moveaxis(differ, axis, 0).reshape(differ.shape[axis], -1).any(axis=1)


def patches_needed(clean: dict[tuple, Any], corrupted: dict[tuple, Any], paths: Sequence[tuple],
                   where: tuple[int, ...] | None, axis: int | None,
                   view: tuple[int, ...] | None) -> jax.Array:
  """``(calls, positions)``: whether the clean and corrupted outputs differ there.

  Where they are equal, bit for bit, the patched run is the corrupted run and
  its effect is exactly zero, so it need not run.
  """
  def differs(p, a, b):
    differ = _differs(viewed(a, view, point_name(p)), viewed(b, view, point_name(p)), axis)
    return differ if where is None else differ[jnp.asarray(where)]

  return jnp.stack([
      functools.reduce(jnp.logical_or, [differs(p, a, b) for a, b in
                                        zip(jax.tree.leaves(clean[p]), jax.tree.leaves(corrupted[p]))])
      for p in paths])


def activation_patching(tracer: Tracer, fn: Callable[..., Any], *, filter: Any, axis: int | None,
                        positions: Sequence[int] | None, batch_size: int | None,
                        progress: bool, view: tuple[int, ...] | None = None,
                        leaves: Any = None, function: str) -> Callable[..., PatchingResult]:
  """The front-end-neutral :func:`perturbkit.activation_patching` (``tracer`` picks the API)."""
  check_given(fn, filter, function)
  view = checked_view(view)
  positions = checked_positions(positions, axis)
  leaves = checked_leaves(leaves)
  check_batch_size(batch_size)
  check_progress(progress)

  @named_after(fn)
  def patch(model, clean, corrupted) -> PatchingResult:
    clean_points = trace(tracer, fn, model, (clean,), {}, filter, function)
    corrupted_points = traced_alike(clean_points, clean, corrupted, tracer, fn, model, filter,
                                    function)
    where = sweep_positions(clean_points, axis, positions, view, leaves)
    clean_metric, outputs, _ = clean_points.run({}, (clean,), {}, None)
    corrupted_metric, corrupted_outputs, _ = corrupted_points.run({}, (corrupted,), {}, None)
    # The swept arrays of each output (with leaves=, a tuple of those).
    outputs = {p: chosen(o, leaves) for p, o in outputs.items()}
    corrupted_outputs = {p: chosen(o, leaves) for p, o in corrupted_outputs.items()}
    clean_metric = check_metric(clean_metric, function)
    corrupted_metric = check_metric(corrupted_metric, function)
    paths = corrupted_points.paths

    def job(group, call, column):
      at = None if where is None else jnp.asarray(where)[column]
      group_paths = [paths[i] for i in group]
      edit = on_leaves(edit_function(patching_edits(outputs, group_paths, call - group[0], at,
                                                    axis, view), paths), leaves)
      patched, _, _ = corrupted_points.run({}, (corrupted,), {}, edit, reads=False)
      # float32 effects, as the attribution functions give: the difference of two
      # bfloat16 metrics is exact in float32 (in bfloat16 only within a factor 2).
      return widened(check_metric(patched, function)) - widened(corrupted_metric)

    columns = 1 if where is None else len(where)
    needed = patches_needed(outputs, corrupted_outputs, paths, where, axis, view)
    skipped = jnp.zeros((), widened(corrupted_metric).dtype)
    effects = sweep(job, len(paths), jnp.arange(columns), batch_size,
                    'activation patching' if progress else None, (needed, skipped))
    return PatchingResult(tuple(map(point_name, paths)), where,
                          effects, clean_metric, corrupted_metric)

  return compiled_when_eager(patch)
