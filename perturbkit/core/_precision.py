"""The dtype that sums and products over many elements (and norms) are taken in: at least
float32."""
from typing import Any

import jax
import jax.numpy as jnp
import optax


def accumulation_dtype(dtype) -> jnp.dtype:
  """``dtype`` promoted to at least float32 (float64 stays float64)."""
  return jnp.promote_types(dtype, jnp.float32)


def accumulation_dtype_of(*arrays: Any) -> jnp.dtype:
  """The accumulation dtype of ``arrays`` together: their promoted dtype, at least float32
  (integer arrays, such as token ids, do not widen a float32 one)."""
  return accumulation_dtype(jnp.result_type(*arrays))


def widened(x: jax.Array) -> jax.Array:
  """``x`` in at least float32, where it is summed or multiplied with many others.

  A bfloat16 or float16 model's activations and gradients are exact in float32,
  so the difference of two close values, a sum of thousands of products and a
  squared norm lose nothing there; in the model's own dtype each would be rounded
  to about 3 digits. Elementwise, so XLA fuses the conversion into its consumer.
  """
  return x.astype(accumulation_dtype(x.dtype))


def global_norm(tree: Any) -> jax.Array:
  """The norm of all of ``tree``'s arrays together, in at least float32.

  A float16 gradient is finite while its norm in float16 is not: an entry above
  256 has a square past float16's largest value (65504), so the norm read as a
  non-finite gradient, and a model's steps were skipped.
  """
  return optax.tree.norm(jax.tree.map(widened, tree))


def stored_dtype(dtype, wide) -> jnp.dtype:
  """``dtype`` (a model's own, to keep memory low) for values computed in ``wide``, unless
  ``dtype``'s range is narrower: float16's largest value is 65504, so a per-example gradient
  stored in it turns inf where the model's own gradient (a mean over the examples) is finite.
  """
  if jnp.finfo(dtype).maxexp < jnp.finfo(wide).maxexp:
    return jnp.dtype(wide)
  return jnp.dtype(dtype)
