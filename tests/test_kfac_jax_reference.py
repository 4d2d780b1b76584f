"""perturbkit's Kronecker factors equal kfac-jax's on the same weights and batch.

``tests/data/kfac_jax_reference.npz`` holds the factors kfac-jax 0.0.8 computed
(``scripts/kfac_jax_reference.py``, run under jax 0.6.2: kfac-jax does not import
with the jax pinned here) for an MLP, a CNN and a dense layer on sequences written in plain ``jax.numpy``/``lax``,
with the weights and the batch. The Flax twins below get those weights. The
conventions differ by known scalars only:

* A: perturbkit sums a conv's ``T`` output locations and averages over examples;
  kfac-jax averages over examples and locations and multiplies the block by its
  ``fixed_scale() = T`` instead. So ``A = T · A_kfac_jax`` (T = 1 for a dense layer),
  in the same feature order (flattened ``(kh, kw, in)`` kernel rows, the bias last).
* G: equal for the true Fisher (``fisher='exact'`` / kfac-jax's ``fisher_exact``, the
  expectation over labels; no sampling). kfac-jax's ``fisher_empirical`` divides the
  statistics once more by the batch size (documented in its
  ``BlockDiagonalCurvature``), so there ``G = B · G_kfac_jax``.
* A dense layer on ``(B, T, d)`` inputs: ``A`` is equal (both sum over the ``T``
  positions); kfac-jax sums ``G`` over them where perturbkit averages, and its
  ``fixed_scale`` is 1, so ``G = G_kfac_jax / T`` (``B / T`` times it for the
  empirical Fisher) and kfac-jax's block is ``T`` times perturbkit's.
"""
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import perturbkit

REFERENCE = np.load(os.path.join(os.path.dirname(__file__), 'data', 'kfac_jax_reference.npz'))
TOL = dict(rtol=2e-5, atol=1e-6)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, name='dense1')(jnp.tanh(nn.Dense(5, name='dense0')(x)))


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Conv(3, (3, 3), padding='SAME', name='conv0')(x))
    h = jnp.tanh(nn.Conv(4, (3, 3), strides=2, padding='VALID', use_bias=False,
                         name='conv1')(h))
    return nn.Dense(3, name='head')(h.reshape(h.shape[0], -1))


class Seq(nn.Module):
  """A dense layer on every token of ``(batch, T, d)`` inputs, mean-pooled, then a head."""

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(5, name='token')(x))
    return nn.Dense(3, name='head')(jnp.mean(h, axis=1))


def _reference_model(name):
  params = {}
  for key in REFERENCE.files:
    if key.startswith(f'{name}/params/'):
      _, _, layer, leaf = key.split('/')
      params.setdefault(layer, {})[leaf] = jnp.asarray(REFERENCE[key])
  x, y = jnp.asarray(REFERENCE[f'{name}/x']), jnp.asarray(REFERENCE[f'{name}/y'])
  return {'params': params}, x, y


@pytest.mark.parametrize('name, model, locations', [
    ('mlp', MLP(), {'dense0': 1, 'dense1': 1}),
    ('cnn', CNN(), {'conv0': 36, 'conv1': 4, 'head': 1})])
@pytest.mark.parametrize('fisher, kfac_jax_mode', [('exact', 'fisher_exact'),
                                                   ('empirical', 'fisher_empirical')])
def test_factors_equal_kfac_jax(name, model, locations, fisher, kfac_jax_mode):
  variables, x, y = _reference_model(name)
  predict = lambda v, inputs: model.apply(v, inputs)
  layers = perturbkit.kfac_layers(predict, variables, x)
  assert sorted(layers.layers) == sorted(locations)
  estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers, fisher=fisher)
  _, _, stats = jax.jit(estimate)(variables, x, y)
  examples = x.shape[0]
  for layer, t in locations.items():
    prefix = f'{name}/{kfac_jax_mode}/{layer}'
    assert float(REFERENCE[f'{prefix}/fixed_scale']) == t
    g_scale = examples if fisher == 'empirical' else 1
    np.testing.assert_allclose(stats[layer].a, t * REFERENCE[f'{prefix}/a'], **TOL,
                               err_msg=f'{layer}.a')
    np.testing.assert_allclose(stats[layer].g, g_scale * REFERENCE[f'{prefix}/g'], **TOL,
                               err_msg=f'{layer}.g')


@pytest.mark.parametrize('fisher, kfac_jax_mode', [('exact', 'fisher_exact'),
                                                   ('empirical', 'fisher_empirical')])
def test_dense_on_sequences_differs_from_kfac_jax_by_the_number_of_positions(fisher,
                                                                              kfac_jax_mode):
  """Dense on ``(B, T, d)``: kfac-jax sums ``G`` over the ``T`` positions, perturbkit averages."""
  variables, x, y = _reference_model('seq')
  examples, positions = x.shape[:2]
  predict = lambda v, inputs: Seq().apply(v, inputs)
  layers = perturbkit.kfac_layers(predict, variables, x)
  assert sorted(layers.layers) == ['head', 'token']
  estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers, fisher=fisher)
  _, _, stats = jax.jit(estimate)(variables, x, y)
  g_scale = examples if fisher == 'empirical' else 1
  prefix = f'seq/{kfac_jax_mode}'
  assert float(REFERENCE[f'{prefix}/token/fixed_scale']) == 1
  np.testing.assert_allclose(stats['token'].a, REFERENCE[f'{prefix}/token/a'], **TOL)
  np.testing.assert_allclose(stats['token'].g,
                             g_scale / positions * REFERENCE[f'{prefix}/token/g'], **TOL)
  np.testing.assert_allclose(stats['head'].a, REFERENCE[f'{prefix}/head/a'], **TOL)
  np.testing.assert_allclose(stats['head'].g, g_scale * REFERENCE[f'{prefix}/head/g'], **TOL)
