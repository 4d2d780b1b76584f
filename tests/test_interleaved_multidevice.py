"""interleaved() data-parallel on 8 host CPU devices equals one device on the whole batch.

The test process has 8 host CPU devices (``conftest.py``); the step runs under
``jax.shard_map`` over them with ``axis_name='data'``, the reference under ``jax.jit`` on
one device. The plain model is the multi-process check's (``multiprocess_child.problem``).
Every metric of the step (loss, gradient and activation gradient norms, the non-finite and
skipped flags) equals one device's, on both front ends.
"""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import nnx_models
import perturbkit
from host_devices import data_mesh, sharded_nnx_step, sharded_step
from multiprocess_child import problem


class Block(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return h + jnp.tanh(nn.Dense(16)(h)), None


class Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    h, _ = nn.scan(Block, variable_axes={'params': 0}, split_rngs={'params': True},
                   length=3)(name='blocks')(h, None)
    return nn.Dense(2)(h)


def one_device_and_eight(loss_fn, variables, x, y, steps, **options):
  """The states and metrics after ``steps`` steps on one device and on 8, checked equal."""
  single = perturbkit.interleaved(loss_fn, optax.adam(1e-2), **options)
  parallel = perturbkit.interleaved(loss_fn, optax.adam(1e-2), axis_name='data', **options)
  step = sharded_step(parallel.step)
  s1, s8 = single.init(variables, x, y), parallel.init(variables, x, y)
  for _ in range(steps):
    s1, m1 = jax.jit(single.step)(s1, x, y)
    s8, m8 = step(s8, x, y)
  chex.assert_trees_all_close(s8.params, s1.params, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(m8, m1, rtol=1e-5, atol=1e-6)
  return single, s8, m8


def test_shard_map_step_equals_single_device():
  """Both schedules, three steps each, equal one device; and they differ from each other."""
  loss_fn, variables, x, y = problem()
  results = {}
  for propagate in ('updated', 'original'):
    _, s8, _ = one_device_and_eight(loss_fn, variables, x, y, 3, propagate=propagate)
    results[propagate] = float(jnp.abs(jax.tree.leaves(s8.params)[0]).sum())
  # The two schedules really differ, so the comparison above is not vacuous.
  assert results['updated'] != results['original'], results


def test_scanned_blocks_step_equals_single_device():
  """Blocks in nn.scan: each iteration's step inside the scan's backward pass, its gradient
  averaged over the devices there, equals one device."""
  _, _, x, y = problem()
  scanned = Scanned()
  variables = scanned.init(jax.random.key(0), x)
  mse = lambda v, x, y: jnp.mean((scanned.apply(v, x) - y) ** 2)
  single, _, m8 = one_device_and_eight(mse, variables, x, y, 2)
  assert dict(single.segments(variables, x, y).iterations) == {'blocks/Dense_0': 3}
  assert m8['activation_grad_norm']['blocks/Dense_0'].shape == (3,)


def squared_error_with_aux(predict):
  """``(variables_or_model, x, y) -> (mean squared error, aux)``, the aux the mean absolute
  error and the batch size, each device's own."""
  def loss_fn(v, x, y):
    error = predict(v, x) - y
    return jnp.mean(error ** 2), {'mae': jnp.mean(jnp.abs(error)), 'examples': x.shape[0]}
  return loss_fn


def assert_own_aux(aux, error):
  assert int(aux['examples']) == len(error)
  np.testing.assert_allclose(aux['mae'], jnp.mean(jnp.abs(error)), rtol=1e-5)


def test_every_metric_equals_single_device_on_both_front_ends():
  """Every metric of one step on 8 devices equals one device on the whole batch, for Linen's
  ``interleaved`` and NNX's ``InterleavedOptimizer``: the activation gradient norms are the
  whole batch's (not a device's own), and the model's second call of ``dense_1`` puts it in
  ``REST``, whose flags are compared too."""
  _, _, x, y = problem()
  linen_model = nnx_models.LinenMLP()
  variables = linen_model.init(jax.random.key(0), x)
  apply = lambda v, x: linen_model.apply(v, x)
  single = perturbkit.interleaved(squared_error_with_aux(apply), optax.sgd(0.1),
                                  has_aux=True)
  parallel = perturbkit.interleaved(squared_error_with_aux(apply), optax.sgd(0.1),
                                    has_aux=True, axis_name='data')
  _, m1 = jax.jit(single.step)(single.init(variables, x, y), x, y)
  _, m8 = sharded_step(parallel.step)(parallel.init(variables, x, y), x, y)
  assert set(m1['nonfinite']) == {'dense_0', 'dense_2', perturbkit.REST}, m1['nonfinite']
  shard = len(x) // 8  # the device whose aux comes back: the first shard's, before the update
  assert_own_aux(m8.pop('aux'), apply(variables, x[:shard]) - y[:shard])
  assert_own_aux(m1.pop('aux'), apply(variables, x) - y)
  chex.assert_trees_all_close(m8, m1, rtol=1e-5, atol=1e-6)

  make = lambda: nnx_models.MLP(5, 6, 2, rngs=nnx.Rngs(0))
  call = lambda model, x: model(x)
  model1, model8 = make(), make()
  opt1 = perturbkit.nnx.InterleavedOptimizer(model1, optax.sgd(0.1),
                                             squared_error_with_aux(call), x, y,
                                             has_aux=True)
  opt8 = perturbkit.nnx.InterleavedOptimizer(model8, optax.sgd(0.1),
                                             squared_error_with_aux(call), x, y,
                                             has_aux=True, axis_name='data')
  n1 = nnx.jit(lambda m, o, x, y: o.step(m, x, y))(model1, opt1, x, y)
  n8 = sharded_nnx_step(lambda m, o, x, y: o.step(m, x, y))(model8, opt8, x, y)
  assert set(n1['activation_grad_norm']) == {'dense_0', 'dense_2'}, n1
  assert_own_aux(n8.pop('aux'), make()(x[:shard]) - y[:shard])
  assert_own_aux(n1.pop('aux'), make()(x) - y)
  chex.assert_trees_all_close(n8, n1, rtol=1e-5, atol=1e-6)


class SyncedNorm(nn.Module):
  """BatchNorm whose statistics are the whole batch's (``axis_name='data'``)."""

  @nn.compact
  def __call__(self, x):
    h = nn.BatchNorm(use_running_average=False, axis_name='data')(nn.Dense(6)(x))
    return nn.Dense(2)(nn.relu(h))


def test_init_of_a_model_with_collectives_runs_in_the_steps_shard_map():
  """Outside the shard_map its axis is unbound: a named error saying where to call init;
  inside it, the state is the one-device init's."""
  _, _, x, y = problem()
  model = SyncedNorm()
  mesh_init = jax.jit(jax.shard_map(lambda x: model.init(jax.random.key(0), x),
                                    mesh=data_mesh(), in_specs=P('data'), out_specs=P(),
                                    check_vma=False))
  variables = mesh_init(x)

  def loss_fn(v, x, y):
    out, updates = model.apply(v, x, mutable=['batch_stats'])
    return jnp.mean((out - y) ** 2), updates
  tx = perturbkit.interleaved(loss_fn, optax.sgd(0.1), has_aux=True, axis_name='data')
  with pytest.raises(perturbkit.UnboundAxisError, match='inside the same jax.shard_map'):
    tx.init(variables, x, y)
  init = jax.jit(jax.shard_map(tx.init, mesh=data_mesh(), in_specs=(P(), P('data'), P('data')),
                               out_specs=P(), check_vma=False))
  state = init(variables, x, y)
  chex.assert_trees_all_close(state.params, variables['params'])


def test_an_axis_name_no_shard_map_binds_is_named():
  """A misspelt axis_name inside shard_map, or one given outside any shard_map: a named
  error listing the axes bound there, from each family that takes axis_name."""
  loss_fn, variables, x, y = problem()
  sharded = lambda f, *specs: jax.jit(jax.shard_map(
      f, mesh=data_mesh(), in_specs=specs, out_specs=P(), check_vma=False))
  tx = perturbkit.interleaved(loss_fn, optax.sgd(0.1), axis_name='batch')
  state = tx.init(variables, x, y)
  private = perturbkit.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=1.0,
                                    axis_name='batch')
  private_grad = lambda v, x, y: private(v, jax.random.key(0), x, y)[0]
  for run, where in (
      (lambda: sharded(tx.step, P(), P('data'), P('data'))(state, x, y), "binds 'data'"),
      (lambda: jax.jit(tx.step)(state, x, y), 'no jax.shard_map or jax.pmap'),
      (lambda: sharded(private_grad, P(), P('data'), P('data'))(variables, x, y),
       "binds 'data'")):
    with pytest.raises(perturbkit.UnknownAxisError, match=f"axis_name='batch', but .*{where}"):
      run()


def test_no_axis_name_under_unchecked_shard_map_warns_that_each_device_steps_alone():
  """With check_vma=False and no axis_name nothing sums the devices' gradients: each device
  steps on its own shard, and the families that take axis_name say so."""
  loss_fn, variables, x, y = problem()
  sharded = lambda f: jax.jit(jax.shard_map(
      f, mesh=data_mesh(), in_specs=(P(), P('data'), P('data')), out_specs=P('data'),
      check_vma=False))
  tx = perturbkit.interleaved(loss_fn, optax.sgd(0.1))
  state = tx.init(variables, x, y)
  private = perturbkit.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=0.0)
  with pytest.warns(perturbkit.DeviceLocalStepWarning,
                    match="perturbkit.interleaved .*axis_name='data'"):
    per_device = sharded(lambda s, x, y: tx.step(s, x, y)[0].params)(state, x, y)
  with pytest.warns(perturbkit.DeviceLocalStepWarning,
                    match="perturbkit.private_grad .*axis_name='data'"):
    sharded(lambda v, x, y: private(v, jax.random.key(0), x, y)[0])(variables, x, y)
  # The first device's params are those of a step on its own shard alone.
  shard = x.shape[0] // 8
  alone = jax.jit(tx.step)(state, x[:shard], y[:shard])[0].params
  first = jax.tree.map(lambda a, b: a[:b.shape[0]], per_device, alone)
  chex.assert_trees_all_close(first, alone, rtol=1e-5, atol=1e-6)
  whole = jax.jit(tx.step)(state, x, y)[0].params
  assert max(float(jnp.abs(a - b).max())
             for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(whole))) > 1e-4
