"""Per-segment K-FAC inside the interleaved sweep, against whole-model K-FAC and a hand sweep.

One Dense layer per segment (the default layer-wise segments). With
``propagate='original'`` every segment's factors are the ordinary backpropagated
ones, so the step must equal the whole-model preconditioner fed the estimator's
empirical factors. With ``'updated'`` the reference is a sweep written out by hand
in float64 numpy: each layer's factors, damped inverses and step, then the
cotangent sent to the layer below computed with the layer's NEW kernel. On the test
process's 8 host CPU devices the sweep's factors and steps are checked against one device.
"""
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import perturbkit
from test_kfac import MLP
from host_devices import sharded_step

LR, DAMPING = 0.2, 0.1


class CNN(nn.Module):
  """Conv 3x3 SAME -> tanh -> Conv 3x3 stride 2 VALID -> tanh -> Dense."""
  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Conv(4, (3, 3), name='Conv_0')(x))
    x = jnp.tanh(nn.Conv(3, (3, 3), strides=2, padding='VALID', name='Conv_1')(x))
    return nn.Dense(4, name='Dense_0')(x.reshape(x.shape[0], -1))


class NormMLP(nn.Module):
  """Dense -> LayerNorm -> tanh -> Dense -> RMSNorm -> Dense."""
  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.LayerNorm(name='LayerNorm_0')(nn.Dense(6, name='Dense_0')(x)))
    x = nn.RMSNorm(name='RMSNorm_0')(nn.Dense(5, name='Dense_1')(x))
    return nn.Dense(4, name='Dense_2')(x)


@functools.cache
def initial_variables(model_type, shape):
  """``model_type()``'s variables for inputs of ``shape`` (they depend on the shape alone):
  compiled once per model and shape for the tests."""
  return jax.jit(model_type().init)(jax.random.key(0), jnp.zeros(shape))


def problem(steps, model=None):
  model = MLP() if model is None else model
  shape = (7, 7, 2) if isinstance(model, CNN) else (3,)
  xs = jax.random.normal(jax.random.key(1), (steps, 8) + shape)
  ys = jnp.arange(steps * 8).reshape(steps, 8) % 4
  variables = initial_variables(type(model), xs.shape[1:])
  predict = lambda v, x: model.apply(v, x)
  loss_fn = lambda v, x, y: optax.softmax_cross_entropy_with_integer_labels(
      predict(v, x), y).mean()
  return predict, loss_fn, variables, xs, ys


def segment_optimizer(layers, wrap=lambda tx: tx, **kfac):
  def optimizer(name):
    if name not in layers.layers:     # perturbkit.REST: no params in this model
      return wrap(optax.sgd(LR))
    return wrap(optax.chain(perturbkit.kfac_segment(layers.layers[name], **kfac),
                            optax.sgd(LR)))
  return optimizer


def accumulated(tx):
  """Gradient accumulation over two steps, whose update takes the extra arguments as
  ``**extra_args`` without being a ``GradientTransformationExtraArgs``."""
  return optax.MultiSteps(tx, every_k_schedule=2).gradient_transformation()


@pytest.mark.parametrize('model, accumulate', [(MLP(), False), (CNN(), False),
                                               (NormMLP(), False), (MLP(), True)],
                         ids=['mlp', 'cnn', 'norms', 'mlp-multisteps'])
def test_original_equals_whole_model_kfac_on_the_same_factors(model, accumulate):
  wrap, kfac_state = (accumulated, lambda s: s.inner_opt_state[0]) if accumulate else (
      lambda tx: tx, lambda s: s[0])
  predict, loss_fn, variables, xs, ys = problem(3, model)
  layers = perturbkit.kfac_layers(predict, variables, xs[0])
  kfac = dict(damping=DAMPING, decay=0.8, inverse_every=2, stats_every=1)
  tx = perturbkit.interleaved(loss_fn, segment_optimizer(layers, wrap, **kfac),
                              propagate='original')
  state = tx.init(variables, xs[0], ys[0])
  assert set(state.opt_state) == {*layers.layers, perturbkit.REST}
  step = jax.jit(tx.step)

  estimate = jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                               fisher='empirical'))
  whole = wrap(optax.chain(perturbkit.kfac_preconditioner(layers, **kfac), optax.sgd(LR)))
  whole_update = jax.jit(whole.update)
  params, whole_state = variables['params'], whole.init(variables['params'])
  for x, y in zip(xs, ys):
    state, metrics = step(state, x, y)
    loss, grads, stats = estimate({'params': params}, x, y)
    updates, whole_state = whole_update(grads, whole_state, params, kfac_stats=stats)
    params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(metrics['loss'], loss, rtol=1e-6)
    for name in layers.layers:
      segment = kfac_state(state.opt_state[name])
      chex.assert_trees_all_close(segment.factors['segment'],
                                  kfac_state(whole_state).factors[name], rtol=1e-5, atol=1e-6)
      chex.assert_trees_all_close(segment.inverses['segment'],
                                  kfac_state(whole_state).inverses[name], rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(state.params, params, rtol=1e-4, atol=1e-6)
  # Accumulating over two steps, the three steps take one K-FAC update.
  assert int(kfac_state(state.opt_state['Dense_0']).count) == (1 if accumulate else 3)
  assert {info.kind for info in layers.layers.values()} == {
      'mlp': {'dense'}, 'cnn': {'conv', 'dense'}, 'norms': {'dense', 'norm'}}[
          {MLP: 'mlp', CNN: 'cnn', NormMLP: 'norms'}[type(model)]]


def test_a_segment_on_flattened_rows_takes_the_batchs_examples():
  """A Dense segment run on ``(N * T, d)`` rows gets the same factors and steps as its twin on
  ``(N, T, d)``: the sweep gives the batch's examples (``segment_examples``), and the
  cotangent of the mean loss is scaled by them, not by the rows."""
  from test_kfac import TokenMLP
  xs = jax.random.normal(jax.random.key(1), (2, 4, 6, 3))
  ys = jnp.arange(8).reshape(2, 4) % 3
  states = []
  for flatten in (False, True):
    model = TokenMLP(flatten)
    variables = jax.jit(model.init)(jax.random.key(0), xs[0])
    predict = lambda v, x, model=model: model.apply(v, x)
    loss_fn = lambda v, x, y, predict=predict: optax.softmax_cross_entropy_with_integer_labels(
        predict(v, x), y).mean()
    layers = perturbkit.kfac_layers(predict, variables, xs[0])
    tx = perturbkit.interleaved(loss_fn, segment_optimizer(layers, damping=DAMPING,
                                                           inverse_every=1),
                                propagate='original')
    state, step = tx.init(variables, xs[0], ys[0]), jax.jit(tx.step)
    for x, y in zip(xs, ys):
      state, _ = step(state, x, y)
    states.append(state)
  chex.assert_trees_all_close(states[1].opt_state['Dense_0'][0].factors,
                              states[0].opt_state['Dense_0'][0].factors, rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(states[1].params, states[0].params, rtol=1e-5, atol=1e-7)


def test_a_step_whose_first_argument_is_not_the_batch_is_refused():
  """The examples are the first axis of the step's first array argument: a shared argument
  of shape ``(3,)`` passed first would scale ``A`` by 8/3 and ``G`` by (3/8)², silently.
  Refused, with the fix; passed after the batch, the factors are ``E[ã ãᵀ]`` and ``E[g gᵀ]``
  of the hand-written MLP."""
  predict, _, variables, xs, ys = problem(1)
  x, y, scale = xs[0], ys[0], jnp.ones((3,))
  layers = perturbkit.kfac_layers(predict, variables, x)
  optimizer = segment_optimizer(layers, damping=DAMPING, inverse_every=1)
  loss = lambda v, x, y, scale: optax.softmax_cross_entropy_with_integer_labels(
      predict(v, x), y).mean() * jnp.mean(scale)
  first = perturbkit.interleaved(lambda v, scale, x, y: loss(v, x, y, scale), optimizer,
                                 propagate='original')
  with pytest.raises(perturbkit.KFACExamplesError, match=r'Pass the batch first') as info:
    jax.jit(first.step)(first.init(variables, scale, x, y), scale, x, y)
  assert 'not the (or a multiple of the) 3 examples' in str(info.value)

  last = perturbkit.interleaved(loss, optimizer, propagate='original')
  state, _ = jax.jit(last.step)(last.init(variables, x, y, scale), x, y, scale)
  assert_hand_mlp_factors(state, variables, x, y)


def test_a_prng_key_passed_before_the_batch_is_not_counted_as_the_examples():
  """A loss ``(variables, rng, x, y)`` with a raw ``jax.random.PRNGKey`` first: its two
  ``uint32`` words are no batch of two (that count would scale ``A`` by 8/2 and ``G`` by
  (2/8)²); the examples are ``x``'s, and the factors those of the hand-written MLP."""
  predict, _, variables, xs, ys = problem(1)
  x, y = xs[0], ys[0]
  layers = perturbkit.kfac_layers(predict, variables, x)
  optimizer = segment_optimizer(layers, damping=DAMPING, inverse_every=1)
  loss = lambda v, rng, x, y: optax.softmax_cross_entropy_with_integer_labels(
      predict(v, x), y).mean()
  tx = perturbkit.interleaved(loss, optimizer, propagate='original')
  rng = jax.random.PRNGKey(0)
  state, _ = jax.jit(tx.step)(tx.init(variables, rng, x, y), rng, x, y)
  assert_hand_mlp_factors(state, variables, x, y)


def test_float64_segment_factors_and_step_are_float64():
  """A float64 segment's factors are the textbook ``E[ã ãᵀ]`` and ``E[g gᵀ]`` (``g`` the
  per-example gradient, ``examples`` times the mean loss's cotangent) in float64, and its
  running factors, inverses and step are float64 (they were float32, off by 1e-7)."""
  from test_kfac import assert_float64_close, hand_precondition, kernel_matrix
  layer = perturbkit.LayerInfo('dense', ('Dense_0',), 'kernel', (3, 2), True, ('__call__',))
  tx = perturbkit.kfac_segment(layer, damping=DAMPING)
  with jax.enable_x64(True):
    @jax.jit  # the inputs in one compile, not one per op
    def inputs():
      x, cotangent, kernel = (jax.random.normal(jax.random.key(i), shape, jnp.float64)
                              for i, shape in enumerate([(5, 3), (5, 2), (3, 2)]))
      params = {'kernel': kernel, 'bias': jnp.zeros(2, jnp.float64)}
      grads = {'kernel': x.T @ cotangent, 'bias': cotangent.sum(0)}
      return x, cotangent, params, grads

    x, cotangent, params, grads = inputs()
    update = jax.jit(functools.partial(tx.update, segment_examples=5))
    updates, state = update(grads, tx.init(params), params, segment_inputs=(x,),
                            segment_output_grad=cotangent)
  a = np.concatenate([np.asarray(x), np.ones((5, 1))], axis=1)
  g = 5 * np.asarray(cotangent)
  want_a, want_g = a.T @ a / 5, g.T @ g / 5
  assert_float64_close(state.factors['segment'].a, want_a)
  assert_float64_close(state.factors['segment'].g, want_g)
  assert all(leaf.dtype == jnp.float64 for leaf in state.inverses['segment'])
  assert all(leaf.dtype == jnp.float64 for leaf in updates.values())
  assert_float64_close(kernel_matrix(updates),
                       hand_precondition(kernel_matrix(grads), want_a, want_g, DAMPING))


def assert_hand_mlp_factors(state, variables, x, y):
  """The segments' factors after one step equal the hand-written MLP's on ``(x, y)``."""
  from test_kfac import dense_reference, hand_factors, hand_mlp
  inputs, gs = hand_factors(hand_mlp, variables['params'], x, lambda logits: y,
                            [(8, 6), (8, 5), (8, 4)])
  for i in range(3):
    a, g = dense_reference(inputs[i], gs[i], 8)
    factors = state.opt_state[f'Dense_{i}'][0].factors['segment']
    np.testing.assert_allclose(factors.a, a, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(factors.g, g, rtol=2e-5, atol=1e-6)


def hand_updated_sweep(params, x, y, factors, decay):
  """One update-then-propagate K-FAC step, by hand. ``factors[i]`` is the running
  ``(A, G)`` of layer ``i`` or ``None``; inverses are refreshed every step."""
  params = {k: {n: np.asarray(v, np.float64) for n, v in p.items()} for k, p in params.items()}
  x = np.asarray(x, np.float64)
  inputs, pre = [], []
  h = x
  for i in range(3):
    layer = params[f'Dense_{i}']
    inputs.append(h)
    z = h @ layer['kernel'] + layer['bias']
    pre.append(z)
    h = np.tanh(z) if i < 2 else z
  examples = x.shape[0]
  probs = np.exp(h - h.max(1, keepdims=True))
  probs /= probs.sum(1, keepdims=True)
  g = (probs - np.eye(4)[np.asarray(y)]) / examples   # d mean-loss / d logits
  new, new_factors = {}, [None] * 3
  for i in reversed(range(3)):
    if i < 2:
      g = g * (1 - np.tanh(pre[i]) ** 2)
    a = np.concatenate([inputs[i], np.ones((examples, 1))], axis=1)
    per_example = g * examples
    batch = (a.T @ a / examples, per_example.T @ per_example / examples)
    old = factors[i]
    running = batch if old is None else tuple(decay * o + (1 - decay) * b
                                              for o, b in zip(old, batch))
    new_factors[i] = running
    inv_a = np.linalg.inv(running[0] + DAMPING * np.eye(len(running[0])))
    inv_g = np.linalg.inv(running[1] + DAMPING * np.eye(len(running[1])))
    layer = params[f'Dense_{i}']
    theta = np.concatenate([layer['kernel'], layer['bias'][None]])
    theta = theta - LR * inv_a @ (a.T @ g) @ inv_g
    new[f'Dense_{i}'] = {'kernel': theta[:-1], 'bias': theta[-1]}
    g = g @ new[f'Dense_{i}']['kernel'].T    # propagated with the updated kernel
  return new, new_factors


@functools.cache
def updated_mlp_segments():
  """``(layers, tx, step)``: the MLP's K-FAC segments with ``propagate='updated'`` (the
  default; damping ``DAMPING``, decay 0.5, inverses every step) and its jitted step, compiled
  once for ``test_updated_equals_a_hand_sweep`` and ``test_nnx_segments_equal_the_linen_twin``."""
  predict, loss_fn, variables, xs, _ = problem(2)
  layers = perturbkit.kfac_layers(predict, variables, xs[0])
  tx = perturbkit.interleaved(
      loss_fn, segment_optimizer(layers, damping=DAMPING, decay=0.5, inverse_every=1))
  return layers, tx, jax.jit(tx.step)


def test_updated_equals_a_hand_sweep():
  predict, _, variables, xs, ys = problem(2)
  layers, tx, step = updated_mlp_segments()
  state = tx.init(variables, xs[0], ys[0])
  params, factors = variables['params'], [None] * 3
  for x, y in zip(xs, ys):
    state, _ = step(state, x, y)
    params, factors = hand_updated_sweep(params, x, y, factors, 0.5)
    for i in range(3):
      segment = state.opt_state[f'Dense_{i}'][0].factors['segment']
      np.testing.assert_allclose(segment.a, factors[i][0], rtol=1e-4, atol=1e-6)
      np.testing.assert_allclose(segment.g, factors[i][1], rtol=1e-4, atol=1e-6)
    chex.assert_trees_all_close(state.params, params, rtol=1e-4, atol=1e-6)
  # The sweep's own cotangents differ from backpropagation at the old weights.
  plain = hand_updated_sweep(variables['params'], xs[0], ys[0], [None] * 3, 0.5)
  original = jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                               fisher='empirical'))(variables, xs[0], ys[0])[2]
  assert not np.allclose(plain[1][0][1], original['Dense_0'].g, rtol=1e-3)


def test_amortised_segment_statistics_and_errors():
  predict, loss_fn, variables, xs, ys = problem(3)
  layers = perturbkit.kfac_layers(predict, variables, xs[0])
  tx = perturbkit.interleaved(loss_fn, segment_optimizer(
      layers, damping=DAMPING, decay=0.5, inverse_every=2), propagate='original')
  state = tx.init(variables, xs[0], ys[0])
  step = jax.jit(tx.step)
  taken = []
  for x, y in zip(xs, ys):
    before = state.opt_state['Dense_1'][0].factors['segment']
    taken.append(bool(state.opt_state['Dense_1'][0].stats_due))
    state, _ = step(state, x, y)
    after = state.opt_state['Dense_1'][0].factors['segment']
    assert np.allclose(before.a, after.a) != taken[-1]
  assert taken == [True, False, True]

  embed = perturbkit.LayerInfo('embed', ('Embed_0',), 'embedding', (7, 3), False,
                               ('__call__',))
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match='Embed'):
    perturbkit.kfac_segment(embed)
  alone = perturbkit.kfac_segment(layers.layers['Dense_0'])
  w = variables['params']['Dense_0']
  with pytest.raises(perturbkit.KFACUpdateArgsError, match='segment_inputs'):
    alone.update(w, alone.init(w), w)
  # A coarser segment than the layer (here: the whole model) is named, not half-handled.
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match='one Dense, Conv or norm call'):
    alone.init(variables['params'])


def test_shard_map_segment_factors_and_steps_equal_one_device():
  """Each of 8 devices forms its 2 examples' factors in the sweep; averaged over the axis they
  are the whole batch's, so two steps on 8 devices (``jax.shard_map``) equal one device: the
  factors and optimizer states, and the params."""
  predict, loss_fn, variables, xs, ys = problem(2)
  x, y = xs.reshape(16, 3), ys.reshape(16)
  layers = perturbkit.kfac_layers(predict, variables, x)
  kfac = dict(damping=DAMPING, decay=0.5, inverse_every=1)
  single = perturbkit.interleaved(loss_fn, segment_optimizer(layers, **kfac))
  parallel = perturbkit.interleaved(
      loss_fn, segment_optimizer(layers, **kfac, axis_name='data'), axis_name='data')
  step = sharded_step(parallel.step)
  s1, s8 = single.init(variables, x, y), parallel.init(variables, x, y)
  step1 = jax.jit(single.step)
  for _ in range(2):
    s1, _ = step1(s1, x, y)
    s8, _ = step(s8, x, y)
  chex.assert_trees_all_close(s8.opt_state, s1.opt_state, rtol=1e-4, atol=1e-6)
  chex.assert_trees_all_close(s8.params, s1.params, rtol=1e-4, atol=1e-6)


def stepped_twins(model, nnx_layers, variables, loss_fn, linen_layers, xs, ys, propagate,
                  linen=None, **kfac):
  """An NNX model and its Linen twin stepped on ``xs, ys`` by K-FAC segments (and SGD), their
  losses equal at every step: ``(NNX state, Linen state)``. ``linen``: the Linen twin's
  ``(interleaved, jitted step)`` with these options, when already made."""
  nnx_loss = lambda m, x, y: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
  nnx_tx = perturbkit.nnx.interleaved(nnx_loss, segment_optimizer(nnx_layers, **kfac),
                                      propagate=propagate)
  if linen is None:
    linen_tx = perturbkit.interleaved(loss_fn, segment_optimizer(linen_layers, **kfac),
                                      propagate=propagate)
    linen = linen_tx, jax.jit(linen_tx.step)
  linen_tx, linen_step = linen
  s_nnx, s_linen = nnx_tx.init(model, xs[0], ys[0]), linen_tx.init(variables, xs[0], ys[0])
  nnx_step = jax.jit(nnx_tx.step)
  for x, y in zip(xs, ys):
    s_nnx, m_nnx = nnx_step(s_nnx, x, y)
    s_linen, m_linen = linen_step(s_linen, x, y)
    np.testing.assert_allclose(m_nnx['loss'], m_linen['loss'], rtol=1e-6)
  return s_nnx, s_linen


def test_nnx_segments_equal_the_linen_twin():
  """The NNX front end runs the same sweep: K-FAC segments on an NNX MLP, built from
  hand-written ``LayerInfo``s (equal to those ``perturbkit.nnx.kfac_layers`` finds), equal the
  Linen twin's, whose layers ``kfac_layers`` found."""
  from flax import nnx
  import nnx_models
  from test_nnx_kfac import NNXMLP  # test_kfac's MLP written in NNX

  model = nnx.jit(lambda: NNXMLP(nnx.Rngs(0)))()  # one compile, not one per eager op
  variables = nnx_models.linen_variables(model)
  predict, loss_fn, _, xs, ys = problem(2)
  linen_layers = perturbkit.kfac_layers(predict, variables, xs[0])
  hand_layers = perturbkit.KFACLayers(
      layers={f'Dense_{i}': perturbkit.LayerInfo('dense', (f'Dense_{i}',), 'kernel',
                                                 (din, dout), True, ('__call__',))
              for i, (din, dout) in enumerate([(3, 6), (6, 5), (5, 4)])},
      skipped=linen_layers.skipped)
  assert hand_layers.layers == linen_layers.layers
  # The NNX front end finds the same layers, and its kfac_segment is the same rule.
  assert perturbkit.nnx.kfac_layers(model, xs[0]).layers == hand_layers.layers
  assert perturbkit.nnx.kfac_segment is perturbkit.kfac_segment
  shared_layers, *updated = updated_mlp_segments()  # the same layers, options and step
  assert shared_layers == linen_layers
  for propagate in ('updated', 'original'):
    s_nnx, s_linen = stepped_twins(model, hand_layers, variables, loss_fn, linen_layers, xs, ys,
                                   propagate, linen=updated if propagate == 'updated' else None,
                                   damping=DAMPING, decay=0.5, inverse_every=1)
    chex.assert_trees_all_close(nnx_models.pure(nnx.state(s_nnx.model(), nnx.Param)),
                                s_linen.params, rtol=1e-5, atol=1e-6)
    for name in hand_layers.layers:
      chex.assert_trees_all_close(s_nnx.opt_state[name][0].factors,
                                  s_linen.opt_state[name][0].factors, rtol=1e-5, atol=1e-6)
