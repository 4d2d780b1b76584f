"""The dtype that sums and products over many elements are taken in: at least float32."""
import jax
import jax.numpy as jnp


def accumulation_dtype(dtype) -> jnp.dtype:
  """``dtype`` promoted to at least float32 (float64 stays float64)."""
  return jnp.promote_types(dtype, jnp.float32)


def widened(x: jax.Array) -> jax.Array:
  """``x`` in at least float32, where it is summed or multiplied with many others.

  A bfloat16 or float16 model's activations and gradients are exact in float32,
  so the difference of two close values, a sum of thousands of products and a
  squared norm lose nothing there; in the model's own dtype each would be rounded
  to about 3 digits. Elementwise, so XLA fuses the conversion into its consumer.
  """
  return x.astype(accumulation_dtype(x.dtype))
