"""Every ```python block of README.md runs as written, in order, in one namespace.

Once here on one device, and once in a child process with 8 host CPU devices (``XLA_FLAGS``
must be set before jax is imported): there the blocks up to the README's data-parallel
``step`` (the ones the many devices change), and ``step`` is then also run on a batch whose
rows differ and compared with one device on the whole batch.
"""
import pathlib
import re
import subprocess
import sys
import textwrap

import host_devices

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


CHILD = textwrap.dedent('''
    import os, sys
    os.environ['XLA_FLAGS'] += ' --xla_force_host_platform_device_count=8'
    import chex, jax, jax.numpy as jnp, optax
    jax.config.update('jax_numpy_rank_promotion', 'raise')
    sys.path.insert(0, sys.argv[1])
    import test_readme
    assert jax.device_count() == 8, jax.devices()
    ns = test_readme.run_readme(until='jax.shard_map')
    perturbkit, loss_fn, variables = ns['perturbkit'], ns['loss_fn'], ns['variables']
    # Rows that differ, so that a missing all-reduce could not go unnoticed.
    x = jax.random.normal(jax.random.key(1), ns['x'].shape)
    y = jax.random.randint(jax.random.key(2), ns['y'].shape, 0, 10)
    state, metrics = ns['step'](ns['tx'].init(variables, x, y), x, y)
    single = perturbkit.interleaved(loss_fn, optax.adam(1e-3))
    want, want_metrics = jax.jit(single.step)(single.init(variables, x, y), x, y)
    chex.assert_trees_all_close(state.params, want.params, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(metrics['loss'], want_metrics['loss'], rtol=1e-5, atol=1e-6)
    moved = jax.tree.map(lambda a, b: jnp.abs(a - b).max(), want.params, variables['params'])
    assert max(jax.tree.leaves(moved)) > 1e-4
    print('README-8-DEVICES-OK')
''')


def test_readme_runs_on_eight_host_devices():
  proc = subprocess.run([sys.executable, '-c', CHILD, str(pathlib.Path(__file__).parent)],
                        capture_output=True, text=True, env=host_devices.child_environment(),
                        timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  assert 'README-8-DEVICES-OK' in proc.stdout
