"""K-FAC on Flax NNX models: the inputs next to the output gradients, the layers, the
factors and the preconditioned steps, against inputs captured by hand and the Linen twin;
the steps on the test process's 8 host CPU devices against one device."""
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_models as M
import perturbkit
from test_kfac import CNN, MLP, SequenceModel
from host_devices import sharded_nnx_step

TOL = dict(rtol=1e-5, atol=1e-6)


# --- return_inputs ---------------------------------------------------------------------


def test_return_inputs_equal_inputs_captured_by_hand():
  """Each call's ``(args, kwargs)`` at the path and key of its activation gradient, the
  shared module's two calls apart, eagerly and under ``nnx.jit``."""
  model, x = M.MLP(rngs=nnx.Rngs(0)), M.random_batch((4, 3))
  h0 = nnx.relu(model.dense_0(x))
  h1 = nnx.relu(model.dense_1(h0)) + h0
  h2 = jnp.tanh(model.dense_1(h1))
  want = {'dense_0': {'__call__': ((x,), {})},
          'dense_1': {'__call__': ((h0,), {}), '__call__#1': ((h1,), {})},
          'dense_2': {'__call__': ((h2,), {})}}
  vg = perturbkit.nnx.value_and_grad(M.mse, return_inputs=True)
  for run in (vg, nnx.jit(vg)):
    loss, grads, inputs = run(model, x)
    chex.assert_trees_all_close(inputs, want, **TOL)
    assert jax.tree.structure(grads['perturbations']) == jax.tree.structure(
        {path: {key: 0 for key in calls} for path, calls in want.items()})
  _, _, acts, inputs = perturbkit.nnx.value_and_grad(
      M.mse, return_activations=True, return_inputs=True)(model, x)
  chex.assert_trees_all_close(inputs, want, **TOL)
  chex.assert_trees_all_close(acts['dense_2']['__call__'], model(x), **TOL)


def test_return_inputs_keyword_and_non_array_arguments():
  """Keyword inputs are kept by name; a Python flag or ``None`` becomes ``None``."""

  class Scaled(nnx.Module):
    def __init__(self, rngs):
      self.inner = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x, *, scale, flag=True):
      return self.inner(x) * scale if flag else self.inner(x)

  class Outer(nnx.Module):
    def __init__(self, rngs):
      self.scaled = Scaled(rngs)

    def __call__(self, x):
      return self.scaled(x, scale=jnp.asarray(2.0), flag=True)

  model, x = Outer(nnx.Rngs(0)), M.random_batch((2, 3))
  _, _, inputs = perturbkit.nnx.value_and_grad(
      lambda m, x: jnp.sum(m(x)), return_inputs=True)(model, x)
  args, kwargs = inputs['scaled']['__call__']
  chex.assert_trees_all_close(args, (x,), **TOL)
  assert kwargs['flag'] is None
  chex.assert_trees_all_close(kwargs['scale'], jnp.asarray(2.0), **TOL)
  chex.assert_trees_all_close(inputs['scaled']['inner']['__call__'], ((x,), {}), **TOL)


def test_return_inputs_inside_an_nnx_vmap_with_broadcast_state_is_refused():
  # (Inside nnx.scan they come out per iteration: tests/test_nnx.py.)
  with pytest.raises(perturbkit.ActivationsUnavailableError):
    perturbkit.nnx.value_and_grad(M.mse, return_inputs=True)(
        M.VmapBroadcast(mapped=True, rngs=nnx.Rngs(0)), M.random_batch((2, 4)))


# --- NNX twins of test_kfac's Linen MLP and CNN (same attribute names, same weights) -------


class NNXMLP(nnx.Module):
  def __init__(self, rngs):
    self.Dense_0 = nnx.Linear(3, 6, rngs=rngs)
    self.Dense_1 = nnx.Linear(6, 5, rngs=rngs)
    self.Dense_2 = nnx.Linear(5, 4, rngs=rngs)

  def __call__(self, x):
    return self.Dense_2(jnp.tanh(self.Dense_1(jnp.tanh(self.Dense_0(x)))))


class NNXCNN(nnx.Module):
  def __init__(self, rngs):
    self.Conv_0 = nnx.Conv(2, 4, (3, 3), rngs=rngs)
    self.Conv_1 = nnx.Conv(4, 3, (3, 3), strides=2, padding='VALID', rngs=rngs)
    self.Dense_0 = nnx.Linear(27, 5, rngs=rngs)

  def __call__(self, x):
    x = jnp.tanh(self.Conv_1(jnp.tanh(self.Conv_0(x))))
    return self.Dense_0(x.reshape(x.shape[0], -1))


def twins(kind):
  """``(nnx_model, linen_model, linen_variables, x, y)`` with the same weights."""
  if kind == 'mlp':
    model, linen, x = NNXMLP(nnx.Rngs(0)), MLP(), jax.random.normal(jax.random.key(1), (8, 3))
  else:
    model, linen = NNXCNN(nnx.Rngs(0)), CNN()
    x = jax.random.normal(jax.random.key(1), (4, 7, 7, 2))
  y = jnp.arange(x.shape[0]) % (4 if kind == 'mlp' else 5)
  return model, linen, M.linen_variables(model), x, y


def linen_kfac(linen, variables, x):
  predict = lambda v, inputs: linen.apply(v, inputs)
  return predict, perturbkit.kfac_layers(predict, variables, x)


@pytest.mark.parametrize('kind', ['mlp', 'cnn'])
def test_layers_equal_the_linen_twins(kind):
  model, linen, variables, x, _ = twins(kind)
  assert perturbkit.nnx.kfac_layers(model, x) == linen_kfac(linen, variables, x)[1]


@pytest.mark.parametrize('kind', ['mlp', 'cnn'])
@pytest.mark.parametrize('fisher', ['sampled', 'empirical'])
def test_factors_and_gradients_equal_the_linen_twins(kind, fisher):
  """Same weights, same key: the NNX estimator's loss, param gradients and factors are
  the Linen estimator's, eagerly and under ``nnx.jit``; the model is left as it was."""
  model, linen, variables, x, y = twins(kind)
  predict, linen_layers = linen_kfac(linen, variables, x)
  key = jax.random.key(2)
  want = jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', linen_layers,
                                           fisher=fisher))(variables, x, y, key)
  estimate = perturbkit.nnx.kfac_estimator('softmax_cross_entropy',
                                           perturbkit.nnx.kfac_layers(model, x), fisher=fisher)
  # Eagerly too, once: the eager path is the slow one to run.
  runs = (nnx.jit(estimate),) + ((estimate,) if (kind, fisher) == ('mlp', 'empirical') else ())
  for run in runs:
    loss, grads, stats = run(model, x, y, key)
    np.testing.assert_allclose(loss, want[0], rtol=1e-6)
    assert isinstance(grads, nnx.State)
    chex.assert_trees_all_close(M.pure(grads), want[1], rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(stats, want[2], rtol=2e-5, atol=1e-6)
  chex.assert_trees_all_close(M.pure(nnx.state(model, nnx.Param)), variables['params'],
                              rtol=0, atol=0)


def test_traced_with_stats_and_the_preconditioner_state():
  """``with_stats=state.stats_due`` (a traced flag): the statistics on the due steps
  only, and the same gradient on every step."""
  model, linen, variables, x, y = twins('mlp')
  predict, linen_layers = linen_kfac(linen, variables, x)
  layers = perturbkit.nnx.kfac_layers(model, x)
  estimate = nnx.jit(perturbkit.nnx.kfac_estimator('softmax_cross_entropy', layers))
  want = jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', linen_layers))(
      variables, x, y, jax.random.key(3))
  for due in (True, False):
    loss, grads, stats = estimate(model, x, y, jax.random.key(3), with_stats=jnp.asarray(due))
    chex.assert_trees_all_close(M.pure(grads), want[1], rtol=1e-5, atol=1e-6)
    if due:
      chex.assert_trees_all_close(stats, want[2], rtol=2e-5, atol=1e-6)
    else:  # none taken: NaN, never to be folded in
      assert all(np.isnan(leaf).all() for leaf in jax.tree.leaves(stats))


def test_float64_factors_inverses_and_steps_are_the_textbook_ones_in_float64():
  """A CNN with float64 Conv layers: every layer's factors are the textbook ones of the
  Linen hand twin in float64, and the Conv layers' running factors, damped inverses and
  preconditioned gradients are float64 (they were float32, off by 1e-7). Its Dense keeps
  float32 params on float64 activations: its factors, formed from float64 inputs and
  gradients, are float64 too, while its state and step stay in its params' float32 (and the
  traced ``with_stats``' other branch, with no statistics, takes the factors' float64)."""
  from test_kfac import (CONV_SETTINGS, assert_float64_close, dense_reference, hand_cnn,
                         hand_factors, hand_patches, hand_precondition, kernel_matrix)
  with jax.enable_x64(True):
    model = NNXCNN(nnx.Rngs(0))
    for layer in (model.Conv_0, model.Conv_1):
      nnx.update(layer, jax.tree.map(lambda a: a.astype(jnp.float64), nnx.state(layer)))
    x = jax.random.normal(jax.random.key(1), (4, 7, 7, 2), jnp.float64)
    y = jnp.arange(4) % 5
    layers = perturbkit.nnx.kfac_layers(model, x)
    estimate = perturbkit.nnx.kfac_estimator('softmax_cross_entropy', layers, fisher='empirical')
    # A NumPy float64 damping leaves the float32 Dense's inverses float32, as its state.
    tx = perturbkit.nnx.kfac_preconditioner(layers, damping=np.float64(0.1))

    @nnx.jit
    def step(model, state):
      _, grads, stats = estimate(model, x, y, with_stats=state.stats_due)
      updates, state = tx.update(grads, state, nnx.state(model, nnx.Param), kfac_stats=stats)
      return grads, stats, updates, state

    grads, stats, updates, state = step(model, tx.init(nnx.state(model, nnx.Param)))
    inputs, gs = hand_factors(hand_cnn, M.linen_variables(model)['params'], x,
                              lambda logits: y, [(4, 7, 7, 4), (4, 3, 3, 3), (4, 5)])
  grads, updates = M.pure(grads), M.pure(updates)
  rows = [hand_patches(inputs[i], 3, *CONV_SETTINGS[f'Conv_{i}']) for i in range(2)]
  for name, a, g in zip(['Conv_0', 'Conv_1', 'Dense_0'], rows + [inputs[2]], gs):
    want_a, want_g = dense_reference(a, g, 4)
    assert_float64_close(stats[name].a, want_a, f'{name}.a')
    assert_float64_close(stats[name].g, want_g, f'{name}.g')
    dtype = jnp.float32 if name == 'Dense_0' else jnp.float64
    for leaf in (*state.factors[name], *state.inverses[name], *updates[name].values()):
      assert leaf.dtype == dtype, name
    want = hand_precondition(kernel_matrix(grads[name]), want_a, want_g, 0.1)
    if name == 'Dense_0':
      np.testing.assert_allclose(kernel_matrix(updates[name]), want, rtol=1e-5, atol=1e-6)
    else:
      assert_float64_close(kernel_matrix(updates[name]), want, name)


KFAC = dict(damping=0.05, decay=0.5, inverse_every=2, stats_every=1)


@functools.cache
def linen_steps(kind, steps):
  """The Linen twin's params, factors and losses after ``steps`` K-FAC steps with ``KFAC``
  then SGD with momentum (once per process: two tests compare with the MLP's)."""
  _, linen, variables, x, y = twins(kind)
  predict, layers = linen_kfac(linen, variables, x)
  estimate = jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers))
  tx = optax.chain(perturbkit.kfac_preconditioner(layers, **KFAC), optax.sgd(0.2, momentum=0.5))
  update = jax.jit(tx.update)
  params, opt_state = variables['params'], tx.init(variables['params'])
  losses = []
  for i in range(steps):
    loss, grads, stats = estimate({'params': params}, x, y, jax.random.key(i),
                                  with_stats=opt_state[0].stats_due)
    updates, opt_state = update(grads, opt_state, params, kfac_stats=stats)
    params = optax.apply_updates(params, updates)
    losses.append(loss)
  return params, opt_state[0].factors, losses


@pytest.mark.parametrize('kind', ['mlp', 'cnn'])
def test_nnx_optimizer_steps_equal_the_linen_twins(kind):
  """``nnx.Optimizer`` with the NNX preconditioner, ``optimizer.update(model, grads,
  kfac_stats=stats)`` inside ``nnx.jit``: the Linen twin's params after 3 steps."""
  steps = 3
  want_params, want_factors, want_losses = linen_steps(kind, steps)
  model, _, _, x, y = twins(kind)
  layers = perturbkit.nnx.kfac_layers(model, x)
  estimate = perturbkit.nnx.kfac_estimator('softmax_cross_entropy', layers)
  tx = optax.chain(perturbkit.nnx.kfac_preconditioner(layers, **KFAC),
                   optax.sgd(0.2, momentum=0.5))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, key):
    loss, grads, stats = estimate(model, x, y, key, with_stats=optimizer.opt_state[0].stats_due)
    optimizer.update(model, grads, kfac_stats=stats)
    return loss

  losses = [step(model, optimizer, jax.random.key(i)) for i in range(steps)]
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  assert abs(float(losses[-1]) - float(losses[0])) > 1e-3
  # The two Conv modules round differently in float32 (~1e-7), and the damped inverses
  # (λ = 0.05) magnify that: the CNN's params agree to ~2e-6 after three steps.
  tol = dict(rtol=1e-5, atol=1e-6) if kind == 'mlp' else dict(rtol=1e-4, atol=1e-5)
  chex.assert_trees_all_close(M.pure(nnx.state(model, nnx.Param)), want_params, **tol)
  chex.assert_trees_all_close(nnx.as_pure(optimizer.opt_state[0].factors), want_factors,
                              rtol=2e-5, atol=1e-6)


def test_plain_optax_on_the_param_state_equals_the_linen_twin():
  """Plain optax on ``nnx.state(model, nnx.Param)`` (``Param`` leaves in and out), then
  ``nnx.update(model, optax.apply_updates(params, updates))``."""
  steps = 3
  want_params, _, _ = linen_steps('mlp', steps)
  model, _, _, x, y = twins('mlp')
  layers = perturbkit.nnx.kfac_layers(model, x)
  estimate = nnx.jit(perturbkit.nnx.kfac_estimator('softmax_cross_entropy', layers))
  tx = optax.chain(perturbkit.nnx.kfac_preconditioner(layers, **KFAC),
                   optax.sgd(0.2, momentum=0.5))
  opt_state = tx.init(nnx.state(model, nnx.Param))
  update = jax.jit(tx.update)  # one compile, not one per op of the inverses
  for i in range(steps):
    _, grads, stats = estimate(model, x, y, jax.random.key(i),
                               with_stats=opt_state[0].stats_due)
    params = nnx.state(model, nnx.Param)
    updates, opt_state = update(grads, opt_state, params, kfac_stats=stats)
    assert isinstance(updates, nnx.State)
    nnx.update(model, optax.apply_updates(params, updates))
  chex.assert_trees_all_close(M.pure(nnx.state(model, nnx.Param)), want_params,
                              rtol=1e-5, atol=1e-6)


class NNXSequenceModel(nnx.Module):
  """The NNX twin of ``test_kfac.SequenceModel``: Embed -> Dense on (N, T, .) -> Dense."""

  def __init__(self, rngs):
    self.Embed_0 = nnx.Embed(11, 6, rngs=rngs)
    self.Dense_0 = nnx.Linear(6, 7, rngs=rngs)
    self.Dense_1 = nnx.Linear(7, 3, rngs=rngs)

  def __call__(self, tokens):
    h = jnp.tanh(self.Dense_0(jnp.tanh(self.Embed_0(tokens))))
    return self.Dense_1(h.mean(axis=1))


def test_embed_and_sequence_dense_factors_equal_the_linen_twin():
  model = NNXSequenceModel(nnx.Rngs(0))
  variables = M.linen_variables(model)
  tokens = jax.random.randint(jax.random.key(1), (5, 4), 0, 11)
  y = jnp.arange(5) % 3
  predict, linen_layers = linen_kfac(SequenceModel(), variables, tokens)
  layers = perturbkit.nnx.kfac_layers(model, tokens)
  assert layers == linen_layers
  assert layers.layers['Embed_0'].kind == 'embed'
  key = jax.random.key(2)
  want = jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', linen_layers))(
      variables, tokens, y, key)
  _, grads, stats = nnx.jit(perturbkit.nnx.kfac_estimator('softmax_cross_entropy', layers))(
      model, tokens, y, key)
  chex.assert_trees_all_close(M.pure(grads), want[1], rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(stats, want[2], rtol=2e-5, atol=1e-6)


def test_layers_without_a_rule_are_listed_or_refused():
  model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
                         nnx.GroupNorm(4, num_groups=2, rngs=nnx.Rngs(0)),
                         nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
  x = jnp.ones((2, 3))
  layers = perturbkit.nnx.kfac_layers(model, x)
  assert sorted(layers.layers) == ['layers/0', 'layers/2']
  assert layers.layers['layers/0'].path == ('layers', 0)
  assert layers.skipped == {'layers/1': 'GroupNorm has no K-FAC rule'}
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match='GroupNorm'):
    perturbkit.nnx.kfac_layers(
        model, x, filter=perturbkit.nnx.filters.by_type(nnx.Linear, nnx.GroupNorm))
  only = perturbkit.nnx.kfac_layers(model, x, filter=perturbkit.nnx.filters.by_path('layers/2'))
  assert list(only.layers) == ['layers/2']
  assert only.skipped == {'layers/0': 'not selected by the filter',
                          'layers/1': 'not selected by the filter'}
  scanned = perturbkit.nnx.kfac_layers(M.ScanMLP(rngs=nnx.Rngs(0)), jnp.ones((2, 4)))
  assert scanned.layers['blocks/linear'].iterations == 3  # per iteration: test_kfac_scan.py


class ScaledInputLinear(nnx.Linear):
  """Overrides ``__call__``: the kernel multiplies ``3 x``, not the call's input."""

  def __call__(self, x):
    return super().__call__(3.0 * x)


class RenamedLinear(nnx.Linear):
  """A subclass that keeps ``nnx.Linear.__call__``: the Dense rule applies."""


def test_a_linear_subclass_overriding_call_is_skipped_or_refused_and_one_keeping_it_is_not():
  """As in Linen (``test_kfac.py``): the override's call need not be a Linear's; a subclass
  that keeps ``nnx.Linear.__call__`` has the factors of a Linear, checked against ``A`` from
  the call's input and ``G`` from the per-example gradient at its output."""
  model = nnx.Sequential(RenamedLinear(3, 4, rngs=nnx.Rngs(0)), nnx.tanh,
                         ScaledInputLinear(4, 3, rngs=nnx.Rngs(1)))
  x, y = M.random_batch((6, 3)), jnp.arange(6) % 3
  layers = perturbkit.nnx.kfac_layers(model, x)
  assert list(layers.layers) == ['layers/0']
  assert 'overrides nnx.Linear.__call__' in layers.skipped['layers/2']
  assert 'self.layer = nnx.Linear(...)' in layers.skipped['layers/2']
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match='overrides nnx.Linear'):
    perturbkit.nnx.kfac_layers(model, x, filter=perturbkit.nnx.filters.by_type(nnx.Linear))
  by_hand = perturbkit.LayerInfo('dense', ('layers', 2), 'kernel', (4, 3), True, ('__call__',))
  estimate = perturbkit.nnx.kfac_estimator(
      'softmax_cross_entropy', perturbkit.KFACLayers({'layers/2': by_hand}, {}),
      fisher='empirical')
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match='overrides nnx.Linear'):
    estimate(model, x, y)

  _, _, stats = nnx.jit(perturbkit.nnx.kfac_estimator('softmax_cross_entropy', layers,
                                                      fisher='empirical'))(model, x, y)
  first, last = model.layers[0], model.layers[2]
  z = x @ first.kernel[...] + first.bias[...][None]
  g = jax.grad(lambda z: -jnp.sum(jnp.take_along_axis(
      jax.nn.log_softmax(last(jnp.tanh(z))), y[:, None], axis=1)))(z)
  a = np.concatenate([np.asarray(x, np.float64), np.ones((6, 1))], axis=1)
  g = np.asarray(g, np.float64)
  np.testing.assert_allclose(stats['layers/0'].a, a.T @ a / 6, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(stats['layers/0'].g, g.T @ g / 6, rtol=2e-5, atol=1e-6)


def test_a_bare_linear_as_the_model_and_a_linen_model_are_named_errors():
  x = jnp.ones((4, 5))
  layers = perturbkit.nnx.kfac_layers(nnx.Linear(5, 3, rngs=nnx.Rngs(0)), x)
  assert layers.layers == {}
  assert 'e.g. `nnx.Sequential(nnx.Linear(5, 3, rngs=rngs))`' in layers.skipped['<root>']
  with pytest.raises(perturbkit.KFACNoLayersError, match='must be wrapped in a module'):
    perturbkit.nnx.kfac_estimator('softmax_cross_entropy', layers)
  model = nnx.Sequential(nnx.Linear(5, 3, rngs=nnx.Rngs(0)))
  estimate = perturbkit.nnx.kfac_estimator('softmax_cross_entropy',
                                           perturbkit.nnx.kfac_layers(model, x))
  linen = nn.Dense(3)
  with pytest.raises(perturbkit.WrongFrontEndError, match='perturbkit.kfac_estimator'):
    estimate(linen.init(jax.random.key(0), x), x, jnp.zeros((4,), jnp.int32), jax.random.key(1))


class _RematBlock(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(6, 8, rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.down = nnx.Linear(8, 6, rngs=rngs)

  def __call__(self, x):
    return x + self.down(nnx.tanh(self.norm(self.up(x))))


class _Rematted(nnx.Module):
  """Tokens and positions embedded, a residual block, a head; with ``remat`` the embeddings
  and the block run inside ``nnx.remat`` of a function of the whole model (which hands every
  param, the head's too, back out of the transform)."""

  def __init__(self, remat: bool, rngs):
    self.remat = remat
    self.tokens = nnx.Embed(7, 6, rngs=rngs)
    self.positions = nnx.Embed(5, 6, rngs=rngs)
    self.block = _RematBlock(rngs)
    self.head = nnx.Linear(6, 3, rngs=rngs)

  def __call__(self, ids):
    def body(model, ids):
      h = model.tokens(ids) + model.positions(jnp.arange(ids.shape[1]))[None]
      return model.block(h)

    h = nnx.remat(body)(self, ids) if self.remat else body(self, ids)
    return self.head(h)


def test_layers_inside_nnx_remat_are_preconditioned_like_the_plain_model():
  """Layers inside ``nnx.remat`` are the plain model's layers, with the same skips (the
  position table looked up with ``jnp.arange`` is shared by every example, also inside the
  transform), and the estimator's loss, gradients and factors equal the plain model's."""
  ids = jax.random.randint(jax.random.key(0), (4, 5), 0, 7)
  labels = jax.random.randint(jax.random.key(1), (4, 5), 0, 3)
  plain, rematted = _Rematted(False, nnx.Rngs(0)), _Rematted(True, nnx.Rngs(0))
  layers = perturbkit.nnx.kfac_layers(rematted, ids)
  assert layers == perturbkit.nnx.kfac_layers(plain, ids)
  # a norm's copy inside the transform is a norm too
  assert sorted(layers.layers) == ['block/down', 'block/norm', 'block/up', 'head', 'tokens']
  assert 'is not computed from the batch' in layers.skipped['positions']
  for fisher, key in (('empirical', None), ('sampled', jax.random.key(3))):
    estimate = nnx.jit(perturbkit.nnx.kfac_estimator('softmax_cross_entropy', layers,
                                                     fisher=fisher))
    got, want = estimate(rematted, ids, labels, key), estimate(plain, ids, labels, key)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(got[2]['block/up'].a).max()) > 0



class NNXTiedHead(nnx.Module):
  """Embed -> Linear -> an LM head on the embedding: inline ``h @ E.T`` or ``embed.attend``."""

  def __init__(self, rngs, attend=False):
    self.embed = nnx.Embed(11, 4, rngs=rngs)
    self.hidden = nnx.Linear(4, 4, rngs=rngs)
    self.use_attend = attend

  def __call__(self, tokens):
    h = jnp.tanh(self.hidden(self.embed(tokens)))
    return self.embed.attend(h) if self.use_attend else h @ self.embed.embedding[...].T


class LinenTiedHead(nn.Module):
  """The Linen twin of ``NNXTiedHead`` (inline transpose)."""

  def setup(self):
    self.embed = nn.Embed(11, 4)
    self.hidden = nn.Dense(4)

  def __call__(self, tokens):
    h = jnp.tanh(self.hidden(self.embed(tokens)))
    return h @ self.embed.embedding.T


TOKENS = jnp.array([[0, 1, 2], [3, 4, 5]])


def test_tied_embedding_read_by_an_inline_transpose_is_skipped_as_in_linen():
  """The LM head's ``h @ E.T`` share of the embedding gradient has no factors: the embed is
  skipped with the read named, the same entries as the Linen twin's, and refused when a
  filter selects it. A loss term on a kernel in ``predict`` is a read outside as well."""
  model = NNXTiedHead(nnx.Rngs(0))
  layers = perturbkit.nnx.kfac_layers(model, TOKENS)
  assert list(layers.layers) == ['hidden']
  assert 'read outside its calls (by transpose)' in layers.skipped['embed']
  linen = LinenTiedHead()
  assert layers == perturbkit.kfac_layers(lambda v, x: linen.apply(v, x),
                                          M.linen_variables(model), TOKENS)
  for selecting in (perturbkit.nnx.filters.by_type(nnx.Embed, nnx.Linear),
                    perturbkit.nnx.filters.by_path('embed')):
    with pytest.raises(perturbkit.KFACUnsupportedLayerError,
                       match=r"embed was selected.*read outside its calls \(by transpose\)"
                             r".*perturbkit\.nnx\.filters\.negate"):
      perturbkit.nnx.kfac_layers(model, TOKENS, filter=selecting)
  only = perturbkit.nnx.kfac_layers(model, TOKENS, filter=perturbkit.nnx.filters.by_path('hidden'))
  assert list(only.layers) == ['hidden'] and only.skipped == {
      'embed': 'not selected by the filter'}
  penalized = perturbkit.nnx.kfac_layers(
      model, TOKENS, predict=lambda m, x: m(x) + jnp.sum(m.hidden.kernel[...] ** 2))
  assert list(penalized.layers) == []
  assert 'read outside its calls (by integer_pow)' in penalized.skipped['hidden']


def test_tied_embedding_through_attend_is_skipped_or_refused():
  """``embed.attend(h)`` has no rule (skipped, refused when selected); a filter that
  selects only the embed's ``__call__`` still does not get it preconditioned, since
  ``attend`` reads the embedding outside that call."""
  model = NNXTiedHead(nnx.Rngs(0), attend=True)
  layers = perturbkit.nnx.kfac_layers(model, TOKENS)
  assert list(layers.layers) == ['hidden']
  assert layers.skipped == {'embed': 'Embed.attend has no K-FAC rule (only __call__)'}
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match='attend'):
    perturbkit.nnx.kfac_layers(model, TOKENS, filter=perturbkit.nnx.filters.by_type(nnx.Embed))
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match='read outside its calls'):
    perturbkit.nnx.kfac_layers(model, TOKENS, filter=perturbkit.nnx.filters.by_method('__call__'))


def test_a_linear_holding_another_linears_kernel_is_skipped_or_refused():
  """``b.kernel = a.kernel``: ``nnx.state`` lists the kernel under ``a``, so ``b``'s calls have
  no weight of their own to precondition, and ``a``'s kernel is read outside its calls."""
  model = M.SharedKernel(rngs=nnx.Rngs(0))
  x = M.random_batch((3, 4))
  layers = perturbkit.nnx.kfac_layers(model, x)
  assert list(layers.layers) == ['head']
  assert 'kernel is the nnx.Variable of another module' in layers.skipped['b']
  assert 'read outside its calls (by dot_general)' in layers.skipped['a']
  with pytest.raises(perturbkit.KFACUnsupportedLayerError,
                     match=r"b was selected.*another module.*perturbkit\.nnx\.filters\.negate"):
    perturbkit.nnx.kfac_layers(model, x, filter=perturbkit.nnx.filters.by_path('b'))


def test_batchnorm_dropout_model_with_predict_and_has_aux():
  """BatchNorm in train mode and Dropout, through ``predict=``: the factors of the Linen
  twin (which returns its batch statistics as ``aux``), and the model's own batch
  statistics updated once, to the Linen twin's new ones."""
  model = M.CNN(channels=2, rngs=nnx.Rngs(0))
  variables = M.linen_variables(model)
  x = jax.random.normal(jax.random.key(1), (4, 5, 5, 2))
  y = jnp.arange(4) % 3
  dropout_key, key = jax.random.key(7), jax.random.key(2)
  linen = M.LinenCNN()
  predict = lambda v, x: linen.apply(v, x, dropout_key, mutable=['batch_stats'])
  linen_layers = perturbkit.kfac_layers(lambda v, x: predict(v, x)[0], variables, x)
  want = jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', linen_layers,
                                           has_aux=True))(variables, x, y, key)
  nnx_predict = lambda m, x: (m(x, dropout_key=dropout_key), jnp.zeros(()))
  layers = perturbkit.nnx.kfac_layers(model, x, predict=lambda m, x: nnx_predict(m, x)[0])
  assert layers == linen_layers
  estimate = perturbkit.nnx.kfac_estimator('softmax_cross_entropy', layers,
                                           predict=nnx_predict, has_aux=True)
  loss, grads, stats, aux = nnx.jit(estimate)(model, x, y, key)
  np.testing.assert_allclose(loss, want[0], rtol=1e-6)
  chex.assert_trees_all_close(M.pure(grads), want[1], rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(stats, want[2], rtol=2e-5, atol=1e-6)
  chex.assert_trees_all_close(M.pure(nnx.state(model, nnx.BatchStat)),
                              want[3]['batch_stats'], rtol=1e-6, atol=1e-7)
  assert not np.allclose(want[3]['batch_stats']['norm']['mean'],
                         variables['batch_stats']['norm']['mean'])


# ---------------------------------------------------------------- many devices

def kfac_optimizer(layers, axis_name):
  """A fresh NNXCNN and its ``nnx.Optimizer``: K-FAC (damping 0.1, inverses every 2 steps)
  then SGD with momentum."""
  model = NNXCNN(nnx.Rngs(0))
  tx = optax.chain(perturbkit.nnx.kfac_preconditioner(layers, damping=0.1, inverse_every=2,
                                                      axis_name=axis_name),
                   optax.sgd(0.1, momentum=0.5))
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def kfac_step(estimate, axis_name):
  """One optimizer step; with ``axis_name`` the loss and grads are averaged over the devices,
  the factors by the preconditioner."""
  def run(model, optimizer, x, y):
    loss, grads, stats = estimate(model, x, y, with_stats=optimizer.opt_state[0].stats_due)
    if axis_name:
      loss, grads = jax.lax.pmean((loss, grads), axis_name)
    optimizer.update(model, grads, kfac_stats=stats)
    return loss
  return run


def test_shard_map_on_8_devices_equals_one_device():
  """``nnx.shard_map`` inside ``nnx.jit``, ``axis_name='data'``: each device's factors are
  ``pmean``-ed by the preconditioner, and three steps of ``nnx.Optimizer`` equal the same
  steps on one device with the whole batch (the exact Fisher, so no per-device keys)."""
  x = jax.random.normal(jax.random.key(1), (3 * 8, 7, 7, 2))
  y = jnp.arange(24) % 5
  layers = perturbkit.nnx.kfac_layers(NNXCNN(nnx.Rngs(0)), x)
  estimate = perturbkit.nnx.kfac_estimator('softmax_cross_entropy', layers, fisher='exact')
  m1, o1 = kfac_optimizer(layers, None)
  m8, o8 = kfac_optimizer(layers, 'data')
  step1 = nnx.jit(kfac_step(estimate, None))
  step8 = sharded_nnx_step(kfac_step(estimate, 'data'))
  losses = []
  for _ in range(3):
    l1, l8 = step1(m1, o1, x, y), step8(m8, o8, x, y)
    chex.assert_trees_all_close(l8, l1, **TOL)
    losses.append(float(l1))
  assert losses[-1] < losses[0], losses
  chex.assert_trees_all_close(o8.opt_state[0].factors, o1.opt_state[0].factors, **TOL)
  # The damped inverses amplify float32 summation-order differences.
  chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(m8, nnx.Param)),
                              nnx.to_pure_dict(nnx.state(m1, nnx.Param)), rtol=1e-3, atol=1e-5)


def test_a_linear_holding_another_linears_bias_is_skipped():
  """``b.bias = a.bias``: ``nnx.state`` lists the bias under ``a``; ``b``'s factors would
  precondition a bias it does not own (the preconditioner then found no bias there), so ``b``
  is skipped with the reason, and K-FAC preconditions the rest."""
  model = M.SharedKernel(rngs=nnx.Rngs(0))
  model.b.kernel = nnx.Param(model.a.kernel[...] + 0.1)
  model.b.bias = model.a.bias
  x = M.random_batch((3, 4))
  layers = perturbkit.nnx.kfac_layers(model, x)
  assert 'bias is the nnx.Variable of another module' in layers.skipped['b']
  assert 'b' not in layers.layers and 'head' in layers.layers
  tx = perturbkit.nnx.kfac_preconditioner(layers)
  tx.init(nnx.state(model, nnx.Param))


def test_an_nnx_optimizer_training_some_layers_takes_the_layers_of_those_only():
  """``nnx.Optimizer(..., wrt=<the head>)`` hands the preconditioner the head's params: the
  layers found on the whole model name the filter as the fix, and the head's layer alone
  builds its state."""
  model, _, _, x, _ = twins('mlp')
  head = nnx.All(nnx.Param, nnx.PathContains('Dense_2'))
  with pytest.raises(perturbkit.KFACShapeError, match=r"Dense_0.*wrt.*filter=\.\.\."):
    nnx.Optimizer(model, perturbkit.nnx.kfac_preconditioner(perturbkit.nnx.kfac_layers(model, x)),
                  wrt=head)
  layers = perturbkit.nnx.kfac_layers(model, x, filter=perturbkit.nnx.filters.by_path('Dense_2'))
  optimizer = nnx.Optimizer(model, perturbkit.nnx.kfac_preconditioner(layers), wrt=head)
  assert list(optimizer.opt_state.factors) == ['Dense_2']
