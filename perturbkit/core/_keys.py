"""Checks of the random keys the public functions are given."""
from typing import Any

import jax
import jax.numpy as jnp

from perturbkit.errors import PRNGKeyError


def check_key(key: Any, where: str) -> None:
  """Raises unless ``key`` is one typed key (``jax.random.key``) or one raw ``uint32`` key.

  Raises:
    PRNGKeyError: ``key`` is a Python or NumPy integer, an array of another dtype, or an
      array of several keys (keys split per device and sharded by ``shard_map``).
  """
  dtype = getattr(key, 'dtype', None)
  typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
  if typed or (dtype == jnp.uint32 and jnp.ndim(key) >= 1):
    if jnp.ndim(key) == (0 if typed else 1):
      return
    raise PRNGKeyError(where, f'an array of keys of shape {jnp.shape(key)}', several=True)
  got = (f'an array of dtype {dtype} and shape {jnp.shape(key)}' if dtype is not None
         else f'{type(key).__name__} {key!r}')
  raise PRNGKeyError(where, got)
