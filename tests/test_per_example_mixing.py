"""Losses that mix examples on their differentiable path are refused while tracing.

Each refused loss is also refused by ``check_per_example`` (a value check that
runs every example alone), so the two agree that the loss is not a per-example
sum. Mixing on a path without params (data normalized by its batch, a token
count, a ``stop_gradient``-ed statistic) is allowed, and the norms equal
per-example gradients with that batch quantity held fixed.
"""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import perturbkit
from test_per_example import TOL, norms_of


class Towers(nn.Module):
  """Two encoders, as in CLIP: one for each input."""

  @nn.compact
  def __call__(self, x, y):
    a = nn.Dense(4, name='left')(nn.tanh(nn.Dense(6, name='left_hidden')(x)))
    return a, nn.Dense(4, name='right')(y)


MODEL = Towers()
X = jax.random.normal(jax.random.key(0), (6, 3))
Y = jax.random.normal(jax.random.key(1), (6, 5))
VARIABLES = MODEL.init(jax.random.key(2), X, Y)


def contrastive(v, x, y):
  a, b = MODEL.apply(v, x, y)
  logits = a @ b.T
  return jnp.mean(jax.nn.logsumexp(logits, axis=1) - jnp.diagonal(logits))


def batch_centered(v, x, y):
  a, b = MODEL.apply(v, x, y)
  return jnp.mean(jnp.sum((a - a.mean(axis=0, keepdims=True)) * b, axis=1) ** 2)


def root_mean_square(v, x, y):
  a, b = MODEL.apply(v, x, y)
  return jnp.sqrt(jnp.mean(jnp.sum((a - b) ** 2, axis=1)))


def worst_example(v, x, y):
  a, b = MODEL.apply(v, x, y)
  return jnp.max(jnp.sum((a - b) ** 2, axis=1))


@pytest.mark.parametrize('loss_fn, match', [
    (contrastive, 'contrastive'),
    (batch_centered, 'batch statistic'),
    (root_mean_square, '`sqrt` is applied to a sum over the examples'),
    (worst_example, 'a maximum over the examples'),
], ids=['contrastive', 'batch_centered', 'root_mean_square', 'worst_example'])
def test_mixing_losses_are_refused(loss_fn, match):
  with pytest.raises(perturbkit.ExamplesMixedError, match=match):
    jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn), VARIABLES, X, Y)
  with pytest.raises(perturbkit.ExamplesMixedError, match=match):
    jax.eval_shape(perturbkit.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=1.0),
                   VARIABLES, jax.random.key(0), X, Y)
  with pytest.raises(perturbkit.ExamplesMixedError):  # the value check agrees
    perturbkit.check_per_example(loss_fn, VARIABLES, X, Y)


def fixed_batch_reference(term, variables, x, y):
  """Each example's gradient of ``term(params, x_i, y_i)``, batch quantities bound in ``term``."""
  grad = jax.grad(lambda p, xi, yi: term({**variables, 'params': p}, xi[None], yi[None]))
  return jax.vmap(grad, in_axes=(None, 0, 0))(variables['params'], x, y)


def assert_norms(loss_fn, term, **options):
  _, norms = jax.jit(perturbkit.per_example_grad_norms(loss_fn, **options))(VARIABLES, X, Y)
  by_param, total = norms_of(fixed_batch_reference(term, VARIABLES, X, Y))
  chex.assert_trees_all_close(norms.by_param, by_param, **TOL)
  np.testing.assert_allclose(norms.total, total, **TOL)


def test_inputs_normalized_by_their_batch_are_per_example():
  """The batch mean of the data carries no gradient: each term is its own example's."""
  mean, std = X.mean(axis=0, keepdims=True), X.std(axis=0, keepdims=True)

  def loss_fn(v, x, y):
    normalized = (x - x.mean(axis=0, keepdims=True)) / x.std(axis=0, keepdims=True)
    a, b = MODEL.apply(v, normalized, y)
    return jnp.mean(jnp.sum((a - b) ** 2, axis=1))

  def term(v, x, y):
    a, b = MODEL.apply(v, (x - mean) / std, y)
    return jnp.sum((a - b) ** 2)
  assert_norms(loss_fn, term)


def test_token_count_normalization_is_per_example():
  """``sum(loss · mask) / sum(mask)``: the count is computed from the data alone."""
  mask = (Y[:, 0] > 0).astype(jnp.float32)
  count = jnp.sum(mask)

  def loss_fn(v, x, y):
    a, b = MODEL.apply(v, x, y)
    weights = (y[:, 0] > 0).astype(jnp.float32)
    return jnp.sum(jnp.sum((a - b) ** 2, axis=1) * weights) / jnp.sum(weights)

  def term(v, x, y):  # loss = mean_i term_i: a weighted mean is a mean (reduction='mean')
    a, b = MODEL.apply(v, x, y)
    return len(X) * jnp.sum((a - b) ** 2) * (y[0, 0] > 0) / count
  assert_norms(loss_fn, term)


def test_a_stop_gradient_batch_statistic_is_per_example():
  a_all, _ = MODEL.apply(VARIABLES, X, Y)
  fixed = a_all.mean(axis=0, keepdims=True)

  def loss_fn(v, x, y):
    a, b = MODEL.apply(v, x, y)
    center = jax.lax.stop_gradient(a.mean(axis=0, keepdims=True))
    return jnp.mean(jnp.sum((a - center) * b, axis=1) ** 2)

  def term(v, x, y):
    a, b = MODEL.apply(v, x, y)
    return jnp.sum((a - fixed) * b) ** 2
  assert_norms(loss_fn, term)


def test_pairing_with_a_stop_gradient_side_keeps_the_live_examples():
  """``a @ stop_gradient(b).T`` summed over the data side: each row is one example's term."""
  _, b_all = MODEL.apply(VARIABLES, X, Y)

  def loss_fn(v, x, y):
    a, b = MODEL.apply(v, x, y)
    return jnp.mean(jnp.sum(jnp.tanh(a @ jax.lax.stop_gradient(b).T), axis=1))

  def term(v, x, y):
    a, _ = MODEL.apply(v, x, y)
    return jnp.sum(jnp.tanh(a @ b_all.T))
  assert_norms(loss_fn, term)


class Centered(nn.Module):
  """Subtracts the batch mean of its activations: a batch statistic without BatchNorm."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4)(x)
    return h - jnp.mean(h, axis=0, keepdims=True)


class WithCentered(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(Centered(name='block')(x))


def test_mixing_inside_the_model_is_refused_where_it_happens():
  model = WithCentered()
  variables = model.init(jax.random.key(0), X)
  loss_fn = lambda v, x: jnp.mean(model.apply(v, x) ** 2)
  with pytest.raises(perturbkit.ExamplesMixedError, match='`sub` in WithCentered/block'):
    jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn), variables, X)
  with pytest.raises(perturbkit.ExamplesMixedError):
    perturbkit.check_per_example(loss_fn, variables, X)
