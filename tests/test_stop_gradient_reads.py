"""A param read outside its module's calls only under ``stop_gradient`` adds nothing to its
gradient: K-FAC keeps the layer and the interleaved schedule keeps the segment (the
read without ``stop_gradient`` skips both). Per-example norms: ``test_per_example_reads``.
"""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import perturbkit

TOKENS = jnp.array([[0, 1, 2], [3, 4, 5]])


class Head(nn.Module):
  """Embed -> Dense -> a head on the embedding matrix, read inline."""
  how: str = 'stop_then_transpose'

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(7, 4)
    h = jnp.tanh(nn.Dense(4)(embed(tokens)))
    table = embed.embedding
    head = {'stop_then_transpose': lambda: jax.lax.stop_gradient(table).T,
            'transpose_then_stop': lambda: jax.lax.stop_gradient(table.T),
            'live': lambda: table.T}[self.how]()
    return h @ head


def _setup(how):
  model = Head(how)
  variables = model.init(jax.random.key(0), TOKENS)
  loss_fn = lambda v, t: jnp.mean(model.apply(v, t) ** 2)
  return model, variables, loss_fn


@pytest.mark.parametrize('how', ['stop_then_transpose', 'transpose_then_stop'])
def test_kfac_keeps_and_interleaved_segments_a_layer_read_under_stop_gradient(how):
  model, variables, loss_fn = _setup(how)
  layers = perturbkit.kfac_layers(lambda v, x: model.apply(v, x), variables, TOKENS)
  assert sorted(layers.layers) == ['Dense_0', 'Embed_0'] and layers.skipped == {}
  tx = perturbkit.interleaved(loss_fn, optax.sgd(0.1), propagate='original')
  assert tx.segments(variables, TOKENS).segments == ('Embed_0', 'Dense_0')
  # The step equals plain SGD on jax.grad, which leaves the stopped read out as well.
  state, _ = jax.jit(tx.step)(tx.init(variables, TOKENS), TOKENS)
  grads = jax.grad(lambda p: loss_fn({'params': p}, TOKENS))(variables['params'])
  expected = jax.tree.map(lambda p, g: p - 0.1 * g, variables['params'], grads)
  chex.assert_trees_all_close(state.params, expected, rtol=1e-5, atol=1e-6)


def test_the_same_read_with_gradient_is_skipped():
  model, variables, loss_fn = _setup('live')
  layers = perturbkit.kfac_layers(lambda v, x: model.apply(v, x), variables, TOKENS)
  assert list(layers.layers) == ['Dense_0']
  assert 'read outside its calls (by transpose)' in layers.skipped['Embed_0']
  listing = perturbkit.interleaved(loss_fn, optax.sgd(0.1)).segments(variables, TOKENS)
  assert listing.segments == ('Dense_0',) and 'Embed_0' in listing.rest
