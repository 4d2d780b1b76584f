"""Caching: every selected call's output (and inputs, and metric gradient) from one run."""
import functools
from typing import Any, Callable, NamedTuple

import jax

from perturbkit.core._traced_points import TracedPoints
from perturbkit.core._validate import flag
from perturbkit.interpret._points import Tracer, check_given, check_metric, nest, trace


class Cache(NamedTuple):
  """What :func:`perturbkit.run_with_cache` returns next to the output.

  Each field is a nested dict keyed like ``grads['perturbations']`` of
  :func:`perturbkit.value_and_grad`: the module path, then the point key
  (``cache.outputs['Dense_0']['__call__']``).

  Attributes:
    outputs: Each selected call's output (its floating-point part).
    inputs: Each call's ``(args, kwargs)`` (array leaves, ``None`` for the
      rest), or ``None`` unless ``return_inputs=True``.
    grads: d(metric)/d(output) of each call, or ``None`` unless ``grads=True``.
  """
  outputs: dict
  inputs: dict | None = None
  grads: dict | None = None


def metric_and_grads(traced: TracedPoints, args: tuple, kwargs: dict, function: str):
  """``(metric, outputs, inputs, d metric / d outputs)`` of one run, all by point path.

  Raises:
    NonScalarMetricError: the function returned no real scalar.
  """
  def metric(perturbations):
    out, outputs, inputs = traced.run(perturbations, args, kwargs, None)
    return check_metric(out, function), (outputs, inputs)

  zeros = {p: shape.zeros() for p, shape in traced.shapes.items()}
  (value, (outputs, inputs)), grads = jax.value_and_grad(metric, has_aux=True)(zeros)
  return value, outputs, inputs, grads


def run_with_cache(tracer: Tracer, fn: Callable[..., Any], *, filter: Any, return_inputs: bool,
                   grads: bool, function: str) -> Callable[..., tuple[Any, Cache]]:
  """The front-end-neutral :func:`perturbkit.run_with_cache` (``tracer`` picks the API)."""
  check_given(fn, filter, function)
  flag('return_inputs', return_inputs)
  flag('grads', grads)

  @functools.wraps(fn)
  def cached(model, *args, **kwargs):
    traced = trace(tracer, fn, model, args, kwargs, filter, function, split_iterations=False)
    inputs = None
    if not grads:
      out, outputs, inputs = traced.run({}, args, kwargs, None)
      return out, Cache(nest(outputs), nest(inputs) if return_inputs else None)

    value, outputs, inputs, point_grads = metric_and_grads(traced, args, kwargs, function)
    return value, Cache(nest(outputs), nest(inputs) if return_inputs else None,
                        nest(point_grads))

  return cached
