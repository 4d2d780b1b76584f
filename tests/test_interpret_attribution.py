"""Layer integrated gradients, Grad-CAM and learnable interventions against independent references.

* Integrated gradients: completeness (each call's attributions sum to the metric's change when
  that call's output goes to the baseline, measured with the model written out by hand), with
  an error that shrinks with the steps; each attribution against ``jax.grad`` of the
  hand-written model with the call's output as an explicit argument, at numpy's Gauss-Legendre
  nodes (or the trapezoid rule's), summed with their weights here.
* Grad-CAM against ``jax.vjp`` of the demo CNN written out with explicit deltas at its
  convolutions, the map computed here from the definition.
* A steering vector's gradient against ``jax.grad`` of the hand-written model with the vector
  as an explicit parameter; optax training it lowers a loss; gates at 1 give the unedited run;
  the model's variables get no gradient.
* NNX against the Linen twin, for all three. Every named error, and the fix it suggests.
"""
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import hand_mlp
import models
import nnx_models
import perturbkit
import perturbkit.interpret._sweep as sweep_module
from perturbkit.interpret import _grad_cam
from hand_mlp import NAMES, SHAPE, metric_of
from perturbkit import filters, interpret
from perturbkit.demo._digits import SmallCNN

TOL = dict(rtol=1e-5, atol=1e-6)
smooth_by_hand = functools.partial(hand_mlp.by_hand, activation=jnp.tanh)  # models.SmoothMLP
outputs_by_hand = functools.partial(hand_mlp.outputs_by_hand, activation=jnp.tanh)


def replaced(params, x, name, value):
  """The metric with call ``name``'s output replaced by ``value``."""
  return metric_of(smooth_by_hand(params, x, lambda n, h: jnp.broadcast_to(value, h.shape)
                                  if n == name else h))


@pytest.fixture(scope='module', name='smooth')
def _smooth():
  model = models.SmoothMLP()
  variables, x, baseline = hand_mlp.problem(model)
  metric = lambda v, x: metric_of(model.apply(v, x))
  return variables, x, baseline, metric


# --- layer integrated gradients ------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(2, 6))
def ig_by_hand(params, x, name, b, alphas, weights, per='btd->t'):
  """Per token (or as ``per`` sums): ``(a - b) . sum_k w_k grad(alpha_k)``, ``grad`` by
  ``jax.grad`` of the model."""
  a = outputs_by_hand(params, x)[name]
  grad = jax.grad(lambda h: replaced(params, x, name, h))
  grads = jax.vmap(lambda alpha: grad(b + alpha * (a - b)))(jnp.asarray(alphas, jnp.float32))
  mean_grad = jnp.tensordot(jnp.asarray(weights, jnp.float32), grads, axes=1)
  product = (a - b) * mean_grad
  return jnp.einsum(per, product if per == 'btd->t' else product.reshape(SHAPE[:2] + (2, 4)))


@pytest.mark.parametrize('groups', [1, 2, 8])
def test_integrated_gradients_equal_grad_of_the_model_by_hand_at_the_same_nodes(
    smooth, groups, monkeypatch):
  """In at most ``groups`` groups of neighbouring calls (see the activation patching test)."""
  monkeypatch.setattr(sweep_module, 'GROUPS', groups)
  variables, x, baseline, metric = smooth
  params = variables['params']
  steps = 5
  nodes, weights = np.polynomial.legendre.leggauss(steps)
  ig = perturbkit.layer_integrated_gradients(metric, axis=1, steps=steps)
  result = jax.jit(ig)(variables, x, baseline)
  base = outputs_by_hand(params, baseline)
  want = jnp.stack([ig_by_hand(params, x, n, base[n], (nodes + 1) / 2, weights / 2)
                    for n in NAMES])
  assert result.paths == NAMES and result.positions == tuple(range(SHAPE[1]))
  assert result.gaps is None and result.endpoint_metrics is None  # not asked for
  chex.assert_trees_all_close(result.effects, want, **TOL)
  chex.assert_trees_all_close((result.clean_metric, result.corrupted_metric),
                              (metric_of(smooth_by_hand(params, x)),
                               metric_of(smooth_by_hand(params, baseline))), **TOL)

  alphas, weights = np.linspace(0, 1, 4), np.array([0.5, 1.0, 1.0, 0.5]) / 3
  zero = jax.jit(perturbkit.layer_integrated_gradients(
      metric, steps=4, method='riemann_trapezoid', batch_size=5, progress=True))(variables, x)
  want = [ig_by_hand(params, x, n, 0.0, alphas, weights).sum() for n in NAMES]
  chex.assert_trees_all_close(zero.effects[:, 0], jnp.stack(want), **TOL)


def test_integrated_gradients_per_head_of_a_view_equal_the_heads_by_hand(smooth):
  """Dense_0's and Dense_1's 8 features as 2 heads of 4: one row per head."""
  variables, x, baseline, metric = smooth
  params = variables['params']
  nodes, weights = np.polynomial.legendre.leggauss(4)
  base = outputs_by_hand(params, baseline)
  ig = perturbkit.layer_integrated_gradients(metric, filter=filters.by_path('Dense_0', 'Dense_1'),
                                             axis=2, view=(-1, SHAPE[1], 2, 4), steps=4)
  got = jax.jit(ig)(variables, x, baseline)
  want = jnp.stack([ig_by_hand(params, x, n, base[n], (nodes + 1) / 2, weights / 2, 'btkd->k')
                    for n in NAMES[:2]])
  assert got.positions == (0, 1)
  chex.assert_trees_all_close(got.effects, want, **TOL)


def test_integrated_gradients_are_complete_with_an_error_that_shrinks_with_steps(smooth):
  variables, x, baseline, metric = smooth
  params = variables['params']
  base = outputs_by_hand(params, baseline)
  total = metric_of(smooth_by_hand(params, x))
  run = lambda steps, method, b: jax.jit(perturbkit.layer_integrated_gradients(
      metric, steps=steps, method=method))(variables, x, b).effects[:, 0]
  change = jnp.stack([total - replaced(params, x, n, 0.0) for n in NAMES])
  np.testing.assert_allclose(run(16, 'gauss_legendre', None), change, rtol=1e-4, atol=1e-6)

  change = jnp.stack([total - replaced(params, x, n, base[n]) for n in NAMES])
  np.testing.assert_allclose(run(16, 'gauss_legendre', baseline), change, rtol=1e-4, atol=1e-6)
  errors = [float(jnp.abs(run(steps, 'riemann_trapezoid', baseline) - change).max())
            for steps in (3, 9)]
  # The trapezoid rule's error falls as 1/steps^2: (8/2)^2 = 16 times from 3 to 9 steps.
  assert errors[1] < errors[0] / 8 and errors[1] < 2e-2 * float(jnp.abs(change).max()), errors


def test_integrated_gradients_of_nnx_equal_its_linen_twin():
  model = nnx_models.MLP(rngs=nnx.Rngs(0))
  variables = nnx_models.linen_variables(model)
  linen = nnx_models.LinenMLP()
  x, baseline = (jax.random.normal(jax.random.key(k), SHAPE) for k in (1, 2))
  got = jax.jit(perturbkit.nnx.layer_integrated_gradients(lambda m, x: metric_of(m(x)), axis=1,
                                                          steps=2, gaps=True))(model, x, baseline)
  want = jax.jit(perturbkit.layer_integrated_gradients(lambda v, x: metric_of(linen.apply(v, x)),
                                                       axis=1, steps=2, gaps=True))(
                                                           variables, x, baseline)
  assert got.paths == want.paths == ('dense_0/__call__', 'dense_1/__call__',
                                     'dense_1/__call__#1', 'dense_2/__call__')
  chex.assert_trees_all_close(got, want, **TOL)  # the gaps and endpoint metrics too
  assert float(jnp.abs(got.gaps).max()) > 1e-3  # two nodes: far from complete


def test_integrated_gradients_gaps_against_the_edited_run_and_the_effects(smooth):
  """``gaps=True``: each call's endpoint metric is the run with its output replaced by its
  baseline (``run_with_edits`` and the model by hand), and its gap is the effects' sum minus
  the change, under 1% at 64 steps on a smooth model."""
  variables, x, baseline, metric = smooth
  params = variables['params']
  ig = perturbkit.layer_integrated_gradients(metric, axis=1, steps=64, gaps=True)
  edited = perturbkit.run_with_edits(metric)

  @jax.jit
  def with_references(variables, x, baseline):
    base = outputs_by_hand(params, baseline)
    return (ig(variables, x, baseline),
            jnp.stack([edited(variables, {n: interpret.replace(base[n])}, x) for n in NAMES]),
            jnp.stack([replaced(params, x, n, base[n]) for n in NAMES]))

  result, want, by_hand = with_references(variables, x, baseline)
  chex.assert_trees_all_close((result.endpoint_metrics, result.endpoint_metrics),
                              (want, by_hand), **TOL)
  change = result.clean_metric - result.endpoint_metrics
  chex.assert_trees_all_close(result.gaps, result.effects.sum(1) - change, **TOL)
  assert float(jnp.abs(result.gaps / change).max()) < 1e-2, (result.gaps, change)
  assert float(jnp.abs(change).min()) > 1e-2


def _gap_by_hand(rest, a, b, steps=16):
  """``(rest(b), gap)`` of one call: ``rest`` the metric of the call's output,
  ``jax.grad`` along ``b + alpha (a - b)`` at numpy's Gauss-Legendre nodes, minus
  ``rest(a) - rest(b)``."""
  nodes, weights = np.polynomial.legendre.leggauss(steps)
  grads = jax.vmap(lambda alpha: jax.grad(rest)(b + alpha * (a - b)))(
      jnp.asarray((nodes + 1) / 2, jnp.float32))
  integral = jnp.sum((a - b) * jnp.tensordot(jnp.asarray(weights / 2, jnp.float32), grads, 1))
  return rest(b), integral - (rest(a) - rest(b))


def test_integrated_gradients_gaps_through_layer_norm_from_zeros_are_large():
  """Dense -> LayerNorm -> Dense: from a zero baseline LayerNorm's input is ~0 near it, where
  the integrand peaks, so 16 nodes leave much of the change unattributed; the gap says so and
  equals the hand computation, the endpoint the zero-ablated run. From a baseline input's
  outputs the gap is small. (NNX's gaps: against its Linen twin's, below.)"""
  x, baseline = (jax.random.normal(jax.random.key(k), (2, 3)) for k in (1, 2))
  # A nonzero bias after the norm: the metric at the zero baseline is no 0.
  model = nn.Sequential([nn.Dense(4), nn.LayerNorm(),
                         nn.Dense(1, bias_init=nn.initializers.constant(0.2))])
  variables = jax.jit(model.init)(jax.random.key(0), x)
  metric = lambda v, x: jnp.tanh(model.apply(v, x)).mean()
  ig = perturbkit.layer_integrated_gradients(metric, filter=filters.by_path('layers_0'),
                                             gaps=True)
  zero_ablated = perturbkit.run_with_edits(metric)

  @jax.jit
  def with_references(variables, x, baseline):
    dense = lambda x: model.apply(variables, x, method=lambda m, x: m.layers[0](x))
    rest = lambda h: jnp.tanh(model.apply(variables, h, method=lambda m, h: m.layers[2](
        m.layers[1](h)))).mean()
    zeroed = zero_ablated(variables, {'layers_0/__call__': interpret.zero_ablate()}, x)
    return (ig(variables, x), ig(variables, x, baseline), zeroed,
            _gap_by_hand(rest, dense(x), jnp.zeros((2, 4))),
            _gap_by_hand(rest, dense(x), dense(baseline)))

  zero, near, zeroed, (endpoint, gap), (near_endpoint, near_gap) = with_references(
      variables, x, baseline)
  chex.assert_trees_all_close((zero.endpoint_metrics[0], zero.gaps[0]), (zeroed, gap), **TOL)
  chex.assert_trees_all_close(endpoint, zeroed, **TOL)
  assert abs(float(gap)) > 0.25 * abs(float(zero.clean_metric - endpoint)), gap
  chex.assert_trees_all_close((near.endpoint_metrics[0], near.gaps[0]),
                              (near_endpoint, near_gap), **TOL)
  assert abs(float(near_gap)) < 1e-3 * abs(float(near.clean_metric - near_endpoint)), near_gap
  assert abs(float(zeroed)) > 0.1


def test_invalid_steps_and_method():
  for steps in (0, -2, 1.5, True, '8'):
    with pytest.raises(perturbkit.InvalidOptionError, match='steps'):
      perturbkit.layer_integrated_gradients(lambda v, x: 0.0, steps=steps)
  with pytest.raises(perturbkit.InvalidOptionError, match=r'steps.*riemann_trapezoid'):
    perturbkit.nnx.layer_integrated_gradients(lambda m, x: 0.0, steps=1,
                                              method='riemann_trapezoid')
  with pytest.raises(perturbkit.InvalidOptionError, match="method.*'gauss_legendre'"):
    perturbkit.layer_integrated_gradients(lambda v, x: 0.0, method='simpson')
  with pytest.raises(perturbkit.InvalidOptionError, match='batch_size'):
    perturbkit.layer_integrated_gradients(lambda v, x: 0.0, batch_size=0)
  alphas, weights = interpret.quadrature('gauss_legendre', 1)
  assert alphas.tolist() == [0.5] and weights.tolist() == [1.0]
  with pytest.raises(perturbkit.InvalidOptionError, match='gaps'):
    perturbkit.layer_integrated_gradients(lambda v, x: 0.0, gaps='yes')


def test_integrated_gradients_gaps_need_every_position(smooth):
  """A gap compares the sum over all positions with the change: a subset is refused, every
  position in another order is taken."""
  variables, x, _, metric = smooth
  with pytest.raises(perturbkit.InvalidOptionError, match=r'every index along axis 1.*gaps'):
    jax.eval_shape(perturbkit.layer_integrated_gradients(
        metric, axis=1, positions=[0, 1, 2, 3, 3], gaps=True), variables, x)
  result = jax.eval_shape(perturbkit.layer_integrated_gradients(
      metric, axis=1, positions=[4, 3, 2, 1, -5], gaps=True), variables, x)
  assert result.gaps.shape == result.endpoint_metrics.shape == (3,)


# --- Grad-CAM ------------------------------------------------------------------------


def cnn_by_hand(params, x, deltas):
  """``SmallCNN`` written out, with explicit additive deltas at its two convolutions."""
  conv = lambda name, n, h: nn.Conv(n, (3, 3)).apply({'params': params[name]}, h)
  a0 = conv('Conv_0', 16, x) + deltas[0]
  h = nn.avg_pool(nn.relu(a0), (2, 2), strides=(2, 2))
  a1 = conv('Conv_1', 32, h) + deltas[1]
  h = nn.avg_pool(nn.relu(a1), (2, 2), strides=(2, 2)).reshape((x.shape[0], -1))
  h = nn.relu(nn.Dense(64).apply({'params': params['Dense_0']}, h))
  return nn.Dense(10).apply({'params': params['Dense_1']}, h), (a0, a1)


def test_grad_cam_equals_the_definition_with_vjp_gradients():
  model = SmallCNN()
  images = jax.random.uniform(jax.random.key(1), (3, 8, 8, 1))
  labels = jnp.array([1, 4, 7])
  variables = jax.jit(model.init)(jax.random.key(0), images)
  score = lambda logits: jnp.sum(jnp.take_along_axis(logits, labels[:, None], axis=1))
  metric, maps = jax.jit(perturbkit.grad_cam(lambda v, x: score(model.apply(v, x))))(
      variables, images)

  params = variables['params']
  zeros = (jnp.zeros((3, 8, 8, 16)), jnp.zeros((3, 4, 4, 32)))


  @jax.jit
  def by_hand(params, images):
    (value, feature_maps), vjp = jax.vjp(lambda d: cnn_by_hand(params, images, d), zeros)
    grads = vjp((jax.nn.one_hot(labels, 10), jax.tree.map(jnp.zeros_like, feature_maps)))[0]
    cams = {}
    for name, a, g in zip(('Conv_0/__call__', 'Conv_1/__call__'), feature_maps, grads):
      weights = g.mean(axis=(1, 2))
      cams[name] = jnp.maximum(jnp.sum(a * weights[:, None, None, :], axis=-1), 0.0)
    return value, cams

  value, want = by_hand(params, images)
  chex.assert_trees_all_close(metric, score(value), **TOL)
  chex.assert_trees_all_close(maps, want, **TOL)
  assert maps['Conv_1/__call__'].shape == (3, 4, 4) and float(maps['Conv_1/__call__'].max()) > 0

  one = perturbkit.grad_cam(lambda v, x: score(model.apply(v, x)), upsample=True,
                            filter=filters.by_path('Conv_1'))
  _, upsampled = jax.jit(one)(variables, images)
  assert list(upsampled) == ['Conv_1/__call__']
  chex.assert_trees_all_close(
      upsampled['Conv_1/__call__'],
      jax.image.resize(want['Conv_1/__call__'], (3, 8, 8), 'bilinear'), **TOL)

  # Channels-first pixel values (as Hugging Face's image processors make them), transposed
  # inside the metric: axes 1 and 2 are (channels, height), not the images' height and width.
  pixels = jnp.transpose(images, (0, 3, 1, 2))
  channels_first = lambda v, x: score(model.apply(v, jnp.transpose(x, (0, 2, 3, 1))))
  with pytest.raises(perturbkit.ImageLayoutError, match=r'Conv_1/__call__ makes a \(4, 4\) map'):
    jax.jit(perturbkit.grad_cam(channels_first, upsample=True, filter=filters.by_path('Conv_1')))(
        variables, pixels)
  _, sized = jax.jit(perturbkit.grad_cam(channels_first, upsample=(8, 8),
                                         filter=filters.by_path('Conv_1')))(variables, pixels)
  chex.assert_trees_all_close(sized, upsampled, **TOL)


def test_grad_cam_of_nnx_equals_its_linen_twin():
  model = nnx_models.ConvNet(rngs=nnx.Rngs(0))
  variables = nnx_models.linen_variables(model)
  twin = nnx_models.LinenConvNet()
  images = nnx_models.random_batch((2, 5, 5, 1))
  got = jax.jit(perturbkit.nnx.grad_cam(lambda m, x: m(x)[:, 0].sum(), upsample=True))(
      model, images)
  want = jax.jit(perturbkit.grad_cam(lambda v, x: twin.apply(v, x)[:, 0].sum(), upsample=True))(
      variables, images)
  assert list(got[1]) == ['conv/__call__'] and list(want[1]) == ['conv/__call__']
  chex.assert_trees_all_close(got, want, **TOL)


def test_grad_cam_at_a_call_that_is_not_a_feature_map():
  model = SmallCNN()
  images = jnp.ones((2, 8, 8, 1))
  variables = jax.jit(model.init)(jax.random.key(0), images)
  metric = lambda v, x: model.apply(v, x)[:, 0].sum()
  # The errors are raised while the function is traced (under jax.jit: nothing runs op by op).
  with pytest.raises(perturbkit.FeatureMapShapeError, match=r'Dense_0/__call__ returns \(2, 64\)'):
    jax.jit(perturbkit.grad_cam(metric, filter=filters.by_path('Conv_1', 'Dense_0')))(
        variables, images)
  with pytest.raises(perturbkit.InvalidOptionError, match='upsample'):
    jax.jit(perturbkit.grad_cam(lambda v, x: metric(v, x[0]), upsample=True))(
        variables, images[None])
  # Several inputs (images and labels): upsample=True cannot tell the images; a size can.
  with pytest.raises(perturbkit.InvalidOptionError, match='upsample.*structure'):
    jax.jit(perturbkit.grad_cam(lambda v, xy: metric(v, xy[0]), upsample=True))(
        variables, (images, 0))
  for wrong in ('yes', (8,), (8, 0), (True, True), 8):
    with pytest.raises(perturbkit.InvalidOptionError, match='upsample'):
      perturbkit.grad_cam(metric, upsample=wrong)
  # A (4, 4) map of (batch, 3, 16, 16) channels-first pixels is refused; a map strided along
  # one axis only (a spectrogram's, a signal's) is resized as it is.
  with pytest.raises(perturbkit.ImageLayoutError, match=r'\(3, 16\)'):
    _grad_cam.resized(jnp.ones((2, 4, 4)), jnp.ones((2, 3, 16, 16)), True, 'stage', 'grad_cam')
  signal = _grad_cam.resized(jnp.ones((2, 1, 25)), jnp.ones((2, 1, 100, 1)), True, 'c', 'g')
  chex.assert_trees_all_close(signal, jnp.ones((2, 1, 100)), **TOL)
  _, maps = jax.jit(perturbkit.grad_cam(metric, filter=filters.by_path('Conv_1')))(
      variables, images)
  assert list(maps) == ['Conv_1/__call__']


# --- learnable interventions ---------------------------------------------------------


@pytest.fixture(scope='module', name='mlp')
def _mlp():
  model = models.MLP()
  x = jax.random.normal(jax.random.key(1), SHAPE)
  variables = jax.jit(model.init)(jax.random.key(0), x)
  return model, variables, x


mlp_by_hand = hand_mlp.by_hand  # models.MLP


def target_loss(out):
  return jnp.mean((out[..., 0] - 1.0) ** 2 + (out[..., 1] + 1.0) ** 2)


def test_steering_vector_gradient_equals_the_vector_as_an_explicit_parameter(mlp):
  model, variables, x = mlp
  interventions = {
      'steer': interpret.steering_vector('Dense_1/__call__', (8,), positions=[1, 3], axis=1),
      'gate': interpret.gates('Dense_0/__call__', (8,), init_logit=0.5)}
  run = perturbkit.run_with_interventions(model.apply, interventions)
  params = interpret.init_interventions(interventions)
  params['steer'] = jax.random.normal(jax.random.key(5), (8,))
  loss = lambda p: target_loss(run(variables, p, x)) + 0.1 * interpret.gate_penalty(p['gate'])

  tokens = jnp.zeros(SHAPE[1], bool).at[jnp.array([1, 3])].set(True)[None, :, None]

  def by_hand(p):
    def edit(name, h):
      if name == 'Dense_1/__call__':
        return jnp.where(tokens, h + jnp.broadcast_to(p['steer'], h.shape), h)
      if name == 'Dense_0/__call__':
        return h * jnp.broadcast_to(jax.nn.sigmoid(p['gate']), h.shape)
      return h
    return (target_loss(mlp_by_hand(variables['params'], x, edit))
            + 0.1 * jnp.sum(jax.nn.sigmoid(p['gate'])))

  chex.assert_trees_all_close(jax.jit(jax.value_and_grad(loss))(params),
                              jax.jit(jax.value_and_grad(by_hand))(params), **TOL)
  # The model's variables are frozen: no gradient reaches them.
  frozen = jax.jit(jax.grad(lambda v: target_loss(run(v, params, x))))(variables)
  assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(frozen))


def test_optax_trains_a_steering_vector_to_lower_a_loss(mlp):
  model, variables, x = mlp
  steer = {'steer': interpret.steering_vector('Dense_1/__call__', (8,))}
  run = perturbkit.run_with_interventions(model.apply, steer)
  loss = lambda p: target_loss(run(variables, p, x))
  optimizer = optax.adam(0.1)

  @jax.jit
  def step(params, opt_state):
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, value

  params = interpret.init_interventions(steer)
  opt_state = optimizer.init(params)
  losses = []
  for _ in range(15):
    params, opt_state, value = step(params, opt_state)
    losses.append(float(value))
  np.testing.assert_allclose(losses[0], target_loss(model.apply(variables, x)), rtol=1e-6)
  assert loss(params) < 0.5 * losses[0], losses


def test_gate_penalty_of_float16_logits_is_summed_past_float16s_range():
  """200000 float16 gates at logit 0 sum to 100000, past float16's largest value: the
  penalty was inf, and so was a loss it was added to."""
  logits = {'a': jnp.zeros(200_000, jnp.float16), 'b': jnp.full((3,), 2.0, jnp.bfloat16)}
  want = 100_000 + 3 / (1 + np.exp(-2.0))
  np.testing.assert_allclose(perturbkit.interpret.gate_penalty(logits), want, rtol=1e-3)


def test_gates_at_one_are_the_unedited_run_and_nnx_equals_its_linen_twin(mlp):
  model, variables, x = mlp
  gate = {'gate': interpret.gates('Dense_1/__call__', (8,), init_logit=30.0)}
  run = jax.jit(perturbkit.run_with_interventions(model.apply, gate))
  chex.assert_trees_all_close(run(variables, interpret.init_interventions(gate), x),
                              jax.jit(model.apply)(variables, x), **TOL)

  nnx_model = nnx_models.MLP(rngs=nnx.Rngs(0))
  linen_variables = nnx_models.linen_variables(nnx_model)
  linen = nnx_models.LinenMLP()
  interventions = {'gate': interpret.gates('dense_0/__call__', (6,)),
                   'steer': interpret.steering_vector('dense_1/__call__#1', (6,), positions=[2],
                                                      axis=1)}
  params = interpret.init_interventions(interventions)
  params['steer'] = jnp.linspace(-1.0, 1.0, 6)
  before = nnx_models.pure(nnx.state(nnx_model))
  got = nnx.jit(lambda m, p: jax.value_and_grad(lambda p: target_loss(
      perturbkit.nnx.run_with_interventions(lambda m, x: m(x), interventions)(m, p, x)))(p))(
          nnx_model, params)
  want = jax.jit(jax.value_and_grad(lambda p: target_loss(perturbkit.run_with_interventions(
      linen.apply, interventions)(linen_variables, p, x))))(params)
  chex.assert_trees_all_close(got, want, **TOL)
  assert float(jnp.abs(got[1]['steer']).max()) > 0 and float(jnp.abs(got[1]['gate']).max()) > 0
  chex.assert_trees_all_close(nnx_models.pure(nnx.state(nnx_model)), before, rtol=0, atol=0)


def test_intervention_errors(mlp):
  model, variables, x = mlp
  steer = {'steer': interpret.steering_vector('Dense_1/__call__', (8,))}
  run = perturbkit.run_with_interventions(model.apply, steer)
  with pytest.raises(perturbkit.InterventionParamsError, match=r"\['vector'\].*\['steer'\]"):
    run(variables, {'vector': jnp.zeros(8)}, x)
  wrong = {'steer': interpret.steering_vector('Dense_9/__call__', (8,))}
  with pytest.raises(perturbkit.UnknownEditPathError, match='Dense_9/__call__'):
    perturbkit.run_with_interventions(model.apply, wrong)(variables, {'steer': jnp.zeros(8)}, x)
  with pytest.raises(perturbkit.EditShapeError, match=r'\(3,\)'):
    run(variables, {'steer': jnp.zeros(3)}, x)
  with pytest.raises(perturbkit.NotInterventionsError, match='dict of named interventions'):
    perturbkit.run_with_interventions(model.apply, [steer['steer']])
  with pytest.raises(perturbkit.InvalidOptionError, match='axis'):
    interpret.steering_vector('Dense_1/__call__', (8,), positions=[1])


def test_custom_intervention_returning_another_output_is_a_named_error(mlp):
  """A custom ``apply`` returning another shape or dtype, or None (no ``return``): an error
  naming the intervention, the call and both layouts; a correct one equals the edit by hand,
  also on NNX."""
  model, variables, x = mlp
  returned = [(lambda p, o: o[..., :2], r'float32\[2, 5, 2\]'),
              (lambda p, o: o.astype(jnp.int32), r'int32\[2, 5, 8\]'),
              (lambda p, o: o.astype(jnp.bfloat16), r'bfloat16\[2, 5, 8\]'),
              (lambda p, o: None, 'None'),
              (lambda p, o: (o, o), r'\(float32\[2, 5, 8\], float32\[2, 5, 8\]\)')]
  for apply, got in returned:
    shift = {'shift': interpret.Intervention('Dense_0/__call__', lambda: jnp.zeros(()), apply)}
    run = perturbkit.run_with_interventions(model.apply, shift)
    with pytest.raises(perturbkit.InterventionOutputError,
                       match=rf"'shift' at Dense_0/__call__ returned {got}, .*: float32\[2, 5, 8\]"):
      run(variables, interpret.init_interventions(shift), x)
  # The fix: the output edited in its own shape and dtype.
  shift = {'shift': interpret.Intervention('Dense_0/__call__', lambda: jnp.zeros(()),
                                           lambda p, o: (o + p).astype(o.dtype))}
  got = perturbkit.run_with_interventions(model.apply, shift)(variables, {'shift': 0.5}, x)
  want = mlp_by_hand(variables['params'], x,
                     lambda n, h: h + 0.5 if n == 'Dense_0/__call__' else h)
  chex.assert_trees_all_close(got, want, **TOL)
  twin = nnx_models.MLP(rngs=nnx.Rngs(0))
  bad = {'b': interpret.Intervention('dense_0/__call__', lambda: jnp.zeros(()), lambda p, o: None)}
  with pytest.raises(perturbkit.InterventionOutputError, match="'b' at dense_0/__call__ returned None"):
    perturbkit.nnx.run_with_interventions(lambda m, x: m(x), bad)(twin, {'b': 0.0}, jnp.ones((2, 3)))


# --- low-precision models --------------------------------------------------------------


class Bf16Net(nn.Module):
  """Dense (or, with ``conv``, Conv) layers computing in bfloat16, a float32 metric head."""
  conv: bool = False

  @nn.compact
  def __call__(self, x):
    layer = (functools.partial(nn.Conv, kernel_size=(3, 3)) if self.conv else nn.Dense)
    for width in (32, 32, 16):
      x = jnp.tanh(layer(width, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x))
    return x.astype(jnp.float32).mean()


def recorded(model, variables, x, deltas):
  """The metric and each layer's output, ``deltas[name]`` added there (``nn.intercept_methods``)."""
  outputs = {}

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    name = f'{context.module.name}/__call__'
    if context.method_name != '__call__' or context.module is model or name not in deltas:
      return out
    outputs[name] = out
    return out + deltas[name]

  with nn.intercept_methods(interceptor):
    value = model.apply(variables, x)
  return value, outputs


def bf16_problem(conv):
  model = Bf16Net(conv)
  shape = (6, 5, 5, 3) if conv else (16, 12, 24)
  x = jax.random.normal(jax.random.key(1), shape).astype(jnp.bfloat16)
  corrupted = (x + 0.2 * jax.random.normal(jax.random.key(2), shape)).astype(jnp.bfloat16)
  variables = jax.jit(model.init)(jax.random.key(0), x)
  names = [f'{"Conv" if conv else "Dense"}_{i}/__call__' for i in range(3)]
  zeros = {n: jnp.zeros(shape[:-1] + (w,), jnp.bfloat16) for n, w in zip(names, (32, 32, 16))}

  def outputs_and_grads(inputs):
    """float64 copies of each layer's bfloat16 output and of d metric / d output there."""
    grads, outputs = jax.grad(lambda d: recorded(model, variables, inputs, d), has_aux=True)(
        zeros)
    as64 = lambda tree: {n: np.asarray(tree[n], np.float64) for n in names}
    return as64(outputs), as64(grads)

  return model, variables, x, corrupted, names, outputs_and_grads


def test_bf16_attributions_are_summed_in_float32_without_rounding_the_differences():
  """A bfloat16 model's outputs and gradients are exact in float64; the attributions (1000s of
  products per position) must equal their float64 sums to float32 precision, not bfloat16's.

  Op by op (``jax.disable_jit``: called eagerly, the sweeps compile themselves), so that both
  sides round the model's bfloat16 values alike (under ``jax.jit`` XLA may fuse bfloat16 ops
  and keep float32 between them, differently in each program)."""
  model, variables, x, corrupted, names, outputs_and_grads = bf16_problem(conv=False)
  clean_out, _ = outputs_and_grads(x)
  out, grads = outputs_and_grads(corrupted)
  metric = lambda v, x: model.apply(v, x)
  with jax.disable_jit():
    patched = perturbkit.attribution_patching(metric, axis=1)(variables, x, corrupted)
    gxa = perturbkit.grad_times_activation(metric, axis=1)(variables, corrupted)
  assert patched.paths == gxa.paths == tuple(names)
  want = np.stack([np.sum((clean_out[n] - out[n]) * grads[n], axis=(0, 2)) for n in names])
  want_gxa = np.stack([np.sum(out[n] * grads[n], axis=(0, 2)) for n in names])
  for got, expected in ((patched.effects, want), (gxa.effects, want_gxa)):
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=0,
                               atol=1e-6 * np.abs(expected).max())

  # Its dtype only: traced, not run.
  ig = jax.eval_shape(perturbkit.layer_integrated_gradients(metric, axis=1, steps=4),
                      variables, corrupted)
  assert ig.effects.dtype == jnp.float32


def test_bf16_grad_cam_is_computed_in_float32():
  model, variables, images, _, names, outputs_and_grads = bf16_problem(conv=True)
  feature_maps, grads = outputs_and_grads(images)
  with jax.disable_jit():  # op by op, as the reference
    _, maps = perturbkit.grad_cam(lambda v, x: model.apply(v, x))(variables, images)
  assert list(maps) == names
  for n in names:
    want = np.maximum(np.einsum('bhwc,bc->bhw', feature_maps[n], grads[n].mean(axis=(1, 2))), 0)
    assert maps[n].dtype == jnp.float32 and want.max() > 0
    np.testing.assert_allclose(np.asarray(maps[n], np.float64), want, rtol=0,
                               atol=1e-6 * want.max())


def test_bf16_metric_patching_effects_are_exact_differences_in_float32():
  """Activation patching of a bfloat16 metric gives float32 effects, as attribution patching
  does, so the two compare in one dtype; each is the exact difference of the two metrics.
  Op by op (``jax.disable_jit``), as the bfloat16 metrics by hand are rounded."""
  model, variables, x, corrupted, names, _ = bf16_problem(conv=False)
  metric = lambda v, x: model.apply(v, x).astype(jnp.bfloat16)
  with jax.disable_jit():
    result = perturbkit.activation_patching(metric)(variables, x, corrupted)
  zeros = {n: 0 for n in names}
  _, clean_out = recorded(model, variables, x, zeros)
  base = np.float64(metric(variables, corrupted))
  assert result.effects.dtype == jnp.float32 and result.paths == tuple(names)
  for i, name in enumerate(names):
    def interceptor(next_fun, args, kwargs, context, name=name):
      out = next_fun(*args, **kwargs)
      return clean_out[name] if f'{context.module.name}/__call__' == name else out
    with nn.intercept_methods(interceptor):
      patched = np.float64(metric(variables, corrupted))
    assert float(result.effects[i, 0]) == patched - base


class ComplexLayer(nn.Module):
  """A complex-valued linear layer: ``x @ w`` with a complex ``w``, output complex64."""

  @nn.compact
  def __call__(self, x):
    w = self.param('w', lambda key: jax.random.normal(key, (x.shape[-1], 3), jnp.complex64))
    return x.astype(jnp.complex64) @ w


def complex_metric(z, linear):
  """A real metric of a complex output: linear in ``z``, or not (``|z|^2`` and ``Re(z^2)``)."""
  if linear:
    return jnp.real(z).sum() + 2.0 * jnp.imag(z).sum()
  return (jnp.abs(z) ** 2).sum() + jnp.real(z ** 2 * (1 + 0.5j)).sum()


class ComplexNet(nn.Module):
  linear: bool

  @nn.compact
  def __call__(self, x):
    return complex_metric(ComplexLayer(name='c')(x), self.linear)


@pytest.mark.parametrize('linear', [True, False])
def test_attributions_at_a_complex_output_are_real_derivatives_along_a_real_step(linear):
  """Each effect is d metric(o + eps d) / d eps at a REAL eps = 0, by hand: ``jax.grad`` with
  respect to eps of the layer written out with ``+ eps * d``. Real (float32), where the
  complex scalars gave a spurious imaginary part. A metric linear in the output: attribution
  patching equals activation patching, integrated gradients the change to the zero output."""
  model = ComplexNet(linear)
  x = jax.random.normal(jax.random.key(1), (2, 4))
  corrupted = jax.random.normal(jax.random.key(2), (2, 4))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  w = variables['params']['c']['w']
  out = lambda x: x.astype(jnp.complex64) @ w
  along = lambda o, d: jax.grad(lambda eps: complex_metric(o + eps * d, linear))(0.0)
  metric = model.apply

  @jax.jit
  def by_hand(x, corrupted):
    """The references, compiled together."""
    change = complex_metric(out(x), True) - complex_metric(jnp.zeros_like(out(x)), True)
    return along(out(corrupted), out(x) - out(corrupted)), along(out(x), out(x)), change

  @jax.jit
  def everything(variables, x, corrupted):
    """The functions, compiled together (activation patching for the linear metric only)."""
    return (perturbkit.attribution_patching(metric)(variables, x, corrupted),
            perturbkit.grad_times_activation(metric)(variables, x),
            perturbkit.layer_integrated_gradients(metric, steps=4)(variables, x),
            perturbkit.activation_patching(metric)(variables, x, corrupted) if linear else None)

  want_patched, want_gxa, change = by_hand(x, corrupted)
  patched, gxa, ig, patching = everything(variables, x, corrupted)
  for got, want in ((patched.effects, want_patched), (gxa.effects, want_gxa)):
    assert got.dtype == jnp.float32 and got.shape == (1, 1)
    np.testing.assert_allclose(np.asarray(got)[0, 0], want, rtol=1e-5, atol=1e-5)
  assert ig.effects.dtype == jnp.float32
  if linear:
    np.testing.assert_allclose(patched.effects, patching.effects, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ig.effects)[0, 0], change, rtol=1e-5, atol=1e-5)
