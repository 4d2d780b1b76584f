"""interleaved() against a hand-coded layer-wise backward and against jax.grad + optax."""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.nnx import bridge

import hand_lora
import hand_skip_mlp
from hand_skip_mlp import dense, sgd_step
import models
import perturbkit
from flax.core.scope import LazyRng

TOL = dict(rtol=2e-5, atol=2e-6)


class SkipMLP(nn.Module):
  """Three Dense segments; the second one's input also skips past it."""

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(8)(x))
    h2 = nn.relu(nn.Dense(8)(h)) + h
    return nn.Dense(1)(h2)


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(4, (3, 3))(x))
    x = nn.relu(nn.Conv(4, (3, 3), strides=2)(x))
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


class Block(nn.Module):
  """A residual Transformer-style block (pre-norm MLP); its glue is inside it."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(nn.LayerNorm()(x))
    return x + nn.Dense(x.shape[-1])(nn.gelu(h))


class Blocks(nn.Module):
  depth: int = 3

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth):
      x = Block()(x)
    return nn.Dense(2)(x)


def mse(model):
  return lambda v, x, y: jnp.mean((model.apply(v, x) - y) ** 2)


def hand_chain(layers, glues, weights, x, dloss, lr):
  """Layer-wise backward written out with jax.vjp: update, then propagate.

  layers[k](w, a) -> z_k; glues[k](z_k) -> a_{k+1}; dloss(out) -> cotangent. Jitted: one
  compile, not one per op.
  """
  @jax.jit
  def run(weights, x):
    acts, outs = [x], []
    for f, glue, w in zip(layers, glues, weights):
      outs.append(f(w, acts[-1]))
      acts.append(glue(outs[-1]))
    g = dloss(acts[-1])
    new = [None] * len(layers)
    for k in reversed(range(len(layers))):
      _, glue_vjp = jax.vjp(glues[k], outs[k])
      (g,) = glue_vjp(g)
      _, vjp_old = jax.vjp(layers[k], weights[k], acts[k])
      dw, _ = vjp_old(g)
      new[k] = sgd_step(weights[k], dw, lr)
      _, vjp_new = jax.vjp(lambda a: layers[k](new[k], a), acts[k])
      (g,) = vjp_new(g)
    return new
  return run(weights, x)


def test_skip_mlp_matches_hand_coded_backward():
  model, lr = SkipMLP(), 0.1
  x = jax.random.normal(jax.random.key(1), (16, 3))
  y = jnp.sin(x[:, :1])
  v = jax.jit(model.init)(jax.random.key(0), x)
  p = v['params']
  (w0, w1, w2), (g_z0, g_z1, g_out), (dw0, dw1, dw2) = hand_skip_mlp.updated_step(
      p['Dense_0'], p['Dense_1'], p['Dense_2'], x, y, lr)

  tx = perturbkit.interleaved(mse(model), optax.sgd(lr))
  state, metrics = jax.jit(tx.step)(tx.init(v, x, y), x, y)
  chex.assert_trees_all_close(state.params, {'Dense_0': w0, 'Dense_1': w1, 'Dense_2': w2}, **TOL)
  for name, g in [('Dense_2', g_out), ('Dense_1', g_z1), ('Dense_0', g_z0)]:
    np.testing.assert_allclose(metrics['activation_grad_norm'][name], jnp.linalg.norm(g), **TOL)
  for name, g in [('Dense_2', dw2), ('Dense_1', dw1), ('Dense_0', dw0)]:
    np.testing.assert_allclose(metrics['grad_norm'][name], optax.tree.norm(g), **TOL)


def test_cnn_matches_hand_coded_backward():
  model, lr = CNN(), 0.05
  x = jax.random.normal(jax.random.key(2), (4, 8, 8, 2))
  y = jax.random.normal(jax.random.key(3), (4, 3))
  v = jax.jit(model.init)(jax.random.key(0), x)
  p = v['params']
  conv = lambda strides: (lambda w, a: nn.Conv(4, (3, 3), strides=strides).apply({'params': w}, a))
  layers = [conv(1), conv(2), dense]
  glues = [jax.nn.relu, lambda z: jax.nn.relu(z).reshape(z.shape[0], -1), lambda z: z]
  dloss = lambda out: 2 * (out - y) / out.size
  new = hand_chain(layers, glues, [p['Conv_0'], p['Conv_1'], p['Dense_0']], x, dloss, lr)
  tx = perturbkit.interleaved(mse(model), optax.sgd(lr))
  state, _ = jax.jit(tx.step)(tx.init(v, x, y), x, y)
  chex.assert_trees_all_close(
      state.params, {'Conv_0': new[0], 'Conv_1': new[1], 'Dense_0': new[2]}, **TOL)


def test_residual_blocks_match_hand_coded_backward():
  model, lr = Blocks(depth=3), 0.1
  x = jax.random.normal(jax.random.key(4), (2, 5, 6))
  y = jax.random.normal(jax.random.key(5), (2, 5, 2))
  v = jax.jit(model.init)(jax.random.key(0), x)
  p = v['params']
  block = lambda w, a: Block().apply({'params': w}, a)
  names = ['Block_0', 'Block_1', 'Block_2', 'Dense_0']
  layers = [block, block, block, dense]
  glues = [lambda z: z] * 4
  dloss = lambda out: 2 * (out - y) / out.size
  new = hand_chain(layers, glues, [p[n] for n in names], x, dloss, lr)
  tx = perturbkit.interleaved(mse(model), optax.sgd(lr), segments=1)
  state, _ = jax.jit(tx.step)(tx.init(v, x, y), x, y)
  chex.assert_trees_all_close(state.params, dict(zip(names, new)), **TOL)


class NNXBlock(nnx.Module):
  def __init__(self, width: int, rngs: nnx.Rngs):
    self.a = nnx.Linear(width, width, rngs=rngs)
    self.b = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x)))


class WithNNXBlock(nn.Module):
  """A Linen model running an NNX block through ``nnx.bridge.ToLinen``: Linen sees the
  block's call, not the calls of its ``nnx.Linear`` layers, which own its params."""

  @nn.compact
  def __call__(self, x):
    h = bridge.ToLinen(NNXBlock, args=(4,))(nn.Dense(4)(x))
    return nn.Dense(2)(h)


def test_an_nnx_block_through_the_bridge_is_one_default_segment_matching_hand_coded_backward():
  model, lr = WithNNXBlock(), 0.1
  x = jax.random.normal(jax.random.key(6), (5, 3))
  y = jax.random.normal(jax.random.key(7), (5, 2))
  v = jax.jit(model.init)(jax.random.key(0), x)
  tx = perturbkit.interleaved(mse(model), optax.sgd(lr))
  chosen = tx.segments(v, x, y)
  assert chosen.segments == ('Dense_0', 'ToLinen_0', 'Dense_1') and chosen.rest == {}
  p = v['params']
  block = lambda w, a: bridge.ToLinen(NNXBlock, args=(4,)).apply({'params': w}, a)
  names = ['Dense_0', 'ToLinen_0', 'Dense_1']
  dloss = lambda out: 2 * (out - y) / out.size
  new = hand_chain([dense, block, dense], [lambda z: z] * 3, [p[n] for n in names], x, dloss,
                   lr)
  state, _ = jax.jit(tx.step)(tx.init(v, x, y), x, y)
  chex.assert_trees_all_close(state.params, dict(zip(names, new)), **TOL)


def standard_step(loss_fn, optimizer, params, opt_state, *args):
  grads = jax.grad(loss_fn)(params, *args)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


@jax.jit  # one compile, not one per leaf
def _leaves_equal(a, b):
  return jax.tree.map(lambda a, b: jnp.all(a == b), a, b)


def all_equal(a, b):
  """Whether every leaf of ``a`` equals that of ``b``, entry by entry."""
  return jax.tree.all(jax.tree.map(bool, _leaves_equal(a, b)))


def three_steps_each(loss_fn, optimizer, propagate, v, *args):
  """``(first state, state after 3 interleaved steps, params after 3 standard steps)``."""
  tx = perturbkit.interleaved(loss_fn, optimizer, propagate=propagate)
  state = first = tx.init(v, *args)
  params, opt_state = v['params'], optimizer.init(v['params'])
  step = jax.jit(tx.step)
  standard = jax.jit(lambda params, opt_state, *args: standard_step(
      lambda p, *a: loss_fn({'params': p}, *a), optimizer, params, opt_state, *args))
  for _ in range(3):
    state, _ = step(state, *args)
    params, opt_state = standard(params, opt_state, *args)
  return first, state, params


@pytest.mark.parametrize('optimizer', [
    optax.sgd(0.1), optax.adam(1e-2), optax.chain(optax.clip(0.01), optax.adamw(1e-2)),
    optax.sgd(0.05, momentum=0.9, nesterov=True)], ids=['sgd', 'adam', 'clip-adamw', 'nesterov'])
def test_original_propagation_equals_standard_step(optimizer):
  model = SkipMLP()
  x = jax.random.normal(jax.random.key(1), (16, 3))
  y = jnp.cos(x[:, :1])
  v = jax.jit(model.init)(jax.random.key(0), x)
  loss_fn = mse(model)
  _, state, params = three_steps_each(loss_fn, optimizer, 'original', v, x, y)
  chex.assert_trees_all_close(state.params, params, **TOL)


@pytest.mark.parametrize('propagate', ['original', 'updated'])
def test_bf16_model_keeps_its_dtypes_and_original_equals_standard_step(propagate):
  """A bfloat16 model's gradients, optimizer state and params stay bfloat16 from step to step
  (the clipping scale, a float32 scalar, used to promote the gradients, so a step's state did
  not match the last one's, and a guarded step failed); 'original' equals optax on jax.grad."""
  low = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  model = nn.Sequential([nn.Dense(16, **low), nn.tanh, nn.Dense(16, **low), nn.tanh,
                         nn.Dense(1, **low)])
  x = jax.random.normal(jax.random.key(1), (16, 3)).astype(jnp.bfloat16)
  y = jnp.cos(x[:, :1]).astype(jnp.float32)
  v = jax.jit(model.init)(jax.random.key(0), x)
  loss_fn = lambda v, x, y: jnp.mean((model.apply(v, x).astype(jnp.float32) - y) ** 2)
  first, state, params = three_steps_each(loss_fn, optax.sgd(0.1, momentum=0.9), propagate,
                                          v, x, y)
  chex.assert_trees_all_equal_dtypes(state, first)
  assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
  if propagate == 'original':
    # One bfloat16 step (2e-3 at 0.5) apart at most; the params moved by up to 0.3.
    chex.assert_trees_all_close(state.params, params, rtol=0, atol=4e-3)
    assert not all_equal(state.params, v['params'])  # the steps moved the params


def test_float16_gradient_above_256_is_finite_and_its_step_taken():
  """A float16 gradient with entries above 256 is finite, though its squares are not in
  float16: the norms (the check for a non-finite gradient, the metrics) are taken in float32.
  Before, every step was skipped as non-finite and the norms were inf; now 'original' equals
  optax on jax.grad, and the norms are the float32 norms of the float16 gradients."""
  low = dict(dtype=jnp.float16, param_dtype=jnp.float16)
  model = nn.Sequential([nn.Dense(8, **low), nn.tanh, nn.Dense(1, **low)])
  x = (30 * jax.random.normal(jax.random.key(1), (8, 3))).astype(jnp.float16)
  y = jnp.full((8, 1), 300.0)
  v = jax.jit(model.init)(jax.random.key(0), x)
  loss_fn = lambda v, x, y: jnp.mean((model.apply(v, x).astype(jnp.float32) - y) ** 2)

  @jax.jit  # the gradients and each layer's float32 norm in one compile, not one per op
  def gradients(v, x, y):
    grads = jax.grad(loss_fn)(v, x, y)['params']
    return grads, {name: optax.tree.norm(jax.tree.map(lambda a: a.astype(jnp.float32), g))
                   for name, g in grads.items()}
  grads, norms = gradients(v, x, y)
  # Op by op, so each square is rounded to float16 (a jitted sum may keep them in float32).
  assert not jnp.isfinite(optax.tree.norm(grads))  # in float16
  tx = perturbkit.interleaved(loss_fn, optax.sgd(1e-4), propagate='original')
  state, metrics = jax.jit(tx.step)(tx.init(v, x, y), x, y)
  assert not metrics['skipped']
  for name in grads:
    np.testing.assert_allclose(metrics['grad_norm'][name], norms[name], rtol=1e-6)
  params, _ = jax.jit(lambda params, x, y: standard_step(
      lambda p, *a: loss_fn({'params': p}, *a), optax.sgd(1e-4), params,
      optax.sgd(1e-4).init(params), x, y))(v['params'], x, y)
  chex.assert_trees_all_equal_dtypes(state.params, v['params'])
  chex.assert_trees_all_close(state.params, params, rtol=0, atol=1e-3)
  assert not all_equal(state.params, v['params'])  # the step moved the params


class BNNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(8)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
    x = nn.Dropout(0.3, deterministic=not train)(x)
    return nn.Dense(2)(x)


def bn_loss(model):
  def loss_fn(v, x, y, rng):
    out, updates = model.apply(v, x, True, mutable=['batch_stats'], rngs={'dropout': rng})
    return jnp.mean((out - y) ** 2), updates
  return loss_fn


def test_batchnorm_and_dropout_original_equals_standard_step():
  model, optimizer = BNNet(), optax.sgd(0.1)
  x = jax.random.normal(jax.random.key(1), (16, 3))
  y = jax.random.normal(jax.random.key(2), (16, 2))
  v = jax.jit(model.init, static_argnums=2)(jax.random.key(0), x, False)
  loss_fn = bn_loss(model)
  tx = perturbkit.interleaved(loss_fn, optimizer, propagate='original', has_aux=True)
  state = tx.init(v, x, y, jax.random.key(10))
  params, stats, opt_state = v['params'], v['batch_stats'], optimizer.init(v['params'])
  @jax.jit
  def standard(params, stats, opt_state, rng):
    grads, updates = jax.grad(
        lambda p: loss_fn({'params': p, 'batch_stats': stats}, x, y, rng), has_aux=True)(params)
    upd, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, upd), updates['batch_stats'], opt_state

  for i in range(2):
    rng = jax.random.key(10 + i)
    state, _ = jax.jit(tx.step)(state, x, y, rng)
    params, stats, opt_state = standard(params, stats, opt_state, rng)
  chex.assert_trees_all_close(state.params, params, **TOL)
  chex.assert_trees_all_close(state.variables['batch_stats'], stats, **TOL)


class DropBlock(nn.Module):
  """A segment with dropout inside: its replays must reuse the forward's mask."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dropout(0.5, deterministic=False)(nn.relu(nn.Dense(8)(x)))
    return nn.Dense(x.shape[-1])(h)


class DropNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(3)(x)
    x = DropBlock()(x)  # its input gradient (to Dense_0) needs the mask again
    return nn.Dense(2)(x)


def test_dropout_inside_a_segment_uses_one_mask_for_all_replays():
  model, lr = DropNet(), 0.1
  x = jax.random.normal(jax.random.key(1), (16, 3))
  y = jax.random.normal(jax.random.key(2), (16, 2))
  v = jax.jit(model.init)(jax.random.key(0), x)
  rng = jax.random.key(7)
  loss_fn = lambda v, x, y, rng: jnp.mean((model.apply(v, x, rngs={'dropout': rng}) - y) ** 2)
  tx = perturbkit.interleaved(loss_fn, optax.sgd(lr), segments=1)
  s1, m1 = jax.jit(tx.step)(tx.init(v, x, y, rng), x, y, rng)
  s2, m2 = jax.jit(tx.step)(tx.init(v, x, y, rng), x, y, rng)
  chex.assert_trees_all_equal((s1, m1), (s2, m2))  # deterministic, bitwise

  # Hand-coded: the block as a function of (w, a) with the rng stream Flax gives
  # the block inside the model (checked against the model's own output first).
  block_rngs = {'dropout': LazyRng.create(rng, 'DropBlock_0')}
  block = lambda w, a: DropBlock().apply({'params': w}, a, rngs=block_rngs)
  p = v['params']
  forward = dense(p['Dense_1'], block(p['DropBlock_0'], dense(p['Dense_0'], x)))
  chex.assert_trees_all_close(forward, model.apply(v, x, rngs={'dropout': rng}), **TOL)
  dloss = lambda out: 2 * (out - y) / out.size
  names = ['Dense_0', 'DropBlock_0', 'Dense_1']
  new = hand_chain([dense, block, dense], [lambda z: z] * 3, [p[n] for n in names], x, dloss, lr)
  chex.assert_trees_all_close(s1.params, dict(zip(names, new)), **TOL)


def test_clip_global_norm_uses_previous_step_norm():
  model, lr, c = SkipMLP(), 0.1, 0.05
  x = jax.random.normal(jax.random.key(1), (16, 3))
  y = jnp.cos(x[:, :1])
  v = jax.jit(model.init)(jax.random.key(0), x)
  loss_fn = mse(model)
  tx = perturbkit.interleaved(loss_fn, optax.sgd(lr), propagate='original', clip_global_norm=c)
  state = tx.init(v, x, y)
  for _ in range(2):
    state, metrics = jax.jit(tx.step)(state, x, y)
  grad = jax.jit(jax.grad(lambda p: loss_fn({'params': p}, x, y)))
  g1 = grad(v['params'])
  p1 = sgd_step(v['params'], g1, lr)  # first step: no previous norm, no clipping
  g2 = grad(p1)
  n1 = optax.tree.norm(g1)
  assert n1 > c  # so the clip is active on the second step
  p2 = sgd_step(p1, jax.tree.map(lambda g: g * c / n1, g2), lr)
  chex.assert_trees_all_close(state.params, p2, **TOL)
  np.testing.assert_allclose(metrics['global_grad_norm'], optax.tree.norm(g2), **TOL)


def test_a_whole_gradient_clip_in_the_optimizer_warns_and_clips_each_segment_by_its_own_norm():
  """One optimizer with optax.clip_by_global_norm acts per segment in the sweep (each segment
  steps before the gradients below it exist): a warning says so, and the step is SGD on each
  segment's gradient clipped by that segment's own norm."""
  model, lr, c = SkipMLP(), 0.1, 0.05
  x = jax.random.normal(jax.random.key(1), (16, 3))
  y = jnp.cos(x[:, :1])
  v = jax.jit(model.init)(jax.random.key(0), x)
  optimizer = optax.chain(optax.clip_by_global_norm(c), optax.sgd(lr))
  with pytest.warns(perturbkit.PerSegmentTransformWarning, match='clip_global_norm=c'):
    tx = perturbkit.interleaved(mse(model), optimizer, propagate='original')
  state, _ = jax.jit(tx.step)(tx.init(v, x, y), x, y)
  g = jax.jit(jax.grad(lambda p: mse(model)({'params': p}, x, y)))(v['params'])
  clipped = {n: jax.tree.map(lambda a: a * jnp.minimum(1.0, c / optax.tree.norm(g[n])), g[n])
             for n in g}
  assert all(optax.tree.norm(g[n]) > c for n in g)  # every segment's clip is active
  chex.assert_trees_all_close(state.params, sgd_step(v['params'], clipped, lr), **TOL)
  # A function of the segment's name builds per-segment chains on purpose: no warning.
  perturbkit.interleaved(mse(model), lambda name: optimizer)


def test_a_mask_tree_for_the_whole_params_is_refused_and_a_mask_function_equals_the_standard_step():
  model = SkipMLP()
  x = jax.random.normal(jax.random.key(1), (16, 3))
  y = jnp.cos(x[:, :1])
  v = jax.jit(model.init)(jax.random.key(0), x)
  mask = jax.tree.map(lambda w: w.ndim > 1, v['params'])
  labels = jax.tree.map(lambda w: 'kernel' if w.ndim > 1 else 'bias', v['params'])
  for optimizer in (optax.adamw(1e-2, weight_decay=0.5, mask=mask),
                    optax.multi_transform({'kernel': optax.adam(1e-2), 'bias': optax.sgd(0.5)},
                                          labels)):
    tx = perturbkit.interleaved(mse(model), optimizer, propagate='original')
    with pytest.raises(perturbkit.SegmentOptimizerError, match=r"segment 'Dense_0'.*mask=lambda"):
      tx.init(v, x, y)
  optimizer = optax.adamw(1e-2, weight_decay=0.5,
                          mask=lambda params: jax.tree.map(lambda w: w.ndim > 1, params))
  _, state, params = three_steps_each(mse(model), optimizer, 'original', v, x, y)
  chex.assert_trees_all_close(state.params, params, **TOL)


def test_root_params_are_updated_with_their_ordinary_gradient():
  class Scaled(nn.Module):
    @nn.compact
    def __call__(self, x):
      s = self.param('scale', nn.initializers.ones, ())
      h = nn.relu(nn.Dense(4)(x))
      return s * nn.Dense(1)(h)

  model, lr = Scaled(), 0.1
  x = jax.random.normal(jax.random.key(1), (8, 3))
  y = jnp.ones((8, 1))
  v = jax.jit(model.init)(jax.random.key(0), x)
  tx = perturbkit.interleaved(mse(model), optax.sgd(lr))
  state, _ = jax.jit(tx.step)(tx.init(v, x, y), x, y)

  @jax.jit  # one compile, not one per op
  def hand(p, x, y):
    h = jax.nn.relu(dense(p['Dense_0'], x))
    out_inner = dense(p['Dense_1'], h)
    g_scale = jnp.sum(2 * (p['scale'] * out_inner - y) / y.size * out_inner)
    return p['scale'] - lr * g_scale
  np.testing.assert_allclose(state.params['scale'], hand(v['params'], x, y), **TOL)


class MaskedEncoder(nn.Module):
  """Owns a mask embedding, read only when ``mask`` is given (as Hugging Face Wav2Vec2's
  ``masked_spec_embed``), around two Dense layers."""

  @nn.compact
  def __call__(self, x, mask=None):
    embed = self.param('mask_embed', nn.initializers.normal(1.0), (x.shape[-1],))
    if mask is not None:
      x = jnp.where(mask[..., None], embed, x)
    h = jnp.tanh(nn.Dense(6)(x))
    return jnp.tanh(nn.Dense(4)(h))


class MaskedNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(MaskedEncoder(name='encoder')(x))


def test_params_the_loss_never_reads_leave_the_layers_around_them_segments_of_their_own():
  """A module whose own params the loss never reads was one segment with every layer inside
  it; now those layers are segments, updated as a hand-coded backward, and the unread params
  go to REST."""
  model, lr = MaskedNet(), 0.1
  x = jax.random.normal(jax.random.key(1), (16, 3))
  y = jnp.sin(x[:, :1])
  v = jax.jit(model.init)(jax.random.key(0), x)
  p = v['params']
  tx = perturbkit.interleaved(mse(model), optax.sgd(lr))
  listing = tx.segments(v, x, y)
  assert listing.segments == ('encoder/Dense_0', 'encoder/Dense_1', 'Dense_0'), listing
  assert list(listing.rest) == ['encoder'] and 'does not read' in listing.rest['encoder']
  state, _ = jax.jit(tx.step)(tx.init(v, x, y), x, y)
  e = p['encoder']
  new = hand_chain([dense] * 3, [jnp.tanh, jnp.tanh, lambda z: z],
                   [e['Dense_0'], e['Dense_1'], p['Dense_0']], x,
                   lambda out: 2 * (out - y) / out.size, lr)
  want = {'encoder': {'mask_embed': e['mask_embed'], 'Dense_0': new[0], 'Dense_1': new[1]},
          'Dense_0': new[2]}
  chex.assert_trees_all_close(state.params, want, **TOL)


def test_nonfinite_gradient_skips_the_step():
  model = SkipMLP()
  x = jnp.ones((4, 3))
  v = jax.jit(model.init)(jax.random.key(0), x)
  tx = perturbkit.interleaved(mse(model), optax.sgd(0.1))
  state = tx.init(v, x, jnp.ones((4, 1)))
  new, metrics = jax.jit(tx.step)(state, x, jnp.full((4, 1), jnp.nan))
  assert bool(metrics['skipped'])
  chex.assert_trees_all_equal(new.params, state.params)
  assert int(new.step) == 1


def test_shared_segment_is_rejected():
  class Twice(nn.Module):
    @nn.compact
    def __call__(self, x):
      d = nn.Dense(3)
      return nn.Dense(1)(d(nn.relu(d(x))))

  model = Twice()
  x = jnp.ones((2, 3))
  v = jax.jit(model.init)(jax.random.key(0), x)
  y = jnp.ones((2, 1))
  chosen = perturbkit.interleaved(mse(model), optax.sgd(0.1), segments=1)
  with pytest.raises(perturbkit.SharedSegmentError, match='called 2 times'):
    chosen.init(v, x, y)
  # The default leaves the shared module to REST, says why, and trains the rest.
  tx = perturbkit.interleaved(mse(model), optax.sgd(0.1), propagate='original')
  listing = tx.segments(v, x, y)
  assert listing.segments == ('Dense_1',)
  assert 'called 2 times' in listing.rest['Dense_0']
  state, _ = jax.jit(tx.step)(tx.init(v, x, y), x, y)
  g = jax.jit(jax.grad(lambda p: mse(model)({'params': p}, x, y)))(v['params'])
  chex.assert_trees_all_close(state.params, sgd_step(v['params'], g, 0.1), **TOL)


class Scaled(nn.Module):
  """A learned scale on a module handed to it as an attribute (the embedding it shares)."""
  embed: nn.Module

  @nn.compact
  def __call__(self, ids):
    return self.embed(ids) * self.param('scale', nn.initializers.ones, (4,))[None, None]


class HandedEmbedding(nn.Module):
  def setup(self):
    self.shared = nn.Embed(10, 4)
    self.scaled = Scaled(self.shared)
    self.head = nn.Dense(1)

  def __call__(self, ids):
    return self.head(self.scaled(ids))


def test_a_segment_running_a_module_handed_to_it_is_refused_or_left_to_rest():
  """``scaled`` runs ``shared``, which lies outside it: its replay could not see the
  embedding (Flax's ScopeParamNotFoundError). Chosen, it is refused by name; by default it
  goes to REST, and ``shared`` (called inside it) and ``head`` step as a hand-coded backward."""
  model, lr = HandedEmbedding(), 0.5
  ids = jnp.array([[1, 2, 3], [4, 5, 1]])
  v = jax.jit(model.init)(jax.random.key(0), ids)
  loss_fn = lambda v, ids: jnp.mean(jnp.sin(3 * model.apply(v, ids)))
  chosen = perturbkit.interleaved(loss_fn, optax.sgd(lr),
                                  segments=perturbkit.filters.by_path('scaled'))
  with pytest.raises(perturbkit.SharedSegmentError, match="'scaled'.*runs 'shared'"):
    chosen.init(v, ids)
  tx = perturbkit.interleaved(loss_fn, optax.sgd(lr))
  listing = tx.segments(v, ids)
  assert listing.segments == ('shared', 'head') and list(listing.rest) == ['scaled']
  state, _ = jax.jit(tx.step)(tx.init(v, ids), ids)

  @jax.jit  # one compile, not one per op
  def hand(p, ids):
    e = p['shared']['embedding'][ids]
    h = e * p['scaled']['scale'][None, None]
    g_out = jax.grad(lambda out: jnp.mean(jnp.sin(3 * out)))(dense(p['head'], h))
    d_head = jax.vjp(dense, p['head'], h)[1](g_out)[0]
    new_head = sgd_step(p['head'], d_head, lr)
    g_h = jax.vjp(lambda h: dense(new_head, h), h)[1](g_out)[0]
    g_scale = jnp.sum(g_h * e, axis=(0, 1))                   # REST: updated at the end
    g_table = jnp.zeros((10, 4)).at[ids].add(g_h * p['scaled']['scale'][None, None])
    return {'head': new_head, 'scaled': {'scale': p['scaled']['scale'] - lr * g_scale},
            'shared': {'embedding': p['shared']['embedding'] - lr * g_table}}
  chex.assert_trees_all_close(state.params, hand(v['params'], ids), **TOL)


def test_scan_segment_with_params_stacked_along_another_axis_is_rejected():
  """A scan stacking the params along axis 1 hands each iteration a slice that no segment can
  update in place (along axis 0, each iteration is a segment: tests/test_interleaved_scan.py)."""
  class Body(nn.Module):
    @nn.compact
    def __call__(self, c, _):
      return nn.tanh(nn.Dense(3)(c)), None

  class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
      x, _ = nn.scan(Body, variable_axes={'params': 1}, split_rngs={'params': True},
                     length=2)()(x, None)
      return x

  model = Scanned()
  x = jnp.ones((2, 3))
  v = jax.jit(model.init)(jax.random.key(0), x)
  y = jnp.ones((2, 3))
  chosen = perturbkit.interleaved(mse(model), optax.sgd(0.1), segments=2)
  with pytest.raises(perturbkit.SegmentationError, match='lifted transform'):
    chosen.init(v, x, y)
  # By default the stacked params have no enclosing call to take them: REST, with the reason.
  listing = perturbkit.interleaved(mse(model), optax.sgd(0.1)).segments
  with pytest.raises(perturbkit.SegmentationError, match='nn.scan'):
    listing(v, x, y)


def test_mismatched_optimizer_state_is_rejected():
  model = SkipMLP()
  x = jnp.ones((2, 3))
  v = jax.jit(model.init)(jax.random.key(0), x)
  state = perturbkit.interleaved(mse(model), optax.sgd(0.1)).init(v, x, jnp.ones((2, 1)))
  tx = perturbkit.interleaved(mse(model), optax.adam(0.1))
  with pytest.raises(perturbkit.OptimizerStateError, match='does not match'):
    tx.step(state, x, jnp.ones((2, 1)))


def test_per_segment_learning_rates():
  model = SkipMLP()
  x = jax.random.normal(jax.random.key(1), (8, 3))
  y = jnp.ones((8, 1))
  v = jax.jit(model.init)(jax.random.key(0), x)
  rates = {'Dense_0': 0.0, 'Dense_1': 0.1, 'Dense_2': 0.2, perturbkit.REST: 0.0}
  tx = perturbkit.interleaved(mse(model), lambda name: optax.sgd(rates[name]),
                              propagate='original')
  state, _ = jax.jit(tx.step)(tx.init(v, x, y), x, y)
  g = jax.jit(jax.grad(lambda p: mse(model)({'params': p}, x, y)))(v['params'])
  want = {n: sgd_step(v['params'][n], g[n], rates[n]) for n in ('Dense_0', 'Dense_1', 'Dense_2')}
  chex.assert_trees_all_close(state.params, want, **TOL)


def test_step_compiles_once():
  model = SkipMLP()
  x = jnp.ones((4, 3))
  v = jax.jit(model.init)(jax.random.key(0), x)
  tx = perturbkit.interleaved(mse(model), optax.adam(1e-3))
  step = jax.jit(chex.assert_max_traces(tx.step, n=1))
  state = tx.init(v, x, jnp.ones((4, 1)))
  for _ in range(3):
    state, _ = step(state, x, jnp.ones((4, 1)))


def test_a_step_on_inits_input_types_traces_the_loss_once():
  """A step's segments are checked on its loss and inputs, unless they passed on inputs of
  the same types (``init`` chose them there): the first step then traces the loss once, as
  ``jax.value_and_grad`` does. Another batch size is checked again, then remembered."""
  model = SkipMLP()
  x, y = jnp.ones((4, 3)), jnp.ones((4, 1))
  v = jax.jit(model.init)(jax.random.key(0), x)
  count = [0]

  def loss_fn(v, x, y):
    count[0] += 1
    return mse(model)(v, x, y)

  def traces(fn, *args):
    count[0] = 0
    jax.jit(lambda *a: fn(*a)).trace(*args)  # a new function: nothing from JAX's trace cache
    return count[0]

  tx = perturbkit.interleaved(loss_fn, optax.adam(1e-3))
  state = tx.init(v, x, y)
  assert traces(tx.step, state, x, y) == traces(jax.value_and_grad(loss_fn), v, x, y) == 1
  other = (jnp.ones((6, 3)), jnp.ones((6, 1)))
  assert traces(tx.step, state, *other) > 1
  assert traces(tx.step, state, *other) == 1


@pytest.mark.parametrize('segments', [2, perturbkit.filters.by_type(Block)], ids=['depth', 'filter'])
def test_segments_by_depth_or_filter(segments):
  model = Blocks(depth=2)
  x = jax.random.normal(jax.random.key(4), (2, 5, 6))
  y = jnp.ones((2, 5, 2))
  v = jax.jit(model.init)(jax.random.key(0), x)
  want = (['Block_0/LayerNorm_0', 'Block_0/Dense_0', 'Block_0/Dense_1', 'Block_1/LayerNorm_0',
           'Block_1/Dense_0', 'Block_1/Dense_1'] if segments == 2 else ['Block_0', 'Block_1'])
  tx = perturbkit.interleaved(mse(model), optax.sgd(0.1), segments=segments,
                              propagate='original')
  assert sorted(tx.segments(v, x, y).segments) == sorted(want)
  state, metrics = jax.jit(tx.step)(tx.init(v, x, y), x, y)
  assert sorted(metrics['activation_grad_norm']) == sorted(want)
  g = jax.jit(jax.grad(lambda p: mse(model)({'params': p}, x, y)))(v['params'])
  chex.assert_trees_all_close(state.params, sgd_step(v['params'], g, 0.1), **TOL)


def test_segment_filter_needs_example_arguments():
  model = Blocks(depth=1)
  v = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 2, 6)))
  tx = perturbkit.interleaved(mse(model), optax.sgd(0.1), segments=perturbkit.filters.all_calls)
  with pytest.raises(perturbkit.SegmentationError, match='example arguments'):
    tx.init(v)


def test_segment_called_through_two_methods_is_rejected():
  """A tied embedding: `__call__` at the input and `attend` at the output share weights."""
  class Tied(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      embed = nn.Embed(7, 4)
      h = nn.relu(nn.Dense(4)(embed(tokens)))
      return embed.attend(h)

  model = Tied()
  tokens = jnp.array([[1, 2, 3]])
  v = jax.jit(model.init)(jax.random.key(0), tokens)
  loss_fn = lambda v, t: jnp.mean(model.apply(v, t) ** 2)
  chosen = perturbkit.interleaved(loss_fn, optax.sgd(0.1), segments=1)
  with pytest.raises(perturbkit.SharedSegmentError, match='Embed_0'):
    chosen.init(v, tokens)
  listing = perturbkit.interleaved(loss_fn, optax.sgd(0.1)).segments(v, tokens)
  assert listing.segments == ('Dense_0',)
  assert 'called 2 times' in listing.rest['Embed_0']


def test_a_segment_calling_its_own_helper_method_is_one_call():
  class WithHelper(nn.Module):
    @nn.compact
    def __call__(self, x):
      return self.scale(nn.Dense(3)(x))

    def scale(self, x):
      return 2.0 * x

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(1)(WithHelper()(x))

  model = Net()
  x = jax.random.normal(jax.random.key(1), (4, 3))
  y = jnp.ones((4, 1))
  v = jax.jit(model.init)(jax.random.key(0), x)
  tx = perturbkit.interleaved(mse(model), optax.sgd(0.1), propagate='original')
  state, _ = jax.jit(tx.step)(tx.init(v, x, y), x, y)
  g = jax.jit(jax.grad(lambda p: mse(model)({'params': p}, x, y)))(v['params'])
  chex.assert_trees_all_close(state.params, sgd_step(v['params'], g, 0.1), **TOL)


def lora_problem():
  model = models.LoRANet()
  x = jax.random.normal(jax.random.key(1), (8, 3))
  y = jax.random.normal(jax.random.key(2), (8, 2))
  return model, jax.jit(model.init)(jax.random.key(0), x), x, y


def test_a_dense_subclass_calling_super_is_one_segment_original_equals_standard_steps():
  """``super().__call__`` inside a LoRA ``nn.Dense`` is part of the layer's call, not a second
  use of its weights: each layer is a segment, and two ``'original'`` adam steps equal
  ``jax.grad`` + optax."""
  model, v, x, y = lora_problem()
  tx = perturbkit.interleaved(mse(model), optax.adam(1e-2), propagate='original')
  listing = tx.segments(v, x, y)
  assert (listing.segments, listing.rest) == (('hidden', 'head'), {})
  step = jax.jit(tx.step)

  @jax.jit
  def standard_step(params, opt_state):
    g = jax.grad(lambda p: mse(model)({'params': p}, x, y))(params)
    updates, opt_state = optax.adam(1e-2).update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  state = tx.init(v, x, y)
  params, opt_state = v['params'], optax.adam(1e-2).init(v['params'])
  for _ in range(2):
    state, _ = step(state, x, y)
    params, opt_state = standard_step(params, opt_state)
  chex.assert_trees_all_close(state.params, params, **TOL)


def test_a_dense_subclass_calling_super_updated_matches_hand_coded_backward():
  model, v, x, y = lora_problem()
  tx = perturbkit.interleaved(mse(model), optax.sgd(0.5))
  state, _ = jax.jit(tx.step)(tx.init(v, x, y), x, y)
  chex.assert_trees_all_close(  # the hand-coded step jitted: one compile, not one per op
      state.params, jax.jit(hand_lora.updated_sgd_step)(v['params'], x, y, 0.5), **TOL)


def weight_penalty(v, only=None):
  return 1e-3 * sum(jnp.sum(w ** 2) for w in jax.tree.leaves(v['params'][only] if only else
                                                                v['params']))


def standard_sgd_step(loss_fn, v, x, y, lr=0.1):
  g = jax.jit(jax.grad(lambda p: loss_fn({'params': p}, x, y)))(v['params'])
  return sgd_step(v['params'], g, lr)


def test_a_loss_applying_the_model_twice_says_to_apply_it_once_and_that_fix_works():
  """A siamese loss calls every layer twice, so no call can be a segment; the fix the error
  gives (one apply on the concatenated inputs) is a segment per layer and the same step."""
  model, v, x, y = lora_problem()
  siamese = lambda v, x, y: jnp.mean((model.apply(v, x) - model.apply(v, x[::-1])) ** 2)
  with pytest.raises(perturbkit.NoSegmentError, match='concatenated along the batch axis'):
    perturbkit.interleaved(siamese, optax.sgd(0.1)).init(v, x, y)

  def inner_step(v, x, y):  # a test-time-training loss: it applies the model twice too
    inner = lambda p: jnp.mean((model.apply({'params': p}, x) - y) ** 2)
    params = jax.tree.map(lambda w, g: w - 0.1 * g, v['params'], jax.grad(inner)(v['params']))
    return jnp.mean((model.apply({'params': params}, x) - y) ** 2)

  with pytest.raises(perturbkit.NoSegmentError, match='inner gradient step.*ordinary gradient'):
    perturbkit.interleaved(inner_step, optax.sgd(0.1)).init(v, x, y)

  def once(v, x, y):
    first, second = jnp.split(model.apply(v, jnp.concatenate([x, x[::-1]])), 2)
    return jnp.mean((first - second) ** 2)

  tx = perturbkit.interleaved(once, optax.sgd(0.1), propagate='original')
  assert tx.segments(v, x, y).segments == ('hidden', 'head')
  state, _ = jax.jit(tx.step)(tx.init(v, x, y), x, y)
  chex.assert_trees_all_close(state.params, standard_sgd_step(siamese, v, x, y), **TOL)


def test_a_penalty_on_every_weight_says_to_give_it_to_the_optimizer_and_that_fix_works():
  """``c * sum(w ** 2)`` in the loss reads every param outside its call; the fix the error
  gives (``optax.add_decayed_weights(2 * c)`` before the optimizer) is the same step."""
  model, v, x, y = lora_problem()
  penalized = lambda v, x, y: mse(model)(v, x, y) + weight_penalty(v)
  with pytest.raises(perturbkit.NoSegmentError, match='optax.add_decayed_weights'):
    perturbkit.interleaved(penalized, optax.sgd(0.1)).init(v, x, y)
  tx = perturbkit.interleaved(mse(model), optax.chain(optax.add_decayed_weights(2e-3),
                                                      optax.sgd(0.1)), propagate='original')
  state, _ = jax.jit(tx.step)(tx.init(v, x, y), x, y)
  chex.assert_trees_all_close(state.params, standard_sgd_step(penalized, v, x, y), **TOL)


def test_a_penalty_on_one_layer_puts_it_in_rest_and_original_equals_standard_step():
  """As documented: a module whose params the loss also reads goes to REST, the others stay
  segments, and the step is still the standard one."""
  model, v, x, y = lora_problem()
  loss_fn = lambda v, x, y: mse(model)(v, x, y) + weight_penalty(v, 'hidden')
  tx = perturbkit.interleaved(loss_fn, optax.sgd(0.1), propagate='original')
  listing = tx.segments(v, x, y)
  assert listing.segments == ('head',) and 'read outside' in listing.rest['hidden'], listing
  state, _ = jax.jit(tx.step)(tx.init(v, x, y), x, y)
  chex.assert_trees_all_close(state.params, standard_sgd_step(loss_fn, v, x, y), **TOL)


class _CondBlock(nn.Module):
  """Runs ``b`` in both branches of ``nn.cond`` on itself: one call per step, in the branch
  taken."""

  def setup(self):
    self.b = nn.Dense(4)

  def __call__(self, h, flag):
    return nn.cond(flag, lambda m, h: m.b(h), lambda m, h: 2 * m.b(-h), self, h)


class _CondModel(nn.Module):
  block: bool  # the conditional in a block of its own, or on the model itself

  def setup(self):
    self.a, self.c = nn.Dense(4), nn.Dense(1)
    if self.block:
      self.blk = _CondBlock()
    else:
      self.b = nn.Dense(4)

  def __call__(self, x, flag):
    h = self.a(x)
    if self.block:
      h = self.blk(h, flag)
    else:
      h = nn.cond(flag, lambda m, h: m.b(h), lambda m, h: 2 * m.b(-h), self, h)
    return jnp.sum(jnp.sin(self.c(h)))


@pytest.mark.parametrize('block', [False, True])
def test_a_module_called_in_the_branches_of_nn_cond(block):
  """A Dense called in both branches is no segment of its own (it is not called twice: the
  reason names nn.cond), and chosen it is refused; the block running the conditional is a
  segment, and 'original' steps equal jax.grad + SGD for either branch."""
  model, lr = _CondModel(block), 0.3
  x = jax.random.normal(jax.random.key(1), (2, 4))
  v = jax.jit(model.init, static_argnums=2)(jax.random.key(0), x, True)
  loss_fn = lambda v, x, flag: model.apply(v, x, flag)
  tx = perturbkit.interleaved(loss_fn, optax.sgd(lr), propagate='original')
  listing = tx.segments(v, x, True)
  inner = 'blk/b' if block else 'b'
  if block:
    assert listing.segments == ('a', 'blk', 'c') and listing.rest == {}
  else:
    assert listing.segments == ('a', 'c') and list(listing.rest) == ['b']
    assert 'inside nn.cond' in listing.rest['b'] and 'called' not in listing.rest['b']
  chosen = perturbkit.interleaved(loss_fn, optax.sgd(lr), segments=perturbkit.filters.by_path(inner))
  with pytest.raises(perturbkit.SegmentationError, match=f"'{inner}' runs inside nn.cond"):
    chosen.init(v, x, True)
  state = tx.init(v, x, True)
  step = jax.jit(tx.step)
  want = v['params']
  standard = jax.jit(lambda p, flag: sgd_step(  # one compile for both flags
      p, jax.grad(lambda p: loss_fn({'params': p}, x, flag))(p), lr))
  for flag in (True, False):
    state, _ = step(state, x, flag)
    want = standard(want, flag)
  chex.assert_trees_all_close(state.params, want, **TOL)
