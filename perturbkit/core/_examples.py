"""The number of examples in a batch, as the K-FAC rules count them."""
from typing import Any

import jax


def num_examples(inputs: Any) -> int | None:
  """The batch size: the first axis of the first array of ``inputs`` that has one.

  Example:
    >>> import jax.numpy as jnp
    >>> num_examples((jnp.ones(()), {'x': jnp.ones((8, 3)), 'y': jnp.ones((2,))}))
    8
  """
  for leaf in jax.tree.leaves(inputs):
    if jax.numpy.ndim(leaf) >= 1:
      return int(jax.numpy.shape(leaf)[0])
  return None
