"""Whether a function given as an option can be called the way perturbkit calls it.

Checked where the function is given, so that a call filter of one argument (or a
module where a filter goes) is refused with a message saying what it must take,
not by Python's ``TypeError`` when the step runs.
"""
import inspect
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from perturbkit.errors import FilterError, TracedFilterError


def takes(fn: Any, count: int) -> bool:
  """Whether ``fn`` can be called with ``count`` positional arguments (``True`` where its
  signature cannot be read, as for some builtins)."""
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):
    return True
  try:
    signature.bind(*range(count))
  except TypeError:
    return False
  return True


def takes_keywords(fn: Any) -> bool:
  """Whether ``fn`` takes any keyword argument (``**kwargs``), as the ``update`` of
  ``optax.MultiSteps(...).gradient_transformation()`` does to hand them to its inner
  transformation (``False`` where its signature cannot be read)."""
  try:
    parameters = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return False
  return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def call_filter(item: Any, function: str, want: str) -> Any:
  """``item`` if it is a call filter: a callable taking ``(module, method_name)``.

  Raises:
    FilterError: ``item`` is a module class or a module (calling it would build or run
      a module), not callable, or takes other arguments.
  """
  if isinstance(item, type) or isinstance(item, (nn.Module, nnx.Module)):
    name = (item if isinstance(item, type) else type(item)).__name__
    raise FilterError(function, f'{want}, not a module class or module (for the calls of '
                      f'{name} modules pass filters.by_type({name}))', item)
  if not callable(item):
    raise FilterError(function, want, item)
  if not takes(item, 2):
    raise FilterError(function, 'a call filter of the two arguments (module, method_name) '
                      f'(the function given takes {inspect.signature(item)})', item)
  return item


def selects(filter: Any, module: Any, method_name: str) -> bool:
  """Whether ``filter`` selects the call of ``module``'s ``method_name``, as a Python bool.

  Raises:
    TracedFilterError: the filter's answer is a traced value (or the filter failed on one),
      which has no truth value while the model is traced.
  """
  try:
    return bool(filter(module, method_name))
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
          jax.errors.TracerIntegerConversionError) as error:
    raise TracedFilterError(filter, type(module).__name__, method_name) from error
