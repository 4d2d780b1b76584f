"""Variables in Flax's containers: params annotated for sharding (``nn.with_partitioning``,
``nn.with_logical_partitioning``), and variables frozen (``flax.core.freeze``).

Annotated params stay in their ``nn.Partitioned`` boxes in the variables (as the Flax guide to
sharded models keeps them); frozen variables are ``FrozenDict`` all the way down. Per-example
norms are checked against ``vmap(grad)``, DP-SGD against clipping that by hand, K-FAC and
interleaved training against the same functions on the unboxed variables (themselves checked
against references in their own tests). Whatever mirrors the params (a gradient, an update,
the trained variables, the optimizer's moments) keeps the boxes and the ``FrozenDict``, so
that ``nn.get_partition_spec`` reads the same sharding from it and ``optax.apply_updates``
takes it with the params; the rest (norms) holds arrays in dicts. On NNX, where the sharding
is the variables' metadata, ``InterleavedOptimizer``'s moments carry their params' as
``nnx.Optimizer``'s do.
"""
import functools

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import perturbkit
from host_devices import require_devices

_init = nn.initializers.lecun_normal()


class ShardedMLP(nn.Module):
  """Dense kernels split over 'model' (one by mesh axis, one by logical names), a LayerNorm
  scale and a root-level temperature in boxes too."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8, kernel_init=nn.with_partitioning(_init, (None, 'model')))(x)
    h = nn.LayerNorm(scale_init=nn.with_partitioning(nn.initializers.ones, ('model',)))(h)
    h = nn.Dense(3, kernel_init=nn.with_logical_partitioning(_init, ('hidden', 'classes')),
                 bias_init=nn.with_partitioning(nn.initializers.zeros_init(), ('model',)))(
                     jnp.tanh(h))
    temperature = self.param('temperature', nn.with_partitioning(nn.initializers.ones, ()), ())
    return h * temperature


MODEL = ShardedMLP()
X = jax.random.normal(jax.random.key(0), (4, 5))
Y = jnp.arange(4) % 3
VARIABLES = jax.jit(MODEL.init)(jax.random.key(1), X)  # one compile, not one per initializer
UNBOXED = nn.meta.unbox(VARIABLES)
GIVEN = {'boxed': VARIABLES, 'frozen': flax.core.freeze(VARIABLES)}


def loss_fn(variables, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(MODEL.apply(variables, x), y).mean()


def predict(variables, x):
  return MODEL.apply(variables, x)


@functools.cache
def per_example_grads():
  """Each example's gradient, by ``jax.vmap(jax.grad)`` on the unboxed variables (jitted, and
  computed once for every test that compares with it)."""
  one = lambda x, y: jax.grad(loss_fn)(UNBOXED, x[None], y[None])['params']
  return jax.jit(jax.vmap(one))(X, Y)


def specs(tree):
  return nn.get_partition_spec(tree)


def test_the_model_keeps_boxes():
  boxed = [type(leaf).__name__ for leaf in jax.tree.leaves(
      VARIABLES, is_leaf=lambda leaf: isinstance(leaf, nn.meta.AxisMetadata))]
  assert boxed.count('Partitioned') == 4 and boxed.count('LogicallyPartitioned') == 1


@pytest.mark.parametrize('given', GIVEN)
def test_per_example_norms_equal_vmap_grad(given):
  _, norms = jax.jit(perturbkit.per_example_grad_norms(loss_fn))(GIVEN[given], X, Y)
  grads = per_example_grads()
  squares = jax.tree.map(lambda g: np.sum(np.asarray(g).reshape(4, -1) ** 2, axis=1), grads)
  np.testing.assert_allclose(norms.total, np.sqrt(sum(jax.tree.leaves(squares))), rtol=1e-5)
  chex.assert_trees_all_close(norms.by_param, jax.tree.map(np.sqrt, squares), rtol=1e-5,
                              atol=1e-7)


@pytest.mark.parametrize('given, mesh', [('boxed', False), ('boxed', True), ('frozen', False)],
                         ids=['boxed', 'boxed_model_parallel', 'frozen'])
def test_dp_sgd_step_equals_clipping_by_hand_and_keeps_the_containers(given, mesh):
  clip = 0.5
  dp = perturbkit.dp_sgd(loss_fn, optax.sgd(0.1), clip_norm=clip, noise_multiplier=0.0)
  if mesh:
    with jax.set_mesh(Mesh(np.array(require_devices(8)).reshape(2, 4), ('data', 'model'))), \
         nn.logical_axis_rules([('hidden', None), ('classes', 'model')]):
      state, metrics = jax.jit(dp.step)(dp.init(GIVEN[given]), jax.random.key(2), X, Y)
  else:
    state, metrics = jax.jit(dp.step)(dp.init(GIVEN[given]), jax.random.key(2), X, Y)
  grads = per_example_grads()
  norms = np.sqrt(sum(np.sum(np.asarray(g).reshape(4, -1) ** 2, axis=1)
                      for g in jax.tree.leaves(grads)))
  scale = np.minimum(1.0, clip / norms)
  clipped_mean = jax.tree.map(lambda g: np.tensordot(scale, np.asarray(g), 1) / 4, grads)
  expected = jax.tree.map(lambda p, g: p - 0.1 * g, UNBOXED['params'], clipped_mean)
  np.testing.assert_allclose(metrics['per_example_norms'], norms, rtol=1e-5)
  assert specs(state.variables) == specs(VARIABLES)
  assert type(state.variables['params']) is type(GIVEN[given]['params'])
  chex.assert_trees_all_close(flax.core.unfreeze(nn.meta.unbox(state.variables['params'])),
                              expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('given', GIVEN)
def test_private_grad_is_in_the_containers_of_the_params(given):
  grads, _ = jax.jit(perturbkit.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=1.0))(
      GIVEN[given], jax.random.key(3), X, Y)
  assert jax.tree.structure(grads) == jax.tree.structure(GIVEN[given]['params'])
  assert specs(grads) == specs(VARIABLES['params'])


def kfac_step(variables):
  layers = perturbkit.kfac_layers(predict, variables, X)
  estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers)
  tx = optax.chain(perturbkit.kfac_preconditioner(layers, damping=0.1, fallback=optax.sgd(0.5)),
                   optax.sgd(0.1))
  state = tx.init(variables['params'])
  loss, grads, stats = jax.jit(estimate)(variables, X, Y, jax.random.key(4))
  update = lambda grads, state, params, stats: tx.update(grads, state, params, kfac_stats=stats)
  updates, state = jax.jit(update)(grads, state, variables['params'], stats)
  return layers, grads, updates, state


@functools.cache
def plain_kfac_step():
  """:func:`kfac_step` on the unboxed variables, and ``jax.grad`` of the loss on them: computed
  once, for both containers."""
  return kfac_step(UNBOXED), jax.jit(jax.grad(loss_fn))(UNBOXED, X, Y)['params']


def unpacked(tree):
  return flax.core.unfreeze(nn.meta.unbox(tree))


@pytest.mark.parametrize('given', GIVEN)
def test_kfac_step_equals_the_plain_step_and_keeps_the_containers(given):
  layers, grads, updates, state = kfac_step(GIVEN[given])
  (plain_layers, plain_grads, plain_updates, plain_state), want_grads = plain_kfac_step()
  assert layers.layers == plain_layers.layers and layers.skipped == plain_layers.skipped
  assert set(layers.layers) == {'Dense_0', 'LayerNorm_0', 'Dense_1'}
  params_structure = jax.tree.structure(GIVEN[given]['params'])
  assert jax.tree.structure(grads) == jax.tree.structure(updates) == params_structure
  assert specs(grads) == specs(updates) == specs(VARIABLES['params'])
  chex.assert_trees_all_close(unpacked(grads), plain_grads, rtol=1e-6)
  chex.assert_trees_all_close(unpacked(updates), plain_updates, rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(unpacked(state), plain_state, rtol=1e-5, atol=1e-7)
  # The gradient itself is jax.grad's.
  chex.assert_trees_all_close(unpacked(grads), want_grads, rtol=1e-5, atol=1e-7)


class _Block(nn.Module):

  @nn.compact
  def __call__(self, h, _):
    y = nn.Dense(8, kernel_init=nn.with_partitioning(_init, ('embed', 'mlp')))(h)
    y = nn.LayerNorm(scale_init=nn.with_partitioning(nn.initializers.ones, ('mlp',)))(jnp.tanh(y))
    return h + y, None


class ScannedBlocks(nn.Module):
  """Blocks stacked by ``nn.scan`` (and remat), their params annotated with a 'layers' axis."""

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(nn.remat(_Block), variable_axes={'params': 0}, split_rngs={'params': True},
                    length=3, metadata_params={nn.PARTITION_NAME: 'layers'})
    h, _ = stack()(nn.Dense(8)(x), None)
    return nn.Dense(3)(h)


def segment_params(params, name):
  for key in name.split('/'):
    params = params[key]
  return params


@pytest.mark.parametrize('scanned', [False, True], ids=['mlp', 'scanned'])
def test_interleaved_steps_boxed_params_as_plain_ones_and_keeps_the_boxes(scanned):
  """The boxes stay on the variables and on each segment's optimizer moments; scanned layers
  are segments per iteration, as without the boxes."""
  model = ScannedBlocks() if scanned else MODEL
  variables = model.init(jax.random.key(5), X) if scanned else VARIABLES
  boxed_loss = lambda v, x, y: optax.softmax_cross_entropy_with_integer_labels(
      model.apply(v, x), y).mean()
  tx = perturbkit.interleaved(boxed_loss, optax.adam(0.1))
  states = {}
  for name, given in [('boxed', variables), ('plain', nn.meta.unbox(variables))]:
    segmentation = tx.segments(given, X, Y)
    if scanned:
      assert segmentation.iterations == {'ScanCheckpoint_Block_0/Dense_0': 3,
                                         'ScanCheckpoint_Block_0/LayerNorm_0': 3}
    step = jax.jit(tx.step)
    states[name] = step(step(tx.init(given, X, Y), X, Y)[0], X, Y)[0]
  boxed = states['boxed']
  assert specs(boxed.variables) == specs(variables)
  for name in segmentation.segments:
    adam = boxed.opt_state[name][0]
    assert specs(adam.mu) == specs(adam.nu) == specs(
        segment_params(variables['params'], name)), name
  if scanned:
    assert specs(variables)['params']['ScanCheckpoint_Block_0']['Dense_0']['kernel'] == \
        jax.sharding.PartitionSpec('layers', 'embed', 'mlp')
  chex.assert_trees_all_close(nn.meta.unbox(boxed), states['plain'], rtol=1e-6)


class ShardedNNX(nnx.Module):
  """The NNX counterpart: kernels sharded over 'model' by their variables' metadata."""

  def __init__(self, rngs):
    self.a = nnx.Linear(5, 8, kernel_init=nnx.with_partitioning(_init, (None, 'model')),
                        rngs=rngs)
    self.b = nnx.Linear(8, 3, kernel_init=nnx.with_partitioning(_init, ('model', None)),
                        rngs=rngs)

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x)))


def test_nnx_interleaved_optimizer_state_keeps_the_params_sharding_like_nnx_optimizer():
  nnx_loss = lambda m, x, y: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
  with jax.set_mesh(Mesh(np.array(require_devices(8)).reshape(2, 4), ('data', 'model'))):
    model, reference = ShardedNNX(nnx.Rngs(0)), ShardedNNX(nnx.Rngs(0))
    opt = perturbkit.nnx.InterleavedOptimizer(model, optax.adam(0.1), nnx_loss, X, Y,
                                              propagate='original')
    plain = nnx.Optimizer(reference, optax.adam(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, reference, plain):
      opt.step(model, X, Y)
      plain.update(reference, nnx.grad(nnx_loss)(reference, X, Y))

    step(model, opt, reference, plain)
  for name in ('a', 'b'):
    mine, theirs = opt.opt_state[name][0], plain.opt_state[0]
    assert nnx.get_partition_spec(nnx.state(mine.mu)) == nnx.get_partition_spec(
        nnx.state(theirs.mu[name])), name
    chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(mine.mu)),
                                nnx.to_pure_dict(nnx.state(theirs.mu[name])), rtol=1e-6)
  assert nnx.get_partition_spec(nnx.state(opt.opt_state['a'][0].mu))['kernel'].get_value() == \
      jax.sharding.PartitionSpec(None, 'model')
  chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                              nnx.to_pure_dict(nnx.state(reference, nnx.Param)), rtol=1e-6)
