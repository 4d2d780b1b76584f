"""Attribution patching and gradient x activation: first-order effects from one backward pass."""
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from perturbkit.core._precision import widened
from perturbkit.core._traced_points import TracedPoints, point_name
from perturbkit.interpret._edits import checked_view
from perturbkit.interpret._points import Tracer, check_metric, trace
from perturbkit.interpret._positions import (check_same_calls, checked_positions,
                                            per_position, sweep_positions)
from perturbkit.interpret._result import PatchingResult


def metric_and_grads(traced: TracedPoints, inputs: Any, function: str):
  """``(metric, outputs, d metric / d outputs)`` of one run, all by point path."""
  def metric(perturbations):
    out, outputs, _ = traced.run(perturbations, (inputs,), {}, None)
    return check_metric(out, function), outputs

  zeros = {p: shape.zeros() for p, shape in traced.shapes.items()}
  (value, outputs), grads = jax.value_and_grad(metric, has_aux=True)(zeros)
  return value, outputs, grads


def difference(a: Any, b: Any) -> Any:
  """``a - b`` leaf by leaf, in at least float32 (:func:`widened`)."""
  return jax.tree.map(lambda x, y: widened(x) - widened(y), a, b)


def first_order(paths: Sequence[tuple], deltas: dict, grads: dict, axis: int | None,
                positions: tuple[int, ...] | None,
                view: tuple[int, ...] | None = None) -> jax.Array:
  """``(calls, positions)``: ``delta . grad`` of each call in ``paths``, summed per position.

  In at least float32 (:func:`widened`), whatever the model's dtype.
  """
  rows = []
  for path in paths:
    terms = [per_position(widened(d) * widened(g), axis, positions, view)
             for d, g in zip(jax.tree.leaves(deltas[path]), jax.tree.leaves(grads[path]))]
    rows.append(functools.reduce(jnp.add, terms))
  return jnp.stack(rows)


def attribution_patching(tracer: Tracer, fn: Callable[..., Any], *, filter: Any,
                         axis: int | None, positions: Sequence[int] | None,
                         view: tuple[int, ...] | None = None,
                         function: str) -> Callable[..., PatchingResult]:
  """The front-end-neutral :func:`perturbkit.attribution_patching` (``tracer`` picks the API)."""
  view = checked_view(view)
  positions = checked_positions(positions, axis)

  @functools.wraps(fn)
  def attribute(model, clean, corrupted) -> PatchingResult:
    clean_points = trace(tracer, fn, model, (clean,), {}, filter, function)
    corrupted_points = trace(tracer, fn, model, (corrupted,), {}, filter, function)
    check_same_calls(clean_points, corrupted_points)
    where = sweep_positions(clean_points, axis, positions, view)
    clean_metric, clean_outputs, _ = clean_points.run({}, (clean,), {}, None)
    clean_metric = check_metric(clean_metric, function)
    corrupted_metric, outputs, grads = metric_and_grads(corrupted_points, corrupted, function)
    deltas = {p: difference(clean_outputs[p], outputs[p]) for p in corrupted_points.paths}
    effects = first_order(corrupted_points.paths, deltas, grads, axis, where, view)
    return PatchingResult(tuple(map(point_name, corrupted_points.paths)), where, effects,
                          clean_metric, corrupted_metric)

  return attribute


def grad_times_activation(tracer: Tracer, fn: Callable[..., Any], *, filter: Any,
                          axis: int | None, positions: Sequence[int] | None,
                          view: tuple[int, ...] | None = None,
                          function: str) -> Callable[..., PatchingResult]:
  """The front-end-neutral :func:`perturbkit.grad_times_activation` (``tracer`` picks the API)."""
  view = checked_view(view)
  positions = checked_positions(positions, axis)

  @functools.wraps(fn)
  def attribute(model, inputs) -> PatchingResult:
    traced = trace(tracer, fn, model, (inputs,), {}, filter, function)
    where = sweep_positions(traced, axis, positions, view)
    metric, outputs, grads = metric_and_grads(traced, inputs, function)
    effects = first_order(traced.paths, outputs, grads, axis, where, view)
    return PatchingResult(tuple(map(point_name, traced.paths)), where, effects, metric, metric)

  return attribute
