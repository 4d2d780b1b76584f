"""Runs a check in a child Python process, where ``XLA_FLAGS`` can give it host CPU devices.

``XLA_FLAGS`` must be set before jax is imported, so a check on several devices
sets it at the top of its child's source and runs there.
"""
import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))


def run_child(source: str, marker: str, timeout: int = 600) -> subprocess.CompletedProcess:
  """Runs ``source`` with ``python -c`` and asserts that it exits 0 and prints ``marker``.

  The child imports perturbkit from this checkout, gets this tests folder as
  ``sys.argv[1]`` (to import the test models from), and none of this process's
  ``XLA_FLAGS``.

  Returns:
    The finished process (its ``stdout`` and ``stderr`` as text).
  """
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env['PYTHONPATH'] = os.pathsep.join([os.path.dirname(TESTS), env.get('PYTHONPATH', '')])
  proc = subprocess.run([sys.executable, '-c', source, TESTS], capture_output=True, text=True,
                        env=env, timeout=timeout)
  assert proc.returncode == 0 and marker in proc.stdout, (proc.stdout[-3000:]
                                                          + proc.stderr[-6000:])
  return proc
