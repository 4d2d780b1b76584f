"""What the interpret functions share: tracing a function's points, nesting, the metric check."""
import inspect
from typing import Any, Callable, Mapping, Protocol

import jax
import jax.numpy as jnp

from perturbkit.core._loss import check_loss_fn, describe, point_options
from perturbkit.core._traced_points import TracedPoints
from perturbkit.core._types import CallFilter
from perturbkit.errors import MetricSignatureError, NonScalarMetricError


class Tracer(Protocol):
  """A front end's ``traced_points``: ``perturbkit.linen`` or ``perturbkit.nnx``."""

  def __call__(self, fn: Callable[..., Any], model: Any, args: tuple, kwargs: dict, *,
               filter: CallFilter, strict: bool, function: str,
               split_iterations: bool = True) -> TracedPoints: ...


def check_given(fn: Any, filter: Any, function: str) -> None:
  """Checks ``fn`` and ``filter`` where an interpret function is given them.

  Raises:
    LossNotCallableError: ``fn`` is not callable.
    FilterError, InvalidOptionError: ``filter`` is no filter.
  """
  first = 'model' if '.nnx.' in function else 'variables'
  check_loss_fn(fn, function, f'({first}, *args) -> output', 'function', 'fn')
  point_options(filter, None)


def trace(tracer: Tracer, fn: Callable[..., Any], model: Any, args: tuple, kwargs: dict,
          filter: CallFilter | bool | None, function: str,
          split_iterations: bool = True) -> TracedPoints:
  """``tracer`` with the filter read as ``value_and_grad`` reads it.

  ``split_iterations``: a call inside a scan is one point per iteration
  (``'__call__[0]'``, ...), which the edits and patching address; ``False``: one
  point, stacked per iteration like its gradient (the cache).

  Raises:
    MetricSignatureError: ``fn`` cannot take ``(model, *args, **kwargs)``.
  """
  check_signature(fn, model, args, kwargs, function)
  points, strict = point_options(filter, None)
  return tracer(fn, model, args, kwargs, filter=points, strict=strict, function=function,
                split_iterations=split_iterations)


def check_signature(fn: Callable[..., Any], model: Any, args: tuple, kwargs: dict,
                    function: str):
  """Raises ``MetricSignatureError`` unless ``fn(model, *args, **kwargs)`` binds.

  Checked before tracing, so that a function of other arguments (a metric of
  ``(variables, x, y)`` given to patching, which passes one input) gets a
  message about its signature rather than Python's ``TypeError`` from deep inside.
  """
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):  # no signature to read (some builtins): let the call tell
    return
  try:
    signature.bind(model, *args, **kwargs)
  except TypeError as cause:
    first = 'model' if '.nnx.' in function else 'variables'
    called = (f'fn({first}, inputs)' if len(args) == 1 and not kwargs else
              f'fn({first}, *args, **kwargs) with {len(args)} positional input(s) and '
              f'keywords {sorted(kwargs)}')
    raise MetricSignatureError(function, fn, f'{signature}', called, cause) from None


def nest(flat: Mapping[tuple, Any]) -> dict:
  """``{('Dense_0', '__call__'): v}`` as ``{'Dense_0': {'__call__': v}}``."""
  tree: dict = {}
  for path, value in flat.items():
    node = tree
    for name in path[:-1]:
      node = node.setdefault(name, {})
    node[path[-1]] = value
  return tree


def check_metric(value: Any, function: str) -> jax.Array:
  """``value`` checked to be a real scalar.

  Raises:
    NonScalarMetricError: it is anything else.
  """
  if (value is None or not jax.tree_util.treedef_is_leaf(jax.tree.structure(value))
      or jnp.shape(value) != () or not jnp.issubdtype(jnp.result_type(value), jnp.floating)):
    raise NonScalarMetricError(function, describe(value))
  return value
