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


def interleaved_options(segments: Any, clip_global_norm: Any) -> None:
  """The numeric options of the interleaved schedule: a ``segments`` depth, ``clip_global_norm``."""
  if isinstance(segments, (numbers.Real, np.ndarray, jax.Array)):
    positive_int('segments', segments)
  if clip_global_norm is not None:
    positive('clip_global_norm', clip_global_norm)
