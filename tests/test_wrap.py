"""wrap(model): same params and outputs as the model; perturbations add like ``self.perturb``."""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
import perturbkit

TOL = dict(rtol=1e-6, atol=1e-6)
NAMES = ['mlp', 'cnn_train', 'transformer_train', 'setup_style', 'shared', 'pytree_outputs',
         'sequential', 'remat', 'scan', 'vmap']


def _keys():
  return {'params': jax.random.key(0), 'dropout': jax.random.key(1)}


def _apply(case, module, variables, x):
  kw = dict(rngs={'dropout': jax.random.key(2)}) if case.dropout else {}
  if case.mutable:
    return module.apply(variables, x, mutable=list(case.mutable), **kw)
  return module.apply(variables, x, **kw)


@pytest.mark.parametrize('name', NAMES)
def test_same_params_and_outputs_as_model(name):
  case = models.CASES[name]
  x = jax.random.normal(jax.random.key(3), case.x_shape)
  wrapped = perturbkit.wrap(case.model, case.filter)
  plain = case.model.init(_keys(), x)
  variables = wrapped.init(_keys(), x)
  chex.assert_trees_all_equal(variables['params'], plain['params'])
  want = _apply(case, case.model, plain, x)
  # Zero perturbations, and no perturbations at all, both give the model's outputs
  # (and, for the transformer, the same dropout masks).
  chex.assert_trees_all_close(_apply(case, wrapped, variables, x), want, **TOL)
  chex.assert_trees_all_close(_apply(case, wrapped, plain, x), want, **TOL)
  # The points are the twin's, at perturbkit's paths.
  hand = case.hand.init(_keys(), x)['perturbations']
  chex.assert_trees_all_equal_shapes(variables['perturbations'], models.nest(hand))


@pytest.mark.parametrize('name', ['mlp', 'transformer_train', 'setup_style', 'scan', 'vmap',
                                  'pytree_outputs'])
def test_perturbations_add_like_hand_written_perturb(name):
  """A random tree passed to ``wrapped.apply`` changes the output as in the twin."""
  case = models.CASES[name]
  x = jax.random.normal(jax.random.key(3), case.x_shape)
  wrapped = perturbkit.wrap(case.model, case.filter)
  variables = wrapped.init(_keys(), x)
  hand = case.hand.init(_keys(), x)['perturbations']
  leaves, treedef = jax.tree.flatten(hand)
  keys = jax.random.split(jax.random.key(4), len(leaves))
  noise = jax.tree.unflatten(treedef, [jax.random.normal(k, a.shape) for k, a in zip(keys, leaves)])
  got = _apply(case, wrapped, {**variables, 'perturbations': models.nest(noise)}, x)
  want = _apply(case, case.hand, {'params': variables['params'], 'perturbations': noise,
                                  **{c: variables[c] for c in case.mutable}}, x)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
  assert not np.allclose(jax.tree.leaves(got)[0], jax.tree.leaves(_apply(case, wrapped, variables, x))[0])


def test_dropout_masks_match_with_and_without_points():
  case = models.CASES['transformer_train']
  x = jax.random.normal(jax.random.key(3), case.x_shape)
  wrapped = perturbkit.wrap(case.model)
  variables = wrapped.init(_keys(), x)
  for seed in range(3):
    rngs = {'dropout': jax.random.key(10 + seed)}
    np.testing.assert_allclose(wrapped.apply(variables, x, rngs=rngs),
                               case.model.apply({'params': variables['params']}, x, rngs=rngs),
                               **TOL)
  # Different rngs give different masks, so the equality above is not trivial.
  a = wrapped.apply(variables, x, rngs={'dropout': jax.random.key(1)})
  b = wrapped.apply(variables, x, rngs={'dropout': jax.random.key(2)})
  assert not np.allclose(a, b)


def test_method_and_mutable():
  model = models.AutoEncoder()
  x = jax.random.normal(jax.random.key(3), (3, 3))
  wrapped = perturbkit.wrap(model)
  variables = wrapped.init(jax.random.key(0), x, method='encode')
  assert set(models.unnest(variables['perturbations'])) == {'codec/encode',
                                                            'codec/inner/__call__'}
  np.testing.assert_allclose(wrapped.apply(variables, x, method='encode'),
                             model.apply({'params': variables['params']}, x, method='encode'),
                             **TOL)
  cnn = models.CNN()
  x = jax.random.normal(jax.random.key(3), (2, 5, 5, 2))
  wrapped, plain = perturbkit.wrap(cnn).init(jax.random.key(0), x), cnn.init(jax.random.key(0), x)
  got, got_state = perturbkit.wrap(cnn).apply(wrapped, x, mutable=['batch_stats'])
  want, want_state = cnn.apply(plain, x, mutable=['batch_stats'])
  chex.assert_trees_all_close((got, got_state), (want, want_state), **TOL)
  assert set(got_state) == {'batch_stats'}
  # The stats really moved from their initial values.
  assert not np.allclose(got_state['batch_stats']['BatchNorm_0']['mean'], 0.0)


def test_jvp_through_wrapped_apply_equals_activation_grad():
  """Forward mode on ``wrap(model).apply`` in the points agrees with value_and_grad."""
  case = models.CASES['cnn_eval']
  x = jax.random.normal(jax.random.key(3), case.x_shape)
  wrapped = perturbkit.wrap(case.model)
  variables = wrapped.init(jax.random.key(0), x)
  direction = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype).reshape(a.shape)),
                           variables['perturbations'])
  _, derivative = jax.jvp(
      lambda eps: models.scalar(wrapped.apply({**variables, 'perturbations': eps}, x)),
      (variables['perturbations'],), (direction,))
  grads = perturbkit.grad(lambda v, x: models.scalar(case.model.apply(v, x)))(
      {'params': variables['params'], 'batch_stats': variables['batch_stats']}, x)
  predicted = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grads['perturbations']),
                                                 jax.tree.leaves(direction)))
  np.testing.assert_allclose(derivative, predicted, rtol=1e-4, atol=1e-5)


def test_rejects_bound_modules_and_non_modules():
  with pytest.raises(perturbkit.NotAModuleError, match='flax.linen.Module'):
    perturbkit.wrap(lambda x: x)
  bound = nn.Dense(2).bind(nn.Dense(2).init(jax.random.key(0), jnp.ones((1, 2))))
  with pytest.raises(perturbkit.BoundModuleError, match=r'unbind\(\)\[0\]'):
    perturbkit.wrap(bound)


def test_init_warns_about_calls_a_lifted_transform_cannot_perturb():
  model = models.Scanned(map_perturbations=False)
  x = jax.random.normal(jax.random.key(1), (3, 3))
  with pytest.warns(perturbkit.UnperturbedCallsWarning, match='"perturbations": <axis>'):
    variables = perturbkit.wrap(model).init(jax.random.key(0), x)
  assert 'scan' not in variables['perturbations']
  # The params are still exactly the model's own.
  chex.assert_trees_all_equal(variables['params'], model.init(jax.random.key(0), x)['params'])


def test_a_wrapped_model_is_refused_where_its_points_would_count_twice():
  """perturbkit's own points at a wrapped model's calls would be added to the same outputs as
  the wrapped model's: with a filter, ``value_and_grad`` returned twice the activation gradient
  there. Wrapping again, or running a wrapped model inside a perturbkit function, is refused."""
  model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
  wrapped = perturbkit.wrap(model)
  x = jax.random.normal(jax.random.key(1), (2, 3))
  variables = {'params': wrapped.init(jax.random.key(0), x)['params']}
  with pytest.raises(perturbkit.WrappedModelError, match=r'wrapped\.module'):
    perturbkit.wrap(wrapped)
  for filter in (None, perturbkit.filters.by_path('layers_0')):
    with pytest.raises(perturbkit.WrappedModelError, match=r'wrapped\.module'):
      perturbkit.value_and_grad(lambda v, x: jnp.sum(wrapped.apply(v, x) ** 2),
                                filter=filter)(variables, x)
  # The advice works: the unwrapped model's gradient at the first layer is the one
  # the wrapped model's own point has under jax.grad.
  eps = wrapped.init(jax.random.key(0), x)['perturbations']
  want = jax.grad(lambda e: jnp.sum(wrapped.apply({**variables, 'perturbations': e}, x) ** 2))(eps)
  _, grads = perturbkit.value_and_grad(
      lambda v, x: jnp.sum(wrapped.module.apply(v, x) ** 2),
      filter=perturbkit.filters.by_path('layers_0'))(variables, x)
  chex.assert_trees_all_close(grads['perturbations'], {'layers_0': want['layers_0']}, **TOL)


def test_hooks_act_on_a_wrapped_model():
  """Backward hooks only wrap each call's output, so a wrapped model keeps working under them:
  halving the gradient at the output halves every params' gradient."""
  model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
  wrapped = perturbkit.wrap(model)
  x = jax.random.normal(jax.random.key(1), (2, 3))
  variables = wrapped.init(jax.random.key(0), x)
  half = perturbkit.backward_hook(lambda g: 0.5 * g, perturbkit.filters.by_path('layers_2'))
  loss = lambda v: jnp.sum(wrapped.apply(v, x) ** 2)
  got = jax.grad(perturbkit.with_hooks(loss, half))(variables)
  want = jax.tree.map(lambda g: 0.5 * g, jax.grad(loss)(variables))
  chex.assert_trees_all_close(got, want, **TOL)
