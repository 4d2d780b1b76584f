"""Layer integrated gradients: each call's attribution along a straight path from a baseline.

For one call with output ``a`` and baseline ``b``, the metric is run with that
output replaced by ``b + alpha * (a - b)`` and differentiated there; the
attribution is ``(a - b) . integral_0^1 d metric / d output (alpha) d alpha``,
by a quadrature over ``alpha``. Its sum is the change of the metric along the
path: ``metric(inputs) - metric(that call's output at the baseline)``
(completeness), up to the quadrature's error. The (call, node) pairs are a
sweep (``_sweep.sweep``): one ``jax.vmap`` per group of neighbouring calls.
With ``gaps``, a second sweep, forward only, runs each call at its baseline
(the path's other end) and measures that error: the effects' sum minus the
metric's change.
"""
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from perturbkit.core._precision import widened
from perturbkit.core._traced_points import TracedPoints, point_name
from perturbkit.core._validate import count, flag
from perturbkit.core._naming import named_after
from perturbkit.errors import InvalidOptionError
from perturbkit.interpret._attribution import Direction, difference, first_order_effects
from perturbkit.interpret._compiled import compiled_when_eager
from perturbkit.interpret._edits import Edit, checked_view, edit_function, viewed_shape
from perturbkit.interpret._leaves import checked_leaves, chosen, on_leaves, swept
from perturbkit.interpret._points import Tracer, check_given, check_metric, trace
from perturbkit.interpret._positions import checked_positions, sweep_positions, traced_alike
from perturbkit.interpret._result import IntegratedGradientsResult
from perturbkit.interpret._sweep import check_batch_size, check_progress, sweep

METHODS = ('gauss_legendre', 'riemann_trapezoid')


def quadrature(method: str, steps: int) -> tuple[np.ndarray, np.ndarray]:
  """Nodes in ``[0, 1]`` and weights (summing to 1) for ``integral_0^1 f(alpha) d alpha``.

  ``'gauss_legendre'``: numpy's Gauss-Legendre nodes moved from ``[-1, 1]``
  (exact for polynomials of degree ``2 * steps - 1``). ``'riemann_trapezoid'``:
  ``steps`` equally spaced nodes, both ends included, and the trapezoid rule.

  Args:
    method: ``'gauss_legendre'`` or ``'riemann_trapezoid'``.
    steps: The number of nodes (at least 2 for the trapezoid rule).

  Returns:
    ``(alphas, weights)``, two float64 arrays of length ``steps``.

  Raises:
    InvalidOptionError: an unknown method, or ``steps`` not a positive int
      (or 1 with the trapezoid rule).

  Example:
    >>> alphas, weights = quadrature('riemann_trapezoid', 3)
    >>> alphas.tolist(), weights.tolist()
    ([0.0, 0.5, 1.0], [0.25, 0.5, 0.25])
    >>> alphas, weights = quadrature('gauss_legendre', 2)
    >>> round(float(weights @ alphas ** 3), 12)   # exact for a cubic
    0.25
  """
  if method not in METHODS:
    raise InvalidOptionError('method', method, ' or '.join(map(repr, METHODS)))
  count('steps', steps)
  if method == 'gauss_legendre':
    nodes, weights = np.polynomial.legendre.leggauss(int(steps))
    return (nodes + 1) / 2, weights / 2
  if steps < 2:
    raise InvalidOptionError('steps', steps, "an integer >= 2 with method='riemann_trapezoid'")
  weights = np.full(int(steps), 1.0 / (steps - 1))
  weights[[0, -1]] /= 2
  return np.linspace(0.0, 1.0, int(steps)), weights


def path_edits(baselines: dict, deltas: dict, paths: Sequence[tuple], call: jax.Array,
               alpha: jax.Array) -> dict[str, Edit]:
  """Edits of ``paths`` putting call number ``call`` of them at ``baseline + alpha * delta``.

  Every path gets an edit, all but one inactive, so that the edits have one
  structure along ``jax.vmap``.
  """
  between = lambda b, d: b + alpha * d
  return {point_name(p): Edit(jnp.zeros(()), jax.tree.map(between, baselines[p], deltas[p]),
                              None, call == i, None)
          for i, p in enumerate(paths)}


def endpoint_edits(baselines: dict, paths: Sequence[tuple], call: jax.Array) -> dict[str, Edit]:
  """Edits of ``paths`` replacing call number ``call`` of them by its baseline, the others inactive.

  The baseline itself, not ``baseline + 0 * delta``: an infinite delta (a masked
  score against a zero baseline) would make that ``nan``.
  """
  return {point_name(p): Edit(jnp.zeros(()), baselines[p], None, call == i, None)
          for i, p in enumerate(paths)}


def check_every_position(traced: TracedPoints, axis: int | None, where: tuple[int, ...] | None,
                         view: tuple[int, ...] | None, leaves: tuple[int, ...] | None) -> None:
  """Raises ``InvalidOptionError`` unless ``where`` holds every index along ``axis`` once, at
  every swept array: a gap compares the effects' sum over all positions with the change."""
  if axis is None:
    return
  for path in traced.paths:
    name = point_name(path)
    for i, array in enumerate(traced.shapes[path].leaves):
      if not swept(leaves, i):
        continue
      size = viewed_shape(array.shape, view, name)[axis]
      if sorted(p % size for p in where) != list(range(size)):
        raise InvalidOptionError(
            'positions', where, f'every index along axis {axis} once (0 .. {size - 1} at '
            f'{name}) with gaps=True, since a gap compares the effects summed over all '
            'positions with the change of the metric; leave positions out, or pass gaps=False')


def baseline_outputs(tracer: Tracer, fn: Callable[..., Any], model: Any, traced: TracedPoints,
                     inputs: Any, outputs: dict, metric: jax.Array, baseline: Any, filter: Any,
                     function: str) -> tuple[dict, jax.Array]:
  """Each call's baseline (zeros, or its output on ``baseline``) and the metric there."""
  if baseline is None:
    return {p: jax.tree.map(jnp.zeros_like, outputs[p]) for p in traced.paths}, metric
  baseline_points = traced_alike(traced, inputs, baseline, tracer, fn, model, filter, function)
  value, baselines, _ = baseline_points.run({}, (baseline,), {}, None)
  return baselines, check_metric(value, function)


def layer_integrated_gradients(tracer: Tracer, fn: Callable[..., Any], *, filter: Any,
                               axis: int | None, positions: Sequence[int] | None, steps: int,
                               method: str, batch_size: int | None, progress: bool,
                               view: tuple[int, ...] | None = None, leaves: Any = None,
                               gaps: bool = False,
                               function: str) -> Callable[..., IntegratedGradientsResult]:
  """The front-end-neutral :func:`perturbkit.layer_integrated_gradients`."""
  check_given(fn, filter, function)
  alphas, weights = quadrature(method, steps)
  check_batch_size(batch_size)
  view = checked_view(view)
  positions = checked_positions(positions, axis)
  leaves = checked_leaves(leaves)
  check_progress(progress)
  flag('gaps', gaps)

  @named_after(fn)
  def attribute(model, inputs, baseline=None) -> IntegratedGradientsResult:
    traced = trace(tracer, fn, model, (inputs,), {}, filter, function)
    where = sweep_positions(traced, axis, positions, view, leaves)
    if gaps:
      check_every_position(traced, axis, where, view, leaves)
    metric, outputs, _ = traced.run({}, (inputs,), {}, None)
    metric = check_metric(metric, function)
    baselines, baseline_metric = baseline_outputs(tracer, fn, model, traced, inputs, outputs,
                                                  metric, baseline, filter, function)
    paths = traced.paths
    # The swept arrays of each output (with leaves=, a tuple of those).
    outputs = {p: chosen(outputs[p], leaves) for p in paths}
    baselines = {p: chosen(baselines[p], leaves) for p in paths}
    deltas = {p: difference(outputs[p], baselines[p]) for p in paths}

    along_delta = Direction(lambda path, _: deltas[path], lambda _, delta: delta, infinite=True)

    def job(group, call, alpha):
      group_paths = [paths[i] for i in group]
      edit = on_leaves(edit_function(path_edits(baselines, deltas, group_paths, call - group[0],
                                                alpha), paths), leaves)
      # (a - b) . d metric / d (the edited output), per position; only the group's calls and
      # what follows them are differentiated.
      _, effects = first_order_effects(traced, inputs, along_delta, axis, where, view, function,
                                       group_paths, edit, leaves)
      return effects[call - group[0]]

    per_node = sweep(job, len(paths), jnp.asarray(alphas, jnp.float32), batch_size,
                     'integrated gradients' if progress else None)
    effects = jnp.einsum('cnp,n->cp', per_node, jnp.asarray(weights, per_node.dtype))
    names = tuple(map(point_name, paths))
    if not gaps:
      return IntegratedGradientsResult(names, where, effects, metric, baseline_metric)

    def endpoint(group, call, _):
      group_paths = [paths[i] for i in group]
      edit = on_leaves(edit_function(endpoint_edits(baselines, group_paths, call - group[0]),
                                     paths), leaves)
      value, _, _ = traced.run({}, (inputs,), {}, edit, reads=False)
      return check_metric(value, function)

    # One group: the whole model is compiled once more, forward only, not once per group of
    # calls; the runs are one per call, few beside the steps' backward runs.
    ends = sweep(endpoint, len(paths), jnp.zeros((1,)), batch_size, groups=1)[:, 0]
    gap = effects.sum(axis=1) - (widened(metric) - widened(ends))
    return IntegratedGradientsResult(names, where, effects, metric, baseline_metric, ends, gap)

  return compiled_when_eager(attribute)
