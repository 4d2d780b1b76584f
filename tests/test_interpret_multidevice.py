"""Caching, patching and attribution with the batch sharded over 8 host CPU devices equal one device.

The single-device results are checked against independent references in
``test_interpret.py``; here the same functions run under ``jax.jit`` on a batch
split over the test process's 8 host CPU devices (``conftest.py``), the sweep's
progress bar included, whose callback must be one that JAX allows on many devices.
"""
import chex
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import models
import perturbkit
from hand_mlp import SHAPE, metric_of
from host_devices import data_mesh

TOL = dict(rtol=1e-5, atol=1e-6)


def problem():
  """The MLP's variables, metric, a clean and a corrupted batch of 16."""
  model = models.MLP()
  shape = (16,) + SHAPE[1:]
  clean = jax.random.normal(jax.random.key(1), shape)
  corrupted = jax.random.normal(jax.random.key(2), shape)
  variables = model.init(jax.random.key(0), clean)
  return variables, lambda v, x: metric_of(model.apply(v, x)), clean, corrupted


def split(a):
  """``a`` with its batch split over the 8 devices."""
  sharded = jax.device_put(a, NamedSharding(data_mesh(), P('data')))
  assert len(sharded.sharding.device_set) == 8
  return sharded


def test_sharded_batch_equals_single_device(capsys):
  variables, metric, clean, corrupted = problem()
  pairs = {
      'activation_patching': perturbkit.activation_patching(metric, axis=1, batch_size=3,
                                                            progress=True),
      'attribution_patching': perturbkit.attribution_patching(metric, axis=1),
  }
  capsys.readouterr()
  for name, fn in pairs.items():
    one = jax.jit(fn)(variables, clean, corrupted)
    eight = jax.jit(fn)(variables, split(clean), split(corrupted))
    chex.assert_trees_all_close(eight, one, **TOL)
    assert float(jnp.abs(one.effects).max()) > 1e-4, name
  singles = {
      'layer_integrated_gradients': perturbkit.layer_integrated_gradients(metric, axis=1,
                                                                          steps=4),
      'run_with_cache': perturbkit.run_with_cache(metric, grads=True),
  }
  for fn in singles.values():
    chex.assert_trees_all_close(jax.jit(fn)(variables, split(clean)),
                                jax.jit(fn)(variables, clean), **TOL)
  jax.effects_barrier()
  err = capsys.readouterr().err
  assert err.count('activation patching: 100%') == 2, err[-3000:]  # one bar per run, full
