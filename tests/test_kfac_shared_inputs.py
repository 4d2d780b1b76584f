"""K-FAC skips a layer whose call does not see the examples one by one.

A position table looked up with ``jnp.arange(length)`` inside the model gives an output
every example shares: the gradient at it is summed over the examples, and factors from
it would be ``(Σ g)(Σ g)ᵀ``, not ``Σ g gᵀ``. Positions broadcast to ``(batch, length)``
are per-example rows and keep the layer. Linen and NNX twins give the same entries.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import perturbkit

IDS = jnp.array([[1, 2, 3], [4, 5, 6]])
SHARED = "its input (shape (3,)) is neither computed from the batch nor has the batch's 2"


class Positions(nn.Module):
  broadcast: bool = False

  @nn.compact
  def __call__(self, ids):
    positions = jnp.arange(ids.shape[1])
    if self.broadcast:
      positions = jnp.broadcast_to(positions, ids.shape)
    pos = nn.Embed(8, 4, name='pos')(positions)
    h = nn.Embed(11, 4, name='tok')(ids) + (pos if self.broadcast else pos[None])
    return nn.Dense(3, name='out')(jnp.tanh(h)).mean(axis=1)


class NNXPositions(nnx.Module):
  def __init__(self, rngs):
    self.tok = nnx.Embed(11, 4, rngs=rngs)
    self.pos = nnx.Embed(8, 4, rngs=rngs)
    self.out = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, ids):
    h = self.tok(ids) + self.pos(jnp.arange(ids.shape[1]))[None]
    return self.out(jnp.tanh(h)).mean(axis=1)


def _layers(model, **kwargs):
  variables = model.init(jax.random.key(0), IDS)
  return perturbkit.kfac_layers(lambda v, x: model.apply(v, x), variables, IDS, **kwargs)


def test_positions_looked_up_inside_the_model_are_skipped_or_refused():
  layers = _layers(Positions())
  assert sorted(layers.layers) == ['out', 'tok']
  assert layers.skipped['pos'].startswith(SHARED)
  with pytest.raises(perturbkit.KFACUnsupportedLayerError,
                     match=r'pos was selected.*summed over the examples.*filters\.negate'):
    _layers(Positions(), filter=perturbkit.filters.by_type(nn.Embed))
  nnx_layers = perturbkit.nnx.kfac_layers(NNXPositions(nnx.Rngs(0)), IDS)
  assert nnx_layers == layers


def test_positions_broadcast_to_the_batch_are_per_example_rows():
  model = Positions(broadcast=True)
  variables = model.init(jax.random.key(0), IDS)
  predict = lambda v, x: model.apply(v, x)
  layers = perturbkit.kfac_layers(predict, variables, IDS)
  assert sorted(layers.layers) == ['out', 'pos', 'tok'] and layers.skipped == {}
  _, _, stats = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers)(
      variables, IDS, jnp.array([0, 2]), jax.random.key(1))
  # Each example looks up positions 0, 1, 2 once: A is one count per position.
  np.testing.assert_allclose(stats['pos'].a, [1, 1, 1, 0, 0, 0, 0, 0])
