"""Losses that mix examples on their differentiable path are refused while tracing.

Each refused loss is also refused by ``check_per_example`` (a value check that
runs every example alone), so the two agree that the loss is not a per-example
sum. Mixing on a path without params (data normalized by its batch, a token
count, a ``stop_gradient``-ed statistic) is allowed, and the norms equal
per-example gradients with that batch quantity held fixed.
"""
from typing import Callable

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import perturbkit
from test_per_example import (TOL, assert_norms_match, cross_entropy, norms_of,
                              per_example_grads)


class Towers(nn.Module):
  """Two encoders, as in CLIP: one for each input."""

  @nn.compact
  def __call__(self, x, y):
    a = nn.Dense(4, name='left')(nn.tanh(nn.Dense(6, name='left_hidden')(x)))
    return a, nn.Dense(4, name='right')(y)


MODEL = Towers()
X = jax.random.normal(jax.random.key(0), (6, 3))
Y = jax.random.normal(jax.random.key(1), (6, 5))
VARIABLES = jax.jit(MODEL.init)(jax.random.key(2), X, Y)  # one compile, not one per op


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
  @jax.jit  # one compile for both sides
  def run(variables, x, y):
    return (perturbkit.per_example_grad_norms(loss_fn, **options)(variables, x, y),
            norms_of(fixed_batch_reference(term, variables, x, y)))

  (_, norms), (by_param, total) = run(VARIABLES, X, Y)
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
  a_all, _ = jax.jit(MODEL.apply)(VARIABLES, X, Y)
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
  _, b_all = jax.jit(MODEL.apply)(VARIABLES, X, Y)

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


class TinyLM(nn.Module):
  """Logits at every position: ``(examples, positions, vocabulary)``."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(VOCAB, name='head')(nn.tanh(nn.Dense(4, name='hidden')(x)))


VOCAB = 5
LM = TinyLM()
TOKENS = jax.random.normal(jax.random.key(3), (4, 3, 2))  # 4 examples of 3 positions
LABELS = jax.random.randint(jax.random.key(4), (4, 3), 0, VOCAB)
LM_VARIABLES = jax.jit(LM.init)(jax.random.key(5), TOKENS)
MIXER = jax.random.normal(jax.random.key(6), (VOCAB, VOCAB))


def assert_refused(loss_fn, match, variables, *args):
  """Refused by name while tracing, for norms and DP-SGD; the value check agrees."""
  with pytest.raises(perturbkit.ExamplesMixedError, match=match):
    jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn), variables, *args)
  with pytest.raises(perturbkit.ExamplesMixedError, match=match):
    jax.eval_shape(perturbkit.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=1.0),
                   variables, jax.random.key(0), *args)
  with pytest.raises(perturbkit.ExamplesMixedError):
    perturbkit.check_per_example(loss_fn, variables, *args)


def rows_of(logits):
  """``(B, T, V) -> (B * T, V)``: each example owns a block of rows."""
  return logits.reshape(-1, logits.shape[-1])


def time_major_rows_of(logits):
  """``(B, T, V) -> (T, B, V) -> (T * B, V)``: each example owns every B-th row."""
  return rows_of(jnp.swapaxes(logits, 0, 1))


def rows_cross_entropy(v, x, labels):
  """The usual language-model loss: cross-entropy over the merged rows."""
  return cross_entropy(rows_of(LM.apply(v, x)), labels.reshape(-1))


def time_major_cross_entropy(v, x, labels):
  return cross_entropy(time_major_rows_of(LM.apply(v, x)), labels.T.reshape(-1))


def rows_split_back(v, x, labels):
  """Token losses on the merged rows, split back into examples: a maximum over each one's own."""
  rows = jax.nn.log_softmax(rows_of(LM.apply(v, x)))
  tokens = -jnp.take_along_axis(rows, labels.reshape(-1, 1), axis=1).reshape(labels.shape)
  return jnp.mean(jnp.max(tokens, axis=1))


def rows_with_features(v, x, labels):
  """Rows mixed with a constant across the vocabulary, a mean per row, data from the rows."""
  rows = jnp.tanh(rows_of(LM.apply(v, x)) @ MIXER)
  scale = 1.0 + rows_of(x)[:, :1] ** 2
  return jnp.mean(jnp.mean(rows * scale, axis=1) ** 2) + 0.1 * cross_entropy(
      rows, labels.reshape(-1))


@pytest.mark.parametrize('loss_fn', [
    rows_cross_entropy, time_major_cross_entropy, rows_split_back, rows_with_features,
], ids=['rows', 'time_major_rows', 'split_back', 'row_features'])
def test_losses_over_merged_rows_are_per_example(loss_fn):
  assert_norms_match(loss_fn, LM_VARIABLES, TOKENS, LABELS)


def rows_batch_normalized(v, x, labels):
  """Logits as rows, centered by their mean over all rows: a batch statistic."""
  rows = rows_of(LM.apply(v, x))
  return cross_entropy(rows - rows.mean(axis=0, keepdims=True), labels.reshape(-1))


def time_major_batch_normalized(v, x, labels):
  rows = time_major_rows_of(LM.apply(v, x))
  return cross_entropy(rows - rows.mean(axis=0, keepdims=True), labels.T.reshape(-1))


def rows_contrastive(v, x, labels):
  """``a @ b.T`` between the merged rows of two halves of the logits."""
  rows = rows_of(LM.apply(v, x))
  logits = rows[:, :2] @ rows[:, 2:4].T
  return jnp.mean(jax.nn.logsumexp(logits, axis=1) - jnp.diagonal(logits))


def rows_worst(v, x, labels):
  rows = jax.nn.log_softmax(rows_of(LM.apply(v, x)))
  return -jnp.min(jnp.take_along_axis(rows, labels.reshape(-1, 1), axis=1))


def major_times_minor(v, x, labels):
  """Rows merged examples-major times rows merged examples-minor: different examples meet."""
  logits = LM.apply(v, x)
  return jnp.mean(rows_of(logits)[:, 0] * time_major_rows_of(logits)[:, 1])


@pytest.mark.parametrize('loss_fn, match', [
    (rows_batch_normalized, 'batch statistic'),
    (time_major_batch_normalized, 'batch statistic'),
    (rows_contrastive, 'contrastive'),
    (rows_worst, 'a minimum over the examples'),
    (major_times_minor, '`mul` pairs the examples'),
], ids=['batch_normalized', 'time_major_batch_normalized', 'contrastive', 'worst_row',
        'major_times_minor'])
def test_mixing_over_merged_rows_is_refused(loss_fn, match):
  assert_refused(loss_fn, match, LM_VARIABLES, TOKENS, LABELS)


def scanned_recurrence(v, x, labels):
  """An RNN over the logits written in the loss: time-major ``xs``, a per-example carry."""
  logits = LM.apply(v, x)

  def step(state, logits_t):
    state = jnp.tanh(logits_t @ MIXER + 0.5 * state)
    return state, jnp.sum(state ** 2, axis=1)
  state, per_step = jax.lax.scan(step, jnp.zeros_like(logits[:, 0]), jnp.swapaxes(logits, 0, 1))
  return jnp.mean(jnp.sum(state, axis=1) + jnp.max(per_step, axis=0))


def scanned_chunked_cross_entropy(v, x, labels):
  """Cross-entropy position by position in a ``lax.scan``, the carry a running total."""
  logits = LM.apply(v, x)

  def step(total, chunk):
    logits_t, labels_t = chunk
    log_probs = jax.nn.log_softmax(logits_t)
    return total - jnp.sum(jnp.take_along_axis(log_probs, labels_t[:, None], axis=1)), None
  total, _ = jax.lax.scan(step, 0.0, (jnp.swapaxes(logits, 0, 1), labels.T))
  return total / labels.size


def scanned_over_examples(v, x, labels):
  """A scan through the examples themselves is not followed, and not refused."""
  terms = jnp.mean(jnp.sum(LM.apply(v, x) ** 2, axis=2), axis=1)
  total, _ = jax.lax.scan(lambda total, term: (total + term, None), 0.0, terms)
  return total / len(terms)


@pytest.mark.parametrize('loss_fn', [
    scanned_recurrence, scanned_chunked_cross_entropy, scanned_over_examples,
], ids=['recurrence', 'chunked_cross_entropy', 'over_examples'])
def test_scanned_losses_are_per_example(loss_fn):
  assert_norms_match(loss_fn, LM_VARIABLES, TOKENS, LABELS)


def scanned_running_center(v, x, labels):
  """A running batch mean in the carry, subtracted from each example at the next step."""
  logits = LM.apply(v, x)

  def step(center, logits_t):
    center_next = 0.9 * center + 0.1 * logits_t.mean(axis=0, keepdims=True)
    return center_next, jnp.sum((logits_t - center) ** 2, axis=1)
  _, per_step = jax.lax.scan(step, jnp.zeros((1, VOCAB)), jnp.swapaxes(logits, 0, 1))
  return jnp.mean(per_step)


def scanned_pairing(v, x, labels):
  """A carry that pairs every example's state with every other's at each step."""
  logits = LM.apply(v, x)

  def step(state, logits_t):
    state = jnp.tanh(logits_t + 0.1 * state)
    return state, jax.nn.logsumexp(state @ state.T, axis=1)
  _, per_step = jax.lax.scan(step, jnp.zeros_like(logits[:, 0]), jnp.swapaxes(logits, 0, 1))
  return jnp.mean(per_step)


@pytest.mark.parametrize('loss_fn, match', [
    (scanned_running_center, 'batch statistic'),
    (scanned_pairing, 'contrastive'),
], ids=['running_center', 'pairing'])
def test_mixing_in_a_scan_is_refused(loss_fn, match):
  assert_refused(loss_fn, match, LM_VARIABLES, TOKENS, LABELS)


class Rearranged(nn.Module):
  """A hidden layer whose rows go through ``mix`` before the output layer."""
  mix: Callable[[jax.Array], jax.Array]

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name='out')(self.mix(jnp.tanh(nn.Dense(4, name='hidden')(x))))


def rearranged_problem(mix):
  model = Rearranged(mix)
  variables = model.init(jax.random.key(0), X)
  return (lambda v, x, y: jnp.mean(jnp.sum((model.apply(v, x) - y[:, :2]) ** 2, axis=1)),
          variables)


@pytest.mark.parametrize('mix', [
    lambda h: jnp.roll(h, 1, axis=0),
    lambda h: h[::-1],
    lambda h: jnp.concatenate([h[1:], h[:1]]),
    lambda h: jax.lax.dynamic_slice_in_dim(jnp.concatenate([h, h]), 2, len(X)),
], ids=['roll', 'reverse', 'shift', 'dynamic_slice'])
def test_layers_seeing_rearranged_rows_are_refused(mix):
  """The next layer's row i is another example's: its gradient rows are not the examples'."""
  loss_fn, variables = rearranged_problem(mix)
  with pytest.raises(perturbkit.ExamplesAxisError, match='rearranged along the examples axis'):
    jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn), variables, X, Y)


class TwoViews(nn.Module):
  """One layer applied to two views of the batch stacked along the examples axis, its halves
  multiplied back together."""
  stack: Callable[[jax.Array], jax.Array]

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4)(self.stack(x))
    return nn.Dense(2)(jnp.tanh(h[:len(x)]) * h[len(x):])


@pytest.mark.parametrize('stack', [
    lambda x: jnp.concatenate([x, jnp.sin(x)]),
    lambda x: jnp.tile(x, (2, 1)),
], ids=['concatenate', 'tile'])
def test_a_layer_seeing_the_batch_twice_along_the_examples_axis(stack):
  """Row ``r`` is example ``r % examples`` in both: each example's rows are its own."""
  model = TwoViews(stack)
  variables = model.init(jax.random.key(0), X)
  loss_fn = lambda v, x, y: jnp.mean(jnp.sum((model.apply(v, x) - y[:, :2]) ** 2, axis=1))
  assert_norms_match(loss_fn, variables, X, Y)


def test_a_layer_seeing_the_batch_twice_in_another_order_is_refused():
  model = TwoViews(lambda x: jnp.concatenate([x, x[::-1]]))
  variables = model.init(jax.random.key(0), X)
  loss_fn = lambda v, x, y: jnp.mean(jnp.sum((model.apply(v, x) - y[:, :2]) ** 2, axis=1))
  with pytest.raises(perturbkit.ExamplesAxisError, match='rearranged along the examples axis'):
    jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn), variables, X, Y)


def paired_after_split(h):
  """Attention across the batch after ``jnp.split`` into queries and keys."""
  queries, keys = jnp.split(h, 2, axis=1)
  return h * jnp.sum(jnp.tanh(queries @ keys.T), axis=1, keepdims=True)


@pytest.mark.parametrize('mix, match', [
    (lambda h: h + h[:1], 'values of fixed examples'),
    (lambda h: h * h[jnp.arange(h.shape[0])[::-1]], 'values of fixed examples'),
    (lambda h: h.at[0].add(h[-1]), 'writes values of fixed examples'),
    (paired_after_split, 'pairs the examples'),
], ids=['first_row', 'permuted_rows', 'scatter', 'after_split'])
def test_rows_of_other_examples_are_refused(mix, match):
  loss_fn, variables = rearranged_problem(mix)
  assert_refused(loss_fn, match, variables, X, Y)


def roll_negatives(v, x, y):
  """Each example's negative is the next example's embedding: ``jnp.roll`` over the batch."""
  a, b = MODEL.apply(v, x, y)
  return jnp.mean(jax.nn.softplus(jnp.sum(a * jnp.roll(b, 1, axis=0), 1) - jnp.sum(a * b, 1)))


def test_negatives_from_other_examples_are_refused():
  assert_refused(roll_negatives, 'pairs the examples', VARIABLES, X, Y)


@pytest.mark.parametrize('mix', [
    lambda h: h[:, ::-1],
    lambda h: jnp.concatenate(jnp.split(h, 2, axis=1)[::-1], axis=1),
    lambda h: h[:, jnp.array([3, 1, 2, 0])],
    lambda h: h.at[:, 0].set(h[:, 1]),
    lambda h: jnp.concatenate([h[:2], h[2:3], h[3:]]),
    lambda h: jnp.concatenate(jnp.split(h, [1], axis=0)),
], ids=['reverse_features', 'split_features', 'gather_features', 'scatter_features',
        'rows_back_in_order', 'split_rows_back_in_order'])
def test_rearranging_features_keeps_the_examples(mix):
  """Reversing, splitting, gathering or writing along other axes is each example's own."""
  loss_fn, variables = rearranged_problem(mix)
  assert_norms_match(loss_fn, variables, X, Y)


def per_example_token_mean(v, x, y):
  """Each example's masked mean over its own tokens, then the mean over examples."""
  a, b = MODEL.apply(v, x, y)
  losses, mask = (a - b) ** 2, (y[:, :4] > 0).astype(jnp.float32)
  return jnp.mean(jnp.sum(losses * mask, 1) / jnp.maximum(jnp.sum(mask, 1), 1.0))


def token_count_mean(v, x, y):
  """The batch's token count divides every example's term."""
  a, b = MODEL.apply(v, x, y)
  losses, mask = (a - b) ** 2, (y[:, :4] > 0).astype(jnp.float32)
  return jnp.sum(losses * mask) / jnp.sum(mask)


def batch_normalized_inputs(v, x, y):
  a, b = MODEL.apply(v, (x - x.mean(axis=0, keepdims=True)) / x.std(axis=0, keepdims=True), y)
  return jnp.mean(jnp.sum((a - b) ** 2, axis=1))


def stop_gradient_statistic(v, x, y):
  a, b = MODEL.apply(v, x, y)
  center = jax.lax.stop_gradient(a.mean(axis=0, keepdims=True))
  return jnp.mean(jnp.sum((a - center) * b, axis=1) ** 2)


@pytest.mark.parametrize('loss_fn, match', [
    (token_count_mean, '`div` combines values with a quantity computed from the whole batch'),
    (batch_normalized_inputs, 'combines values with a quantity computed from the whole batch'),
    (stop_gradient_statistic, 'combines values with a quantity computed from the whole batch'),
], ids=['token_count', 'normalized_inputs', 'stop_gradient_statistic'])
def test_dp_refuses_terms_computed_from_other_examples(loss_fn, match):
  """Norms hold the batch quantity fixed (above); DP-SGD's bound on one example's effect
  would not hold, since removing it changes every other example's term."""
  jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn), VARIABLES, X, Y)
  with pytest.raises(perturbkit.ExamplesCoupledError, match=match):
    jax.eval_shape(perturbkit.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=1.0),
                   VARIABLES, jax.random.key(0), X, Y)


def test_dp_sensitivity_of_a_per_example_token_mean():
  """A per-example token mean is accepted, and dropping one example moves the clipped sum by
  at most ``clip_norm``: the bound the noise is calibrated to, computed here by ``jax.grad``
  of each example alone."""
  clip = 0.05
  private = perturbkit.private_grad(per_example_token_mean, clip_norm=clip,
                                    noise_multiplier=0.0)

  @jax.jit  # both batches and the reference in one compile
  def run(variables, x, y):
    full, _ = private(variables, jax.random.key(0), x, y)
    fewer, _ = private(variables, jax.random.key(0), x[1:], y[1:])
    change = jax.tree.map(lambda f, g: len(x) * f - (len(x) - 1) * g, full, fewer)
    alone = per_example_grads(per_example_token_mean, variables, x[:1], y[:1])
    _, norm = norms_of(alone)
    want = jax.tree.map(lambda g: g[0] * jnp.minimum(1.0, clip / norm[0]), alone)
    return change, want, norm

  change, want, norm = run(VARIABLES, X, Y)
  chex.assert_trees_all_close(change, want, **TOL)
  assert float(norm[0]) > clip  # the first example is clipped
