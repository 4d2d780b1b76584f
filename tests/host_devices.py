"""Host CPU devices: meshes for the multi-device checks, and the environment for child processes.

``conftest.py`` gives every test process 8 host CPU devices (``XLA_FLAGS`` is read when
jax starts, so it sets them before importing jax): the multi-device checks run in the test
process, on a mesh of :func:`data_mesh` or :func:`require_devices`' devices
(:func:`sharded_step`, :func:`sharded_nnx_step`: a training step data-parallel over them). A check that
needs processes of its own (``jax.distributed``, a fresh Python) starts them with
:func:`child_environment`, which leaves the device count to the child.
"""
import os
import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

DEVICES = 8


def require_devices(n: int = DEVICES) -> list[jax.Device]:
  """The first ``n`` devices; fails (never skips) where this process has fewer."""
  if jax.device_count() < n:
    raise AssertionError(
        f'this check needs {n} devices, jax has {jax.device_count()}: run the tests with the '
        "repository's tests/conftest.py, which gives each test process 8 host CPU devices "
        '(XLA_FLAGS=--xla_force_host_platform_device_count=8); here jax was imported before it '
        'set XLA_FLAGS, or the environment named fewer devices')
  return jax.devices()[:n]


def data_mesh(n: int = DEVICES, axis: str = 'data') -> Mesh:
  """A one-axis mesh over the first ``n`` devices, the batch's axis ``axis``."""
  return Mesh(np.array(require_devices(n)), (axis,))


def sharded_step(step, mesh: Mesh | None = None):
  """``step(state, x, y) -> (state, metrics)`` jitted under ``jax.shard_map`` over ``mesh``
  (default :func:`data_mesh`): the state replicated, the batch split along ``'data'``."""
  return jax.jit(jax.shard_map(step, mesh=data_mesh() if mesh is None else mesh,
                               in_specs=(P(), P('data'), P('data')), out_specs=(P(), P()),
                               check_vma=False))


def sharded_nnx_step(step):
  """``step(model, optimizer, x, y) -> output`` under ``nnx.shard_map`` inside ``nnx.jit`` over
  :func:`data_mesh`: the model and optimizer replicated, the batch split along ``'data'``, the
  output replicated."""
  return nnx.jit(nnx.shard_map(step, mesh=data_mesh(), in_specs=(P(), P(), P('data'), P('data')),
                               out_specs=P(), check_vma=False))


def child_environment() -> dict[str, str]:
  """This process's environment for a child process, ``XLA_FLAGS`` always set.

  The child keeps this process's XLA flags (the cheaper compile passes
  ``conftest.py`` sets) but not the host device count: a child that needs host devices
  adds its own ``--xla_force_host_platform_device_count``.
  """
  env = dict(os.environ)
  env['XLA_FLAGS'] = re.sub(r'--xla_force_host_platform_device_count=\S*', '',
                            env.get('XLA_FLAGS', '')).strip()
  return env
