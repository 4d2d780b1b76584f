"""Benchmark models: an MLP, a CNN and a small pre-norm Transformer.

Each model has a ``tap`` field. With ``tap=False`` (the default) it is an ordinary
Linen model. With ``tap=True`` it is the same model rewritten the way the Flax
guide on intermediate gradients does it: ``self.perturb`` on the output of every
submodule call, at every depth, named ``'<child name>_out'`` in the calling
module's scope. ``tap`` adds no parameters, so both settings share one params tree.
"""
from typing import Any, Callable, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


def tapped(parent: nn.Module, child: nn.Module, *args: Any) -> Any:
  """``child(*args)``, plus a hand-written perturbation when ``parent.tap`` is set.

  A plain function rather than a module method, so it is not itself a module
  call that an interceptor would see.
  """
  out = child(*args)
  return parent.perturb(f'{child.name}_out', out) if parent.tap else out


def tap_name(point_path: tuple[str, ...]) -> tuple[str, ...]:
  """The hand-written perturbation path matching a perturbkit point path.

  perturbkit stores the point of ``Block_0/Dense_1``'s first call at
  ``('Block_0', 'Dense_1', '__call__')``; ``tapped`` stores it in the parent's
  scope as ``('Block_0', 'Dense_1_out')``.
  """
  if point_path[-1] != '__call__':
    raise ValueError(f'Expected a first __call__ point, got {point_path}.')
  return point_path[:-2] + (f'{point_path[-2]}_out',)


class MLP(nn.Module):
  """Dense layers with ReLU, then a linear classifier."""
  widths: Sequence[int]
  classes: int
  tap: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i, width in enumerate(self.widths):
      x = nn.relu(tapped(self, nn.Dense(width, name=f'Dense_{i}'), x))
    return tapped(self, nn.Dense(self.classes, name=f'Dense_{len(self.widths)}'), x)


class CNN(nn.Module):
  """Stages of 3x3 convolutions with ReLU, 2x2 average pooling between stages."""
  channels: Sequence[int]
  convs_per_stage: int
  classes: int
  tap: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for s, width in enumerate(self.channels):
      for c in range(self.convs_per_stage):
        x = nn.relu(tapped(self, nn.Conv(width, (3, 3), name=f'Conv_{s}_{c}'), x))
      x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    return tapped(self, nn.Dense(self.classes, name='Head'), x.reshape(x.shape[0], -1))


class SelfAttention(nn.Module):
  """Multi-head softmax self-attention from four Dense layers."""
  heads: int
  tap: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, dim = x.shape
    split = lambda t: t.reshape(batch, length, self.heads, dim // self.heads)
    q, k, v = (split(tapped(self, nn.Dense(dim, name=n), x)) for n in ('query', 'key', 'value'))
    logits = jnp.einsum('bqhd,bkhd->bhqk', q, k) / jnp.sqrt(dim // self.heads).astype(x.dtype)
    mixed = jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(logits, axis=-1), v)
    return tapped(self, nn.Dense(dim, name='out'), mixed.reshape(batch, length, dim))


class Block(nn.Module):
  """Pre-norm Transformer block: attention and a GELU MLP, each with a residual."""
  heads: int
  mlp_ratio: int
  tap: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dim = x.shape[-1]
    h = tapped(self, nn.LayerNorm(name='LayerNorm_0'), x)
    x = x + tapped(self, SelfAttention(self.heads, self.tap, name='SelfAttention_0'), h)
    h = tapped(self, nn.LayerNorm(name='LayerNorm_1'), x)
    h = nn.gelu(tapped(self, nn.Dense(dim * self.mlp_ratio, name='Dense_0'), h))
    return x + tapped(self, nn.Dense(dim, name='Dense_1'), h)


class ScanBlock(Block):
  """:class:`Block` as the body of ``nn.scan``: ``(carry, _) -> (carry, None)``."""

  def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
    return super().__call__(x), None


class Transformer(nn.Module):
  """Embedding Dense, ``depth`` blocks, final LayerNorm, mean pooling, classifier.

  With ``scan`` the blocks run in ``nn.scan``, their params stacked along axis 0
  (``'Blocks'``), with the perturbations mapped along the same axis.
  """
  dim: int
  depth: int
  heads: int
  classes: int
  mlp_ratio: int = 4
  tap: bool = False
  scan: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = tapped(self, nn.Dense(self.dim, name='Embed'), x)
    if self.scan:
      blocks = nn.scan(ScanBlock, variable_axes={'params': 0, 'perturbations': 0},
                       split_rngs={'params': True}, length=self.depth)
      x, _ = blocks(self.heads, self.mlp_ratio, name='Blocks')(x, None)
    for i in range(0 if self.scan else self.depth):
      x = tapped(self, Block(self.heads, self.mlp_ratio, self.tap, name=f'Block_{i}'), x)
    x = tapped(self, nn.LayerNorm(name='LayerNorm_final'), x)
    return tapped(self, nn.Dense(self.classes, name='Head'), x.mean(axis=1))


class Problem(NamedTuple):
  """A model with one batch of inputs and integer labels."""
  model: nn.Module
  x: jax.Array
  y: jax.Array


def random_problem(model: nn.Module, shape: tuple, classes: int, key: jax.Array) -> Problem:
  """``model`` with a normal random batch of ``shape`` and labels below ``classes``."""
  kx, ky = jax.random.split(key)
  x = jax.random.normal(kx, shape, jnp.float32)
  y = jax.random.randint(ky, (shape[0],), 0, classes)
  return Problem(model, x, y)


def cross_entropy(model: nn.Module) -> Callable[..., jax.Array]:
  """The ordinary loss ``(variables, x, y) -> mean cross-entropy`` of ``model``."""
  def loss_fn(variables, x, y):
    logits = model.apply(variables, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return loss_fn
