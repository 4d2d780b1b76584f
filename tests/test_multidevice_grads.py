"""value_and_grad on 8 host CPU devices (shard_map and sharded jit) equals one device.

XLA_FLAGS must be set before jax is imported, so the check runs in a child process.
"""
import textwrap

from host_devices import run_child

CHILD = textwrap.dedent('''
    import os
    os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
    import sys
    import chex, jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    jax.config.update('jax_numpy_rank_promotion', 'raise')
    sys.path.insert(0, sys.argv[1])
    import models
    import perturbkit
    assert jax.device_count() == 8, jax.devices()

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
    chex.assert_trees_all_close(single['perturbations'], models.nest(hand), rtol=1e-5, atol=1e-6)

    mesh = Mesh(jax.devices(), ('data',))

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
    print('MULTIDEVICE-GRADS-OK')
''')


def test_sharded_value_and_grad_equals_single_device():
  run_child(CHILD, 'MULTIDEVICE-GRADS-OK')
