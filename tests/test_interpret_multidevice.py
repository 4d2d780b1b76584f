"""Caching, patching and attribution with the batch sharded over 8 host CPU devices equal one device.

The single-device results are checked against independent references in
``test_interpret.py``; here the same functions run under ``jax.jit`` on a batch
split over 8 devices (the sweep's progress bar included, whose callback must be
one that JAX allows on many devices). XLA_FLAGS must be set before jax is
imported, so the check runs in a child process.
"""
import textwrap

from host_devices import run_child

CHILD = textwrap.dedent('''
    import os
    os.environ['XLA_FLAGS'] += ' --xla_force_host_platform_device_count=8'
    import sys
    import chex, jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    sys.path.insert(0, sys.argv[1])
    import models
    import perturbkit
    from hand_mlp import SHAPE, metric_of
    assert jax.device_count() == 8, jax.devices()

    model = models.MLP()
    shape = (16,) + SHAPE[1:]
    clean = jax.random.normal(jax.random.key(1), shape)
    corrupted = jax.random.normal(jax.random.key(2), shape)
    variables = model.init(jax.random.key(0), clean)
    metric = lambda v, x: metric_of(model.apply(v, x))
    mesh = Mesh(jax.devices(), ('data',))
    split = lambda a: jax.device_put(a, NamedSharding(mesh, P('data')))
    assert len(split(clean).sharding.device_set) == 8

    pairs = {
        'activation_patching': perturbkit.activation_patching(metric, axis=1, batch_size=3,
                                                              progress=True),
        'attribution_patching': perturbkit.attribution_patching(metric, axis=1),
    }
    for name, fn in pairs.items():
      one = jax.jit(fn)(variables, clean, corrupted)
      eight = jax.jit(fn)(variables, split(clean), split(corrupted))
      chex.assert_trees_all_close(eight, one, rtol=1e-5, atol=1e-6)
      assert float(jnp.abs(one.effects).max()) > 1e-4, name
    singles = {
        'layer_integrated_gradients': perturbkit.layer_integrated_gradients(metric, axis=1,
                                                                            steps=4),
        'run_with_cache': perturbkit.run_with_cache(metric, grads=True),
    }
    for name, fn in singles.items():
      chex.assert_trees_all_close(jax.jit(fn)(variables, split(clean)),
                                  jax.jit(fn)(variables, clean), rtol=1e-5, atol=1e-6)
    jax.effects_barrier()
    print('MULTIDEVICE-INTERPRET-OK')
''')


def test_sharded_batch_equals_single_device():
  proc = run_child(CHILD, 'MULTIDEVICE-INTERPRET-OK')
  assert proc.stderr.count('activation patching: 100%') == 2  # one bar per run, full
