"""Two processes joined by ``jax.distributed`` (4 CPU devices each) equal one process.

Each process runs ``multiprocess_child.py``: the interleaved step under ``jax.shard_map`` over
all 8 devices of both processes, each process feeding its half of the batch. The reference is
the same problem in this process, on one device, on the whole batch.
"""
import pathlib
import socket
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest

import host_devices
import multiprocess_child as child
import perturbkit

CHILD = pathlib.Path(child.__file__)
TIMEOUT_S = 300


def _gloo_available() -> bool:
  try:
    from jax._src.lib import _jax
  except ImportError:
    return False
  return hasattr(_jax, 'make_gloo_tcp_collectives')


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _run_processes(out_dir: pathlib.Path) -> list[pathlib.Path]:
  env = host_devices.child_environment()
  env['XLA_FLAGS'] += ' --xla_force_host_platform_device_count=4'
  env['JAX_PLATFORMS'] = 'cpu'
  port = _free_port()
  outs = [out_dir / f'process{i}.npz' for i in range(child.PROCESSES)]
  procs = [subprocess.Popen([sys.executable, str(CHILD), str(i), str(port), str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i, out in enumerate(outs)]
  logs = []
  try:
    for proc in procs:
      logs.append(proc.communicate(timeout=TIMEOUT_S)[0])
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.communicate()
  for i, (proc, log) in enumerate(zip(procs, logs)):
    assert proc.returncode == 0, f'process {i} failed:\n{log[-6000:]}'
    assert f'process {i}: done' in log, log[-3000:]
  return outs


@pytest.mark.skipif(not _gloo_available(),
                    reason='this jaxlib has no gloo CPU collectives for jax.distributed')
def test_two_processes_shard_map_step_equals_one_process(tmp_path):
  outs = _run_processes(tmp_path)

  loss_fn, variables, x, y = child.problem()
  tx = perturbkit.interleaved(loss_fn, child.optimizer())
  state, step = tx.init(variables, x, y), jax.jit(tx.step)
  losses = []
  for _ in range(child.STEPS):
    state, metrics = step(state, x, y)
    losses.append(metrics['loss'])
  want = child.flat(state.params)
  moved = max(float(np.abs(want[k] - v).max()) for k, v in child.flat(variables['params']).items())
  assert moved > 1e-3  # the steps really changed the weights

  for out in outs:
    with np.load(out) as got:
      got = dict(got)
    np.testing.assert_allclose(got.pop('losses'), np.stack(losses), rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
