"""Attribution patching and gradient x activation: first-order effects from one backward pass."""
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from perturbkit.core._precision import accumulation_dtype, widened
from perturbkit.core._traced_points import PointEdit, TracedPoints, point_name
from perturbkit.core._naming import named_after
from perturbkit.core._varying import vary
from perturbkit.interpret._compiled import compiled_when_eager
from perturbkit.interpret._edits import checked_view, viewed, viewed_shape
from perturbkit.interpret._leaves import checked_leaves, chosen, on_leaves
from perturbkit.interpret._points import Tracer, check_given, check_metric, trace
from perturbkit.interpret._positions import (checked_positions, spread, sweep_positions,
                                            traced_alike)
from perturbkit.interpret._result import PatchingResult


class Direction(NamedTuple):
  """The direction a call's first-order effect is taken along, leaf by leaf of its output.

  ``along(o, r)`` for each leaf ``o`` of the output and the leaf ``r`` of
  ``reference(path, output)``: computed in the backward pass, from values the
  forward pass keeps, so that no direction is stored between the two.
  ``infinite``: whether ``along`` can be infinite where the output's gradient is
  0 (the output itself, or its difference from a finite baseline, at a masked
  ``-inf`` score); such entries then add 0 instead of ``0 * inf``. Attribution
  patching's difference of two runs is 0 where both are the same infinity, and
  it takes no such guard, so that its backward pass stays as short as it is
  (the guard adds about 7% to its compiled instructions on GPT-2): where only
  one run masks an entry (padded differently), its effects are NaN, as its
  docstring says.
  """
  reference: Callable[[tuple, Any], Any]
  along: Callable[[jax.Array, jax.Array], jax.Array]
  infinite: bool = False


def _moved_along(axis: int | None, positions: tuple[int, ...] | None,
                 view: tuple[int, ...] | None, name: str,
                 direction: Callable[[jax.Array, jax.Array], jax.Array],
                 infinite: bool = False) -> Callable[..., jax.Array]:
  """``(o, s, r) -> o + spread(s) * d``, ``d = direction(o, r)``, at ``s = 0``: ``o`` itself.

  Differentiated at zero scalars ``s`` only: the output is ``o`` exactly (no
  ``0 * d`` is computed, which would also make ``nan`` of an infinite ``d``),
  the gradient with respect to ``o`` is the incoming ``g``, with respect to
  ``s`` the per-position sum of ``g * d`` (both in at least float32; ``d`` made
  in the backward pass), and with respect to ``d`` zero (``spread(0) * g``).
  With ``infinite``, an entry whose gradient is exactly 0 adds 0 to that sum,
  also where ``d`` is infinite (``o`` itself at a masked ``-inf`` attention
  score, whose gradient is ``-0``): ``0 * inf`` would be ``nan``. Elsewhere an
  infinite ``d`` gives an infinite (or ``nan``) effect, as it should.
  """

  def along(s: jax.Array, d: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return spread(s, axis, positions, shape) * viewed(d, view, name)

  @jax.custom_vjp
  def moved(o: jax.Array, s: jax.Array, r: jax.Array) -> jax.Array:
    del s, r
    return o

  def forward(o, s, r):
    return o, (o, s, r)

  def backward(residuals, g):
    o, s, r = residuals
    d = direction(o, r)
    if infinite:  # only infinite d is replaced: finite values (and derivatives) stay exact
      d = jnp.where((g == 0) & jnp.isinf(d), jnp.zeros((), d.dtype), d)
    shape = viewed_shape(jnp.shape(g), view, name)
    _, transpose = jax.vjp(lambda s: along(s, d, shape), s)
    (ds,) = transpose(widened(viewed(g, view, name)).astype(jnp.result_type(s, d)))
    return g, ds, jax.tree.map(jnp.zeros_like, r)

  moved.defvjp(forward, backward)
  return moved


def first_order_effects(traced: TracedPoints, inputs: Any, direction: Direction,
                        axis: int | None, positions: tuple[int, ...] | None,
                        view: tuple[int, ...] | None, function: str,
                        paths: Sequence[tuple] | None = None,
                        edit: PointEdit | None = None,
                        leaves: tuple[int, ...] | None = None) -> tuple[jax.Array, jax.Array]:
  """``(metric, effects)``: ``direction . d metric / d output`` of every call, per position.

  Each call in ``paths`` (default: every selected call), its output ``o``
  first edited by ``edit`` where given, runs as ``o + w * d`` with ``d`` the
  ``direction`` (leaf by leaf, ``direction.along(o, r)`` for ``r`` in
  ``direction.reference(path, o)``) and ``w`` :func:`spread` from zero scalars
  ``s[path]``, one per position along ``axis`` (one without it); the gradient
  with respect to ``s`` is the per-position sum of ``d . d metric / d o``. So
  all the effects come from one backward pass in which no call's output
  gradient is kept whole: each is summed per position where it is made, and
  ``d`` is made there too. In at least float32 (:func:`widened`); the model
  sees ``o`` exactly (see :func:`_moved_along`). With ``leaves``, only those
  arrays of each output move (``direction.reference`` gets their tuple).

  Returns:
    The metric (checked to be a real scalar) and ``effects`` of shape
    ``(len(paths), len(positions) or 1)``.
  """
  paths = traced.paths if paths is None else tuple(paths)
  count = 1 if positions is None else len(positions)

  def scalars(path: tuple) -> jax.Array:
    shape = traced.shapes[path]
    # Real even for a complex output: each effect is the derivative of the (real) metric
    # along a real step o + s * d, whose transpose takes the real part of g * d's sum.
    dtype = functools.reduce(jnp.promote_types, [jnp.finfo(accumulation_dtype(leaf.dtype)).dtype
                                                 for leaf in shape.leaves])
    # Inside shard_map, varying like the output, so each device gets its own effects.
    return vary(jnp.zeros((count,), dtype), frozenset().union(*shape.varying))

  def metric(s: dict) -> jax.Array:
    def moved_along(path: tuple, output: Any) -> Any:
      output = output if edit is None else edit(path, output)
      if path not in s:
        return output
      name = point_name(path)

      moved = _moved_along(axis, positions, view, name, direction.along, direction.infinite)
      move = lambda path, out: jax.tree.map(lambda o, r: moved(o, s[path], r), out,
                                            direction.reference(path, out))
      return on_leaves(move, leaves)(path, output)

    out, _, _ = traced.run({}, (inputs,), {}, moved_along, reads=False)
    return check_metric(out, function)

  value, grads = jax.value_and_grad(metric)({p: scalars(p) for p in paths})
  return value, jnp.stack([grads[p] for p in paths])


def _minus(x: jax.Array, y: jax.Array) -> jax.Array:
  x, y = widened(x), widened(y)
  return jnp.where((x == y) & jnp.isinf(x), jnp.zeros((), x.dtype), x - y)


def difference(a: Any, b: Any) -> Any:
  """``a - b`` leaf by leaf, in at least float32 (:func:`widened`); 0 where they are equal.

  Equal infinite entries (a masked ``-inf`` attention score in both runs) give
  0, where ``a - b`` would be ``nan``; elsewhere it is ``a - b`` itself, with
  its derivatives (``da - db``, also where the two are equal).
  """
  return jax.tree.map(_minus, a, b)


def attribution_patching(tracer: Tracer, fn: Callable[..., Any], *, filter: Any,
                         axis: int | None, positions: Sequence[int] | None,
                         view: tuple[int, ...] | None = None, leaves: Any = None,
                         function: str) -> Callable[..., PatchingResult]:
  """The front-end-neutral :func:`perturbkit.attribution_patching` (``tracer`` picks the API)."""
  check_given(fn, filter, function)
  view = checked_view(view)
  positions = checked_positions(positions, axis)
  leaves = checked_leaves(leaves)

  @named_after(fn)
  def attribute(model, clean, corrupted) -> PatchingResult:
    clean_points = trace(tracer, fn, model, (clean,), {}, filter, function)
    corrupted_points = traced_alike(clean_points, clean, corrupted, tracer, fn, model, filter,
                                    function)
    where = sweep_positions(clean_points, axis, positions, view, leaves)
    clean_metric, clean_outputs, _ = clean_points.run({}, (clean,), {}, None)
    clean_metric = check_metric(clean_metric, function)
    # Along a_clean - a_corrupted, a_corrupted being the output the corrupted run makes.
    towards_clean = Direction(lambda path, _: chosen(clean_outputs[path], leaves),
                              lambda o, c: _minus(c, o))
    corrupted_metric, effects = first_order_effects(corrupted_points, corrupted, towards_clean,
                                                    axis, where, view, function, leaves=leaves)
    return PatchingResult(tuple(map(point_name, corrupted_points.paths)), where, effects,
                          clean_metric, corrupted_metric)

  return compiled_when_eager(attribute)


def grad_times_activation(tracer: Tracer, fn: Callable[..., Any], *, filter: Any,
                          axis: int | None, positions: Sequence[int] | None,
                          view: tuple[int, ...] | None = None, leaves: Any = None,
                          function: str) -> Callable[..., PatchingResult]:
  """The front-end-neutral :func:`perturbkit.grad_times_activation` (``tracer`` picks the API)."""
  check_given(fn, filter, function)
  view = checked_view(view)
  positions = checked_positions(positions, axis)
  leaves = checked_leaves(leaves)

  @functools.wraps(fn)
  def attribute(model, inputs) -> PatchingResult:
    traced = trace(tracer, fn, model, (inputs,), {}, filter, function)
    where = sweep_positions(traced, axis, positions, view, leaves)
    itself = Direction(lambda _, output: output, lambda o, _: widened(o), infinite=True)
    metric, effects = first_order_effects(traced, inputs, itself, axis, where, view, function,
                                          leaves=leaves)
    return PatchingResult(tuple(map(point_name, traced.paths)), where, effects, metric, metric)

  return compiled_when_eager(attribute)
