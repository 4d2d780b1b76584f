"""perturbkit.nnx.interleaved against nnx.Optimizer, a hand-coded per-layer backward and Linen;
on the test process's 8 host CPU devices against one device."""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, traverse_util

import hand_lora
import hand_skip_mlp
from hand_skip_mlp import dense, sgd_step
import nnx_models
import perturbkit
from host_devices import sharded_nnx_step, sharded_step

TOL = dict(rtol=2e-5, atol=2e-6)


class SkipMLP(nnx.Module):
  """Three Linear segments; the second one's input also skips past it."""

  def __init__(self, din=3, width=8, dout=1, *, rngs: nnx.Rngs):
    self.dense_0 = nnx.Linear(din, width, rngs=rngs)
    self.dense_1 = nnx.Linear(width, width, rngs=rngs)
    self.dense_2 = nnx.Linear(width, dout, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.dense_0(x))
    h2 = nnx.relu(self.dense_1(h)) + h
    return self.dense_2(h2)


def mse(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def batch(n=16, din=3, dout=1):
  x = jax.random.normal(jax.random.key(1), (n, din))
  return x, jnp.sin(x[:, :dout])


def params_of(model):
  return nnx_models.pure(nnx.state(model, nnx.Param))


def test_updated_matches_hand_coded_backward():
  model, lr = SkipMLP(rngs=nnx.Rngs(0)), 0.1
  x, y = batch()
  p = params_of(model)
  (w0, w1, w2), (g_z0, g_z1, g_out), (dw0, dw1, dw2) = hand_skip_mlp.updated_step(
      p['dense_0'], p['dense_1'], p['dense_2'], x, y, lr)

  tx = perturbkit.nnx.interleaved(mse, optax.sgd(lr))
  assert tx.segments(model, x, y).segments == ('dense_0', 'dense_1', 'dense_2')
  state, metrics = jax.jit(tx.step)(tx.init(model, x, y), x, y)
  chex.assert_trees_all_close(nnx_models.pure(state.variables),
                              {'dense_0': w0, 'dense_1': w1, 'dense_2': w2}, **TOL)
  for name, g in [('dense_2', g_out), ('dense_1', g_z1), ('dense_0', g_z0)]:
    np.testing.assert_allclose(metrics['activation_grad_norm'][name], jnp.linalg.norm(g), **TOL)
  for name, g in [('dense_2', dw2), ('dense_1', dw1), ('dense_0', dw0)]:
    np.testing.assert_allclose(metrics['grad_norm'][name], optax.tree.norm(g), **TOL)
  # The schedule really differs from a plain step (the comparison is not vacuous).
  plain = sgd_step(p['dense_0'], params_of(nnx.jit(nnx.grad(mse))(model, x, y))['dense_0'], lr)
  assert not np.allclose(plain['kernel'], w0['kernel'], **TOL)


def standard_steps(model, tx, loss_fn, batches):
  """``nnx.value_and_grad`` + ``nnx.Optimizer.update``, the reference for 'original'."""
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, *args):
    loss, grads = nnx.value_and_grad(loss_fn)(model, *args)
    optimizer.update(model, grads)
    return loss

  return [step(model, optimizer, *args) for args in batches]


@nnx.jit
def interleaved_step(model, opt, *args):
  return opt.step(model, *args)


@pytest.mark.parametrize('tx', [
    optax.sgd(0.1), optax.adam(1e-2), optax.chain(optax.clip(0.01), optax.adamw(1e-2))],
    ids=['sgd', 'adam', 'clip-adamw'])
def test_original_equals_nnx_optimizer(tx):
  x, y = batch()
  model, reference = SkipMLP(rngs=nnx.Rngs(0)), SkipMLP(rngs=nnx.Rngs(0))
  opt = perturbkit.nnx.InterleavedOptimizer(model, tx, mse, x, y, propagate='original')
  losses = [interleaved_step(model, opt, x, y)['loss'] for _ in range(3)]
  expected = standard_steps(reference, tx, mse, [(x, y)] * 3)
  chex.assert_trees_all_close(params_of(model), params_of(reference), **TOL)
  chex.assert_trees_all_close(losses, expected, **TOL)
  assert int(opt.step_count[...]) == 3


def cnn_loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def test_batchnorm_and_dropout_original_equals_nnx_optimizer():
  """Batch statistics and the dropout stream's RNG count move as in the plain step."""
  x = jax.random.normal(jax.random.key(1), (4, 6, 6, 1))
  y = jax.random.normal(jax.random.key(2), (4, 3))
  model, reference = nnx_models.CNN(rngs=nnx.Rngs(0)), nnx_models.CNN(rngs=nnx.Rngs(0))
  tx = optax.sgd(0.1)
  opt = perturbkit.nnx.InterleavedOptimizer(model, tx, cnn_loss, x, y, propagate='original')
  assert opt.segments(model, x, y).segments == ('conv', 'norm', 'head')
  for _ in range(2):
    interleaved_step(model, opt, x, y)
  standard_steps(reference, tx, cnn_loss, [(x, y)] * 2)
  chex.assert_trees_all_close(nnx_models.pure(nnx.state(model)),
                              nnx_models.pure(nnx.state(reference)), **TOL)
  assert int(model.dropout.rngs.count[...]) == 2


def test_dropout_inside_a_segment_uses_one_mask_for_all_replays():
  """'updated' with a Block holding Dropout: the replays in the backward pass reuse the mask."""

  class DropBlock(nnx.Module):
    def __init__(self, rngs):
      self.dense = nnx.Linear(3, 8, rngs=rngs)
      self.dropout = nnx.Dropout(0.5, rngs=rngs)
      self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
      return self.out(self.dropout(nnx.relu(self.dense(x))))

  class DropNet(nnx.Module):
    def __init__(self, rngs):
      self.first = nnx.Linear(3, 3, rngs=rngs)
      self.block = DropBlock(rngs)

    def __call__(self, x):
      return self.block(self.first(x))

  x, y = batch(dout=3)
  model, lr = DropNet(nnx.Rngs(0)), 0.1
  p = params_of(model)
  key = model.block.dropout.rngs()  # the key the step's dropout will draw (count 0)
  model.block.dropout.rngs.count[...] = 0

  @jax.jit  # the hand-coded backward, one compile
  def by_hand(p, key):
    mask = jax.random.bernoulli(key, 0.5, (16, 8)) / 0.5
    block = lambda w, a: dense(w['out'], mask * jax.nn.relu(dense(w['dense'], a)))
    a = dense(p['first'], x)
    out = block(p['block'], a)
    g_out = 2 * (out - y) / out.size
    dw = jax.vjp(block, p['block'], a)[1](g_out)[0]
    w_block = sgd_step(p['block'], dw, lr)
    g_a = jax.vjp(lambda a: block(w_block, a), a)[1](g_out)[0]
    return sgd_step(p['first'], jax.vjp(dense, p['first'], x)[1](g_a)[0], lr), w_block

  w_first, w_block = by_hand(p, key)

  tx = perturbkit.nnx.interleaved(mse, optax.sgd(lr), segments=perturbkit.nnx.filters.by_path(
      'first', 'block'))
  state, _ = jax.jit(tx.step)(tx.init(model, x, y), x, y)
  got = nnx_models.pure(nnx.state(state.model(), nnx.Param))
  chex.assert_trees_all_close(got, {'first': w_first, 'block': w_block}, **TOL)


class RngsBlock(nnx.Module):
  """A Linear and a Dropout drawing from the ``nnx.Rngs`` the loss passes in."""

  def __init__(self, din, dout, rngs):
    self.dense = nnx.Linear(din, dout, rngs=rngs)
    self.dropout = nnx.Dropout(0.5)

  def __call__(self, x, rngs):
    return self.dropout(nnx.relu(self.dense(x)), rngs=rngs)


class RngsNet(nnx.Module):
  def __init__(self, rngs):
    self.first = RngsBlock(3, 8, rngs)
    self.second = RngsBlock(8, 8, rngs)
    self.head = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x, rngs):
    return self.head(self.second(self.first(x, rngs), rngs))


def rngs_mse(model, x, y, rngs):
  return jnp.mean((model(x, rngs) - y) ** 2)


@pytest.mark.parametrize('segments', [None, 1], ids=['layer-wise', 'blocks'])
def test_an_nnx_rngs_argument_of_the_loss_draws_as_in_the_plain_step(segments):
  """Segments drawing dropout from an ``nnx.Rngs`` argument: each call draws the key it
  draws in ``nnx.grad`` (the blocks' second call the next one, not the first again), and
  the argument moves on from step to step as under ``nnx.value_and_grad``."""
  x, y = batch()
  model, reference = RngsNet(nnx.Rngs(0)), RngsNet(nnx.Rngs(0))
  rngs, reference_rngs = nnx.Rngs(dropout=3), nnx.Rngs(dropout=3)
  opt = perturbkit.nnx.InterleavedOptimizer(model, optax.sgd(0.1), rngs_mse, x, y, rngs,
                                            segments=segments, propagate='original')
  for _ in range(2):
    interleaved_step(model, opt, x, y, rngs)
  standard_steps(reference, optax.sgd(0.1), rngs_mse, [(x, y, reference_rngs)] * 2)
  assert int(rngs.dropout.count[...]) == int(reference_rngs.dropout.count[...]) == 4
  chex.assert_trees_all_close(params_of(model), params_of(reference), **TOL)


def per_segment_adam(name):
  # The attention key's bias has a gradient of exactly zero (softmax over keys is invariant
  # to it), computed as rounding noise; adam's default eps (1e-8) would turn noise of 1e-9
  # into a full step of the learning rate, different in each front end's rounding. With
  # eps 1e-4 such noise moves a param by under 1e-6; both front ends get the same optimizer.
  return optax.adam(1e-2 if name.startswith('attention') else 3e-3, eps=1e-4)


TWINS = {
    # dense_1 is called twice: both front ends leave it to REST, for the same reason.
    'mlp': (lambda: nnx_models.MLP(rngs=nnx.Rngs(0)), nnx_models.LinenMLP, (8, 3), (8, 2),
            optax.adam(1e-2), {}, ('dense_0', 'dense_2')),
    # Attention projections are segments inside the attention call; per-segment learning
    # rates and the global-norm clip (previous step's norm) go through the same core.
    'transformer': (lambda: nnx_models.TransformerBlock(rngs=nnx.Rngs(0)),
                    nnx_models.LinenTransformerBlock, (2, 5, 8), (2, 5, 8), per_segment_adam,
                    {'clip_global_norm': 0.05},
                    ('norm_0', 'attention/query', 'attention/key', 'attention/value',
                     'attention/out', 'norm_1', 'dense_0', 'dense_1')),
}


@pytest.mark.parametrize('twin', list(TWINS))
def test_linen_twin_gives_identical_steps(twin):
  make, linen_cls, x_shape, y_shape, optimizer, options, segments = TWINS[twin]
  x = jax.random.normal(jax.random.key(1), x_shape)
  y = jax.random.normal(jax.random.key(2), y_shape)
  linen_model = linen_cls()
  linen_loss = lambda v, x, y: jnp.mean((linen_model.apply(v, x) - y) ** 2)
  for propagate in ('updated', 'original'):
    model = make()
    variables = nnx_models.linen_variables(model)
    nnx_tx = perturbkit.nnx.interleaved(mse, optimizer, propagate=propagate, **options)
    linen_tx = perturbkit.interleaved(linen_loss, optimizer, propagate=propagate, **options)
    seg_nnx, seg_linen = nnx_tx.segments(model, x, y), linen_tx.segments(variables, x, y)
    assert seg_nnx == seg_linen and seg_nnx.segments == segments, (seg_nnx, seg_linen)
    s_nnx, s_linen = nnx_tx.init(model, x, y), linen_tx.init(variables, x, y)
    for _ in range(2):
      s_nnx, m_nnx = jax.jit(nnx_tx.step)(s_nnx, x, y)
      s_linen, m_linen = jax.jit(linen_tx.step)(s_linen, x, y)
      chex.assert_trees_all_close(m_nnx, m_linen, **TOL)
      # The clip is active: the norm it scales by exceeds the bound.
      assert float(s_nnx.grad_norm) > options.get('clip_global_norm', 0.0)
    both = [traverse_util.flatten_dict(nnx_models.pure(nnx.state(s_nnx.model(), nnx.Param))),
            traverse_util.flatten_dict(s_linen.params)]
    if twin == 'transformer':
      # The key bias cancels in the softmax: its gradient is 0 up to rounding, so after two
      # steps it holds rounding noise (about 1e-6, different on other CPUs), not a value
      # the two front ends must share.
      for params in both:
        bias = params.pop(('attention', 'key', 'bias'))
        assert float(jnp.abs(bias).max()) < 2e-5, bias
    chex.assert_trees_all_close(*both, **TOL)


def test_a_step_on_inits_input_types_traces_the_loss_once():
  """The segments chosen at init are not checked again on inputs of the same types: a step
  traces the loss once, as ``nnx.value_and_grad`` does, for the functional trainer (under
  ``jax.jit``) and the optimizer (eagerly, where each step is traced). Another batch size
  is checked again."""
  x, y = batch()
  count = [0]

  def loss_fn(model, x, y):
    count[0] += 1
    return mse(model, x, y)

  def traces(fn, *args):
    count[0] = 0
    fn(*args)
    return count[0]

  model = SkipMLP(rngs=nnx.Rngs(0))
  assert traces(nnx.value_and_grad(loss_fn), model, x, y) == 1
  tx = perturbkit.nnx.interleaved(loss_fn, optax.sgd(0.1))
  state = tx.init(model, x, y)
  assert traces(jax.jit(tx.step).trace, state, x, y) == 1
  other = batch(n=8)
  assert traces(jax.jit(tx.step).trace, state, *other) > 1
  assert traces(jax.jit(lambda *a: tx.step(*a)).trace, state, *other) == 1
  opt = perturbkit.nnx.InterleavedOptimizer(model, optax.sgd(0.1), loss_fn, x, y)
  assert traces(opt.step, model, x, y) == traces(opt.step, model, x, y) == 1


def test_one_trace_and_the_graphdef_is_unchanged():
  x, y = batch()
  model = SkipMLP(rngs=nnx.Rngs(0))
  graphdef = nnx.graphdef(model)
  opt = perturbkit.nnx.InterleavedOptimizer(model, optax.adam(1e-2), mse, x, y)
  opt_graphdef = nnx.graphdef(opt)
  traces = []

  @nnx.jit
  def step(model, opt, x, y):
    traces.append(1)
    return opt.step(model, x, y)

  losses = [float(step(model, opt, x, y)['loss']) for _ in range(3)]
  assert len(traces) == 1 and losses[2] < losses[0]
  assert nnx.graphdef(model) == graphdef and nnx.graphdef(opt) == opt_graphdef

  # An exception in the loss during a step leaves the model and the optimizer as they were.
  fail = {'now': False}

  def flaky(model, x, y):
    if fail['now']:
      model(x)
      raise RuntimeError('boom')
    return mse(model, x, y)

  flaky_opt = perturbkit.nnx.InterleavedOptimizer(model, optax.sgd(0.1), flaky, x, y)
  before = nnx_models.pure(nnx.state(model))
  fail['now'] = True
  with pytest.raises(RuntimeError, match='boom'):
    nnx.jit(lambda model, opt, x, y: opt.step(model, x, y))(model, flaky_opt, x, y)
  with pytest.raises(RuntimeError, match='boom'):
    flaky_opt.step(model, x, y)
  assert nnx.graphdef(model) == graphdef
  assert all(vars(type(m)).get('_perturbkit_instrumented') is None
             for _, m in nnx.iter_modules(model))
  chex.assert_trees_all_equal(nnx_models.pure(nnx.state(model)), before)
  assert int(flaky_opt.step_count[...]) == 0


class Tied(nnx.Module):
  """An embedding whose matrix is read again as the output head."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(5, 4, rngs=rngs)
    self.dense = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, tokens):
    return self.embed.attend(self.dense(self.embed(tokens)))


def test_segments_shared_tied_and_scanned_go_to_rest_or_raise():
  x, y = batch(n=4, din=3, dout=2)
  mlp = nnx_models.MLP(rngs=nnx.Rngs(0))
  seg = perturbkit.nnx.interleaved(mse, optax.sgd(0.1)).segments(mlp, x, y)
  assert seg.segments == ('dense_0', 'dense_2') and 'called 2 times' in seg.rest['dense_1']
  with pytest.raises(perturbkit.SharedSegmentError, match='dense_1'):
    perturbkit.nnx.interleaved(mse, optax.sgd(0.1), segments=perturbkit.nnx.filters.by_path(
        'dense_1')).init(mlp, x, y)

  tokens = jnp.array([[0, 1, 2], [3, 4, 0]])
  tied = Tied(nnx.Rngs(0))
  tied_loss = lambda model, t: jnp.mean(model(t) ** 2)
  seg = perturbkit.nnx.interleaved(tied_loss, optax.sgd(0.1)).segments(tied, tokens)
  assert seg.segments == ('dense',) and 'embed' in seg.rest, seg
  with pytest.raises(perturbkit.SharedSegmentError, match='embed'):
    perturbkit.nnx.interleaved(tied_loss, optax.sgd(0.1), segments=1).init(tied, tokens)

  # Inside nnx.remat the call is a copy with the params whole: REST, or refused when chosen.
  remat = nnx_models.RematMLP(rngs=nnx.Rngs(0))
  xs = jax.random.normal(jax.random.key(3), (4, 4))
  seg = perturbkit.nnx.interleaved(nnx_models.mse, optax.sgd(0.1)).segments(remat, xs)
  assert seg.segments == ('head',) and 'NNX transform' in seg.rest['block/linear'], seg
  with pytest.raises(perturbkit.nnx.SegmentInTransformError, match='block'):
    perturbkit.nnx.interleaved(nnx_models.mse, optax.sgd(0.1),
                               segments=perturbkit.nnx.filters.by_path('block')).init(remat, xs)
  # REST params (the blocks inside remat) still get their ordinary step.
  tx = perturbkit.nnx.interleaved(nnx_models.mse, optax.sgd(0.1), propagate='original')
  state, _ = jax.jit(tx.step)(tx.init(remat, xs), xs)
  reference = nnx_models.RematMLP(rngs=nnx.Rngs(0))
  standard_steps(reference, optax.sgd(0.1), nnx_models.mse, [(xs,)])
  chex.assert_trees_all_close(nnx_models.pure(nnx.state(state.model(), nnx.Param)),
                              params_of(reference), **TOL)


def test_optimizer_state_of_another_model_is_rejected():
  x, y = batch(n=4, din=3, dout=2)
  tx = perturbkit.nnx.interleaved(mse, optax.adam(1e-2))
  state = tx.init(nnx_models.MLP(rngs=nnx.Rngs(0)), x, y)
  other = tx.init(nnx_models.MLP(width=5, rngs=nnx.Rngs(0)), x, y)
  with pytest.raises(perturbkit.OptimizerStateError, match='dense_0'):
    tx.step(state._replace(opt_state=other.opt_state), x, y)


def test_nonfinite_segment_is_skipped():
  x, y = batch()
  model = SkipMLP(rngs=nnx.Rngs(0))
  before = params_of(model)
  bad_y = y.at[0, 0].set(jnp.nan)
  tx = perturbkit.nnx.interleaved(mse, optax.sgd(0.1))
  state, metrics = jax.jit(tx.step)(tx.init(model, x, y), x, bad_y)
  assert bool(metrics['skipped']) and bool(metrics['segment_skipped']['dense_2'])
  chex.assert_trees_all_equal(nnx_models.pure(nnx.state(state.model(), nnx.Param)), before)


def wide_problem():
  """A SkipMLP 5 -> 16 -> 16 -> 2, a batch of 64 with random targets, and the mean squared
  error."""
  x = jax.random.normal(jax.random.key(1), (64, 5))
  y = jax.random.normal(jax.random.key(2), (64, 2))
  return lambda: SkipMLP(5, 16, 2, rngs=nnx.Rngs(0)), x, y, mse


def test_shard_map_on_8_devices_equals_one_device():
  """The functional step under ``jax.shard_map`` on 8 devices, ``axis_name='data'``, equals
  one device on the whole batch for three steps, with either schedule; the schedules differ."""
  make, x, y, loss_fn = wide_problem()
  results = {}
  for propagate in ('updated', 'original'):
    model = make()
    single = perturbkit.nnx.interleaved(loss_fn, optax.adam(1e-2), propagate=propagate)
    parallel = perturbkit.nnx.interleaved(loss_fn, optax.adam(1e-2), propagate=propagate,
                                          axis_name='data')
    step = sharded_step(parallel.step)
    s1, s8 = single.init(model, x, y), parallel.init(model, x, y)
    for _ in range(3):
      s1, m1 = jax.jit(single.step)(s1, x, y)
      s8, m8 = step(s8, x, y)
    p1 = nnx.to_pure_dict(nnx.state(s1.model(), nnx.Param))
    p8 = nnx.to_pure_dict(nnx.state(s8.model(), nnx.Param))
    chex.assert_trees_all_close(p8, p1, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(m8['loss'], m1['loss'], rtol=1e-5, atol=1e-6)
    results[propagate] = float(jnp.abs(p8['dense_0']['kernel']).sum())
  assert results['updated'] != results['original'], results


def test_stateful_optimizer_on_8_devices_equals_one_device():
  """``InterleavedOptimizer.step`` under ``nnx.shard_map`` inside ``nnx.jit`` on 8 devices
  equals one device: the whole model state and the loss after two steps, and the count."""
  make, x, y, loss_fn = wide_problem()
  m1, m8 = make(), make()
  o1 = perturbkit.nnx.InterleavedOptimizer(m1, optax.adam(1e-2), loss_fn, x, y)
  o8 = perturbkit.nnx.InterleavedOptimizer(m8, optax.adam(1e-2), loss_fn, x, y,
                                           axis_name='data')
  step1 = nnx.jit(lambda m, o, x, y: o.step(m, x, y))
  step8 = sharded_nnx_step(lambda m, o, x, y: o.step(m, x, y))
  for _ in range(2):
    l1, l8 = step1(m1, o1, x, y)['loss'], step8(m8, o8, x, y)['loss']
  chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(m8)), nnx.to_pure_dict(nnx.state(m1)),
                              rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(l8, l1, rtol=1e-5, atol=1e-6)
  assert int(o8.step_count[...]) == 2


class Outer(nnx.Module):
  """ScanMLP as a submodule: with ``segments=1`` its call takes the scanned blocks whole."""

  def __init__(self, rngs):
    self.first = nnx.Linear(4, 4, rngs=rngs)
    self.inner = nnx_models.ScanMLP(rngs=rngs)

  def __call__(self, x):
    return self.inner(jnp.tanh(self.first(x)))


@pytest.mark.parametrize('segments, chosen, iterations', [
    (None, ('first', 'inner/blocks/linear', 'inner/head'), {'inner/blocks/linear': 3}),
    (1, ('first', 'inner'), {})], ids=['layers', 'depth_1'])
def test_scanned_blocks_inside_a_submodule_original_equals_standard_steps(segments, chosen,
                                                                           iterations):
  """Layer-wise, each iteration of the scanned Linear is a segment; at depth 1 the call of the
  module that runs the scan takes the blocks whole."""
  xs = jax.random.normal(jax.random.key(3), (4, 4))
  model, reference = Outer(nnx.Rngs(0)), Outer(nnx.Rngs(0))
  tx = perturbkit.nnx.interleaved(nnx_models.mse, optax.adam(1e-2), propagate='original',
                                  segments=segments)
  listing = tx.segments(model, xs)
  assert listing.segments == chosen and dict(listing.iterations) == iterations
  state = tx.init(model, xs)
  for _ in range(2):
    state, _ = jax.jit(tx.step)(state, xs)
  standard_steps(reference, optax.adam(1e-2), nnx_models.mse, [(xs,)] * 2)
  chex.assert_trees_all_close(nnx_models.pure(nnx.state(state.model(), nnx.Param)),
                              params_of(reference), **TOL)


class LoRANet(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.LoRALinear(3, 8, lora_rank=2, rngs=rngs)
    self.b = nnx.LoRALinear(8, 1, lora_rank=2, rngs=rngs)

  def __call__(self, x):
    return self.b(nnx.relu(self.a(x)))


def test_wrt_lora_params_equals_nnx_optimizer_with_the_same_wrt():
  """Only the LoRA adapters train: they are the segments, the frozen kernels stay put."""
  x, y = batch()
  model, reference = LoRANet(nnx.Rngs(0)), LoRANet(nnx.Rngs(0))
  tx = perturbkit.nnx.interleaved(mse, optax.adam(1e-2), wrt=nnx.LoRAParam,
                                  propagate='original')
  assert tx.segments(model, x, y).segments == ('a/lora', 'b/lora')
  state = tx.init(model, x, y)
  for _ in range(2):
    state, _ = jax.jit(tx.step)(state, x, y)
  optimizer = nnx.Optimizer(reference, optax.adam(1e-2), wrt=nnx.LoRAParam)

  @nnx.jit
  def step(model, optimizer, x, y):
    optimizer.update(model, nnx.grad(mse, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, x, y))

  for _ in range(2):
    step(reference, optimizer, x, y)
  chex.assert_trees_all_close(nnx_models.pure(state.variables),
                              nnx_models.pure(nnx.state(reference)), **TOL)
  frozen = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
  chex.assert_trees_all_equal(nnx_models.pure(nnx.state(state.model(), frozen)),
                              nnx_models.pure(nnx.state(model, frozen)))


def test_hooks_on_segments_equal_with_hooks_and_nnx_grad():
  """A hook on a segment's output changes its own gradient and everything below it."""
  x, y = batch()
  hooks = [perturbkit.backward_hook(lambda g: 0.3 * g, perturbkit.nnx.filters.by_path('dense_1')),
           perturbkit.backward_hook(lambda g: jnp.clip(g, -0.01, 0.01),
                                    perturbkit.nnx.filters.by_path('dense_2'))]
  model, reference = SkipMLP(rngs=nnx.Rngs(0)), SkipMLP(rngs=nnx.Rngs(0))
  tx = perturbkit.nnx.interleaved(mse, optax.sgd(0.1), propagate='original', hooks=hooks)
  state, _ = jax.jit(tx.step)(tx.init(model, x, y), x, y)
  grads = nnx.grad(perturbkit.nnx.with_hooks(mse, *hooks))(reference, x, y)
  expected = sgd_step(params_of(reference), nnx_models.pure(grads), 0.1)
  got = nnx_models.pure(nnx.state(state.model(), nnx.Param))
  chex.assert_trees_all_close(got, expected, **TOL)
  plain = sgd_step(params_of(reference), nnx_models.pure(nnx.grad(mse)(reference, x, y)), 0.1)
  assert not np.allclose(got['dense_0']['kernel'], plain['dense_0']['kernel'], **TOL)
  assert not np.allclose(got['dense_1']['kernel'], plain['dense_1']['kernel'], **TOL)


class Pair(nnx.Module):
  """Two Linear layers called inside one module: a segment with calls nested in it."""

  def __init__(self, rngs: nnx.Rngs):
    self.inner_0 = nnx.Linear(8, 8, rngs=rngs)
    self.inner_1 = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return self.inner_1(jnp.tanh(self.inner_0(x)))


class PairNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.dense_in = nnx.Linear(3, 8, rngs=rngs)
    self.pair = Pair(rngs)
    self.head = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.pair(jnp.tanh(self.dense_in(x)))))


def affine_grad(g):
  return 3.0 * g + 0.01


@jax.custom_vjp
def with_affine_grad(x):
  return x


with_affine_grad.defvjp(lambda x: (x, None), lambda _, g: (affine_grad(g),))


def sgd_on_jax_grad(loss_fn, model, x, y, lr):
  """The params after one sgd step on ``jax.grad`` of ``loss_fn`` over the split params."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  grads = jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), x, y))(params)
  return sgd_step(params_of(model), nnx_models.pure(grads), lr)


def one_step(tx, model, x, y):
  """The params after one jitted step of ``tx`` from ``model``."""
  state, _ = jax.jit(tx.step)(tx.init(model, x, y), x, y)
  return nnx_models.pure(nnx.state(state.model(), nnx.Param))


def test_with_hooks_inside_the_loss_reach_segments_innermost_first():
  """Two with_hooks blocks inside the loss on one segment call: applied as jax.grad applies them."""
  x, y = batch()
  on_dense_1 = perturbkit.nnx.filters.by_path('dense_1')
  plus = perturbkit.backward_hook(lambda g: g + 1.0, on_dense_1)
  times = perturbkit.backward_hook(lambda g: 3.0 * g, on_dense_1)
  hooked = perturbkit.nnx.with_hooks(perturbkit.nnx.with_hooks(mse, plus), times)
  model, reference = SkipMLP(rngs=nnx.Rngs(0)), SkipMLP(rngs=nnx.Rngs(0))
  tx = perturbkit.nnx.interleaved(hooked, optax.sgd(0.1), propagate='original')
  assert tx.segments(model, x, y).segments == ('dense_0', 'dense_1', 'dense_2')
  expected = sgd_on_jax_grad(hooked, reference, x, y, 0.1)
  chex.assert_trees_all_close(one_step(tx, model, x, y), expected, **TOL)
  # The other order gives other gradients below dense_1: the test can tell them apart.
  swapped = perturbkit.nnx.with_hooks(perturbkit.nnx.with_hooks(mse, times), plus)
  other = sgd_on_jax_grad(swapped, reference, x, y, 0.1)
  assert not np.allclose(other['dense_0']['kernel'], expected['dense_0']['kernel'], **TOL)


@pytest.mark.parametrize('where', ['with_hooks', 'hooks='])
def test_hooks_on_calls_inside_a_segment_equal_jax_grad_of_the_hooked_loss(where):
  """propagate='original': a hook on a call nested inside a segment acts in its replay."""
  x, y = batch()
  hook = perturbkit.backward_hook(affine_grad, perturbkit.nnx.filters.by_path('pair/inner_0'))
  hooked = perturbkit.nnx.with_hooks(mse, hook)
  loss_fn, hooks = (hooked, ()) if where == 'with_hooks' else (mse, (hook,))
  model, reference = PairNet(nnx.Rngs(0)), PairNet(nnx.Rngs(0))
  tx = perturbkit.nnx.interleaved(loss_fn, optax.sgd(0.1), segments=1, propagate='original',
                                  hooks=hooks)
  assert tx.segments(model, x, y).segments == ('dense_in', 'pair', 'head')
  got = one_step(tx, model, x, y)
  chex.assert_trees_all_close(got, sgd_on_jax_grad(hooked, reference, x, y, 0.1), **TOL)
  plain = sgd_on_jax_grad(mse, reference, x, y, 0.1)
  assert not np.allclose(got['dense_in']['kernel'], plain['dense_in']['kernel'], **TOL)


def pair_with_hook(w, a):
  return dense(w['inner_1'], jnp.tanh(with_affine_grad(dense(w['inner_0'], a))))


@jax.jit  # one compile, shared by the two cases below
def pair_net_updated_step(p, x, y, lr):
  """PairNet's 'updated' sgd step with the hook in the pair, by hand: (dense_in, pair, head)."""
  h0 = jnp.tanh(dense(p['dense_in'], x))
  h1 = pair_with_hook(p['pair'], h0)
  t1 = jnp.tanh(h1)
  out = dense(p['head'], t1)
  g_out = 2 * (out - y) / out.size
  dw_head = jax.vjp(dense, p['head'], t1)[1](g_out)[0]
  w_head = sgd_step(p['head'], dw_head, lr)
  g_h1 = jax.vjp(lambda a: dense(w_head, a), t1)[1](g_out)[0] * (1 - t1 ** 2)
  dw_pair = jax.vjp(pair_with_hook, p['pair'], h0)[1](g_h1)[0]
  w_pair = sgd_step(p['pair'], dw_pair, lr)
  g_h0 = jax.vjp(lambda a: pair_with_hook(w_pair, a), h0)[1](g_h1)[0]
  dw_in = jax.vjp(dense, p['dense_in'], x)[1](g_h0 * (1 - h0 ** 2))[0]
  return sgd_step(p['dense_in'], dw_in, lr), w_pair, w_head


@pytest.mark.parametrize('where', ['with_hooks', 'hooks='])
def test_hooks_on_calls_inside_a_segment_updated_match_hand_coded_backward(where):
  """propagate='updated': the hook acts in the segment's dw and in its replay at the new weights."""
  model, lr = PairNet(nnx.Rngs(0)), 0.1
  x, y = batch()
  w_in, w_pair, w_head = pair_net_updated_step(params_of(model), x, y, lr)

  hook = perturbkit.backward_hook(affine_grad, perturbkit.nnx.filters.by_path('pair/inner_0'))
  loss_fn, hooks = ((perturbkit.nnx.with_hooks(mse, hook), ()) if where == 'with_hooks'
                    else (mse, (hook,)))
  tx = perturbkit.nnx.interleaved(loss_fn, optax.sgd(lr), segments=1, hooks=hooks)
  chex.assert_trees_all_close(one_step(tx, model, x, y),
                              {'dense_in': w_in, 'pair': w_pair, 'head': w_head}, **TOL)


def lead(b, ndim):
  """``b`` with leading axes of size 1 up to ``ndim`` (rank promotion is an error here)."""
  return b.reshape((1,) * (ndim - b.ndim) + b.shape)


def sequence_dense(p, x):
  return x @ p['kernel'] + lead(p['bias'], x.ndim)


def layer_norm(p, x, eps=1e-6):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + eps) * lead(p['scale'], x.ndim) + lead(p['bias'], x.ndim)


def heads_in(p, x):
  return jnp.einsum('btd,dhk->bthk', x, p['kernel']) + lead(p['bias'], 4)


def heads_out(p, a):
  return jnp.einsum('bthk,hkd->btd', a, p['kernel']) + lead(p['bias'], 3)


def attend(q, k, v):
  logits = jnp.einsum('bqhk,bshk->bhqs', q / jnp.sqrt(q.shape[-1]), k)
  return jnp.einsum('bhqs,bshk->bqhk', jax.nn.softmax(logits, axis=-1), v)


def transformer_updated_step(p, x, y, lr):
  """One interleaved sgd step of TransformerBlock, walking back one segment at a time."""
  def segment(fn, w, inp, g):
    """dw at the old weights, the sgd step, the input cotangent at the new weights."""
    dw = jax.vjp(fn, w, inp)[1](g)[0]
    new = sgd_step(w, dw, lr)
    return new, jax.vjp(lambda a: fn(new, a), inp)[1](g)[0]

  att = p['attention']
  h0 = layer_norm(p['norm_0'], x)
  q, k, v = (heads_in(att[n], h0) for n in ('query', 'key', 'value'))
  a = attend(q, k, v)
  x1 = x + heads_out(att['out'], a)
  h1 = layer_norm(p['norm_1'], x1)
  z = sequence_dense(p['dense_0'], h1)
  u = jax.nn.gelu(z)
  out = x1 + sequence_dense(p['dense_1'], u)
  g_out = 2 * (out - y) / out.size
  new = {'attention': {}}
  new['dense_1'], g_u = segment(sequence_dense, p['dense_1'], u, g_out)
  g_z = jax.vjp(jax.nn.gelu, z)[1](g_u)[0]
  new['dense_0'], g_h1 = segment(sequence_dense, p['dense_0'], h1, g_z)
  new['norm_1'], g_x1 = segment(layer_norm, p['norm_1'], x1, g_h1)
  g_x1 = g_x1 + g_out  # the residual around the MLP
  new['attention']['out'], g_a = segment(heads_out, att['out'], a, g_x1)
  g_qkv = jax.vjp(attend, q, k, v)[1](g_a)
  g_h0 = 0
  for name, g in zip(('query', 'key', 'value'), g_qkv):
    new['attention'][name], g_in = segment(heads_in, att[name], h0, g)
    g_h0 = g_h0 + g_in
  new['norm_0'], _ = segment(layer_norm, p['norm_0'], x, g_h0)
  return new


def test_updated_transformer_matches_hand_coded_backward():
  """Attention projections, LayerNorms and the MLP, each updated before the gradient passes it."""
  model, lr = nnx_models.TransformerBlock(rngs=nnx.Rngs(0)), 0.5
  x = jax.random.normal(jax.random.key(1), (2, 5, 8))
  y = jax.random.normal(jax.random.key(2), (2, 5, 8))
  tx = perturbkit.nnx.interleaved(mse, optax.sgd(lr))
  assert tx.segments(model, x, y).segments == (
      'norm_0', 'attention/query', 'attention/key', 'attention/value', 'attention/out',
      'norm_1', 'dense_0', 'dense_1')
  expected = params_of(model)
  state = tx.init(model, x, y)
  for _ in range(2):
    state, _ = jax.jit(tx.step)(state, x, y)
    expected = jax.jit(transformer_updated_step)(expected, x, y, lr)
  got = nnx_models.pure(nnx.state(state.model(), nnx.Param))
  chex.assert_trees_all_close(got, expected, **TOL)
  # 'updated' differs from 'original' here by more than the tolerance.
  original = perturbkit.nnx.interleaved(mse, optax.sgd(lr), propagate='original')
  other, _ = jax.jit(original.step)(original.init(model, x, y), x, y)
  first = jax.jit(transformer_updated_step)(params_of(model), x, y, lr)
  assert not np.allclose(nnx_models.pure(nnx.state(other.model(), nnx.Param))['norm_0']['scale'],
                         first['norm_0']['scale'], rtol=1e-4, atol=1e-5)


class Inner(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.linear(x))


class Containers(nnx.Module):
  """Blocks in an nnx.List, an nnx.Sequential, a head in an nnx.Dict."""

  def __init__(self, rngs: nnx.Rngs):
    self.blocks = nnx.List([Inner(rngs), Inner(rngs)])
    self.mlp = nnx.Sequential(nnx.Linear(4, 4, rngs=rngs), nnx.relu,
                              nnx.Linear(4, 4, rngs=rngs))
    self.heads = nnx.Dict(out=nnx.Linear(4, 1, rngs=rngs))

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return self.heads['out'](self.mlp(x))


class LinenInner(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.tanh(nn.Dense(4, name='linear')(x))


class LinenContainers(nn.Module):
  """The Linen twin: Linen names list and dict items `blocks_0`, `heads_out`."""

  def setup(self):
    self.blocks = [LinenInner(), LinenInner()]
    self.mlp = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(4)])
    self.heads = {'out': nn.Dense(1)}

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return self.heads['out'](self.mlp(x))


@pytest.mark.parametrize('depth, nnx_names, linen_names', [
    (1, ('blocks/0', 'blocks/1', 'mlp', 'heads/out'),
     ('blocks_0', 'blocks_1', 'mlp', 'heads_out')),
    (2, ('blocks/0/linear', 'blocks/1/linear', 'mlp/layers/0', 'mlp/layers/2'),
     ('blocks_0/linear', 'blocks_1/linear', 'mlp/layers_0', 'mlp/layers_2')),
])
def test_int_segments_count_module_levels_as_linen_does(depth, nnx_names, linen_names):
  """nnx.List/nnx.Dict items are one level below their owner, like Linen's `blocks_0`."""
  x, y = batch(din=4)
  model = Containers(nnx.Rngs(0))
  linen_model = LinenContainers()
  variables = linen_model.init(jax.random.key(0), x)
  linen_loss = lambda v, x, y: jnp.mean((linen_model.apply(v, x) - y) ** 2)
  linen_tx = perturbkit.interleaved(linen_loss, optax.sgd(0.1), segments=depth)
  assert linen_tx.segments(variables, x, y).segments == linen_names
  tx = perturbkit.nnx.interleaved(mse, optax.sgd(0.1), segments=depth)
  assert tx.segments(model, x, y).segments == nnx_names
  state, _ = jax.jit(tx.step)(tx.init(model, x, y), x, y)
  assert sorted(state.opt_state) == sorted(nnx_names + (perturbkit.REST,))


def with_scaled_grad(factor: float):
  """The identity whose backward multiplies the cotangent by ``factor``."""
  @jax.custom_vjp
  def scaled(x):
    return x

  scaled.defvjp(lambda x: (x, None), lambda _, g: (factor * g,))
  return scaled


def skip_mlp_scaled_at_dense_1(factor: float):
  """SkipMLP's mse with dense_1's output gradient scaled, written out by hand."""
  scaled = with_scaled_grad(factor)

  def loss_fn(model, x, y):
    h = nnx.relu(model.dense_0(x))
    h2 = nnx.relu(scaled(model.dense_1(h))) + h
    return jnp.mean((model.dense_2(h2) - y) ** 2)

  return loss_fn


def optax_step(loss_fn, model, x, y, optimizer):
  """The params after one nnx.grad + optax update of ``model`` (a copy)."""
  model = nnx.clone(model)
  params = nnx.state(model, nnx.Param)
  grads = nnx.grad(loss_fn)(model, x, y)
  updates, _ = optimizer.update(grads, optimizer.init(params), params)
  return nnx_models.pure(optax.apply_updates(params, updates))


@pytest.mark.parametrize('factor', [0.0, 2.0])
@pytest.mark.parametrize('where', ['with_hooks around mse', 'with_hooks in the loss body',
                                   'hooks='])
def test_hook_on_a_segment_from_inside_the_loss_equals_the_scaled_gradient_step(where, factor):
  """propagate='original' with a hook scaling dense_1's gradient: nnx.grad of a custom_vjp loss."""
  x, y = batch()
  hook = perturbkit.backward_hook(lambda g: factor * g, perturbkit.nnx.filters.by_path('dense_1'))
  loss_fn, hooks = {
      'with_hooks around mse': (perturbkit.nnx.with_hooks(mse, hook), ()),
      'with_hooks in the loss body': (
          lambda model, x, y: perturbkit.nnx.with_hooks(mse, hook)(model, x, y), ()),
      'hooks=': (mse, (hook,)),
  }[where]
  # Not adam: its first step is blind to a gradient's scale.
  model, optimizer = SkipMLP(rngs=nnx.Rngs(0)), optax.sgd(0.1, momentum=0.9)
  tx = perturbkit.nnx.interleaved(loss_fn, optimizer, propagate='original', hooks=hooks)
  assert tx.segments(model, x, y).segments == ('dense_0', 'dense_1', 'dense_2')
  expected = optax_step(skip_mlp_scaled_at_dense_1(factor), model, x, y, optimizer)
  got = one_step(tx, model, x, y)
  chex.assert_trees_all_close(got, expected, **TOL)
  # The hook changes the step of the layers it reaches: the test can tell.
  plain = optax_step(mse, model, x, y, optimizer)
  for name in ('dense_0', 'dense_1'):
    assert not np.allclose(got[name]['kernel'], plain[name]['kernel'], **TOL), name


def linen_path(path) -> tuple[str, ...]:
  """A path in Containers under the Linen twin's names: `blocks/0` -> `blocks_0`."""
  merged: list[str] = []
  for key in path:
    if merged and merged[-1] in ('blocks', 'layers', 'heads'):
      merged[-1] = f'{merged[-1]}_{key}'
    else:
      merged.append(str(key))
  return tuple(merged)


def linen_containers_params(nnx_params: dict) -> dict:
  """Containers' params as the Linen twin's params tree."""
  flat = traverse_util.flatten_dict(nnx_params)
  return traverse_util.unflatten_dict({linen_path(p): v for p, v in flat.items()})


@pytest.mark.parametrize('propagate', ['updated', 'original'])
@pytest.mark.parametrize('depth', [1, 2])
def test_int_segments_in_containers_step_as_the_linen_twin(depth, propagate):
  """The segments nnx.List/nnx.Dict items give at a depth update as the Linen twin's do."""
  x, y = batch(din=4)
  model = Containers(nnx.Rngs(0))
  linen_model = LinenContainers()
  variables = {'params': linen_containers_params(params_of(model))}
  linen_loss = lambda v, x, y: jnp.mean((linen_model.apply(v, x) - y) ** 2)
  # The twin's variables have the structure Linen's init gives.
  assert (jax.tree.structure(variables['params'])
          == jax.tree.structure(linen_model.init(jax.random.key(0), x)['params']))
  optimizer = optax.adam(1e-2)
  linen_tx = perturbkit.interleaved(linen_loss, optimizer, segments=depth, propagate=propagate)
  tx = perturbkit.nnx.interleaved(mse, optimizer, segments=depth, propagate=propagate)
  linen_names = linen_tx.segments(variables, x, y).segments
  names = tx.segments(model, x, y).segments
  assert len(names) == 4
  assert tuple('/'.join(linen_path(n.split('/'))) for n in names) == linen_names
  s_nnx, s_linen = tx.init(model, x, y), linen_tx.init(variables, x, y)
  for _ in range(2):
    s_nnx, _ = jax.jit(tx.step)(s_nnx, x, y)
    s_linen, _ = jax.jit(linen_tx.step)(s_linen, x, y)
  got = linen_containers_params(nnx_models.pure(nnx.state(s_nnx.model(), nnx.Param)))
  chex.assert_trees_all_close(got, s_linen.params, **TOL)
  # Two steps moved every segment.
  moved = jax.tree.map(lambda a, b: not np.allclose(a, b), got, variables['params'])
  assert all(jax.tree.leaves(moved))


def lora_batch():
  return (jax.random.normal(jax.random.key(1), (8, 3)),
          jax.random.normal(jax.random.key(2), (8, 2)))


def test_a_linear_subclass_calling_its_own_method_is_one_segment_original_equals_standard():
  """``LoRALinear.__call__`` calls its own ``base``, which calls ``super().__call__``: part of
  the layer's call, not a second use of its weights. Each layer is a segment, and two
  ``'original'`` adam steps equal ``nnx.value_and_grad`` + ``nnx.Optimizer``."""
  x, y = lora_batch()
  model, reference = nnx_models.LoRANet(rngs=nnx.Rngs(0)), nnx_models.LoRANet(rngs=nnx.Rngs(0))
  opt = perturbkit.nnx.InterleavedOptimizer(model, optax.adam(1e-2), mse, x, y,
                                            propagate='original')
  listing = opt.segments(model, x, y)
  assert (listing.segments, listing.rest) == (('hidden', 'head'), {})
  losses = [interleaved_step(model, opt, x, y)['loss'] for _ in range(2)]
  expected = standard_steps(reference, optax.adam(1e-2), mse, [(x, y)] * 2)
  chex.assert_trees_all_close(params_of(model), params_of(reference), **TOL)
  chex.assert_trees_all_close(losses, expected, **TOL)


def test_a_linear_subclass_calling_its_own_method_updated_matches_hand_coded_backward():
  x, y = lora_batch()
  model = nnx_models.LoRANet(rngs=nnx.Rngs(0))
  expected = jax.jit(hand_lora.updated_sgd_step)(params_of(model), x, y, 0.5)
  interleaved_step(model, perturbkit.nnx.InterleavedOptimizer(model, optax.sgd(0.5), mse, x, y),
                   x, y)
  chex.assert_trees_all_close(params_of(model), expected, **TOL)


class MaskedEncoder(nnx.Module):
  """Owns a mask embedding, read only when ``mask`` is given (as Hugging Face Wav2Vec2's
  ``masked_spec_embed``), around two Linear layers."""

  def __init__(self, rngs: nnx.Rngs):
    self.mask_embed = nnx.Param(jax.random.normal(rngs.params(), (3,)))
    self.dense_0 = nnx.Linear(3, 6, rngs=rngs)
    self.dense_1 = nnx.Linear(6, 4, rngs=rngs)

  def __call__(self, x, mask=None):
    if mask is not None:
      x = jnp.where(mask[..., None], self.mask_embed[...], x)
    return jnp.tanh(self.dense_1(jnp.tanh(self.dense_0(x))))


class MaskedNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.encoder = MaskedEncoder(rngs)
    self.head = nnx.Linear(4, 1, rngs=rngs)

  def __call__(self, x):
    return self.head(self.encoder(x))


def test_params_the_loss_never_reads_leave_the_layers_around_them_segments_of_their_own():
  """A module whose own params the loss never reads was one segment with every layer inside
  it; now those layers are segments, and the unread params go to REST, where weight decay
  updates them as the standard step does."""
  x, y = batch()
  model = MaskedNet(nnx.Rngs(0))
  optimizer = optax.chain(optax.add_decayed_weights(0.5), optax.sgd(0.1))
  tx = perturbkit.nnx.interleaved(mse, optimizer, propagate='original')
  listing = tx.segments(model, x, y)
  assert listing.segments == ('encoder/dense_0', 'encoder/dense_1', 'head'), listing
  assert list(listing.rest) == ['encoder'] and 'does not read' in listing.rest['encoder']
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit  # one compile; nnx.grad run op by op costs more here
  def standard_step(params):
    grads = jax.grad(lambda p: mse(nnx.merge(graphdef, p, rest), x, y))(params)
    return optax.apply_updates(params, optimizer.update(grads, optimizer.init(params), params)[0])

  got = one_step(tx, model, x, y)
  chex.assert_trees_all_close(got, nnx_models.pure(standard_step(params)), **TOL)
  decayed = params_of(model)['encoder']['mask_embed'] * (1 - 0.1 * 0.5)
  chex.assert_trees_all_close(got['encoder']['mask_embed'], decayed, **TOL)


def test_a_loss_calling_the_model_twice_says_what_to_change():
  x, y = lora_batch()
  siamese = lambda model, x, y: jnp.mean((model(x) - model(x[::-1])) ** 2)
  tx = perturbkit.nnx.interleaved(siamese, optax.sgd(0.1))
  with pytest.raises(perturbkit.NoSegmentError, match='concatenated along the batch axis'):
    tx.segments(nnx_models.LoRANet(rngs=nnx.Rngs(0)), x, y)


class _CondBlock(nnx.Module):
  def __init__(self, rngs):
    self.b = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, h, flag):
    return nnx.cond(flag, lambda m, h: m.b(h), lambda m, h: 2 * m.b(-h), self, h)


class _CondModel(nnx.Module):
  """``b`` called in both branches of ``nnx.cond``: on the model itself, or in a block."""

  def __init__(self, block, rngs):
    self.a, self.c = nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 1, rngs=rngs)
    self.blk = _CondBlock(rngs) if block else None
    self.b = None if block else nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x, flag):
    h = self.a(x)
    if self.blk is not None:
      h = self.blk(h, flag)
    else:
      h = nnx.cond(flag, lambda m, h: m.b(h), lambda m, h: 2 * m.b(-h), self, h)
    return jnp.sum(jnp.sin(self.c(h)))


@pytest.mark.parametrize('block', [False, True])
def test_a_module_called_in_the_branches_of_nnx_cond(block):
  """As Linen's ``nn.cond``: the reason and the error name ``nnx.cond``, the block running the
  conditional is a segment, and 'original' equals nnx.Optimizer for either branch."""
  model, reference = _CondModel(block, nnx.Rngs(0)), _CondModel(block, nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 4))
  loss_fn = lambda m, x, flag: m(x, flag)
  tx = optax.sgd(0.3)
  listing = perturbkit.nnx.interleaved(loss_fn, tx).segments(model, x, True)
  inner = 'blk/b' if block else 'b'
  if block:
    assert listing.segments == ('a', 'blk', 'c') and listing.rest == {}
  else:
    assert listing.segments == ('a', 'c') and list(listing.rest) == ['b']
    assert 'inside nnx.cond' in listing.rest['b']
  chosen = perturbkit.nnx.interleaved(loss_fn, tx, segments=perturbkit.nnx.filters.by_path(inner))
  with pytest.raises(perturbkit.SegmentationError, match=f"'{inner}' runs inside nnx.cond"):
    chosen.init(model, x, True)
  opt = perturbkit.nnx.InterleavedOptimizer(model, tx, loss_fn, x, True, propagate='original')
  losses = [interleaved_step(model, opt, x, flag)['loss'] for flag in (True, False)]
  expected = standard_steps(reference, tx, loss_fn, [(x, True), (x, False)])
  chex.assert_trees_all_close(params_of(model), params_of(reference), **TOL)
  chex.assert_trees_all_close(losses, expected, **TOL)


# -- one Variable in two modules that own params of their own ----------------------------------


def _shared_kernel():
  x = jax.random.normal(jax.random.key(1), (6, 4))
  return nnx_models.SharedKernel(rngs=nnx.Rngs(0)), (x, jnp.sin(x[:, :2]))


def _biased_tied_lm():
  tokens = jax.random.randint(jax.random.key(2), (4, 5), 0, 7)
  return nnx_models.BiasedTiedLM(rngs=nnx.Rngs(0)), (tokens,)


def next_token_loss(model, tokens):
  logits = model(tokens[:, :-1])
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))


@pytest.mark.parametrize('make, loss_fn, owner, reader', [
    (_shared_kernel, mse, 'a', 'b'), (_biased_tied_lm, next_token_loss, 'embed', 'head')],
    ids=['shared-kernel', 'biased-tied-head'])
@pytest.mark.parametrize('tx', [optax.sgd(0.1), optax.adam(1e-2)], ids=['sgd', 'adam'])
def test_a_variable_held_by_two_owners_original_equals_nnx_optimizer(make, loss_fn, owner,
                                                                       reader, tx):
  """The module where ``nnx.state`` lists the Variable owns it; the other module's segment
  reads it, so its owner takes the ordinary step (REST), with the reader named."""
  model, args = make()
  reference, _ = make()
  opt = perturbkit.nnx.InterleavedOptimizer(model, tx, loss_fn, *args, propagate='original')
  chosen = opt.segments(model, *args)
  assert reader in chosen.segments and reader in chosen.rest[owner], chosen
  for _ in range(2):
    interleaved_step(model, opt, *args)
  standard_steps(reference, tx, loss_fn, [args] * 2)
  chex.assert_trees_all_close(nnx_models.pure(nnx.state(model)),
                              nnx_models.pure(nnx.state(reference)), **TOL)
  # The owner took a step: the comparison is not vacuous.
  before, _ = make()
  assert not all(np.allclose(a, b) for a, b in zip(
      jax.tree.leaves(params_of(model)[owner]), jax.tree.leaves(params_of(before)[owner])))


def test_a_variable_held_by_two_owners_updated_matches_hand_coded_backward():
  """``b`` holds ``a``'s kernel: its segment steps its bias, the kernel's gradient through ``b``
  flows back to ``a`` (REST) from the input cotangent at ``b``'s new weights."""
  model, (x, y) = _shared_kernel()
  lr = 0.1
  p = params_of(model)
  kernel = p['a']['kernel']

  @jax.jit  # the hand-coded backward, one compile
  def by_hand(p):
    z1 = dense(p['a'], x)
    h1 = jnp.tanh(z1)
    z2 = h1 @ kernel + p['b']['bias'][None]
    h2 = jnp.tanh(z2)
    out = dense(p['head'], h2)
    g_out = 2 * (out - y) / out.size
    dw_head = jax.vjp(dense, p['head'], h2)[1](g_out)[0]
    head = sgd_step(p['head'], dw_head, lr)
    g_z2 = jax.vjp(lambda a: dense(head, a), h2)[1](g_out)[0] * (1 - h2 ** 2)
    b_call = lambda bias, h, k: h @ k + bias[None]
    d_bias_b, g_h1, dk_b = jax.vjp(b_call, p['b']['bias'], h1, kernel)[1](g_z2)
    g_z1 = g_h1 * (1 - h1 ** 2)
    dw_a = jax.vjp(dense, p['a'], x)[1](g_z1)[0]
    dw_a = {'bias': dw_a['bias'], 'kernel': dw_a['kernel'] + dk_b}
    return {'a': sgd_step(p['a'], dw_a, lr), 'b': {'bias': p['b']['bias'] - lr * d_bias_b},
            'head': head}, jnp.linalg.norm(d_bias_b)

  want, d_bias_b_norm = by_hand(p)

  tx = perturbkit.nnx.interleaved(mse, optax.sgd(lr))
  assert tx.segments(model, x, y).segments == ('b', 'head')
  state, metrics = jax.jit(tx.step)(tx.init(model, x, y), x, y)
  chex.assert_trees_all_close(nnx_models.pure(state.variables), want, **TOL)
  np.testing.assert_allclose(metrics['grad_norm']['b'], d_bias_b_norm, **TOL)
  trained = state.model()
  assert trained.a.kernel is trained.b.kernel
  # The schedule really differs from a plain step (the comparison is not vacuous).
  plain = params_of(nnx.jit(nnx.grad(mse))(model, x, y))['a']['kernel']
  assert not np.allclose(kernel - lr * plain, want['a']['kernel'], **TOL)


@pytest.mark.parametrize('wrt', [nnx.All(nnx.Param, nnx.PathContains('dense_2')),
                                 nnx.Any(nnx.PathContains('dense_2'), nnx.PathContains('bias'))],
                         ids=['head-only', 'head-and-biases'])
@pytest.mark.parametrize('tx', [optax.sgd(0.1), optax.adam(1e-2)], ids=['sgd', 'adam'])
def test_a_path_filter_wrt_equals_nnx_optimizer_with_the_same_wrt(wrt, tx):
  """``wrt`` is evaluated on the model's paths, as ``nnx.Optimizer`` does: ``PathContains``
  selects the module's params by its path in the model."""
  x, y = batch()
  model, reference = SkipMLP(rngs=nnx.Rngs(0)), SkipMLP(rngs=nnx.Rngs(0))
  opt = perturbkit.nnx.InterleavedOptimizer(model, tx, mse, x, y, wrt=wrt,
                                            propagate='original')
  for _ in range(2):
    interleaved_step(model, opt, x, y)
  optimizer = nnx.Optimizer(reference, tx, wrt=wrt)

  @nnx.jit
  def step(model, optimizer, x, y):
    optimizer.update(model, nnx.grad(mse, argnums=nnx.DiffState(0, wrt))(model, x, y))

  for _ in range(2):
    step(reference, optimizer, x, y)
  chex.assert_trees_all_close(nnx_models.pure(nnx.state(model)),
                              nnx_models.pure(nnx.state(reference)), **TOL)
  moved = nnx_models.pure(nnx.state(model, nnx.Param))['dense_2']['kernel']
  assert not np.allclose(moved, params_of(SkipMLP(rngs=nnx.Rngs(0)))['dense_2']['kernel'])


def test_a_whole_gradient_clip_warns_and_a_mask_tree_is_refused():
  """As in Linen (tests/test_interleaved.py, where the numbers are checked): one optimizer
  with optax.clip_by_global_norm acts per segment, and a mask built for the whole params
  does not fit a segment's."""
  x, y = batch()
  model = SkipMLP(rngs=nnx.Rngs(0))
  clip = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
  with pytest.warns(perturbkit.PerSegmentTransformWarning, match='nnx.interleaved'):
    perturbkit.nnx.interleaved(mse, clip)
  with pytest.warns(perturbkit.PerSegmentTransformWarning, match='InterleavedOptimizer'):
    perturbkit.nnx.InterleavedOptimizer(model, clip, mse, x, y)
  mask = jax.tree.map(lambda w: w.ndim > 1, nnx.state(model, nnx.Param))
  tx = perturbkit.nnx.interleaved(mse, optax.adamw(1e-2, mask=mask))
  with pytest.raises(perturbkit.SegmentOptimizerError, match='mask=lambda'):
    tx.init(model, x, y)
