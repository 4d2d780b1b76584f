"""K-FAC factors and preconditioning against hand-written references.

Every reference here is built without perturbkit: the networks are written out
by hand with an explicit perturbation argument ``eps`` added to each layer's
output, so ``g = d(sum of per-example losses)/d eps`` and the layer inputs are
captured explicitly; ``A`` and ``G`` are then formed with numpy. The last check runs a
step on the test process's 8 host CPU devices against the same step on one.
"""
import functools
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import models
import perturbkit
from host_devices import data_mesh

RTOL, ATOL = 2e-5, 1e-6


# ---------------------------------------------------------------- models and hand twins

class MLP(nn.Module):
  """Dense -> tanh -> Dense -> tanh -> Dense."""
  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Dense(6, name='Dense_0')(x))
    x = jnp.tanh(nn.Dense(5, name='Dense_1')(x))
    return nn.Dense(4, name='Dense_2')(x)


def bias(x, b):
  return x + b.reshape((1,) * (x.ndim - 1) + b.shape)


def hand_mlp(params, x, eps):
  inputs = []
  for i in range(3):
    layer = params[f'Dense_{i}']
    inputs.append(x)
    x = bias(x @ layer['kernel'], layer['bias']) + eps[i]
    x = jnp.tanh(x) if i < 2 else x
  return x, inputs


class CNN(nn.Module):
  """Conv 3x3 SAME -> tanh -> Conv 3x3 stride 2 VALID -> tanh -> Dense."""
  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Conv(4, (3, 3), name='Conv_0')(x))
    x = jnp.tanh(nn.Conv(3, (3, 3), strides=2, padding='VALID', name='Conv_1')(x))
    return nn.Dense(5, name='Dense_0')(x.reshape(x.shape[0], -1))


CONV_SETTINGS = {'Conv_0': (1, ((1, 1), (1, 1))), 'Conv_1': (2, ((0, 0), (0, 0)))}


def hand_conv(x, kernel, stride, padding):
  return jax.lax.conv_general_dilated(x, kernel, (stride, stride), padding,
                                      dimension_numbers=('NHWC', 'HWIO', 'NHWC'))


def hand_cnn(params, x, eps):
  inputs = []
  for i, name in enumerate(['Conv_0', 'Conv_1']):
    stride, padding = CONV_SETTINGS[name]
    inputs.append(x)
    x = jnp.tanh(bias(hand_conv(x, params[name]['kernel'], stride, padding), params[name]['bias'])
                 + eps[i])
  x = x.reshape(x.shape[0], -1)
  inputs.append(x)
  return bias(x @ params['Dense_0']['kernel'], params['Dense_0']['bias']) + eps[2], inputs


def hand_patches(x, size, stride, padding):
  """Patches by slicing: (N, out_h, out_w, size*size*C), features in (di, dj, c) order."""
  x = np.pad(np.asarray(x), ((0, 0),) + tuple(padding) + ((0, 0),))
  out = (x.shape[1] - size) // stride + 1, (x.shape[2] - size) // stride + 1
  taps = [x[:, di:di + stride * (out[0] - 1) + 1:stride, dj:dj + stride * (out[1] - 1) + 1:stride]
          for di in range(size) for dj in range(size)]
  stacked = np.stack(taps, axis=3)
  return stacked.reshape(stacked.shape[:3] + (-1,))


class SequenceModel(nn.Module):
  """Embed tokens (N, T) -> tanh -> Dense on (N, T, D) -> mean over T -> Dense."""
  @nn.compact
  def __call__(self, tokens):
    h = jnp.tanh(nn.Embed(11, 6, name='Embed_0')(tokens))
    h = jnp.tanh(nn.Dense(7, name='Dense_0')(h))
    return nn.Dense(3, name='Dense_1')(h.mean(axis=1))


def hand_sequence(params, tokens, eps):
  h = jnp.tanh(params['Embed_0']['embedding'][tokens] + eps[0])
  inputs = [tokens, h]
  h = jnp.tanh(bias(h @ params['Dense_0']['kernel'], params['Dense_0']['bias']) + eps[1])
  h = h.mean(axis=1)
  inputs.append(h)
  return bias(h @ params['Dense_1']['kernel'], params['Dense_1']['bias']) + eps[2], inputs


def cross_entropy_sum(logits, labels):
  return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def with_bias(rows):
  rows = np.asarray(rows, np.float64).reshape(-1, np.shape(rows)[-1])
  return np.concatenate([rows, np.ones((rows.shape[0], 1))], axis=1)


def hand_factors(hand_fn, params, x, labels_fn, eps_shapes):
  """A hand model's inputs and per-example output gradients at ``labels_fn(logits)``."""
  @jax.jit
  def run(params, x):
    zeros = [jnp.zeros(s) for s in eps_shapes]
    logits, inputs = hand_fn(params, x, zeros)
    labels = labels_fn(logits)
    return inputs, jax.grad(lambda eps: cross_entropy_sum(hand_fn(params, x, eps)[0], labels))(
        zeros)

  inputs, grads = run(params, x)
  return inputs, [np.asarray(g, np.float64) for g in grads]


def dense_reference(a, g, examples):
  a, g = with_bias(a), g.reshape(-1, g.shape[-1])
  return a.T @ a / examples, g.T @ g / g.shape[0]


def setup(model, x, seed=0):
  variables = jax.jit(model.init)(jax.random.key(seed), x)
  predict = lambda v, inputs: model.apply(v, inputs)
  return variables, predict, perturbkit.kfac_layers(predict, variables, x)


def assert_factors(stats, name, a, g):
  np.testing.assert_allclose(stats[name].a, a, rtol=RTOL, atol=ATOL, err_msg=f'{name}.a')
  np.testing.assert_allclose(stats[name].g, g, rtol=RTOL, atol=ATOL, err_msg=f'{name}.g')


# ---------------------------------------------------------------- factors

@functools.cache
def mlp_estimate(fisher):
  """``((x, y, key), variables, (loss, grads, stats))``: the jitted MLP estimator on one batch,
  once per process for the two tests below."""
  x = jax.random.normal(jax.random.key(1), (9, 3))
  y = jnp.arange(9) % 4
  key = jax.random.key(2)
  variables, predict, layers = setup(MLP(), x)
  estimate = jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                               fisher=fisher))
  return (x, y, key), variables, estimate(variables, x, y, key)


@pytest.mark.parametrize('fisher', ['sampled', 'empirical'])
def test_mlp_factors_equal_hand_reference(fisher):
  (x, y, key), variables, (loss, grads, stats) = mlp_estimate(fisher)

  params = variables['params']
  # The documented sampling: labels drawn with jax.random.categorical(key, logits).
  labels_fn = ((lambda logits: jax.random.categorical(key, logits)) if fisher == 'sampled'
               else (lambda logits: y))
  inputs, gs = hand_factors(hand_mlp, params, x, labels_fn, [(9, 6), (9, 5), (9, 4)])
  for i in range(3):
    assert_factors(stats, f'Dense_{i}', *dense_reference(inputs[i], gs[i], 9))

  ref_loss, ref_grads = jax.jit(jax.value_and_grad(
      lambda p: cross_entropy_sum(hand_mlp(p, x, [0.0, 0.0, 0.0])[0], y) / 9))(params)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-6)


def test_sampled_factors_differ_from_empirical():
  # Guards the test above: the two label choices must give different G.
  g = {f: mlp_estimate(f)[2][2]['Dense_2'].g for f in ('sampled', 'empirical')}
  assert not np.allclose(g['sampled'], g['empirical'], rtol=1e-2)


def test_cnn_factors_use_patches():
  x = jax.random.normal(jax.random.key(1), (3, 7, 7, 2))
  y = jnp.array([0, 4, 2])
  variables, predict, layers = setup(CNN(), x)
  assert {n: i.kind for n, i in layers.layers.items()} == {
      'Conv_0': 'conv', 'Conv_1': 'conv', 'Dense_0': 'dense'}
  _, _, stats = jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                                  fisher='empirical'))(variables, x, y)
  inputs, gs = hand_factors(hand_cnn, variables['params'], x, lambda logits: y,
                            [(3, 7, 7, 4), (3, 3, 3, 3), (3, 5)])
  for i, name in enumerate(['Conv_0', 'Conv_1']):
    stride, padding = CONV_SETTINGS[name]
    patches = hand_patches(inputs[i], 3, stride, padding)
    # Spatial-sum convention: A sums over locations (divides by N), G averages.
    assert_factors(stats, name, *dense_reference(patches, gs[i], 3))
  assert_factors(stats, 'Dense_0', *dense_reference(inputs[2], gs[2], 3))


def test_sequence_dense_and_embed_factors():
  tokens = jax.random.randint(jax.random.key(1), (5, 4), 0, 11)
  y = jnp.array([0, 1, 2, 0, 1])
  key = jax.random.key(3)
  variables, predict, layers = setup(SequenceModel(), tokens)
  assert layers.layers['Embed_0'].kind == 'embed'
  _, _, stats = jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers))(
      variables, tokens, y, key)
  inputs, gs = hand_factors(hand_sequence, variables['params'], tokens,
                            lambda logits: jax.random.categorical(key, logits),
                            [(5, 4, 6), (5, 4, 7), (5, 3)])
  counts = np.bincount(np.asarray(tokens).ravel(), minlength=11) / 5
  g = gs[0].reshape(-1, 6)
  assert_factors(stats, 'Embed_0', counts, g.T @ g / 20)
  # Dense on (N, T, D): A sums over the T positions of an example, G averages.
  assert_factors(stats, 'Dense_0', *dense_reference(inputs[1], gs[1], 5))
  assert_factors(stats, 'Dense_1', *dense_reference(inputs[2], gs[2], 5))


def test_shared_dense_calls_are_pooled_as_locations():
  class Twice(nn.Module):
    @nn.compact
    def __call__(self, x):
      dense = nn.Dense(3, name='shared')
      return dense(jnp.tanh(dense(x)))

  x = jax.random.normal(jax.random.key(1), (4, 3))
  y = jnp.array([0, 1, 2, 0])
  variables, predict, layers = setup(Twice(), x)
  assert layers.layers['shared'].calls == ('__call__', '__call__#1')
  _, _, stats = jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                                  fisher='empirical'))(variables, x, y)
  p = variables['params']['shared']

  def hand(eps):
    h = jnp.tanh(bias(x @ p['kernel'], p['bias']) + eps[0])
    return cross_entropy_sum(bias(h @ p['kernel'], p['bias']) + eps[1], y), h

  g, h = jax.jit(jax.grad(hand, has_aux=True))([jnp.zeros((4, 3)), jnp.zeros((4, 3))])
  a = with_bias(np.concatenate([x, h]))
  gg = np.concatenate([g[0], g[1]]).astype(np.float64)
  assert_factors(stats, 'shared', a.T @ a / 4, gg.T @ gg / 8)


@pytest.mark.parametrize('kwargs', [
    dict(features=3, kernel_size=(3, 3)),
    dict(features=2, kernel_size=(2, 3), strides=(2, 1), padding='VALID', use_bias=False),
    dict(features=2, kernel_size=(3, 3), padding='CIRCULAR', kernel_dilation=2),
    dict(features=2, kernel_size=(3, 3), padding=((2, 0), (1, 1)), input_dilation=2),
    dict(features=2, kernel_size=(3,), padding='CAUSAL'),
    dict(features=2, kernel_size=(3, 2), strides=(2, 3), padding='SAME', kernel_dilation=(1, 2)),
    dict(features=2, kernel_size=(2, 3), padding=((0, 1), (-1, 2)), use_bias=False),
    dict(features=2, kernel_size=(2, 2, 3), strides=(1, 2, 1), padding='SAME'),
    dict(features=2, kernel_size=(4,), strides=3, padding='REFLECT'),
])
def test_conv_patches_times_kernel_is_the_conv(kwargs):
  from perturbkit.kfac._rules import conv_patches
  conv = nn.Conv(**kwargs)
  shape = (2,) + (6, 5, 4)[:len(kwargs['kernel_size'])] + (3,)
  x = jax.random.normal(jax.random.key(0), shape)
  model = nn.Sequential([conv])
  # The layers are found by tracing: the variables' shapes are all it reads.
  layers = perturbkit.kfac_layers(lambda v, x: model.apply(v, x),
                                  jax.eval_shape(model.init, jax.random.key(0), x), x)
  info = layers.layers['layers_0']

  @jax.jit  # one compile for the params, the patches, their product and the conv
  def patches_times_kernel_and_conv(x):
    params = model.init(jax.random.key(0), x)['params']['layers_0']
    kernel = params['kernel']
    out = jnp.einsum('...k,kf->...f', conv_patches(info.conv, x),
                     kernel.reshape(-1, kernel.shape[-1]), precision='highest')
    if conv.use_bias:
      out = bias(out, params['bias'])
    return out, conv.apply({'params': params}, x)

  out, want = patches_times_kernel_and_conv(x)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- exact Fisher

class BatchNormNet(nn.Module):
  """Dense -> BatchNorm (batch statistics in train mode) -> tanh -> Dense."""
  @nn.compact
  def __call__(self, x, train):
    x = nn.Dense(6, name='Dense_0')(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, name='BatchNorm_0')(x)
    return nn.Dense(4, name='Dense_1')(jnp.tanh(x))


def hand_batchnorm_net(params, x, eps):
  inputs = [x]
  z = bias(x @ params['Dense_0']['kernel'], params['Dense_0']['bias']) + eps[0]
  mean = jnp.mean(z, axis=0, keepdims=True)
  var = jnp.mean((z - mean) ** 2, axis=0, keepdims=True)
  bn = params['BatchNorm_0']
  h = jnp.tanh(bias((z - mean) / jnp.sqrt(var + 1e-5) * bn['scale'][None], bn['bias']))
  inputs.append(h)
  return bias(h @ params['Dense_1']['kernel'], params['Dense_1']['bias']) + eps[1], inputs


def test_batchnorm_in_train_mode_with_has_aux():
  """BatchNorm's params go to the fallback; the Dense factors are those of the true
  per-example gradients of the coupled batch, and the batch_stats updates come back."""
  x = jax.random.normal(jax.random.key(1), (8, 3))
  y = jnp.arange(8) % 4
  model = BatchNormNet()
  variables = jax.jit(lambda k, x: model.init(k, x, train=False))(jax.random.key(0), x)
  train = lambda v, x: model.apply(v, x, train=True, mutable=['batch_stats'])
  layers = perturbkit.kfac_layers(train, variables, x)
  assert sorted(layers.layers) == ['Dense_0', 'Dense_1']
  assert layers.skipped == {'BatchNorm_0': 'BatchNorm has no K-FAC rule'}
  # Refused while tracing: under jax.jit, so that the ops before the refusal compile once.
  with pytest.raises(perturbkit.KFACOutputError, match='has_aux=True'):
    jax.jit(perturbkit.kfac_estimator(train, 'softmax_cross_entropy', layers))(
        variables, x, y, jax.random.key(2))
  estimate = perturbkit.kfac_estimator(train, 'softmax_cross_entropy', layers,
                                       fisher='empirical', has_aux=True)
  loss, grads, stats, updates = jax.jit(estimate)(variables, x, y)
  inputs, output_grads = hand_factors(hand_batchnorm_net, variables['params'], x,
                                      lambda logits: y, [(8, 6), (8, 4)])
  for i, name in enumerate(['Dense_0', 'Dense_1']):
    assert_factors(stats, name, *dense_reference(inputs[i], output_grads[i], 8))

  @jax.jit  # the reference loss and updates in one compile
  def reference(v):
    logits, want_updates = train(v, x)
    return want_updates, optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  want_updates, want_loss = reference(variables)
  chex.assert_trees_all_close(updates, want_updates, rtol=1e-6)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  # Without the statistics (a traced flag): the same loss, gradient and updates.
  plain = jax.jit(lambda v: estimate(v, x, y, with_stats=jnp.zeros((), bool)))(variables)
  chex.assert_trees_all_close((plain[0], plain[1], plain[3]), (loss, grads, updates),
                              rtol=1e-5, atol=1e-7)


def test_single_dense_gaussian_kfac_is_the_exact_fisher():
  # Linear-Gaussian output: the Fisher of (W, b) is E[ã ãᵀ] ⊗ I/σ², exactly Kronecker.
  model = nn.Sequential([nn.Dense(3)])
  x = jax.random.normal(jax.random.key(1), (6, 4))
  variance = 0.5
  variables, predict, layers = setup(model, x)
  estimate = perturbkit.kfac_estimator(predict, perturbkit.gaussian_output(variance), layers,
                                       fisher='exact')
  _, _, stats = jax.jit(estimate)(variables, x, jnp.zeros((6, 3)))

  def output(theta, xi):   # theta = [W; b], (5, 3), flattened row-major like kron(A, G)
    return xi @ theta[:4] + theta[4]   # xi is (4,): same ranks

  dense = variables['params']['layers_0']
  theta = jnp.concatenate([dense['kernel'], dense['bias'][None]])
  jac = jax.jit(jax.vmap(lambda xi: jax.jacobian(output)(theta, xi).reshape(3, -1)))(x)  # (N, 3, 15)
  exact = np.einsum('nki,nkj->ij', jac, jac) / (6 * variance)
  kron = np.kron(stats['layers_0'].a, stats['layers_0'].g)
  np.testing.assert_allclose(kron, exact, rtol=1e-5, atol=1e-6)

  # The sampled estimate has the same expectation: average G over many keys.
  sampled = perturbkit.kfac_estimator(predict, perturbkit.gaussian_output(variance), layers)
  keys = jax.random.split(jax.random.key(5), 400)
  g_mean = jax.jit(jax.vmap(lambda k: sampled(variables, x, jnp.zeros((6, 3)), k)[2][
      'layers_0'].g))(keys).mean(axis=0)
  # 2400 draws per entry: the standard error of a diagonal entry is ~0.06.
  np.testing.assert_allclose(g_mean, np.eye(3) / variance, atol=0.3)


@pytest.mark.parametrize('loss, optax_loss', [('squared_error', optax.squared_error),
                                               ('gaussian', optax.l2_loss)])
def test_named_squared_losses_have_their_hessian_as_g(loss, optax_loss):
  """A linear last layer's exact ``G`` is the mean Hessian of the per-example loss at its output:
  ``'squared_error'`` is ``optax.squared_error``'s ``(y - t)²`` (``2I``; it used to give
  ``optax.l2_loss``'s ``I``, half the Fisher of the loss it names)."""
  model = nn.Sequential([nn.Dense(3)])
  x = jax.random.normal(jax.random.key(1), (6, 4))
  y = jax.random.normal(jax.random.key(2), (6, 3))
  variables, predict, layers = setup(model, x)
  estimate = perturbkit.kfac_estimator(predict, loss, layers, fisher='exact')
  _, _, stats = jax.jit(estimate)(variables, x, y)
  output = jax.jit(predict)(variables, x)
  hessians = jax.jit(jax.vmap(jax.hessian(lambda o, t: optax_loss(o, t).sum())))(output, y)
  np.testing.assert_allclose(stats['layers_0'].g, hessians.mean(0), rtol=1e-5, atol=1e-6)


def test_exact_categorical_g_is_the_expectation_over_labels():
  model = nn.Sequential([nn.Dense(4)])
  x = jax.random.normal(jax.random.key(1), (5, 3))
  variables, predict, layers = setup(model, x)
  _, _, stats = jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                                  fisher='exact'))(
                                                      variables, x, jnp.zeros(5, jnp.int32))
  p = np.asarray(jax.jit(lambda v: jax.nn.softmax(model.apply(v, x)))(variables), np.float64)
  # E_y[(p - e_y)(p - e_y)ᵀ] = diag(p) - p pᵀ, averaged over the examples.
  expected = np.mean([np.diag(q) - np.outer(q, q) for q in p], axis=0)
  np.testing.assert_allclose(stats['layers_0'].g, expected, rtol=1e-5, atol=1e-6)


def assert_float64_close(got, want, err_msg=''):
  """``got`` is float64 and equals ``want`` to 1e-12 of its largest entry."""
  assert got.dtype == jnp.float64, err_msg
  want = np.asarray(want, np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max(),
                             err_msg=err_msg)


def kernel_matrix(leaves):
  """``[W; b]`` of a Dense/Conv layer's ``{'kernel', 'bias'}`` (a Conv's kernel flattened)."""
  kernel = np.asarray(leaves['kernel'], np.float64)
  return np.concatenate([kernel.reshape(-1, kernel.shape[-1]), np.asarray(leaves['bias'])[None]])


def exact_fisher_factors(hand_fn, params, x, eps_shapes):
  """A hand model's layer inputs, and each layer's exact-Fisher
  ``G = (1/(N T)) Σ_n Σ_t J_ntᵀ (diag p_n - p_n p_nᵀ) J_nt``, with ``J_nt`` the Jacobian of
  example ``n``'s logits at its output location ``t`` (``jax.jacrev``), in numpy float64."""
  @jax.jit
  def run(params, x):
    zeros = [jnp.zeros(s) for s in eps_shapes]
    logits, inputs = hand_fn(params, x, zeros)
    return logits, inputs, jax.jacrev(lambda eps: hand_fn(params, x, eps)[0])(zeros)

  logits, inputs, jacobians = jax.tree.map(lambda a: np.asarray(a, np.float64), run(params, x))
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  fisher = np.stack([np.diag(q) - np.outer(q, q) for q in p])
  gs = []
  for jac, shape in zip(jacobians, eps_shapes):
    n = shape[0]
    per_example = np.stack([jac[i, :, i] for i in range(n)])
    per_example = per_example.reshape(n, logits.shape[1], -1, shape[-1])   # (n, k, t, d)
    gs.append(np.einsum('nkti,nkl,nltj->ij', per_example, fisher, per_example) /
              (n * per_example.shape[2]))
  return inputs, gs


def test_float64_loss_gradient_factors_and_step_are_the_textbook_ones_in_float64():
  """A float64 MLP's loss and gradient are ``jax.grad``'s in float64 (the softmax
  cross-entropy was taken in float32: a float32 loss, gradients off by 1e-8); its factors
  are the textbook ``E[ã ãᵀ]`` and exact-Fisher ``G`` of the hand twin in float64, and the
  running factors, damped inverses and preconditioned gradient are float64 (they were
  float32, about 1e-7 off). A Conv's: the NNX CNN's test in ``test_nnx_kfac.py`` (the
  rules are the same)."""
  shapes = [(6, 6), (6, 5), (6, 4)]
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.key(1), (6, 3), jnp.float64)
    y = jnp.arange(6) % 4
    variables = jax.jit(lambda k, x: jax.tree.map(lambda v: v.astype(jnp.float64),
                                                  MLP().init(k, x)))(jax.random.key(0), x)
    predict = lambda v, inputs: MLP().apply(v, inputs)
    layers = perturbkit.kfac_layers(predict, variables, x)
    estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                         fisher='exact')
    tx = perturbkit.kfac_preconditioner(layers, damping=0.1)

    @jax.jit
    def step(params, state):
      loss, grads, stats = estimate({'params': params}, x, y, with_stats=True)
      updates, state = tx.update(grads, state, params, kfac_stats=stats)
      return loss, grads, stats, updates, state

    loss, grads, stats, updates, state = step(variables['params'],
                                              jax.jit(tx.init)(variables['params']))
    loss_fn = lambda p: optax.softmax_cross_entropy_with_integer_labels(
        predict({'params': p}, x), y).mean()
    want_loss, want_grads = jax.jit(jax.value_and_grad(loss_fn))(variables['params'])
    inputs, want_gs = exact_fisher_factors(hand_mlp, variables['params'], x, shapes)
  assert loss.dtype == jnp.float64
  np.testing.assert_allclose(loss, want_loss, rtol=1e-14)
  chex.assert_trees_all_equal_dtypes(grads, want_grads)
  chex.assert_trees_all_close(grads, want_grads, rtol=1e-12, atol=1e-15)
  for i, (a, want_g) in enumerate(zip(inputs, want_gs)):
    name = f'Dense_{i}'
    rows = with_bias(a)
    want_a = rows.T @ rows / 6
    assert_float64_close(stats[name].a, want_a, f'{name}.a')
    assert_float64_close(stats[name].g, want_g, f'{name}.g')
    for leaf in (*state.factors[name], *state.inverses[name], *updates[name].values()):
      assert leaf.dtype == jnp.float64, name
    want = hand_precondition(kernel_matrix(grads[name]), want_a, want_g, 0.1)
    assert_float64_close(kernel_matrix(updates[name]), want, name)


# ---------------------------------------------------------------- preconditioner

def hand_precondition(grad_matrix, a, g, damping):
  a, g = np.asarray(a, np.float64), np.asarray(g, np.float64)
  inv_a = np.diag(1 / (a + damping)) if a.ndim == 1 else np.linalg.inv(a + damping * np.eye(len(a)))
  return inv_a @ np.asarray(grad_matrix, np.float64) @ np.linalg.inv(g + damping * np.eye(len(g)))


class Mixed(nn.Module):
  """Embed, Conv, GroupNorm (no rule) and Dense."""
  @nn.compact
  def __call__(self, tokens):
    h = nn.Embed(7, 4, name='Embed_0')(tokens)                 # (N, T, 4)
    h = jnp.tanh(nn.Conv(3, (2,), name='Conv_0')(h))            # 1-D conv over T
    h = nn.GroupNorm(num_groups=1, name='GroupNorm_0')(h)
    return nn.Dense(3, name='Dense_0')(h.mean(axis=1))


def test_preconditioned_gradient_is_damped_inverse_sandwich():
  tokens = jax.random.randint(jax.random.key(1), (6, 5), 0, 7)
  y = jnp.arange(6) % 3
  variables, predict, layers = setup(Mixed(), tokens)
  assert layers.skipped == {'GroupNorm_0': 'GroupNorm has no K-FAC rule'}
  estimate = jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers))
  _, grads, stats = estimate(variables, tokens, y, jax.random.key(2))
  damping = 0.05
  tx = perturbkit.kfac_preconditioner(layers, damping=damping, fallback=optax.scale(-3.0))
  params = variables['params']
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params, kfac_stats=stats)

  hand = {}
  for name in ('Conv_0', 'Dense_0'):
    kernel = np.asarray(grads[name]['kernel'])
    theta = np.concatenate([kernel.reshape(-1, kernel.shape[-1]),
                            np.asarray(grads[name]['bias'])[None]])
    expected = hand_precondition(theta, stats[name].a, stats[name].g, damping)
    hand[name] = {'kernel': expected[:-1].reshape(kernel.shape), 'bias': expected[-1]}
  hand['Embed_0'] = {'embedding': hand_precondition(grads['Embed_0']['embedding'],
                                                    stats['Embed_0'].a, stats['Embed_0'].g,
                                                    damping)}
  for name, leaves in hand.items():
    for leaf, expected in leaves.items():
      np.testing.assert_allclose(updates[name][leaf], expected, rtol=1e-4, atol=1e-6)
  chex.assert_trees_all_close(updates['GroupNorm_0'],
                              jax.tree.map(lambda g: -3.0 * np.asarray(g), grads['GroupNorm_0']),
                              rtol=1e-6)
  assert int(state.count) == 1

  # norm_constraint=c scales the layers' v by sqrt(c / <v, g>) where <v, g> > c (here
  # c = <v, g> / 4, so by 1/2), and leaves them as they are where c is larger.
  inner = sum(np.vdot(np.asarray(v, np.float64), np.asarray(grads[name][leaf], np.float64))
              for name, leaves in hand.items() for leaf, v in leaves.items())
  assert inner > 0
  for c, scale in ((inner / 4, 0.5), (4 * inner, 1.0)):
    tx = perturbkit.kfac_preconditioner(layers, damping=damping, fallback=optax.scale(-3.0),
                                        norm_constraint=c)
    constrained, _ = jax.jit(tx.update)(grads, tx.init(params), params, kfac_stats=stats)
    for name, leaves in hand.items():
      for leaf, expected in leaves.items():
        np.testing.assert_allclose(constrained[name][leaf], scale * expected, rtol=1e-4,
                                   atol=1e-6)
    chex.assert_trees_all_close(constrained['GroupNorm_0'], updates['GroupNorm_0'], rtol=1e-6)


class TokenMLP(nn.Module):
  """A Dense layer on every token of ``(N, T, d)`` inputs, run on them as they are or on
  their ``(N * T, d)`` rows (as OPT runs its feed-forward layers), then a pooled head."""
  flatten: bool

  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(5, name='Dense_0')
    if self.flatten:
      n, t, d = x.shape
      h = dense(x.reshape(n * t, d)).reshape(n, t, -1)
    else:
      h = dense(x)
    return nn.Dense(3, name='Dense_1')(jnp.tanh(h).mean(axis=1))


@pytest.mark.parametrize('fisher', ['empirical', 'exact'])
def test_a_layer_on_flattened_rows_has_the_batchs_examples(fisher):
  """The same maths written two ways gives the same factors: A averages over the batch's N
  examples, not over the N * T rows a flattened call has."""
  x = jax.random.normal(jax.random.key(1), (4, 6, 3))
  y = jnp.arange(4) % 3
  stats = []
  for flatten in (False, True):
    variables, predict, layers = setup(TokenMLP(flatten), x)
    estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers, fisher=fisher)
    stats.append(jax.jit(estimate)(variables, x, y)[2])
  chex.assert_trees_all_close(stats[1], stats[0], rtol=1e-5, atol=1e-7)
  # And A is the documented sum over the tokens, averaged over the 4 examples.
  rows = np.concatenate([np.asarray(x, np.float64).reshape(-1, 3), np.ones((24, 1))], axis=1)
  np.testing.assert_allclose(stats[1]['Dense_0'].a, rows.T @ rows / 4, rtol=1e-5)


@functools.cache
def mlp_problem():
  """``(x, y, variables, predict, layers, estimate, jitted_estimate)``: the MLP on a batch of 8
  and its sampled-Fisher estimator, compiled once for the tests below."""
  x = jax.random.normal(jax.random.key(1), (8, 3))
  y = jnp.arange(8) % 4
  variables, predict, layers = setup(MLP(), x)
  estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers)
  return x, y, variables, predict, layers, estimate, jax.jit(estimate)


def test_running_average_and_inverse_refresh():
  x, y, variables, _, layers, _, estimate = mlp_problem()
  params = variables['params']
  tx = perturbkit.kfac_preconditioner(layers, damping=0.1, decay=0.8, inverse_every=2,
                                      stats_every=1)
  update = jax.jit(tx.update)
  state = tx.init(params)
  stats = [estimate(variables, x * s, y, jax.random.key(s))[2] for s in (1, 2, 3)]
  grads = estimate(variables, x, y, jax.random.key(0))[1]
  _, state1 = update(grads, state, params, kfac_stats=stats[0])
  _, state2 = update(grads, state1, params, kfac_stats=stats[1])
  out3, state3 = update(grads, state2, params, kfac_stats=stats[2])
  a1, a2, a3 = (s['Dense_1'].a for s in stats)
  a1, a2, a3 = (np.asarray(a) for a in (a1, a2, a3))  # the averages in numpy, not compiled
  np.testing.assert_allclose(state2.factors['Dense_1'].a, 0.8 * a1 + 0.2 * a2, rtol=1e-5)
  ema3 = 0.8 * (0.8 * a1 + 0.2 * a2) + 0.2 * a3
  np.testing.assert_allclose(state3.factors['Dense_1'].a, ema3, rtol=1e-5)
  # Count 1 keeps the inverses of count 0; count 2 refreshes them from the running average.
  chex.assert_trees_all_close(state2.inverses, state1.inverses)
  np.testing.assert_allclose(
      state3.inverses['Dense_1'].a, np.linalg.inv(np.asarray(ema3, np.float64) + 0.1 * np.eye(7)),
      rtol=1e-4, atol=1e-5)
  assert not np.allclose(state3.inverses['Dense_1'].a, state2.inverses['Dense_1'].a)
  del out3


def test_amortised_statistics_equal_the_every_step_path_on_their_steps():
  """stats_every=3: a traced ``with_stats`` takes the estimator's full statistics on
  steps 0, 3, 6 and a plain gradient otherwise; the factors and inverses are those
  of the every-step preconditioner fed only the batches of those steps, and every
  update is the damped sandwich with the inverses of the last refresh."""
  x, y, variables, _, layers, estimate, jitted_estimate = mlp_problem()
  params = variables['params']
  batches = [(x * (1 + 0.1 * i), jax.random.key(i)) for i in range(7)]
  every = perturbkit.kfac_preconditioner(layers, damping=0.1, decay=0.8, inverse_every=2,
                                         stats_every=1)
  amortised = perturbkit.kfac_preconditioner(layers, damping=0.1, decay=0.8, inverse_every=6,
                                             stats_every=3)

  @jax.jit
  def amortised_step(state, x, key):
    _, grads, stats = estimate(variables, x, y, key, with_stats=state.stats_due)
    updates, state = amortised.update(grads, state, params, kfac_stats=stats)
    return grads, stats, updates, state

  state = amortised.init(params)
  reference = every.init(params)
  taken = 0
  for i, (xi, key) in enumerate(batches):
    assert bool(state.stats_due) == (i % 3 == 0)
    grads, stats, updates, state = amortised_step(state, xi, key)
    _, full_grads, full_stats = jitted_estimate(variables, xi, y, key)
    chex.assert_trees_all_close(grads, full_grads, rtol=1e-5, atol=1e-6)
    if i % 3 == 0:
      chex.assert_trees_all_close(stats, full_stats, rtol=1e-5, atol=1e-6)
      # The every-step preconditioner refreshes on its counts 0, 2: batches 0 and 6.
      _, reference = jax.jit(every.update)(full_grads, reference, params, kfac_stats=full_stats)
      taken += 1
    else:
      # A step without statistics returns NaN stats, which the state does not fold in.
      assert all(np.isnan(leaf).all() for leaf in jax.tree.leaves(stats))
    chex.assert_trees_all_close(state.factors, reference.factors, rtol=1e-5, atol=1e-6)
    if i in (0, 6):
      chex.assert_trees_all_close(state.inverses, reference.inverses, rtol=1e-4, atol=1e-5)
    for name in layers.layers:
      theta = np.concatenate([np.asarray(grads[name]['kernel']),
                              np.asarray(grads[name]['bias'])[None]])
      inverses = state.inverses[name]
      expected = np.asarray(inverses.a, np.float64) @ theta @ np.asarray(inverses.g, np.float64)
      np.testing.assert_allclose(updates[name]['kernel'], expected[:-1], rtol=1e-4, atol=1e-6)
  assert taken == 3 and int(reference.count) == 3


def test_two_jitted_steps_picked_in_python_equal_the_traced_flag():
  """The host switch (one jitted step with statistics, one without, picked with
  ``bool(state.stats_due)``) gives the traced-flag path's updates and states; a
  step without statistics where they were due turns the factors NaN, not zero."""
  x, y, variables, _, layers, estimate, _ = mlp_problem()
  params = variables['params']
  tx = perturbkit.kfac_preconditioner(layers, damping=0.1, inverse_every=3)

  def step(state, x, key, with_stats):
    _, grads, stats = estimate(variables, x, y, key, with_stats=with_stats)
    return tx.update(grads, state, params, kfac_stats=stats)

  traced = jax.jit(lambda state, x, key: step(state, x, key, state.stats_due))
  switch = {flag: jax.jit(functools.partial(step, with_stats=flag)) for flag in (True, False)}
  a = b = tx.init(params)
  for i in range(6):
    xi, key = x * (1 + 0.1 * i), jax.random.key(i)
    out_a, a = traced(a, xi, key)
    out_b, b = switch[bool(b.stats_due)](b, xi, key)
    chex.assert_trees_all_close((out_a, a), (out_b, b), rtol=1e-5, atol=1e-6)
  assert bool(b.stats_due)
  _, wrong = switch[False](b, x, jax.random.key(9))
  assert all(np.isnan(leaf).all() for leaf in jax.tree.leaves(wrong.factors))


def test_a_step_donating_the_state_from_init_equals_the_step_keeping_it():
  """``jax.jit(step, donate_argnums=...)`` on the state ``init`` returns: its factors and
  inverses were one buffer each, and XLA refused to donate a buffer twice."""
  (x, _, _), variables, (_, grads, stats) = mlp_estimate('empirical')
  params, layers = variables['params'], setup(MLP(), x)[2]
  tx = optax.chain(perturbkit.kfac_preconditioner(layers, damping=0.1), optax.adam(0.1))
  update = lambda state: tx.update(grads, state, params, kfac_stats=stats)
  want = jax.jit(update)(tx.init(params))
  chex.assert_trees_all_close(jax.jit(update, donate_argnums=0)(tx.init(params)), want)


def test_jitted_training_step_traces_once_and_lowers_the_loss():
  x = jax.random.normal(jax.random.key(1), (64, 3))
  y = (x[:, 0] > 0).astype(jnp.int32) + 2 * (x[:, 1] > 0).astype(jnp.int32)
  variables, predict, layers = setup(MLP(), x)
  estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers)
  tx = optax.chain(perturbkit.kfac_preconditioner(layers, damping=0.1, inverse_every=3),
                   optax.sgd(0.3, momentum=0.5))

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, opt_state, key):
    loss, grads, stats = estimate({'params': params}, x, y, key)
    updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), opt_state, loss

  params, opt_state = variables['params'], tx.init(variables['params'])
  losses = []
  for i in range(25):
    params, opt_state, loss = step(params, opt_state, jax.random.key(i))
    losses.append(float(loss))
  assert losses[-1] < 0.1 * losses[0], losses


# ---------------------------------------------------------------- errors

def test_explicitly_selected_layer_without_rule_is_an_error():
  x = jnp.ones((2, 3))
  model = nn.Sequential([nn.Dense(4), nn.GroupNorm(num_groups=2), nn.Dense(2)])
  # The layers are found by tracing: the variables' shapes are all it reads.
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match='GroupNorm'):
    perturbkit.kfac_layers(lambda v, x: model.apply(v, x), variables, x,
                           filter=perturbkit.filters.by_type(nn.Dense, nn.GroupNorm))
  layers = perturbkit.kfac_layers(lambda v, x: model.apply(v, x), variables, x,
                                  filter=perturbkit.filters.by_path('layers_0'))
  assert list(layers.layers) == ['layers_0']
  assert layers.skipped == {'layers_1': 'not selected by the filter',
                            'layers_2': 'not selected by the filter'}


MASK = jnp.ones((3, 3, 2, 4)).at[2].set(0.0).at[1, 2].set(0.0)  # causal-style taps


class MaskedCNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Conv(4, (3, 3), mask=MASK, name='conv')(x)
    return nn.Dense(3, name='head')(jnp.tanh(h).reshape(x.shape[0], -1))


def test_a_masked_conv_is_skipped_or_refused_and_its_masked_taps_do_not_move():
  """A mask zeroes kernel taps, whose gradient is exactly zero; factors over every tap
  would move them. The masked Conv (Linen and NNX) is skipped, refused when selected, and
  its params take the fallback: the update is zero wherever the mask is."""
  from flax import nnx
  x = jax.random.normal(jax.random.key(1), (4, 5, 5, 2))
  model = MaskedCNN()
  variables = jax.jit(model.init)(jax.random.key(0), x)
  predict = lambda v, x: model.apply(v, x)
  layers = perturbkit.kfac_layers(predict, variables, x)
  assert list(layers.layers) == ['head'] and 'masked Conv' in layers.skipped['conv']
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match='conv was selected.*masked Conv'):
    perturbkit.kfac_layers(predict, variables, x, filter=perturbkit.filters.by_type(nn.Conv))
  nnx_model = nnx.Sequential(nnx.Conv(2, 4, (3, 3), mask=MASK, rngs=nnx.Rngs(0)))
  nnx_layers = perturbkit.nnx.kfac_layers(nnx.Sequential(nnx_model, nnx.Linear(4, 3, rngs=nnx.Rngs(1))), x)
  assert list(nnx_layers.layers) == ['layers/1'] and 'masked Conv' in nnx_layers.skipped['layers/0/layers/0']
  _, grads, stats = jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                                      fisher='empirical'))(
      variables, x, jnp.array([0, 1, 2, 0]))
  masked = np.asarray(MASK) == 0
  assert float(np.abs(np.asarray(grads['conv']['kernel'])[masked]).max()) == 0.0
  tx = perturbkit.kfac_preconditioner(layers, damping=1e-2)
  updates, _ = jax.jit(lambda p, g, st: tx.update(g, tx.init(p), p, kfac_stats=st))(
      variables['params'], grads, stats)
  np.testing.assert_array_equal(np.asarray(updates['conv']['kernel'])[masked], 0.0)
  assert float(np.abs(np.asarray(updates['conv']['kernel'])[~masked]).max()) > 0


def test_layers_in_a_scan_are_stacked_layers_or_skipped_with_the_reason():
  """A Dense inside nn.scan has stacked params and one point per iteration: one layer with
  factors per iteration (``test_kfac_scan.py``). Inside a scan that does not map the
  perturbations its gradient cannot be read at all: skipped with that reason, refused when
  a filter selects it. The layers around the scan are layers."""
  x = jax.random.normal(jax.random.key(1), (3, 3))
  model = models.Scanned(map_perturbations=True)
  # The layers are found by tracing: the variables' shapes are all it reads.
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  layers = perturbkit.kfac_layers(lambda v, x: model.apply(v, x), variables, x)
  assert sorted(layers.layers) == ['Dense_0', 'Dense_1', 'scan/Dense_0']
  assert layers.layers['scan/Dense_0'].iterations == model.length
  model = models.Scanned(map_perturbations=False)
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  predict = lambda v, x: model.apply(v, x)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', perturbkit.UnperturbedCallsWarning)
    layers = perturbkit.kfac_layers(predict, variables, x)
    assert sorted(layers.layers) == ['Dense_0', 'Dense_1']
    assert 'does not map' in layers.skipped['scan/Dense_0']
    with pytest.raises(perturbkit.KFACUnsupportedLayerError, match='scan/Dense_0.*does not map'):
      perturbkit.kfac_layers(predict, variables, x, filter=perturbkit.filters.by_type(nn.Dense))


def test_tied_embedding_attend_is_skipped_not_half_preconditioned():
  class Tied(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      embed = nn.Embed(5, 4)
      return embed.attend(jnp.tanh(embed(tokens)))

  tokens = jnp.array([[0, 1], [2, 3]])
  variables, predict, layers = setup(Tied(), tokens)
  assert layers.layers == {}
  assert 'attend' in layers.skipped['Embed_0']


class ScaledInputDense(nn.Dense):
  """Overrides ``__call__``: the kernel multiplies ``3 x``, not the call's input."""

  def __call__(self, x):
    return super().__call__(3.0 * x)


class RenamedDense(nn.Dense):
  """A subclass that keeps ``nn.Dense.__call__``: the Dense rule applies."""


class LoRA(nn.Module):
  """The adapter written as the skip reason says: the Dense is a submodule."""
  features: int
  rank: int = 2

  @nn.compact
  def __call__(self, x):
    a = self.param('lora_a', nn.initializers.normal(0.1), (x.shape[-1], self.rank))
    b = self.param('lora_b', nn.initializers.normal(0.1), (self.rank, self.features))
    return nn.Dense(self.features)(x) + x @ a @ b


@pytest.mark.parametrize('subclass', [ScaledInputDense, models.LoRADense])
def test_a_dense_subclass_overriding_call_is_skipped_or_refused(subclass):
  """Its calls need not be a Dense's (the kernel may multiply something other than the call's
  input): skipped with the fix, refused when a filter or hand-built layers select it."""
  x = jax.random.normal(jax.random.key(1), (6, 3))
  model = nn.Sequential([nn.Dense(4), nn.tanh, subclass(3)])
  variables, predict, layers = setup(model, x)
  assert list(layers.layers) == ['layers_0']
  assert 'overrides nn.Dense.__call__' in layers.skipped['layers_2']
  assert 'make the nn.Dense a submodule' in layers.skipped['layers_2']
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match='overrides nn.Dense.__call__'):
    perturbkit.kfac_layers(predict, variables, x, filter=perturbkit.filters.by_type(nn.Dense))
  by_hand = perturbkit.LayerInfo('dense', ('layers_2',), 'kernel', (4, 3), True, ('__call__',))
  estimate = perturbkit.kfac_estimator(
      predict, 'softmax_cross_entropy', perturbkit.KFACLayers({'layers_2': by_hand}, {}),
      fisher='empirical')
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match='overrides nn.Dense.__call__'):
    estimate(variables, x, jnp.zeros((6,), jnp.int32))


def test_a_subclass_keeping_call_and_a_dense_submodule_have_the_dense_factors():
  """A subclass that keeps ``nn.Dense.__call__`` is a Dense; an adapter around an ``nn.Dense``
  submodule (the skip reason's fix) gives that Dense its factors and leaves the adapter's
  params to the fallback."""
  x = jax.random.normal(jax.random.key(1), (6, 3))
  y = jnp.arange(6) % 3
  variables, predict, layers = setup(nn.Sequential([RenamedDense(4), nn.tanh, LoRA(3)]), x)
  assert sorted(layers.layers) == ['layers_0', 'layers_2/Dense_0']
  assert layers.skipped == {'layers_2': 'LoRA has no K-FAC rule'}
  _, _, stats = jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                                  fisher='empirical'))(variables, x, y)

  def hand(params, x, eps):
    first, adapter = params['layers_0'], params['layers_2']
    h = jnp.tanh(bias(x @ first['kernel'], first['bias']) + eps[0])
    dense = adapter['Dense_0']
    out = (bias(h @ dense['kernel'], dense['bias']) + eps[1]
           + h @ adapter['lora_a'] @ adapter['lora_b'])
    return out, [x, h]

  inputs, gs = hand_factors(hand, variables['params'], x, lambda logits: y, [(6, 4), (6, 3)])
  assert_factors(stats, 'layers_0', *dense_reference(inputs[0], gs[0], 6))
  assert_factors(stats, 'layers_2/Dense_0', *dense_reference(inputs[1], gs[1], 6))


def test_a_bare_layer_as_the_model_is_refused_with_the_fix_that_works():
  """A model that is one ``nn.Dense`` owns its params at the root: no layer, a named error
  that says to wrap it; wrapped, its factors are ``E[ã ãᵀ]`` and ``E[g gᵀ]`` by hand."""
  x = jax.random.normal(jax.random.key(1), (4, 5))
  y = jnp.arange(4) % 3
  _, predict, layers = setup(nn.Dense(3), x)
  assert layers.layers == {}
  assert 'wrap it in a module, e.g. `nn.Sequential([nn.Dense(3)])`' in layers.skipped['<root>']
  with pytest.raises(perturbkit.KFACNoLayersError, match=r'must be wrapped in a module'):
    perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers)

  variables, predict, layers = setup(nn.Sequential([nn.Dense(3)]), x)
  _, _, stats = jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                                  fisher='empirical'))(variables, x, y)
  # per example: each row of the gradient is one example's
  g = jax.jit(lambda v: jax.grad(cross_entropy_sum)(predict(v, x), y))(variables)
  assert_factors(stats, 'layers_0', *dense_reference(x, np.asarray(g, np.float64), 4))


def test_misused_estimator_options_are_named_errors():
  x = jnp.ones((2, 5, 3))
  variables, predict, layers = setup(MLP(), x)
  with pytest.raises(perturbkit.InvalidOptionError, match="fisher='fast'.*'empirical'"):
    perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers, fisher='fast')
  exact = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers, fisher='exact')
  # Refused while tracing: under jax.jit, so that the ops before the refusals compile once.
  with pytest.raises(perturbkit.KFACExactFisherError, match=r"\(2, 5, 4\).*fisher='sampled'"):
    jax.jit(exact)(variables, x, jnp.zeros((2, 5), jnp.int32))
  sampled = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers)
  with pytest.raises(perturbkit.PRNGKeyError, match=r'jax\.random\.key\(seed\)'):
    jax.jit(sampled)(variables, x, jnp.zeros((2, 5), jnp.int32))


def test_arguments_of_the_wrong_kind_are_named_errors_where_given():
  """The params where the variables go, the layers dict where the KFACLayers go (or the
  KFACLayers where one LayerInfo goes), a string fallback, an integer seed and a string
  ``with_stats``: each a named error saying what to pass, raised where it is given."""
  from flax import nnx
  model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(3)])
  x, y = jnp.ones((8, 5)), jnp.zeros((8,), jnp.int32)
  variables = jax.jit(model.init)(jax.random.key(0), x)
  layers = perturbkit.kfac_layers(model.apply, variables, x)
  estimate = perturbkit.kfac_estimator(model.apply, 'softmax_cross_entropy', layers)
  with pytest.raises(perturbkit.NotVariablesError, match=r'pass the whole dict'):
    estimate(variables['params'], x, y, jax.random.key(0))
  with pytest.raises(perturbkit.PRNGKeyError, match=r'int 0.*jax\.random\.key\(seed\)'):
    estimate(variables, x, y, 0)
  with pytest.raises(perturbkit.InvalidOptionError, match=r"with_stats='no'.*boolean JAX scalar"):
    estimate(variables, x, y, jax.random.key(0), with_stats='no')
  with pytest.raises(perturbkit.InvalidOptionError, match=r'with_stats=1'):
    estimate(variables, x, y, jax.random.key(0), with_stats=1)
  given_dict = r'takes the KFACLayers.*given dict.*not its dict `layers\.layers`'
  with pytest.raises(perturbkit.KFACLayersTypeError, match=given_dict):
    perturbkit.kfac_estimator(model.apply, 'softmax_cross_entropy', layers.layers)
  with pytest.raises(perturbkit.KFACLayersTypeError, match=given_dict):
    perturbkit.kfac_preconditioner(layers.layers)
  with pytest.raises(perturbkit.KFACLayersTypeError, match=given_dict):
    perturbkit.nnx.kfac_estimator('softmax_cross_entropy', layers.layers)
  with pytest.raises(perturbkit.KFACLayersTypeError, match=given_dict):
    perturbkit.nnx.kfac_preconditioner(layers.layers)
  with pytest.raises(perturbkit.KFACLayersTypeError,
                     match=r'one LayerInfo.*given KFACLayers.*layers\.layers\[name\]'):
    perturbkit.kfac_segment(layers)
  with pytest.raises(perturbkit.NotAnOptimizerError, match=r"fallback is 'adam'.*optax\.adam"):
    perturbkit.kfac_preconditioner(layers, fallback='adam')
  # A transformation of the user's own (init and update, not optax's NamedTuple) is one.
  own = type('Own', (), {'init': staticmethod(optax.sgd(0.1).init),
                         'update': staticmethod(optax.sgd(0.1).update)})()
  perturbkit.kfac_preconditioner(layers, fallback=own).init(variables['params'])
  nnx_model = nnx.Sequential(nnx.Linear(5, 3, rngs=nnx.Rngs(0)))
  nnx_estimate = perturbkit.nnx.kfac_estimator('softmax_cross_entropy',
                                               perturbkit.nnx.kfac_layers(nnx_model, x))
  with pytest.raises(perturbkit.PRNGKeyError):
    nnx_estimate(nnx_model, x, y, 0)
  with pytest.raises(perturbkit.InvalidOptionError, match=r"with_stats='no'"):
    nnx_estimate(nnx_model, x, y, jax.random.key(0), with_stats='no')


def test_loss_without_distribution_names_what_to_pass():
  x = jnp.ones((2, 3))
  variables, predict, layers = setup(MLP(), x)
  with pytest.raises(perturbkit.KFACLossError, match='categorical_output'):
    perturbkit.kfac_estimator(predict, optax.hinge_loss, layers)
  custom = lambda out, t: jnp.sum(jnp.abs(out - t), axis=-1)
  with pytest.raises(perturbkit.KFACLossError, match="fisher='empirical'"):
    perturbkit.kfac_estimator(predict, custom, layers, fisher='sampled')
  # The empirical Fisher needs no distribution: any per-example loss works.
  _, _, stats = jax.jit(perturbkit.kfac_estimator(predict, custom, layers, fisher='empirical'))(
      variables, x, jnp.zeros((2, 4)))
  assert stats['Dense_2'].g.shape == (4, 4)


def test_a_loss_function_without_one_loss_per_example_is_refused():
  """Per-token losses would be averaged over the tokens too, where the named losses sum a
  sequence's tokens: a loss of another scale, and so of another gradient and Fisher."""
  x = jnp.ones((2, 5, 3))
  variables, predict, layers = setup(MLP(), x)
  per_token = lambda out, t: optax.softmax_cross_entropy_with_integer_labels(out, t)
  for estimate in (perturbkit.kfac_estimator(predict, per_token, layers, fisher='empirical'),
                   lambda *a: perturbkit.kfac_estimator(predict, per_token, layers,
                                                        fisher='empirical')(*a, with_stats=False)):
    with pytest.raises(perturbkit.KFACLossShapeError, match=r'shape \(2, 5\).*\(2,\)'):
      jax.jit(estimate)(variables, x, jnp.zeros((2, 5), jnp.int32))
  summed = lambda out, t: per_token(out, t).sum(axis=1)
  named = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers, fisher='empirical')
  own = perturbkit.kfac_estimator(predict, summed, layers, fisher='empirical')
  y = jnp.zeros((2, 5), jnp.int32)
  jax.tree.map(np.testing.assert_allclose,
               *jax.jit(lambda v: (own(v, x, y), named(v, x, y)))(variables))


def test_state_of_another_model_is_a_shape_error():
  x = jnp.ones((2, 3))
  variables, predict, layers = setup(MLP(), x)
  wider = nn.Sequential([nn.Dense(6), nn.Dense(5), nn.Dense(4)])
  tx = perturbkit.kfac_preconditioner(layers)
  other = {f'Dense_{i}': p for i, p in enumerate(
      jax.jit(wider.init)(jax.random.key(0), jnp.ones((2, 4)))['params'].values())}
  with pytest.raises(perturbkit.KFACShapeError, match='Dense_0'):
    tx.init(other)
  estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers)
  _, grads, stats = jax.jit(estimate)(variables, x, jnp.zeros(2, jnp.int32), jax.random.key(0))
  bad = {**stats, 'Dense_1': perturbkit.LayerFactors(jnp.zeros((3, 3)), stats['Dense_1'].g)}
  with pytest.raises(perturbkit.KFACShapeError, match='Dense_1'):
    tx.update(grads, tx.init(variables['params']), kfac_stats=bad)
  with pytest.raises(perturbkit.KFACUpdateArgsError, match='kfac_stats=stats'):
    tx.update(grads, tx.init(variables['params']))


# ---------------------------------------------------------------- many devices

def kfac_step(layers, estimate, axis_name):
  """One preconditioned step from fresh state: ``(loss, updates, factors)``; with ``axis_name``
  the loss and grads are averaged over the devices, the factors by the preconditioner."""
  tx = perturbkit.kfac_preconditioner(layers, damping=0.1, axis_name=axis_name)

  def run(params, x, y):
    loss, grads, stats = estimate({'params': params}, x, y)
    if axis_name:
      loss, grads = jax.lax.pmean((loss, grads), axis_name)
    updates, state = tx.update(grads, tx.init(params), params, kfac_stats=stats)
    return loss, updates, state.factors
  return run


def test_shard_map_factors_and_updates_equal_one_device():
  """The CNN's batch of 24 split over 8 devices under ``jax.shard_map``: the loss, factors and
  preconditioned updates equal one device on the whole batch."""
  x = jax.random.normal(jax.random.key(1), (3 * 8, 7, 7, 2))
  y = jnp.arange(24) % 5
  variables, predict, layers = setup(CNN(), x)
  estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers, fisher='exact')
  params = variables['params']
  loss1, updates1, factors1 = jax.jit(kfac_step(layers, estimate, None))(params, x, y)
  sharded = jax.shard_map(kfac_step(layers, estimate, 'data'), mesh=data_mesh(),
                          in_specs=(P(), P('data'), P('data')), out_specs=P(), check_vma=False)
  loss8, updates8, factors8 = jax.jit(sharded)(params, x, y)
  chex.assert_trees_all_close((loss8, factors8), (loss1, factors1), rtol=1e-5, atol=1e-6)
  # The damped inverses amplify float32 summation-order differences.
  chex.assert_trees_all_close(updates8, updates1, rtol=1e-3, atol=1e-5)
