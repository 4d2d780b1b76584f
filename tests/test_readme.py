"""Every ```python block of README.md runs as written, in order, in one namespace.

Once whole, and once the blocks up to the README's data-parallel ``step`` (the ones the
many devices change), whose mesh then spans the test process's 8 host CPU devices
(``conftest.py``): ``step`` is run on a batch whose rows differ and compared with one device
on the whole batch.
"""
import pathlib
import re

import chex
import jax
import jax.numpy as jnp
import optax

from host_devices import require_devices

README = pathlib.Path(__file__).resolve().parent.parent / 'README.md'


def python_blocks(text: str) -> list[str]:
  return re.findall(r'^```python\n(.*?)^```', text, flags=re.DOTALL | re.MULTILINE)


def run_readme(path=README, until: str | None = None) -> dict:
  """The namespace the blocks leave; with ``until``, the blocks up to the first holding it."""
  namespace: dict = {'__name__': '__readme__'}
  for i, block in enumerate(python_blocks(pathlib.Path(path).read_text())):
    exec(compile(block, f'README.md python block {i}', 'exec'), namespace)
    if until is not None and until in block:
      break
  return namespace


def test_readme_has_the_documented_snippets():
  blocks = python_blocks(README.read_text())
  assert len(blocks) >= 4, blocks
  joined = '\n'.join(blocks)
  for name in ('perturbkit.value_and_grad', 'perturbkit.backward_hook', 'perturbkit.interleaved',
               'jax.shard_map'):
    assert name in joined, name


def test_readme_runs_on_one_device(capsys):
  namespace = run_readme()
  printed = capsys.readouterr().out
  assert 'Dense_0' in printed and 'Dense_2' in printed, printed
  assert float(namespace['metrics']['loss']) > 0


def test_readme_runs_on_eight_host_devices():
  """The blocks up to the data-parallel ``step``, run on the test process's 8 host CPU
  devices, then ``step`` on a batch whose rows differ (so that a missing all-reduce could
  not go unnoticed): it equals one device on the whole batch, and moves the params."""
  require_devices(8)
  ns = run_readme(until='jax.shard_map')
  perturbkit, loss_fn, variables = ns['perturbkit'], ns['loss_fn'], ns['variables']
  assert len(ns['mesh'].devices.flat) == 8, ns['mesh']
  x = jax.random.normal(jax.random.key(1), ns['x'].shape)
  y = jax.random.randint(jax.random.key(2), ns['y'].shape, 0, 10)
  state, metrics = ns['step'](ns['tx'].init(variables, x, y), x, y)
  single = perturbkit.interleaved(loss_fn, optax.adam(1e-3))
  want, want_metrics = jax.jit(single.step)(single.init(variables, x, y), x, y)
  chex.assert_trees_all_close(state.params, want.params, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(metrics['loss'], want_metrics['loss'], rtol=1e-5, atol=1e-6)
  moved = jax.tree.map(lambda a, b: jnp.abs(a - b).max(), want.params, variables['params'])
  assert max(jax.tree.leaves(moved)) > 1e-4
