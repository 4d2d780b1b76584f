"""K-FAC on layers run once per iteration of ``nn.scan``/``nnx.scan`` (stacked params).

A transformer whose blocks run in a scan has each block's params stacked along axis 0,
and with ``'perturbations'`` mapped along the same axis each call's input and output
gradient come out stacked the same way. Each iteration gets its own factors, stacked like
the params. The reference is the same model unrolled into a Python loop of blocks given
each iteration's slice of the params, whose K-FAC layers are ordinary ones (checked
against hand-written formulas in ``test_kfac.py``); one factor is also formed here by hand
from the unrolled model's intermediates. Layers a scan runs that K-FAC cannot split per
iteration (params shared by every iteration, scans nested, inputs without the examples
on their first axis) are skipped with the reason, or refused when a filter selects them.
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_models
import perturbkit

DEPTH, WIDTH = 3, 6
TOL = dict(rtol=2e-4, atol=1e-6)
BLOCK_LAYERS = ('Dense_0', 'LayerNorm_0', 'Conv_0')


class Block(nn.Module):
  """Dense -> LayerNorm -> relu -> causal Conv over the tokens, with a residual."""

  @nn.compact
  def __call__(self, x, _=None):
    h = nn.relu(nn.LayerNorm()(nn.Dense(2 * WIDTH)(x)))
    return x + nn.Conv(WIDTH, (3,), padding='CAUSAL')(h), None


def scanned_blocks(**options):
  options = {'variable_axes': {'params': 0, 'perturbations': 0},
             'split_rngs': {'params': True}, 'length': DEPTH, **options}
  return nn.scan(Block, **options)


class Scanned(nn.Module):
  """Embed -> DEPTH blocks in ``nn.scan`` -> Dense logits over the tokens."""
  body: type = Block
  scan: dict | None = None

  @nn.compact
  def __call__(self, tokens):
    h = nn.Embed(11, WIDTH)(tokens)
    h, _ = nn.scan(self.body, **(self.scan or {'variable_axes': {'params': 0, 'perturbations': 0},
                                               'split_rngs': {'params': True},
                                               'length': DEPTH}))(name='blocks')(h, None)
    return nn.Dense(5)(h)


class Unrolled(nn.Module):
  """``Scanned`` with its blocks in a Python loop, ``blocks_0`` .. ``blocks_2``."""

  @nn.compact
  def __call__(self, tokens):
    h = nn.Embed(11, WIDTH)(tokens)
    for i in range(DEPTH):
      h, _ = Block(name=f'blocks_{i}')(h)
    return nn.Dense(5)(h)


@jax.jit  # one compile for all the slices, not one per leaf shape
def unrolled_params(params):
  blocks = params['blocks']
  return {**{k: v for k, v in params.items() if k != 'blocks'},
          **{f'blocks_{i}': jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(DEPTH)}}


@pytest.fixture(scope='module')
def setup():
  tokens = jax.random.randint(jax.random.key(1), (4, 7), 0, 11)
  targets = jax.random.randint(jax.random.key(2), (4, 7), 0, 5)
  scanned, unrolled = Scanned(), Unrolled()
  variables = jax.jit(scanned.init)(jax.random.key(0), tokens)
  twin = {'params': unrolled_params(variables['params'])}
  predict = lambda v, x: scanned.apply(v, x)
  predict_twin = lambda v, x: unrolled.apply(v, x)
  np.testing.assert_allclose(*jax.jit(lambda v, t: (predict(v, tokens), predict_twin(t, tokens)))(
      variables, twin), **TOL)
  return dict(tokens=tokens, targets=targets, variables=variables, twin=twin, predict=predict,
              predict_twin=predict_twin, unrolled=unrolled,
              layers=perturbkit.kfac_layers(predict, variables, tokens),
              twin_layers=perturbkit.kfac_layers(predict_twin, twin, tokens))


def test_each_scanned_layer_is_one_layer_with_its_iterations(setup):
  layers = setup['layers']
  assert layers.skipped == {}
  assert sorted(layers.layers) == ['Dense_0', 'Embed_0'] + [f'blocks/{n}' for n in
                                                            sorted(BLOCK_LAYERS)]
  twin = setup['twin_layers'].layers
  for name in BLOCK_LAYERS:
    info, one = layers.layers[f'blocks/{name}'], twin[f'blocks_0/{name}']
    assert info.iterations == DEPTH
    assert info.kernel_shape == (DEPTH,) + one.kernel_shape
    assert info._replace(path=(), kernel_shape=(), iterations=0) == one._replace(
        path=(), kernel_shape=())
  assert layers.layers['Dense_0'].iterations == 0


@pytest.fixture(scope='module')
def estimates(setup):
  """``{fisher: (scanned model's estimate, unrolled twin's)}``, jitted, at one key: computed
  once for the tests below."""
  s, key = setup, jax.random.key(3)
  out = {}
  for fisher in ('empirical', 'sampled'):
    estimate = perturbkit.kfac_estimator(s['predict'], 'softmax_cross_entropy', s['layers'],
                                         fisher=fisher)
    estimate_twin = perturbkit.kfac_estimator(s['predict_twin'], 'softmax_cross_entropy',
                                              s['twin_layers'], fisher=fisher)
    out[fisher] = (jax.jit(estimate)(s['variables'], s['tokens'], s['targets'], key),
                   jax.jit(estimate_twin)(s['twin'], s['tokens'], s['targets'], key))
  return out


@pytest.mark.parametrize('fisher', ['empirical', 'sampled'])
def test_factors_and_step_are_each_iterations_of_the_unrolled_model(setup, estimates, fisher):
  s = setup
  (loss, grads, stats), (loss_twin, grads_twin, stats_twin) = estimates[fisher]
  np.testing.assert_allclose(loss, loss_twin, **TOL)
  for name in BLOCK_LAYERS:
    for i in range(DEPTH):
      for stacked, one in zip(stats[f'blocks/{name}'], stats_twin[f'blocks_{i}/{name}']):
        assert float(np.abs(np.asarray(one)).max()) > 0
        np.testing.assert_allclose(np.asarray(stacked)[i], one, **TOL)

  def step(layers, params, grads, stats):
    tx = optax.chain(perturbkit.kfac_preconditioner(layers, damping=0.05), optax.sgd(1.0))
    return jax.jit(lambda p, g, st: tx.update(g, tx.init(p), p, kfac_stats=st)[0])(
        params, grads, stats)

  updates = step(s['layers'], s['variables']['params'], grads, stats)
  updates_twin = unrolled_params(updates)
  expected = step(s['twin_layers'], s['twin']['params'], grads_twin, stats_twin)
  # the preconditioned step is no plain gradient step
  assert not np.allclose(updates['blocks']['Dense_0']['kernel'],
                         -grads['blocks']['Dense_0']['kernel'], rtol=1e-2)
  # float32 products through damped inverses: each entry to 1e-4 of updates of order 1
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4),
               updates_twin, expected)


def test_a_scanned_dense_layers_input_factor_is_formed_from_each_iterations_input(setup,
                                                                                  estimates):
  """``A`` of ``blocks/Dense_0`` at iteration ``i``, by hand: its input is the carry, the
  embedding (i = 0) or the previous block's output in the unrolled model."""
  s = setup
  stats = estimates['empirical'][0][2]['blocks/Dense_0']
  _, inter = jax.jit(lambda v, x: s['unrolled'].apply(v, x, capture_intermediates=True,
                                                      mutable=['intermediates']))(
      s['twin'], s['tokens'])
  carries = [inter['intermediates']['Embed_0']['__call__'][0]] + [
      inter['intermediates'][f'blocks_{i}']['__call__'][0][0] for i in range(DEPTH - 1)]
  examples = s['tokens'].shape[0]
  for i, carry in enumerate(carries):
    rows = np.asarray(carry, np.float64).reshape(-1, WIDTH)
    rows = np.concatenate([rows, np.ones((len(rows), 1))], axis=1)
    np.testing.assert_allclose(stats.a[i], rows.T @ rows / examples, **TOL)


def test_a_scanned_model_trains_with_amortised_statistics_as_its_unrolled_twin(setup):
  """Three jitted steps with ``with_stats=state.stats_due`` (statistics under ``lax.cond``)
  and the inverses refreshed every other step: the same params as the unrolled twin."""
  s = setup

  def train(predict, layers, params):
    estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers)
    tx = optax.chain(perturbkit.kfac_preconditioner(layers, damping=0.5, inverse_every=2,
                                                    stats_every=1), optax.sgd(0.05))

    @jax.jit
    def step(params, opt_state, key):
      _, grads, stats = estimate({'params': params}, s['tokens'], s['targets'], key,
                                 with_stats=opt_state[0].stats_due)
      updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats)
      return optax.apply_updates(params, updates), opt_state

    opt_state = jax.jit(tx.init)(params)  # one compile, not one per eager op
    for i in range(3):
      params, opt_state = step(params, opt_state, jax.random.key(10 + i))
    return params

  params = train(s['predict'], s['layers'], s['variables']['params'])
  expected = train(s['predict_twin'], s['twin_layers'], s['twin']['params'])
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), expected,
                       s['twin']['params'])
  assert min(jax.tree.leaves(moved)) > 5e-3, moved
  # float32 through three damped inverses: to 1e-4 of params that each moved by more than 5e-3
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4),
               unrolled_params(params), expected)


class FlatBlock(nn.Module):
  """A block whose Dense runs on ``(examples * tokens, features)`` rows."""

  @nn.compact
  def __call__(self, x, _=None):
    rows = nn.Dense(WIDTH)(x.reshape(-1, WIDTH))
    return x + rows.reshape(x.shape), None


class Nested(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    inner = nn.scan(Block, variable_axes={'params': 0, 'perturbations': 0},
                    split_rngs={'params': True}, length=2)
    return inner()(x, None)


@pytest.mark.parametrize('case, reason', [
    ('shared params', 'stacked per iteration along axis 0'),
    ('nested scans', 'stacked per iteration along axis 0'),
    ('flattened rows', "does not have the batch's 4 examples on its first axis"),
])
def test_scanned_layers_without_per_iteration_factors_are_skipped_or_refused(case, reason):
  tokens = jnp.zeros((4, 7), jnp.int32)
  scan = {'variable_axes': {'params': 0, 'perturbations': 0}, 'split_rngs': {'params': True},
          'length': DEPTH}
  body, layer = Block, 'blocks/Dense_0'
  if case == 'shared params':
    scan = {'variable_axes': {'perturbations': 0}, 'variable_broadcast': 'params',
            'split_rngs': {'params': False}, 'length': DEPTH}
  elif case == 'nested scans':
    body, layer = Nested, 'blocks/ScanBlock_0/Dense_0'
  else:
    body = FlatBlock
  model = Scanned(body=body, scan=scan)
  # The layers are found by tracing: the variables' shapes are all it reads.
  variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
  predict = lambda v, x: model.apply(v, x)
  layers = perturbkit.kfac_layers(predict, variables, tokens)
  assert reason in layers.skipped[layer]
  assert sorted(n for n in layers.layers if not n.startswith('blocks')) == ['Dense_0', 'Embed_0']
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match=reason):
    perturbkit.kfac_layers(predict, variables, tokens,
                           filter=perturbkit.filters.by_path(layer))


def test_damped_inverse_of_stacked_factors_says_to_map_it_over_the_iterations(setup):
  stacked = jnp.asarray(np.stack([np.eye(3), 2 * np.eye(3)]), jnp.float32)
  with pytest.raises(perturbkit.KFACFactorShapeError, match=r'jax\.lax\.map'):
    perturbkit.damped_inverse(stacked, 1.0)
  inverses = jax.jit(lambda s: jax.lax.map(lambda f: perturbkit.damped_inverse(f, 1.0), s))(
      stacked)
  np.testing.assert_allclose(inverses[1], np.eye(3) / 3.0, rtol=1e-6)


# ----------------------------------------------------------------------- NNX


class NNXBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.dense = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.norm(self.dense(x)))


class NNXRematBlock(NNXBlock):
  """The block under ``nnx.remat`` (gradient checkpointing inside the scan over layers)."""

  def __call__(self, x):
    return nnx.remat(lambda block, x: NNXBlock.__call__(block, x))(self, x)


def nnx_scanned(rngs: nnx.Rngs, block: type = NNXBlock) -> nnx_models.ScanMLP:
  """``DEPTH`` :class:`NNXBlock` s stacked and run by ``nnx.scan``, then a head to 5 classes."""
  return nnx_models.ScanMLP(WIDTH, DEPTH, classes=5, block=block, rngs=rngs)


class NNXUnrolled(nnx.Module):
  def __init__(self, scanned: nnx_models.ScanMLP):
    self.blocks = nnx.List([NNXBlock(nnx.Rngs(i)) for i in range(DEPTH)])
    self.head = nnx.Linear(WIDTH, 5, rngs=nnx.Rngs(0))
    for i, block in enumerate(self.blocks):
      nnx.update(block, jax.tree.map(lambda a, i=i: a[i], nnx.state(scanned.blocks, nnx.Param)))
    nnx.update(self.head, nnx.state(scanned.head))

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def nnx_batch():
  return (jax.random.normal(jax.random.key(1), (4, 7, WIDTH)),
          jax.random.randint(jax.random.key(2), (4, 7), 0, 5))


def nnx_train(model, layers):
  """The first step's factors, after two compiled K-FAC steps (one compile) on ``nnx_batch``."""
  x, y = nnx_batch()
  estimate = perturbkit.nnx.kfac_estimator('softmax_cross_entropy', layers)
  tx = optax.chain(perturbkit.nnx.kfac_preconditioner(layers, damping=0.5), optax.sgd(0.05))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, key):
    _, grads, stats = estimate(model, x, y, key)
    optimizer.update(model, grads, kfac_stats=stats)
    return stats

  return [step(model, optimizer, jax.random.key(k)) for k in (3, 11)][0]


@functools.cache
def nnx_unrolled_twin():
  """``(initial params, initial twin, trained twin, its first step's factors)``: the unrolled
  twin of ``nnx_scanned(nnx.Rngs(0))``, trained once for both blocks of the test below (the
  remat block has the plain block's params: checked there)."""
  # Built under nnx.jit: one compile each, not one per eager op.
  model = nnx.jit(lambda: nnx_scanned(nnx.Rngs(0)))()
  twin = nnx.jit(lambda m: NNXUnrolled(m))(model)
  initial, initial_twin = nnx.state(model, nnx.Param), nnx.clone(twin)
  stats_twin = nnx_train(twin, perturbkit.nnx.kfac_layers(twin, nnx_batch()[0]))
  return initial, initial_twin, twin, stats_twin


@pytest.mark.parametrize('block', [NNXBlock, NNXRematBlock])
def test_nnx_scanned_layers_get_the_unrolled_twins_factors_and_steps(block):
  """The scanned model's factors of each iteration and its params after two K-FAC steps are
  those of its unrolled twin (the same blocks in a Python loop), which starts from the same
  params and outputs."""
  model = nnx.jit(lambda: nnx_scanned(nnx.Rngs(0), block))()
  initial, initial_twin, twin, stats_twin = nnx_unrolled_twin()
  jax.tree.map(np.testing.assert_array_equal, nnx.state(model, nnx.Param), initial)
  x, _ = nnx_batch()
  np.testing.assert_allclose(*nnx.jit(lambda m, t: (m(x), t(x)))(model, initial_twin), **TOL)
  layers = perturbkit.nnx.kfac_layers(model, x)
  assert layers.skipped == {} and sorted(layers.layers) == ['blocks/dense', 'blocks/norm', 'head']
  assert layers.layers['blocks/dense'].iterations == DEPTH
  stats = nnx_train(model, layers)
  for name in ('dense', 'norm'):
    for i in range(DEPTH):
      for stacked, one in zip(stats[f'blocks/{name}'], stats_twin[f'blocks/{i}/{name}']):
        np.testing.assert_allclose(np.asarray(stacked)[i], one, **TOL)
  stacked = nnx.state(model.blocks, nnx.Param)
  for i, block in enumerate(twin.blocks):
    jax.tree.map(lambda a, b, i=i: np.testing.assert_allclose(np.asarray(a)[i], b, rtol=1e-3,
                                                              atol=1e-4),
                 stacked, nnx.state(block, nnx.Param))


class NNXShared(nnx.Module):
  """One block run ``DEPTH`` times by ``nnx.scan``, its params shared by every iteration."""

  def __init__(self, rngs: nnx.Rngs):
    self.block = NNXBlock(rngs)
    self.head = nnx.Linear(WIDTH, 5, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, None), out_axes=nnx.Carry, length=DEPTH)
    def body(x, block):
      return block(x)

    return self.head(body(x, self.block))


def test_nnx_layers_whose_params_every_iteration_shares_are_skipped_or_refused():
  model, x = NNXShared(nnx.Rngs(0)), jnp.ones((4, 7, WIDTH))
  layers = perturbkit.nnx.kfac_layers(model, x)
  assert sorted(layers.layers) == ['head']
  for name in ('block/dense', 'block/norm'):
    assert 'stacked per iteration along axis 0' in layers.skipped[name]
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match='block/dense.*stacked'):
    perturbkit.nnx.kfac_layers(model, x, filter=perturbkit.nnx.filters.by_type(nnx.Linear))
