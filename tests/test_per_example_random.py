"""Per-example norms and DP-SGD on models that draw random numbers (dropout).

Dropout between layers is part of the recorded forward pass: the norms equal the
rows of the Jacobian of the per-example losses of the SAME batched forward pass
(same masks; ``jax.vmap(jax.grad)`` would draw other masks per example). A call
that is replayed per example (no fast rule) and draws random numbers cannot
reproduce the batched masks and raises ``RandomCallError``; layers inside ``nn.remat``,
replayed with their whole apply, raise ``RandomApplyReplayError``.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import perturbkit
from test_per_example import norms_of

X = jax.random.normal(jax.random.key(0), (6, 5))
Y = jnp.arange(6) % 3
DROPOUT_KEY = jax.random.key(7)


class DropoutBetween(nn.Module):
  """Dropout applied by the parent between Dense layers, and on the input of a LayerNorm."""

  @nn.compact
  def __call__(self, x, train):
    x = nn.relu(nn.Dense(8)(x))
    x = nn.LayerNorm()(nn.Dropout(0.5, deterministic=not train)(x))
    return nn.Dense(3)(nn.Dropout(0.3, deterministic=not train)(x))


class ScaledDropout(nn.Module):
  """Owns a param (no fast rule) and draws a dropout mask inside its own call."""

  @nn.compact
  def __call__(self, x, train):
    scale = self.param('scale', nn.initializers.ones, (x.shape[-1],))
    return nn.Dropout(0.5, deterministic=not train)(jnp.tanh(x * scale[None]))


class DropoutInside(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    return nn.Dense(3)(ScaledDropout()(nn.Dense(8)(x), train))


class CheckpointedDropoutBetween(nn.Module):
  """``DropoutBetween`` run inside ``nn.remat``, as gradient checkpointing runs layers."""

  @nn.compact
  def __call__(self, x, train):
    return nn.remat(DropoutBetween, static_argnums=(2,))(name='layers')(x, train)


class KeyedNoise(nn.Module):
  """Owns a param and draws from a typed PRNG key passed to its call."""

  @nn.compact
  def __call__(self, x, key):
    scale = self.param('scale', nn.initializers.ones, (x.shape[-1],))
    return x * scale[None] + 0.1 * jax.random.normal(key, x.shape)


class KeyedNet(nn.Module):
  @nn.compact
  def __call__(self, x, key):
    return nn.Dense(3)(KeyedNoise()(nn.Dense(8)(x), key))


def _terms(model, variables, x, y, key):
  logits = model.apply(variables, x, True, rngs={'dropout': key})
  return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _jacobian_rows(model, variables, key):
  """Each example's gradient of its own loss term through the batched forward pass."""
  return jax.jit(jax.jacrev(lambda p: _terms(model, {**variables, 'params': p}, X, Y, key)))(
      variables['params'])


def _norms(tree):
  """Each example's total norm of a tree of per-example gradients."""
  return norms_of(tree)[1]


def test_dropout_between_layers_gives_the_norms_of_the_same_masks():
  model = DropoutBetween()
  variables = model.init(jax.random.key(1), X, False)
  loss_fn = lambda v, x, y, key: jnp.mean(_terms(model, v, x, y, key))
  norms_fn = perturbkit.per_example_grad_norms(loss_fn, batch_axes=(0, 0, None))
  loss, norms = jax.jit(norms_fn)(variables, X, Y, DROPOUT_KEY)
  rows = _jacobian_rows(model, variables, DROPOUT_KEY)
  np.testing.assert_allclose(loss, jnp.mean(_terms(model, variables, X, Y, DROPOUT_KEY)),
                             rtol=1e-6)
  # Examples whose loss is nearly saturated have norms near 1e-6: float32 cancellation.
  np.testing.assert_allclose(norms.total, _norms(rows), rtol=1e-5, atol=1e-5)
  for layer in ('Dense_0', 'LayerNorm_0', 'Dense_1'):
    np.testing.assert_allclose(norms.by_layer[layer], _norms(rows[layer]), rtol=1e-5, atol=1e-5)
  # The masks matter: a different key gives other norms.
  other = _norms(_jacobian_rows(model, variables, jax.random.key(8)))
  assert not np.allclose(norms.total, other, rtol=1e-3)


def test_dropout_between_layers_private_grad_is_the_clipped_sum_of_the_same_masks():
  model = DropoutBetween()
  variables = model.init(jax.random.key(1), X, False)
  loss_fn = lambda v, x, y, key: jnp.mean(_terms(model, v, x, y, key))
  clip = 0.5
  dp = perturbkit.private_grad(loss_fn, clip_norm=clip, noise_multiplier=0.0,
                               batch_axes=(0, 0, None))
  grads, metrics = jax.jit(dp)(variables, jax.random.key(3), X, Y, DROPOUT_KEY)
  rows = _jacobian_rows(model, variables, DROPOUT_KEY)
  total = _norms(rows)
  factors = np.minimum(1.0, clip / total)
  expected = jax.tree.map(lambda g: np.tensordot(factors, g, axes=1) / len(factors), rows)
  assert np.mean(total > clip) > 0  # some examples are clipped
  np.testing.assert_allclose(metrics['fraction_clipped'], np.mean(total > clip))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               grads, expected)


@pytest.mark.parametrize('make', ['norms', 'private_grad'])
def test_dropout_inside_a_replayed_call_is_a_named_error(make):
  model = DropoutInside()
  variables = model.init(jax.random.key(1), X, False)
  loss_fn = lambda v, x, y, key: jnp.mean(_terms(model, v, x, y, key))
  if make == 'norms':
    fn = perturbkit.per_example_grad_norms(loss_fn, batch_axes=(0, 0, None))
    args = (variables, X, Y, DROPOUT_KEY)
  else:
    fn = perturbkit.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=1.0,
                                 batch_axes=(0, 0, None))
    args = (variables, jax.random.key(3), X, Y, DROPOUT_KEY)
  with pytest.raises(perturbkit.RandomCallError, match='ScaledDropout_0/__call__.*dropout'):
    jax.jit(fn)(*args)
  # Deterministic, the same model has norms (the general path replays the call).
  det = lambda v, x, y: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      model.apply(v, x, False), y))
  _, norms = jax.jit(perturbkit.per_example_grad_norms(det))(variables, X, Y)
  rows = jax.jit(jax.vmap(jax.grad(lambda p, x, y: det({'params': p}, x[None], y[None])),
                          in_axes=(None, 0, 0)))(variables['params'], X, Y)
  np.testing.assert_allclose(norms.total, _norms(rows), rtol=1e-5)


def test_dropout_inside_remat_is_a_named_error_that_names_the_replayed_apply():
  """Layers inside ``nn.remat`` get per-example gradients from a replay of the whole apply,
  which cannot draw the batched pass's masks: the error says so and that the same layers
  outside the remat are supported (``test_dropout_between_layers_gives_the_norms_of_the_same_
  masks``), not that dropout applied between layers is."""
  model = CheckpointedDropoutBetween()
  variables = model.init(jax.random.key(1), X, False)
  loss_fn = lambda v, x, y, key: jnp.mean(_terms(model, v, x, y, key))
  fn = perturbkit.per_example_grad_norms(loss_fn, batch_axes=(0, 0, None))
  with pytest.raises(perturbkit.RandomApplyReplayError,
                     match=r'CheckpointedDropoutBetween.*dropout.*whole apply.*nn\.remat'):
    fn(variables, X, Y, DROPOUT_KEY)


def test_a_typed_key_given_to_a_replayed_call_is_a_named_error():
  model = KeyedNet()
  key = jax.random.key(5)
  variables = model.init(jax.random.key(1), X, key)
  loss_fn = lambda v, x, y, k: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      model.apply(v, x, k), y))
  fn = perturbkit.per_example_grad_norms(loss_fn, batch_axes=(0, 0, None))
  with pytest.raises(perturbkit.RandomCallError, match='KeyedNoise_0/__call__.*PRNG key'):
    fn(variables, X, Y, key)
