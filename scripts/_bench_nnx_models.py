"""NNX versions of the benchmark models in ``_bench_models`` (the same layers and shapes)."""
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


class MLP(nnx.Module):
  """Linear layers with ReLU, then a linear classifier."""

  def __init__(self, features: int, widths: Sequence[int], classes: int, *, rngs: nnx.Rngs):
    dims = [features, *widths]
    self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(dims, dims[1:])])
    self.head = nnx.Linear(dims[-1], classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    for layer in self.layers:
      x = nnx.relu(layer(x))
    return self.head(x)


class CNN(nnx.Module):
  """Stages of 3x3 convolutions with ReLU, 2x2 average pooling between stages."""

  def __init__(self, image: int, in_channels: int, channels: Sequence[int],
               convs_per_stage: int, classes: int, *, rngs: nnx.Rngs):
    convs, width = [], in_channels
    for out in channels:
      for _ in range(convs_per_stage):
        convs.append(nnx.Conv(width, out, (3, 3), rngs=rngs))
        width = out
    self.convs = nnx.List(convs)
    self.convs_per_stage = convs_per_stage
    side = image // 2 ** len(channels)
    self.head = nnx.Linear(side * side * width, classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    for i, conv in enumerate(self.convs):
      x = nnx.relu(conv(x))
      if (i + 1) % self.convs_per_stage == 0:
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
    return self.head(x.reshape(x.shape[0], -1))


class SelfAttention(nnx.Module):
  """Multi-head softmax self-attention from four Linear layers."""

  def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
    self.heads = heads
    self.query, self.key, self.value, self.out = (nnx.Linear(dim, dim, rngs=rngs)
                                                  for _ in range(4))

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, dim = x.shape
    split = lambda t: t.reshape(batch, length, self.heads, dim // self.heads)
    q, k, v = (split(layer(x)) for layer in (self.query, self.key, self.value))
    logits = jnp.einsum('bqhd,bkhd->bhqk', q, k) / jnp.sqrt(dim // self.heads).astype(x.dtype)
    mixed = jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(logits, axis=-1), v)
    return self.out(mixed.reshape(batch, length, dim))


class Block(nnx.Module):
  """Pre-norm Transformer block: attention and a GELU MLP, each with a residual."""

  def __init__(self, dim: int, heads: int, mlp_ratio: int, *, rngs: nnx.Rngs):
    self.norm_0 = nnx.LayerNorm(dim, rngs=rngs)
    self.attention = SelfAttention(dim, heads, rngs=rngs)
    self.norm_1 = nnx.LayerNorm(dim, rngs=rngs)
    self.dense_0 = nnx.Linear(dim, dim * mlp_ratio, rngs=rngs)
    self.dense_1 = nnx.Linear(dim * mlp_ratio, dim, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attention(self.norm_0(x))
    return x + self.dense_1(nnx.gelu(self.dense_0(self.norm_1(x))))


class Transformer(nnx.Module):
  """Embedding Linear, ``depth`` blocks, final LayerNorm, mean pooling, classifier."""

  def __init__(self, features: int, dim: int, depth: int, heads: int, classes: int,
               mlp_ratio: int = 4, *, rngs: nnx.Rngs):
    self.embed = nnx.Linear(features, dim, rngs=rngs)
    self.blocks = nnx.List([Block(dim, heads, mlp_ratio, rngs=rngs) for _ in range(depth)])
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.embed(x)
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x).mean(axis=1))
