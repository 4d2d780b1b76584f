"""K-FAC skips a layer whose call's input is not computed from the batch.

A position table looked up with ``jnp.arange(length)`` inside the model gives an output
every example shares: the gradient at it is summed over the examples, and factors from
it would be ``(Σ g)(Σ g)ᵀ``, not ``Σ g gᵀ``. An input made inside the model whose first
axis happens to have the batch's size (a batch of ``length`` examples, or positions
broadcast to ``(batch, length)``) cannot be told apart from rows of one example each, so
K-FAC does not guess: such a layer is skipped too. Positions passed in the batch are
per-example rows and keep the layer. Linen and NNX twins give the same entries.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import perturbkit

IDS = jnp.array([[1, 2, 3], [4, 5, 6]])
SQUARE = jnp.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]])  # as many examples as positions
SHARED = "its input (shape (3,)) is not computed from the batch `inputs`"
ADVICE = r'pass that array as part of the batch `inputs`.*position_ids=jnp\.broadcast_to'


class Positions(nn.Module):
  """Tokens plus positions, a Dense head; ``positions`` says where the positions come from:
  ``'arange'`` (looked up inside the model), ``'broadcast'`` (``jnp.arange`` broadcast to
  the ids' shape inside the model), ``'table'`` (a Dense on a constant ``(length, 2)``
  array) or ``'passed'`` (the batch is ``(ids, positions)``)."""
  positions: str = 'arange'

  @nn.compact
  def __call__(self, batch):
    ids = batch[0] if self.positions == 'passed' else batch
    if self.positions == 'table':
      pos = nn.Dense(4, name='pos')(jnp.ones((ids.shape[1], 2)))
    elif self.positions == 'passed':
      pos = nn.Embed(8, 4, name='pos')(batch[1])
    else:
      arange = jnp.arange(ids.shape[1])
      pos = nn.Embed(8, 4, name='pos')(
          jnp.broadcast_to(arange, ids.shape) if self.positions == 'broadcast' else arange)
    h = nn.Embed(11, 4, name='tok')(ids) + jnp.broadcast_to(pos, ids.shape + (4,))
    return nn.Dense(3, name='out')(jnp.tanh(h)).mean(axis=1)


class NNXPositions(nnx.Module):
  def __init__(self, rngs):
    self.tok = nnx.Embed(11, 4, rngs=rngs)
    self.pos = nnx.Embed(8, 4, rngs=rngs)
    self.out = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, ids):
    h = self.tok(ids) + self.pos(jnp.arange(ids.shape[1]))[None]
    return self.out(jnp.tanh(h)).mean(axis=1)


def _layers(model, inputs=IDS, **kwargs):
  variables = model.init(jax.random.key(0), inputs)
  return perturbkit.kfac_layers(lambda v, x: model.apply(v, x), variables, inputs, **kwargs)


def test_positions_looked_up_inside_the_model_are_skipped_or_refused():
  layers = _layers(Positions())
  assert sorted(layers.layers) == ['out', 'tok']
  assert layers.skipped['pos'].startswith(SHARED)
  with pytest.raises(perturbkit.KFACUnsupportedLayerError,
                     match=r'pos was selected.*summed over the examples.*filters\.negate'):
    _layers(Positions(), filter=perturbkit.filters.by_type(nn.Embed))
  nnx_layers = perturbkit.nnx.kfac_layers(NNXPositions(nnx.Rngs(0)), IDS)
  assert nnx_layers == layers


@pytest.mark.parametrize('positions, shape', [('arange', (3,)), ('broadcast', (3, 3)),
                                              ('table', (3, 2))])
def test_inputs_made_inside_the_model_with_the_batch_s_size_are_skipped_not_guessed(
    positions, shape):
  """With as many examples as positions, an input made inside the model has the batch's
  size on its first axis; it is skipped (refused when selected) with the advice to pass
  it in the batch, as when the sizes differ."""
  layers = _layers(Positions(positions), SQUARE)
  assert sorted(layers.layers) == ['out', 'tok']
  assert layers.skipped['pos'].startswith(f'its input (shape {shape}) is not computed')
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match=f'pos was selected.*{ADVICE}'):
    _layers(Positions(positions), SQUARE, filter=perturbkit.filters.by_path('pos'))
  if positions == 'arange':
    assert perturbkit.nnx.kfac_layers(NNXPositions(nnx.Rngs(0)), SQUARE) == layers


def test_positions_passed_in_the_batch_have_the_textbook_factors():
  """The advice works: positions passed in ``inputs`` keep the layer, and its factors are
  ``A`` = each example's position counts, ``G = Σ g gᵀ / rows`` of each example's gradient
  at the table's output, from a forward pass written here."""
  model = Positions('passed')
  batch = (SQUARE, jnp.broadcast_to(jnp.arange(3), SQUARE.shape))
  labels = jnp.array([0, 2, 1])
  variables = model.init(jax.random.key(0), batch)
  predict = lambda v, x: model.apply(v, x)
  layers = perturbkit.kfac_layers(predict, variables, batch)
  assert sorted(layers.layers) == ['out', 'pos', 'tok'] and layers.skipped == {}
  _, _, stats = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                          fisher='empirical')(variables, batch, labels)
  p = variables['params']

  def summed_loss(delta):  # delta: added to the position table's (examples, length, 4) output
    h = p['tok']['embedding'][SQUARE] + p['pos']['embedding'][batch[1]] + delta
    logits = (jnp.tanh(h) @ p['out']['kernel'] + p['out']['bias'][None, None]).mean(axis=1)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum()

  g = np.asarray(jax.grad(summed_loss)(jnp.zeros((3, 3, 4))), np.float64).reshape(-1, 4)
  np.testing.assert_allclose(stats['pos'].a, [1, 1, 1, 0, 0, 0, 0, 0], rtol=1e-6, atol=1e-7)
  want = g.T @ g / g.shape[0]
  np.testing.assert_allclose(stats['pos'].g, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


class Rematted(nn.Module):
  """``Positions`` and a Dense run inside ``nn.remat``, whose calls' values stay in the
  transform's trace."""

  @nn.compact
  def __call__(self, ids):
    h = nn.remat(Positions)(name='body')(ids)
    return nn.remat(nn.Dense)(3, name='head')(h)


def test_inputs_inside_nn_remat_are_read_through_the_transform():
  """Inside ``nn.remat`` a call's input is followed from the batch through the transform:
  the Dense on the hidden state is kept, and the position table is skipped even with as
  many examples as positions."""
  layers = _layers(Rematted(), SQUARE)
  assert sorted(layers.layers) == ['body/out', 'body/tok', 'head']
  assert layers.skipped['body/pos'].startswith(SHARED)
