"""value_and_grad on 8 host CPU devices (shard_map, sharded jit, sharded params) equals one device.

The test process has 8 host CPU devices (``conftest.py``). The data-parallel checks split
the batch over all 8; the model-parallel ones shard the params Megatron-style over a
'model' axis and the batch over 'data' (2 x 4 devices), and compare the compiled programs'
collectives with those of ``jax.value_and_grad`` / ``nnx.value_and_grad`` and the standard
optax step.
"""
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import models
import perturbkit
from host_devices import data_mesh, require_devices

TOL = dict(rtol=1e-5, atol=1e-6)
COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute', 'all-to-all')


# ---------------------------------------------------------------- data parallel

def test_sharded_value_and_grad_equals_single_device():
  """Under ``jax.shard_map`` (the loss and params' grads summed over the devices, the
  activation grads each device's own) and under jit on a sharded batch, the loss and all
  grads equal one device, whose activation grads equal the hand twin's."""
  model = models.MLP()
  x = jax.random.normal(jax.random.key(1), (16, 5))
  variables = model.init(jax.random.key(0), x)
  loss_fn = lambda v, x: models.scalar(model.apply(v, x))
  vg = perturbkit.value_and_grad(loss_fn)
  single_loss, single = jax.jit(vg)(variables, x)

  # The hand twin, as an independent reference for the single-device result.
  zeros = models.MLP(hand=True).init(jax.random.key(0), x)['perturbations']
  hand = jax.grad(lambda eps: models.scalar(models.MLP(hand=True).apply(
      {**variables, 'perturbations': eps}, x)))(zeros)
  chex.assert_trees_all_close(single['perturbations'], models.nest(hand), **TOL)

  mesh = data_mesh()

  def local(v, x):
    loss, grads = vg(v, x)
    # Each device's loss is its shard's sum: params grads add up, points stay sharded.
    return (jax.lax.psum(loss, 'data'),
            {'params': jax.lax.psum(grads['params'], 'data'),
             'perturbations': grads['perturbations']})

  sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P('data')),
                                  out_specs=(P(), {'params': P(), 'perturbations': P('data')}),
                                  check_vma=False))
  loss8, grads8 = sharded(variables, x)
  chex.assert_trees_all_close(loss8, single_loss, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(grads8, single, rtol=1e-5, atol=1e-5)

  # Sharded jit: the batch split over the devices, the computation the same.
  x_sharded = jax.device_put(x, NamedSharding(mesh, P('data')))
  loss_j, grads_j = jax.jit(vg)(variables, x_sharded)
  chex.assert_trees_all_close((loss_j, grads_j), (single_loss, single), rtol=1e-5, atol=1e-5)
  assert len(x_sharded.sharding.device_set) == 8


# ---------------------------------------------------------------- model parallel

def model_mesh() -> Mesh:
  """2 x 4 devices: the batch over 'data', the params' hidden dimension over 'model'."""
  return Mesh(np.array(require_devices(8)).reshape(2, 4), ('data', 'model'))


def collectives(compiled) -> dict[str, int]:
  """How many of each collective op the compiled program has (async ones by their start)."""
  text = compiled.as_text()
  return {op: text.count(f' {op}(') + text.count(f' {op}-start(') for op in COLLECTIVES}


def sent_bytes(compiled) -> int:
  """The float32 bytes the compiled program's collectives send, summed over its ops."""
  total = 0
  for line in compiled.as_text().splitlines():
    head = line.split('=', 1)[-1]
    if any(f' {op}(' in head or f' {op}-start(' in head for op in COLLECTIVES):
      for dims in re.findall(r'f32\[([0-9,]*)\]', head.split('(')[0]):
        total += 4 * int(np.prod([int(d) for d in dims.split(',') if d]))
  return total


def split(axes):
  return nn.with_partitioning(nn.initializers.lecun_normal(), axes)


class MegatronMLP(nn.Module):
  """Column- then row-parallel Dense, then a replicated head."""
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(64, kernel_init=split((None, 'model')))(x))
    h = nn.LayerNorm()(nn.Dense(32, kernel_init=split(('model', None)))(h))
    return nn.Dense(8)(h)


class NNXMegatronMLP(nnx.Module):
  """The same column- and row-parallel layers in NNX, without the norm."""
  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(32, 64, kernel_init=nnx.with_partitioning(init, (None, 'model')),
                         rngs=rngs)
    self.down = nnx.Linear(64, 32, kernel_init=nnx.with_partitioning(init, ('model', None)),
                           rngs=rngs)
    self.head = nnx.Linear(32, 8, rngs=rngs)

  def __call__(self, x):
    return self.head(self.down(nnx.relu(self.up(x))))


@pytest.fixture(scope='module')
def megatron():
  """``(mesh, loss_fn, variables, x, xs)``: MegatronMLP's variables sharded by their partition
  specs, a batch ``x`` of 16 on one device and ``xs``, the same split over 'data'."""
  mesh = model_mesh()
  model = MegatronMLP()
  x = jax.random.normal(jax.random.key(1), (16, 32))
  boxed = model.init(jax.random.key(0), x)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), nn.get_partition_spec(boxed))
  variables = jax.device_put(nn.unbox(boxed), shardings)
  xs = jax.device_put(x, NamedSharding(mesh, P('data')))
  loss_fn = lambda v, x: jnp.mean(model.apply(v, x) ** 2)
  return mesh, loss_fn, variables, x, xs


def test_model_parallel_sharding_adds_no_communication(megatron):
  """Linen, under sharded jit: activation gradients add no collective to the compiled program
  of ``jax.value_and_grad``, the params' gradients equal its, the whole result equals one
  device, and the gradient at the column-parallel layer stays sharded like its output."""
  _, loss_fn, variables, x, xs = megatron
  plain = jax.jit(jax.value_and_grad(loss_fn)).lower(variables, xs).compile()
  ours = jax.jit(perturbkit.value_and_grad(loss_fn)).lower(variables, xs).compile()
  assert collectives(ours) == collectives(plain), (collectives(ours), collectives(plain))
  assert collectives(plain)['all-reduce'] > 0
  (loss, grads), (want_loss, want) = ours(variables, xs), plain(variables, xs)
  chex.assert_trees_all_close((loss, grads['params']), (want_loss, want['params']), **TOL)
  hidden = grads['perturbations']['Dense_0']['__call__']
  assert hidden.sharding.spec == P('data', 'model'), hidden.sharding
  single = perturbkit.value_and_grad(loss_fn)(jax.device_get(variables), x)
  chex.assert_trees_all_close((loss, grads), single, **TOL)


def test_model_parallel_interleaved_step_sends_no_activation(megatron):
  """The interleaved step ('original': exactly jax.grad + optax) communicates what the
  standard optax step does, plus scalars (its metrics), nothing of an activation's size; it
  equals that step and keeps the params' sharding."""
  _, loss_fn, variables, _, xs = megatron
  tx = optax.adam(1e-2)

  def standard(params, opt_state, x):
    g = jax.grad(lambda p: loss_fn({'params': p}, x))(params)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  interleaved = perturbkit.interleaved(loss_fn, tx, propagate='original')
  state = interleaved.init(variables, xs)
  step = jax.jit(interleaved.step).lower(state, xs).compile()
  standard = jax.jit(standard).lower(variables['params'], tx.init(variables['params']), xs)
  standard = standard.compile()
  assert collectives(step)['all-gather'] == collectives(standard)['all-gather'] == 0
  smallest_activation = 4 * 8 * 32
  assert sent_bytes(step) - sent_bytes(standard) < smallest_activation, (
      sent_bytes(step), sent_bytes(standard))
  new_state, _ = step(state, xs)
  want = standard(variables['params'], tx.init(variables['params']), xs)[0]
  chex.assert_trees_all_close(new_state.params, want, **TOL)
  assert new_state.params['Dense_0']['kernel'].sharding.spec == P(None, 'model')


def test_nnx_model_parallel_sharding_adds_no_communication(megatron):
  """NNX, the state sharded by its partition specs, jitted on ``nnx.split``: activation
  gradients add no collective to ``nnx.value_and_grad``'s program, the params' gradients
  equal its, and the gradient at the column-parallel layer stays sharded like its output."""
  mesh, _, _, _, xs = megatron
  with jax.set_mesh(mesh):  # NNX shards the variables where it creates them
    net = NNXMegatronMLP(nnx.Rngs(0))
  graphdef, state = nnx.split(net)
  assert state['up']['kernel'][...].sharding.spec == P(None, 'model')
  nnx_loss = lambda m, x: jnp.mean(m(x) ** 2)
  plain = jax.jit(lambda s, x: nnx.value_and_grad(nnx_loss)(nnx.merge(graphdef, s), x))
  ours = jax.jit(lambda s, x: perturbkit.nnx.value_and_grad(nnx_loss)(nnx.merge(graphdef, s), x))
  plain, ours = plain.lower(state, xs).compile(), ours.lower(state, xs).compile()
  assert collectives(ours) == collectives(plain), (collectives(ours), collectives(plain))
  (loss, grads), (want_loss, want) = ours(state, xs), plain(state, xs)
  chex.assert_trees_all_close((loss, grads['params']), (want_loss, want), **TOL)
  assert grads['perturbations']['up']['__call__'].sharding.spec == P('data', 'model')
