"""Checks of the numeric options of the public functions, made where the options are given.

Each check takes the option's name and value, returns the value unchanged and
raises :class:`InvalidOptionError` (naming the option, the value and the allowed
range) when it is outside that range. Python numbers, NumPy scalars and concrete
0-d JAX arrays are checked; a traced value (an option computed inside ``jax.jit``)
has no value to check yet, and passes.
"""
import math
import numbers
from typing import Any

import jax
import numpy as np

from perturbkit.core._callables import call_filter
from perturbkit.errors import InvalidOptionError


def _number(name: str, value: Any, allowed: str) -> float | None:
  """The option as a Python number, ``None`` if traced; raises for anything not a real scalar."""
  if isinstance(value, jax.core.Tracer):
    return None
  if isinstance(value, (bool, np.bool_)):
    raise InvalidOptionError(name, value, allowed)
  if isinstance(value, numbers.Real):
    return value
  if isinstance(value, (jax.Array, np.ndarray)) and value.shape == () and (
      np.issubdtype(value.dtype, np.integer) or np.issubdtype(value.dtype, np.floating)):
    return value.item()
  raise InvalidOptionError(name, value, allowed)


def flag(name: str, value: Any, none: bool = False) -> Any:
  """``value`` if it is a Python bool (or ``None``, where ``none``): a string such as
  ``'no'`` would be read as true."""
  if isinstance(value, (bool, np.bool_)) or (none and value is None):
    return value
  raise InvalidOptionError(name, value, 'True or False' + (' (or None)' if none else ''))


def positive(name: str, value: Any) -> Any:
  """``value`` if it is a finite number > 0."""
  allowed = 'a finite number > 0'
  number = _number(name, value, allowed)
  if number is not None and not (math.isfinite(number) and number > 0):
    raise InvalidOptionError(name, value, allowed)
  return value


def non_negative(name: str, value: Any) -> Any:
  """``value`` if it is a finite number >= 0."""
  allowed = 'a finite number >= 0'
  number = _number(name, value, allowed)
  if number is not None and not (math.isfinite(number) and number >= 0):
    raise InvalidOptionError(name, value, allowed)
  return value


def fraction(name: str, value: Any) -> Any:
  """``value`` if it is in ``[0, 1)`` (a decay: 1 would never forget the first value)."""
  allowed = 'a number in [0, 1)'
  number = _number(name, value, allowed)
  if number is not None and not 0 <= number < 1:
    raise InvalidOptionError(name, value, allowed)
  return value


def _integer(name: str, value: Any, low: int, allowed: str) -> Any:
  number = _number(name, value, allowed)
  if number is not None and not (isinstance(number, numbers.Integral) and number >= low):
    raise InvalidOptionError(name, value, allowed)
  return value


def positive_int(name: str, value: Any) -> Any:
  """``value`` if it is an integer >= 1 (not a bool, not a float)."""
  return _integer(name, value, 1, 'an integer >= 1')


def finite(name: str, value: Any) -> Any:
  """``value`` if it is a finite number (of any sign)."""
  allowed = 'a finite number'
  number = _number(name, value, allowed)
  if number is not None and not math.isfinite(number):
    raise InvalidOptionError(name, value, allowed)
  return value


def _python_int(value: Any) -> bool:
  """Whether ``value`` is a Python or NumPy integer (not a bool, float or JAX array)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def count(name: str, value: Any, low: int = 1) -> Any:
  """``value`` if it is a Python (or NumPy) integer >= ``low``: a size or a number of steps,
  which shapes depend on, so a JAX array (concrete or traced) is refused too."""
  if not (_python_int(value) and value >= low):
    raise InvalidOptionError(name, value, f'a Python int >= {low} (not a float, bool or JAX '
                                          'array)')
  return value


def axes(name: str, value: Any, tuples: bool = False) -> Any:
  """``value`` if it is an int axis (negative ones count from the end), or with ``tuples`` a
  tuple of them; a float, a bool or a JAX array is refused."""
  given = value if tuples and isinstance(value, tuple) else (value,)
  if not given or not all(_python_int(a) for a in given):
    raise InvalidOptionError(name, value, 'an int axis (negative counts from the end)' +
                             (' or a tuple of them' if tuples else ''))
  return value


def interleaved_options(segments: Any, clip_global_norm: Any, propagate: Any, has_aux: Any,
                        skip_nonfinite: Any) -> Any:
  """The options of the interleaved schedule, checked where they are given: ``segments``
  (returned, a depth as a Python int), ``clip_global_norm``, ``propagate`` and the flags
  ``has_aux`` and ``skip_nonfinite`` (a string such as ``'no'`` would be read as true)."""
  if clip_global_norm is not None:
    positive('clip_global_norm', clip_global_norm)
  if not isinstance(propagate, str) or propagate not in ('updated', 'original'):
    raise InvalidOptionError('propagate', propagate, "'updated' or 'original'")
  flag('has_aux', has_aux)
  flag('skip_nonfinite', skip_nonfinite)
  if segments is None:
    return segments
  if callable(segments) and not isinstance(segments, jax.Array):
    return call_filter(segments, 'segments=', 'None, an int depth >= 1 or a call filter')
  if not (_python_int(segments) and segments >= 1):
    raise InvalidOptionError('segments', segments, 'None, an int depth >= 1 or a call filter '
                             '(module, method_name) -> bool')
  return int(segments)
