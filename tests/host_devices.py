"""Runs a check in a child Python process, where ``XLA_FLAGS`` can give it host CPU devices.

``XLA_FLAGS`` must be set before jax is imported, so a check on several devices
adds its device count to it at the top of its child's source and runs there.
"""
import os
import re
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))


def child_environment() -> dict[str, str]:
  """This process's environment for a child process, ``XLA_FLAGS`` always set.

  The child keeps this process's XLA flags (the cheaper compile passes
  ``conftest.py`` sets) but not a host device count, which the child adds itself
  (``os.environ['XLA_FLAGS'] += ' --xla_force_host_platform_device_count=8'``).
  """
  env = dict(os.environ)
  env['XLA_FLAGS'] = re.sub(r'--xla_force_host_platform_device_count=\S*', '',
                            env.get('XLA_FLAGS', '')).strip()
  return env


def run_child(source: str, marker: str, timeout: int = 600) -> subprocess.CompletedProcess:
  """Runs ``source`` with ``python -c`` and asserts that it exits 0 and prints ``marker``.

  The child imports perturbkit from this checkout, gets this tests folder as
  ``sys.argv[1]`` (to import the test models from), and the environment of
  :func:`child_environment`.

  Returns:
    The finished process (its ``stdout`` and ``stderr`` as text).
  """
  env = child_environment()
  env['PYTHONPATH'] = os.pathsep.join([os.path.dirname(TESTS), env.get('PYTHONPATH', '')])
  proc = subprocess.run([sys.executable, '-c', source, TESTS], capture_output=True, text=True,
                        env=env, timeout=timeout)
  assert proc.returncode == 0 and marker in proc.stdout, (proc.stdout[-3000:]
                                                          + proc.stderr[-6000:])
  return proc
