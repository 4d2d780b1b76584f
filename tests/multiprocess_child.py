"""One process of ``test_multiprocess.py``: a two-process ``jax.distributed`` run on localhost.

Run as ``python multiprocess_child.py PROCESS_ID PORT OUT.npz`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` and ``JAX_PLATFORMS=cpu``: the two
processes join through ``jax.distributed.initialize`` (gloo collectives on CPU), build one mesh
over all 8 devices, feed each its own half of the batch with
``jax.make_array_from_process_local_data``, and take ``STEPS`` interleaved steps under
``jax.shard_map``, as the README's "Many devices, many hosts" describes. The final params and
the losses go to ``OUT.npz``. Importing this module has no side effects: the test uses
``problem`` and ``optimizer`` for the one-process reference.
"""
import sys

GLOBAL_BATCH = 64
STEPS = 3
PROCESSES = 2


def problem():
  """``(loss_fn, variables, x, y)``: a small MLP with a skip connection and a regression loss."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.relu(nn.Dense(16)(x))
      h = nn.relu(nn.Dense(16)(h)) + h
      return nn.Dense(2)(h)

  model = Net()
  x = jax.random.normal(jax.random.key(1), (GLOBAL_BATCH, 5))
  y = jax.random.normal(jax.random.key(2), (GLOBAL_BATCH, 2))
  variables = model.init(jax.random.key(0), x)
  loss_fn = lambda v, x, y: jnp.mean((model.apply(v, x) - y) ** 2)
  return loss_fn, variables, x, y


def optimizer():
  import optax
  return optax.adam(1e-2)


def flat(params) -> dict:
  """``{'Dense_0/kernel': array, ...}``, the form both sides save and compare."""
  import flax
  import numpy as np
  return {k: np.asarray(v) for k, v in flax.traverse_util.flatten_dict(params, sep='/').items()}


def main(process_id: int, port: int, out: str):
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import perturbkit

  jax.config.update('jax_numpy_rank_promotion', 'raise')
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(coordinator_address=f'localhost:{port}', num_processes=PROCESSES,
                             process_id=process_id, initialization_timeout=120)
  assert jax.process_count() == PROCESSES and jax.device_count() == 8, jax.devices()
  assert jax.local_device_count() == 4

  loss_fn, variables, x, y = problem()
  mesh = Mesh(jax.devices(), ('data',))
  replicated, by_row = NamedSharding(mesh, P()), NamedSharding(mesh, P('data'))

  def everywhere(a):
    a = np.asarray(a)
    return jax.make_array_from_callback(a.shape, replicated, lambda index: a[index])

  rows = GLOBAL_BATCH // PROCESSES
  mine = slice(process_id * rows, (process_id + 1) * rows)
  local = lambda a: np.asarray(a)[mine]
  xs = jax.make_array_from_process_local_data(by_row, local(x), np.shape(x))
  ys = jax.make_array_from_process_local_data(by_row, local(y), np.shape(y))

  tx = perturbkit.interleaved(loss_fn, optimizer(), axis_name='data')
  state = jax.tree.map(everywhere, tx.init(variables, x, y))
  step = jax.jit(jax.shard_map(tx.step, mesh=mesh, in_specs=(P(), P('data'), P('data')),
                               out_specs=(P(), P()), check_vma=False))
  losses = []
  for _ in range(STEPS):
    state, metrics = step(state, xs, ys)
    losses.append(np.asarray(metrics['loss'].addressable_data(0)))
  params = jax.tree.map(lambda a: a.addressable_data(0), state.params)
  np.savez(out, losses=np.stack(losses), **flat(params))
  jax.distributed.shutdown()
  print(f'process {process_id}: done')


if __name__ == '__main__':
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
