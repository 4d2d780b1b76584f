"""The reduction of the loss is checked, and DP-SGD drops examples with a non-finite gradient.

References are plain JAX: each example's gradient is ``jax.grad`` of the loss of
that example alone (``jax.vmap`` over examples), clipped and summed by hand.
"""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import models
import perturbkit

TOL = dict(rtol=2e-4, atol=1e-6)
BATCH = 5


@pytest.fixture(scope='module')
def problem():
  model = models.MLP(out=3)
  x = jax.random.normal(jax.random.key(0), (BATCH, 4))
  y = jnp.arange(BATCH) % 3
  return model, jax.jit(model.init)(jax.random.key(1), x), x, y


def terms_of(model):
  return lambda v, x, y: optax.softmax_cross_entropy_with_integer_labels(model.apply(v, x), y)


def mean_loss(model):
  return lambda v, x, y: terms_of(model)(v, x, y).mean()


def sum_loss(model):
  return lambda v, x, y: terms_of(model)(v, x, y).sum()


def per_example_grads(loss_fn, variables, x, y):
  def one(x, y):
    return jax.grad(lambda p: loss_fn({**variables, 'params': p}, x[None], y[None]))(
        variables['params'])
  return jax.jit(jax.vmap(one))(x, y)


@jax.jit  # one compile, not an op-by-op compile per leaf shape
def total_norms(per_example):
  return jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1)
                      for g in jax.tree.leaves(per_example)))


@jax.jit  # one compile, not one per leaf
def scaled(tree, factor):
  return jax.tree.map(lambda g: g * factor, tree)


@jax.jit
def clipped_sum(per_example, keep, clip_norm):
  """``sum_{i kept} min(1, C/‖g_i‖) g_i``."""
  norms = total_norms(per_example)
  factors = jnp.where(keep, jnp.minimum(1.0, clip_norm / norms), 0.0)
  return jax.tree.map(lambda g: jnp.tensordot(factors, jnp.where(
      keep.reshape((-1,) + (1,) * (g.ndim - 1)), g, 0.0), axes=1), per_example)


@pytest.mark.parametrize('jit', [False, True])
def test_sum_loss_with_mean_reduction_is_refused(problem, jit):
  model, variables, x, y = problem
  wrap = jax.jit if jit else (lambda f: f)
  with pytest.raises(perturbkit.ReductionMismatchError, match="reduction='sum'"):
    wrap(perturbkit.per_example_grad_norms(sum_loss(model)))(variables, x, y)
  with pytest.raises(perturbkit.ReductionMismatchError, match="reduction='sum'"):
    wrap(perturbkit.private_grad(sum_loss(model), clip_norm=1.0, noise_multiplier=0.0))(
        variables, jax.random.key(0), x, y)
  tx = perturbkit.dp_sgd(sum_loss(model), optax.sgd(0.1), clip_norm=1.0, noise_multiplier=0.0)
  with pytest.raises(perturbkit.ReductionMismatchError, match="reduction='sum'"):
    wrap(tx.step)(tx.init(variables), jax.random.key(0), x, y)


def test_bf16_sum_loss_with_mean_reduction_is_refused():
  """A bfloat16 loss is rounded to 8 significant bits, so the loss of two examples is the sum
  of their losses only to about 0.4% (here 1.0078125 + 1 rounds to 2): the check that a sum
  is additive allowed 0.1%, judged nothing, and a bfloat16 sum passed as a mean gave norms
  as many times too large as there are examples. The check allows the loss dtype's
  rounding."""
  model = nn.Dense(1, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                   kernel_init=nn.initializers.ones)
  x = jnp.array([[1.0078125], [1.0], [1.5], [2.0]], jnp.bfloat16)
  variables = jax.jit(model.init)(jax.random.key(0), x)
  loss_fn = lambda v, x: jnp.sum(model.apply(v, x))
  assert loss_fn(variables, x[:2]) == 2.0  # not 2.0078125
  with pytest.raises(perturbkit.ReductionMismatchError, match="reduction='sum'"):
    perturbkit.per_example_grad_norms(loss_fn)(variables, x)
  _, norms = jax.jit(perturbkit.per_example_grad_norms(loss_fn, reduction='sum'))(variables, x)
  np.testing.assert_allclose(norms.total, x[:, 0].astype(jnp.float32), rtol=1e-6)


def test_mean_loss_with_sum_reduction_is_refused(problem):
  model, variables, x, y = problem
  with pytest.raises(perturbkit.ReductionMismatchError, match="reduction='mean'"):
    jax.jit(perturbkit.per_example_grad_norms(mean_loss(model), reduction='sum'))(
        variables, x, y)
  with pytest.raises(perturbkit.ReductionMismatchError, match="reduction='mean'"):
    perturbkit.private_grad(mean_loss(model), clip_norm=1.0, noise_multiplier=0.0,
                            reduction='sum')(variables, jax.random.key(0), x, y)


@pytest.mark.parametrize('reduction', ['mean', 'sum'])
def test_matching_reductions_give_each_terms_norm(problem, reduction):
  model, variables, x, y = problem
  loss_fn = mean_loss(model) if reduction == 'mean' else sum_loss(model)
  _, norms = jax.jit(perturbkit.per_example_grad_norms(loss_fn, reduction=reduction))(
      variables, x, y)
  want = total_norms(per_example_grads(loss_fn, variables, x, y))
  np.testing.assert_allclose(norms.total, want, **TOL)


def test_a_masked_mean_over_tokens_is_a_mean(problem):
  """A mean weighted by a per-token mask is a mean (the weights double with the examples)."""
  model, variables, x, _ = problem
  tokens = jnp.stack([x, -x, 2 * x], axis=1)  # (examples, tokens, features)
  mask = jnp.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1], [1, 0, 1]], jnp.float32)

  def loss_fn(v, tokens, mask):
    per_token = jnp.sum(model.apply(v, tokens) ** 2, axis=-1)
    return jnp.sum(per_token * mask) / jnp.sum(mask)

  _, norms = jax.jit(perturbkit.per_example_grad_norms(loss_fn))(variables, tokens, mask)
  assert np.all(np.isfinite(norms.total))


def test_how_the_loss_combines_examples_is_judged_from_traces_of_one_or_two(problem):
  """A mean, a sum, and a loss that doubles with a repeated example but pairs each example
  with the whole batch (not a sum: left unjudged). Each trace of the loss is counted: the
  mean is told from one compile of two batches, only a loss that doubles pays for the
  second (whether the first two examples add up)."""
  from perturbkit.per_example._check import found_reduction
  model, variables, x, y = problem
  traces = []

  def counted(loss_fn):
    def traced(*args):
      traces.append(None)
      return loss_fn(*args)
    return traced

  def paired(v, x, y):  # each example's row summed over the whole batch's columns
    out = model.apply(v, x)
    return jnp.mean(jnp.sum(jnp.tanh(out @ jax.lax.stop_gradient(out).T), axis=1)) + 0 * y[0]

  for loss_fn, want, num_traces in [(mean_loss(model), 'mean', 2), (sum_loss(model), 'sum', 4),
                                    (paired, None, 4)]:
    traces.clear()
    found, ratio = found_reduction(counted(loss_fn), variables, (x, y), {}, 0, BATCH)
    assert (found, len(traces)) == (want, num_traces), (found, ratio, len(traces))
    assert want is not None or abs(ratio - 2) < 1e-3  # it does double
  traces.clear()
  assert found_reduction(counted(sum_loss(model)), variables, (x[:1], y[:1]), {}, 0, 1)[0] == 'sum'
  assert len(traces) == 2


def test_the_reduction_is_checked_once_per_loss(problem, monkeypatch):
  """The functions built from one loss (norms, a private gradient, a DP-SGD step) check it
  on the first call of the first of them; another loss, reduction or examples axis is
  checked again, and a check that fails is not remembered. (Called under ``jax.eval_shape``:
  the check is made while tracing, so nothing needs running.)"""
  from perturbkit.per_example import _check
  model, variables, x, y = problem
  checked = []
  check = _check.check_reduction
  monkeypatch.setattr(_check, 'check_reduction',
                      lambda *a, **k: (checked.append(k['reduction']), check(*a, **k)))
  loss_fn = mean_loss(model)
  key = jax.random.key(0)
  jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn), variables, x, y)
  jax.eval_shape(perturbkit.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=0.0),
                 variables, key, x, y)
  tx = perturbkit.dp_sgd(loss_fn, optax.sgd(0.1), clip_norm=1.0, noise_multiplier=0.0)
  jax.eval_shape(tx.step, tx.init(variables), key, x, y)
  assert checked == ['mean']
  jax.eval_shape(perturbkit.per_example_grad_norms(mean_loss(model)), variables, x, y)
  assert checked == ['mean'] * 2
  for _ in range(2):
    with pytest.raises(perturbkit.ReductionMismatchError):
      jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn, reduction='sum'), variables, x,
                     y)
  jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn, batch_axes=(0, 0)), variables, x, y)
  assert checked == ['mean'] * 2 + ['sum'] * 2 + ['mean']

  class Unreferable:  # no weak reference to it: each function checks it once, as its own
    __slots__ = ()

    def __call__(self, v, x, y):
      return mean_loss(model)(v, x, y)

  checked.clear()
  norms = perturbkit.per_example_grad_norms(Unreferable())
  jax.eval_shape(norms, variables, x, y)
  jax.eval_shape(norms, variables, x, y)
  jax.eval_shape(perturbkit.per_example_grad_norms(Unreferable()), variables, x, y)
  assert checked == ['mean'] * 2


@pytest.mark.parametrize('where', ['input', 'target'])
def test_a_nan_example_is_dropped_from_the_clipped_sum(where):
  model = models.MLP(out=1)
  x = jax.random.normal(jax.random.key(0), (BATCH, 4))
  y = jax.random.normal(jax.random.key(2), (BATCH, 1))
  variables = jax.jit(model.init)(jax.random.key(1), x)
  loss_fn = lambda v, x, y: jnp.mean(jnp.sum((model.apply(v, x) - y) ** 2, axis=-1))
  bad = 2
  if where == 'input':
    x = x.at[bad, 1].set(jnp.nan)
  else:
    y = y.at[bad, 0].set(jnp.nan)
  clip = 0.5
  dp = jax.jit(perturbkit.private_grad(loss_fn, clip_norm=clip, noise_multiplier=0.0))
  grads, metrics = dp(variables, jax.random.key(3), x, y)
  keep = np.arange(BATCH) != bad
  per_example = per_example_grads(loss_fn, variables, x, y)
  want = scaled(clipped_sum(per_example, keep, clip), 1 / BATCH)
  chex.assert_trees_all_close(grads, want, **TOL)
  assert int(metrics['dropped']) == 1
  norms = np.asarray(metrics['per_example_norms'])
  assert not np.isfinite(norms[bad])
  np.testing.assert_allclose(norms[keep], np.asarray(total_norms(per_example))[keep], **TOL)
  # The same as DP-SGD on the batch without that example, rescaled to its size.
  clean = dp(variables, jax.random.key(3), np.asarray(x)[keep], np.asarray(y)[keep])[0]
  chex.assert_trees_all_close(grads, scaled(clean, (BATCH - 1) / BATCH), **TOL)


def test_a_nan_example_through_a_replayed_layer_is_dropped():
  """A layer without a fast path (attention: its call is replayed) drops the example too."""
  model = models.TransformerBlock(train=False)
  x = jax.random.normal(jax.random.key(0), (BATCH, 3, 8))
  variables = jax.jit(model.init)(jax.random.key(1), x)
  loss_fn = lambda v, x: jnp.mean(jnp.sum(model.apply(v, x) ** 2, axis=(1, 2)))
  x = x.at[1, 2, 0].set(jnp.inf)
  dp = jax.jit(perturbkit.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=0.0))
  grads, metrics = dp(variables, jax.random.key(3), x)
  keep = jnp.arange(BATCH) != 1

  def one(x):
    return jax.grad(lambda p: loss_fn({**variables, 'params': p}, x[None]))(variables['params'])

  want = jax.tree.map(lambda s: s / BATCH, clipped_sum(jax.jit(jax.vmap(one))(x), keep, 1.0))
  chex.assert_trees_all_close(grads, want, **TOL)
  assert int(metrics['dropped']) == 1


def test_dp_sgd_applies_the_step_without_the_dropped_example(problem):
  model, variables, x, y = problem
  x = x.at[0, 0].set(jnp.nan)
  tx = perturbkit.dp_sgd(mean_loss(model), optax.sgd(0.1), clip_norm=1.0, noise_multiplier=0.0)
  state, metrics = jax.jit(tx.step)(tx.init(variables), jax.random.key(0), x, y)
  keep = jnp.arange(BATCH) != 0
  want = clipped_sum(per_example_grads(mean_loss(model), variables, x, y), keep, 1.0)
  want = jax.tree.map(lambda p, g: p - 0.1 * g / BATCH, variables['params'], want)
  chex.assert_trees_all_close(state.variables['params'], want, **TOL)
  assert int(metrics['dropped']) == 1 and not bool(metrics['skipped'])


def test_dp_sgd_skips_a_step_whose_gradient_is_not_finite(problem):
  model, variables, x, y = problem
  # Noise of standard deviation 3e38 (float32's largest is 3.4e38): some entries are inf.
  tx = perturbkit.dp_sgd(mean_loss(model), optax.adam(0.1), clip_norm=1e30,
                         noise_multiplier=3e8)
  state = tx.init(variables)
  new, metrics = jax.jit(tx.step)(state, jax.random.key(0), x, y)
  assert bool(metrics['skipped']) and int(metrics['dropped']) == 0
  chex.assert_trees_all_equal(new.variables, state.variables)
  chex.assert_trees_all_equal(new.opt_state, state.opt_state)
  assert int(new.step) == 1


def test_dp_sgd_takes_a_float16_step_whose_gradient_is_finite():
  """A float16 gradient with entries above 256 is finite, though its squares are not in
  float16: the check for a non-finite gradient takes its norm in float32 (before, every such
  step was skipped). Without noise or clipping the step is optax's on jax.grad."""
  low = dict(dtype=jnp.float16, param_dtype=jnp.float16)
  model = nn.Sequential([nn.Dense(8, **low), nn.tanh, nn.Dense(1, **low)])
  x = (30 * jax.random.normal(jax.random.key(1), (BATCH, 3))).astype(jnp.float16)
  y = jnp.full((BATCH, 1), 300.0)
  variables = jax.jit(model.init)(jax.random.key(0), x)
  loss_fn = lambda v, x, y: jnp.mean((model.apply(v, x).astype(jnp.float32) - y) ** 2)
  grads = jax.jit(jax.grad(loss_fn))(variables, x, y)['params']
  # Op by op, so each square is rounded to float16 (a jitted sum may keep them in float32).
  assert not jnp.isfinite(optax.tree.norm(grads))  # in float16
  tx = perturbkit.dp_sgd(loss_fn, optax.sgd(1e-4), clip_norm=1e30, noise_multiplier=0.0)
  state, metrics = jax.jit(tx.step)(tx.init(variables), jax.random.key(0), x, y)
  assert not bool(metrics['skipped']) and int(metrics['dropped']) == 0
  # The SGD step and whether each leaf moved, jitted: one compile, not one per leaf and op.
  want, unmoved = jax.jit(lambda p, g, new: (
      jax.tree.map(lambda p, g: p - 1e-4 * g, p, g),
      jax.tree.map(lambda a, b: jnp.all(a == b), new, p)))(
          variables['params'], grads, state.variables['params'])
  chex.assert_trees_all_equal_dtypes(state.variables['params'], variables['params'])
  chex.assert_trees_all_close(state.variables['params'], want, rtol=0, atol=1e-3)
  assert not jax.tree.all(jax.tree.map(bool, unmoved))


def test_float16_per_example_gradients_above_its_range_are_clipped_not_nan():
  """A float16 model's per-example gradient can exceed float16's range (65504) where the batch
  gradient, a mean over the examples, does not: the direct rule's per-example gradients are
  kept in float32 for the clipped sum (they were stored in float16, turned inf, and made the
  clipped sum NaN though every norm was finite). Against a float32 twin's clipped sum."""
  low = dict(dtype=jnp.float16, param_dtype=jnp.float16)
  model = nn.Sequential([nn.Dense(4, **low), nn.Dense(1, **low)])
  x = jax.random.normal(jax.random.key(1), (8, 3)).at[0].set(600.0)
  y = jnp.zeros((8, 1)).at[0].set(-400.0)
  variables = jax.jit(model.init)(jax.random.key(0), x.astype(jnp.float16))
  loss_fn = lambda v, x, y: jnp.mean((model.apply(v, x).astype(jnp.float32) - y) ** 2)
  grads, metrics = jax.jit(perturbkit.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=0.0,
                                                   dense_method='direct'))(
      variables, jax.random.key(0), x.astype(jnp.float16), y)
  assert int(metrics['dropped']) == 0
  wide = nn.Sequential([nn.Dense(4), nn.Dense(1)])
  twin = jax.tree.map(lambda a: a.astype(jnp.float32), variables)
  per_example = per_example_grads(lambda v, x, y: jnp.mean((wide.apply(v, x) - y) ** 2),
                                  twin, x, y)
  assert jnp.max(jnp.abs(per_example['layers_1']['kernel'][0])) > 65504
  want = jax.tree.map(lambda g: g / 8, clipped_sum(per_example, jnp.ones(8, bool), 1.0))
  chex.assert_trees_all_equal_dtypes(grads, variables['params'])
  chex.assert_trees_all_close(jax.tree.map(lambda g: g.astype(jnp.float32), grads), want,
                              rtol=1e-2, atol=1e-3)
