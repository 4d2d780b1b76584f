"""The programs perturbkit builds do not depend on Python's string hashing.

Python salts ``str`` hashes per process (``PYTHONHASHSEED``), so anything built by
iterating a set of module paths can come out in another order in the next process:
the same function then lowers to another program, and JAX's persistent compilation
cache (keyed on the program) misses on every start. Two processes with different
seeds lower the same functions on the same models; their programs must be equal.
"""
import os
import subprocess
import sys

import host_devices

TESTS = os.path.dirname(os.path.abspath(__file__))

CHILD = r'''
import hashlib, re, sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, optax
from flax import nnx
import models, nnx_models, perturbkit
from hand_mlp import SHAPE, metric_of

model = models.MLP()
x = jax.random.normal(jax.random.key(1), SHAPE)
v = model.init(jax.random.key(0), x)
metric = lambda v, x: metric_of(model.apply(v, x))
loss = lambda v, x: jnp.mean(model.apply(v, x) ** 2)
net = nnx_models.MLP(rngs=nnx.Rngs(0))
graphdef, state = nnx.split(net)
nnx_metric = lambda m, x: metric_of(m(x))
tx = perturbkit.interleaved(loss, optax.sgd(0.1))


def program(f, *args):
  text = jax.jit(f).lower(*args).as_text()
  text = re.sub(r' loc\([^)]*\)', '', '\n'.join(
      line for line in text.splitlines() if not line.startswith('#loc')))
  return hashlib.sha256(text.encode()).hexdigest()[:16]


programs = {
    'value_and_grad': program(perturbkit.value_and_grad(metric, return_activations=True), v, x),
    'attribution_patching': program(
        lambda v, a, b: perturbkit.attribution_patching(metric, axis=1)(v, a, b).effects,
        v, x, 2 * x),
    'activation_patching': program(
        lambda v, a, b: perturbkit.activation_patching(metric, axis=1)(v, a, b).effects,
        v, x, 2 * x),
    'per_example_grad_norms': program(perturbkit.per_example_grad_norms(loss), v, x),
    'interleaved': program(tx.step, tx.init(v, x), x),
    'nnx.value_and_grad': program(
        lambda s, x: perturbkit.nnx.value_and_grad(nnx_metric)(nnx.merge(graphdef, s), x)[1],
        state, x),
    'nnx.attribution_patching': program(
        lambda s, a, b: perturbkit.nnx.attribution_patching(nnx_metric, axis=1)(
            nnx.merge(graphdef, s), a, b).effects, state, x, 2 * x),
}
print('PROGRAMS', sorted(programs.items()))
'''


def _programs(seed: int) -> str:
  env = host_devices.child_environment()
  env['PYTHONHASHSEED'] = str(seed)
  env['PYTHONPATH'] = os.pathsep.join([os.path.dirname(TESTS), env.get('PYTHONPATH', '')])
  proc = subprocess.run([sys.executable, '-c', CHILD, TESTS], capture_output=True, text=True,
                        env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-6000:]
  return next(line for line in proc.stdout.splitlines() if line.startswith('PROGRAMS'))


def test_the_same_functions_lower_to_the_same_programs_in_every_process():
  first, second = _programs(1), _programs(2)
  assert first == second, f'seed 1: {first}\nseed 2: {second}'
