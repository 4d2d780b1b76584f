"""The number of examples in a batch, as the K-FAC rules count them."""
from typing import Any

import jax

from perturbkit.core._values import is_array


def num_examples(inputs: Any) -> int | None:
  """The batch size: the first axis of the first array of ``inputs`` that has one.

  Example:
    >>> import jax.numpy as jnp
    >>> num_examples((jnp.ones(()), {'x': jnp.ones((8, 3)), 'y': jnp.ones((2,))}))
    8
  """
  for leaf in jax.tree.leaves(inputs):
    if is_array(leaf) and jax.numpy.ndim(leaf) >= 1:
      return int(jax.numpy.shape(leaf)[0])
  return None


def is_key(leaf: Any) -> bool:
  """Whether ``leaf`` holds PRNG keys: typed keys (``jax.random.key``) of any shape, or one
  raw key, ``jax.random.PRNGKey(seed)`` (``uint32`` of shape ``(2,)``)."""
  dtype = jax.numpy.result_type(leaf)
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return True
  return jax.numpy.shape(leaf) == (2,) and dtype == jax.numpy.uint32


def step_examples(args: tuple) -> int | None:
  """The examples of a training step's arguments: the first axis of the first array
  argument that has one and holds no PRNG keys (other leaves, a flag or a string, hold no examples) (a loss ``(variables, rng, x, y)`` takes
  its dropout key first; the two ``uint32`` words of a raw key are no batch of two).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> step_examples((jax.random.PRNGKey(0), jnp.ones((8, 3)), jnp.zeros((8,))))
    8
  """
  return num_examples([leaf for leaf in jax.tree.leaves(args)
                       if is_array(leaf) and not is_key(leaf)])
