"""The diagonal Fisher of a LayerNorm's or RMSNorm's scale and bias (kfac-jax's scale-and-shift).

A normalisation layer over the last axis computes ``y = x̂ ⊙ scale + bias`` at
every location (token, pixel) ``t`` of an example, with ``x̂`` its input
normalised: ``(x - mean) / sqrt(var + ε)`` for LayerNorm, ``x / sqrt(mean(x²) + ε)``
for RMSNorm, over the features. Its params are vectors, so its Fisher block is
small, and its diagonal is exact where the Kronecker blocks approximate: with
``g`` the gradient of one example's loss at the layer's output,

* that example's gradient is ``Σ_t g_t ⊙ x̂_t`` for the scale and ``Σ_t g_t`` for
  the bias (summed over the layer's calls too, for a layer called twice);
* the block is the mean over the ``N`` examples of its square, summed over the
  lanes of the estimator (one sampled label, or the columns of the exact
  Fisher's root): ``F = (1/N) Σ_n Σ_lanes (∂ℓ_n/∂θ)²``.

The preconditioned gradient is ``∇θ / (F + λ)``. The factors' ``a`` is the
diagonal of the layer's first param (the scale, or the bias of a layer with no
scale) and ``g`` that of its bias (empty without one).
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from perturbkit.core._precision import accumulation_dtype_of, widened


class NormGeometry(NamedTuple):
  """The static attributes of a normalisation over the last axis that decide ``x̂``.

  Attributes:
    epsilon: Added to the variance.
    centered: LayerNorm (the mean is subtracted) rather than RMSNorm.
    fast_variance: The variance as ``E[x²] - E[x]²`` (Flax's ``use_fast_variance``).
  """
  epsilon: float
  centered: bool
  fast_variance: bool = True


def normalized(geometry: NormGeometry, x: jax.Array) -> jax.Array:
  """``x̂`` of the layer's input ``x``, in at least float32, as Flax computes it."""
  x = widened(x)
  if not geometry.centered:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + geometry.epsilon)
  mean = jnp.mean(x, axis=-1, keepdims=True)
  if geometry.fast_variance:
    var = jnp.maximum(0.0, jnp.mean(x * x, axis=-1, keepdims=True) - mean * mean)
  else:
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + geometry.epsilon)


def examples_of(x: jax.Array) -> int:
  """The examples of a call's input: its first axis (one example for a vector)."""
  return x.shape[0] if x.ndim > 1 else 1


def diagonal_factors(param: str, use_bias: bool, geometry: NormGeometry | None,
                     inputs: list[jax.Array], output_grads: list[jax.Array],
                     examples: int | None = None) -> tuple[jax.Array, jax.Array]:
  """``(a, g)``: the diagonal Fisher of the first param and of the bias (module docstring).

  Args:
    param: The scale's name (``'scale'``, Hugging Face's ``'weight'``), or
      ``'bias'`` for a layer with a bias only.
    use_bias: Whether a bias comes with the scale.
    geometry: How the layer normalises (unused for a bias alone).
    inputs: The input of each call, ``(N, ..., d)``.
    output_grads: For each call, per-example gradients at its output, stacked over
      ``L`` lanes: ``(L, N, ..., d)``.
    examples: The batch's ``N`` (default: the first call's input's first axis).

  Raises:
    ValueError: a layer with a scale and no ``geometry`` (a ``LayerInfo`` built by
      hand), or a call whose input does not have the ``examples`` on its first axis.
  """
  if param != 'bias' and geometry is None:
    raise ValueError("A 'norm' LayerInfo with a scale needs LayerInfo.norm, how the layer "
                     'normalises: build the layers with perturbkit.kfac_layers (or '
                     'perturbkit.nnx.kfac_layers), which records it.')
  examples = examples_of(inputs[0]) if examples is None else examples
  dtype = accumulation_dtype_of(*inputs, *output_grads)
  sums: dict[str, jax.Array] = {}
  for x, g in zip(inputs, output_grads):
    n = examples_of(x)
    if n != examples:
      raise ValueError(f'A norm\'s input of shape {x.shape} does not have the batch\'s '
                       f'{examples} examples on its first axis: its diagonal Fisher squares '
                       'each example\'s gradient, so this layer cannot have one.')
    g = g.reshape(g.shape[0], n, -1, g.shape[-1]).astype(dtype)
    parts = {'bias': jnp.sum(g, axis=2)}
    if param != 'bias':
      x_hat = normalized(geometry, x).reshape(1, n, -1, x.shape[-1])
      parts[param] = jnp.sum(g * x_hat, axis=2)
    for k, v in parts.items():
      sums[k] = sums[k] + v if k in sums else v
  diagonal = lambda k: jnp.sum(sums[k] * sums[k], axis=(0, 1)) / examples
  bias = diagonal('bias') if use_bias else jnp.zeros((0,), dtype)
  return diagonal(param), bias


def diagonal_shapes(param_shape: tuple[int, ...], use_bias: bool
                    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The shapes of ``(a, g)``: the param's size, and the bias's (0 without one)."""
  size = int(np.prod(param_shape))
  return (size,), (size if use_bias else 0,)


def precondition_diagonal(param: str, use_bias: bool, grads: dict, a_inverse: jax.Array,
                          g_inverse: jax.Array) -> dict:
  """``∇θ / (F + λ)`` of the layer's params, given the damped inverse diagonals."""
  def scaled(name: str, inverse: jax.Array) -> jax.Array:
    grad = grads[name]
    return (grad * inverse.reshape(grad.shape)).astype(grad.dtype)

  out = {**grads, param: scaled(param, a_inverse)}
  if use_bias:
    out['bias'] = scaled('bias', g_inverse)
  return out
