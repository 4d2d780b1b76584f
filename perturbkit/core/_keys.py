"""Checks of the random keys the public functions are given."""
from typing import Any

import jax
import jax.numpy as jnp

from perturbkit.errors import PRNGKeyError


def check_key(key: Any, where: str) -> None:
  """Raises unless ``key`` is a typed key (``jax.random.key``) or raw ``uint32`` key data.

  Raises:
    PRNGKeyError: ``key`` is a Python or NumPy integer, or an array of another dtype.
  """
  dtype = getattr(key, 'dtype', None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return
  if dtype == jnp.uint32 and jnp.ndim(key) >= 1:
    return
  got = (f'an array of dtype {dtype} and shape {jnp.shape(key)}' if dtype is not None
         else f'{type(key).__name__} {key!r}')
  raise PRNGKeyError(where, got)
