"""interleaved() data-parallel on 8 host CPU devices equals one device on the whole batch.

XLA_FLAGS must be set before jax is imported, so the check runs in a child process.
"""
import textwrap

from host_devices import run_child

CHILD = textwrap.dedent('''
    import os
    os.environ['XLA_FLAGS'] += ' --xla_force_host_platform_device_count=8'
    import functools
    import chex, jax, jax.numpy as jnp, optax, flax.linen as nn
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import perturbkit
    assert jax.device_count() == 8, jax.devices()

    class Net(nn.Module):
      @nn.compact
      def __call__(self, x):
        h = nn.relu(nn.Dense(16)(x))
        h = nn.relu(nn.Dense(16)(h)) + h
        return nn.Dense(2)(h)

    model = Net()
    x = jax.random.normal(jax.random.key(1), (64, 5))
    y = jax.random.normal(jax.random.key(2), (64, 2))
    variables = model.init(jax.random.key(0), x)
    loss_fn = lambda v, x, y: jnp.mean((model.apply(v, x) - y) ** 2)
    mesh = Mesh(jax.devices(), ('data',))

    def one_device_and_eight(loss_fn, variables, steps, **options):
      """The states and metrics after ``steps`` steps on one device and on 8, checked equal."""
      single = perturbkit.interleaved(loss_fn, optax.adam(1e-2), **options)
      parallel = perturbkit.interleaved(loss_fn, optax.adam(1e-2), axis_name='data', **options)
      step = jax.jit(jax.shard_map(parallel.step, mesh=mesh, in_specs=(P(), P('data'), P('data')),
                                   out_specs=(P(), P()), check_vma=False))
      s1, s8 = single.init(variables, x, y), parallel.init(variables, x, y)
      for _ in range(steps):
        s1, m1 = jax.jit(single.step)(s1, x, y)
        s8, m8 = step(s8, x, y)
      chex.assert_trees_all_close(s8.params, s1.params, rtol=1e-5, atol=1e-6)
      chex.assert_trees_all_close(m8['loss'], m1['loss'], rtol=1e-5, atol=1e-6)
      return single, s8, m8

    results = {}
    for propagate in ('updated', 'original'):
      _, s8, _ = one_device_and_eight(loss_fn, variables, 3, propagate=propagate)
      results[propagate] = float(jnp.abs(jax.tree.leaves(s8.params)[0]).sum())
    # The two schedules really differ, so the comparison above is not vacuous.
    assert results['updated'] != results['original'], results

    # Blocks in nn.scan: each iteration's step inside the scan's backward pass, its
    # gradient averaged over the devices there.
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

    scanned = Scanned()
    variables = scanned.init(jax.random.key(0), x)
    loss_fn = lambda v, x, y: jnp.mean((scanned.apply(v, x) - y) ** 2)
    single, _, m8 = one_device_and_eight(loss_fn, variables, 2)
    assert dict(single.segments(variables, x, y).iterations) == {'blocks/Dense_0': 3}
    assert m8['activation_grad_norm']['blocks/Dense_0'].shape == (3,)
    print('MULTIDEVICE-OK')
''')


def test_shard_map_step_equals_single_device():
  run_child(CHILD, 'MULTIDEVICE-OK')
