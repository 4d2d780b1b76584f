"""A layer handed to another module that runs it: Flax's ``nn.WeightNorm`` and ``nn.SpectralNorm``
(the layer runs inside ``nn.map_variables``, which normalizes its kernel first) and a plain
wrapper module given the layer as an attribute. The layer's params live where it was made,
not in the wrapper.

The references are ``jax.grad`` of the loss, the tests' own explicit-delta interceptor
(``tests/explicit_deltas.py``), ``jax.vmap`` of the gradient on one example, and
``jax.grad`` + SGD.
"""
import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

import perturbkit
from explicit_deltas import at, explicit_deltas, points_of, zeros

TOL = dict(rtol=1e-5, atol=1e-6)


class Scaled(nn.Module):
  """Runs the layer it is given and scales the result by a param of its own."""
  layer: nn.Module

  @nn.compact
  def __call__(self, x):
    return self.layer(x) * self.param('scale', nn.initializers.constant(1.5), (1, 6))


class Model(nn.Module):
  wrapper: str

  @nn.compact
  def __call__(self, x, train: bool = False):
    if self.wrapper == 'doubled':  # the layer's class transformed: its params doubled
      doubled = nn.map_variables(nn.Dense, 'params', lambda p: jax.tree.map(lambda w: 2 * w, p),
                                 init=self.is_initializing())
      h = doubled(6, name='layer')(x)
    elif self.wrapper == 'weight_norm':
      h = nn.WeightNorm(nn.Dense(6, name='layer'))(x)
    elif self.wrapper == 'spectral_norm':
      h = nn.SpectralNorm(nn.Dense(6, name='layer'))(x, update_stats=train)
    else:
      h = Scaled(nn.Dense(6, name='layer'))(x)
    return nn.Dense(3, name='head')(nn.relu(h))


WRAPPERS = ('weight_norm', 'spectral_norm', 'doubled', 'scaled')
# The calls inside nn.map_variables, which get no point: the layer's, and the function the
# wrapper gives the transform (which the reference's interceptor sees as a method).
INSIDE = {'weight_norm': {('layer', '__call__'), ('layer', 'layer_forward')},
          'doubled': set(), 'scaled': set()}
INSIDE['spectral_norm'] = INSIDE['weight_norm']
X = jax.random.normal(jax.random.key(1), (3, 4))
Y = jnp.array([0, 2, 1])


@pytest.fixture(scope='module', params=WRAPPERS)
def case(request):
  model = Model(request.param)
  variables = jax.jit(model.init)(jax.random.key(0), X)  # one compile, not one per op

  def loss(variables, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(variables, x), y).mean()

  return request.param, model, variables, loss


def _quiet(wrapper):
  """Expects the warning about the calls inside nn.map_variables, where there are some."""
  if INSIDE[wrapper]:
    return pytest.warns(perturbkit.UnperturbedCallsWarning, match='nn.map_variables')
  return contextlib.nullcontext()  # any warning fails the test


def test_activation_grads_equal_explicit_deltas(case):
  wrapper, _, variables, loss = case
  with _quiet(wrapper):  # jitted: one compile instead of one per op (the warning is a trace's)
    value, grads = jax.jit(perturbkit.value_and_grad(loss))(variables, X, Y)
  shapes = points_of(loss, variables, X, Y)

  def with_deltas(params, deltas):
    with explicit_deltas(deltas=deltas):
      return loss({**variables, 'params': params}, X, Y)

  want_value, (want_params, want_points) = jax.jit(
      jax.value_and_grad(with_deltas, argnums=(0, 1)))(variables['params'], zeros(shapes))
  np.testing.assert_allclose(value, want_value, **TOL)
  for got, want in zip(jax.tree.leaves(grads['params']), jax.tree.leaves(want_params)):
    np.testing.assert_allclose(got, want, **TOL)
  # Every call has its point but those inside nn.map_variables (the wrapper's own call has
  # the same output); the wrapper's helpers (WeightNorm's _l2_normalize) are calls too.
  assert set(traverse_util.flatten_dict(grads['perturbations'])) == set(shapes) - INSIDE[wrapper]
  for name in set(shapes) - INSIDE[wrapper]:
    for got, want in zip(jax.tree.leaves(at(grads['perturbations'], name)), want_points[name]):
      np.testing.assert_allclose(got, want, **TOL)
  wrapper_call = {'weight_norm': 'WeightNorm_0', 'spectral_norm': 'SpectralNorm_0',
                  'doubled': 'layer', 'scaled': 'Scaled_0'}[wrapper]
  assert (wrapper_call, '__call__') in shapes


def test_per_example_norms_equal_vmap_of_grad(case):
  _, _, variables, loss = case
  one = lambda x, y: optax.tree.norm(jax.grad(loss)(variables, x[None], y[None]))
  (_, norms), want = jax.jit(lambda v, x, y: (  # one compile for both sides
      perturbkit.per_example_grad_norms(loss)(v, x, y), jax.vmap(one)(x, y)))(variables, X, Y)
  np.testing.assert_allclose(norms.total, want, **TOL)


def test_interleaved_original_step_equals_jax_grad_and_sgd(case):
  wrapper, _, variables, loss = case
  tx = perturbkit.interleaved(loss, optax.sgd(0.1), propagate='original')
  state = tx.init(variables, X, Y)
  state, _ = jax.jit(tx.step)(state, X, Y)
  grads = jax.jit(jax.grad(loss))(variables, X, Y)['params']
  want = jax.tree.map(lambda p, g: p - 0.1 * g, variables['params'], grads)
  for got, w in zip(jax.tree.leaves(state.variables['params']), jax.tree.leaves(want)):
    np.testing.assert_allclose(got, w, **TOL)


def test_kfac_leaves_out_a_layer_whose_weights_are_mapped(case):
  wrapper, model, variables, _ = case
  layers = perturbkit.kfac_layers(lambda v, x: model.apply(v, x), variables, X)
  if wrapper == 'scaled':
    assert 'layer' in layers.layers  # the wrapper runs it with its own params
  else:  # it sees its params normalized or doubled
    assert 'layer' not in layers.layers
    assert ('nn.map_variables' if INSIDE[wrapper] else 'read outside') in layers.skipped['layer']
  assert 'head' in layers.layers


def test_spectral_norm_in_training_updates_its_stats_as_the_model_does():
  model = Model('spectral_norm')
  variables = jax.jit(model.init)(jax.random.key(0), X)

  def loss(variables, x, y):
    logits, updates = model.apply(variables, x, train=True, mutable=['batch_stats'])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates

  with _quiet('spectral_norm'):  # jitted: one compile instead of one per op
    (value, updates), grads = jax.jit(perturbkit.value_and_grad(loss, has_aux=True))(
        variables, X, Y)

  @jax.jit  # the references in one compile
  def reference(variables):
    (want_value, want_updates), want = jax.value_and_grad(loss, has_aux=True)(variables, X, Y)
    # The wrapper's output: the gradient of the loss with respect to the normalized layer's.
    h = model.apply(variables, X, train=True, mutable=['batch_stats'],
                    capture_intermediates=lambda m, _: isinstance(m, nn.SpectralNorm))[1]
    out = h['intermediates']['SpectralNorm_0']['__call__'][0]
    head = lambda h: optax.softmax_cross_entropy_with_integer_labels(
        nn.Dense(3).apply({'params': variables['params']['head']}, nn.relu(h)), Y).mean()
    return want_value, want_updates, want, jax.grad(head)(out)

  want_value, want_updates, want, want_point = reference(variables)
  np.testing.assert_allclose(value, want_value, **TOL)
  for got, w in zip(jax.tree.leaves((updates, grads['params'])),
                    jax.tree.leaves((want_updates, want['params']))):
    np.testing.assert_allclose(got, w, **TOL)
  np.testing.assert_allclose(grads['perturbations']['SpectralNorm_0']['__call__'], want_point,
                             **TOL)
