"""Cost of NNX activation gradients: perturbkit.nnx against plain nnx.value_and_grad.

For an NNX MLP and an NNX CNN, two jitted functions (``jax.jit`` over the
model's split state) are measured side by side in one run:

  plain       nnx.value_and_grad of the loss (params gradients only).
  perturbkit  perturbkit.nnx.value_and_grad of the same loss on the same,
              unmodified model (params gradients and every activation gradient).

Reported per model: median step time (round-robin interleaved), the ratio to
plain, lowering and compile time, and XLA's memory_analysis argument/temp bytes.
The script checks that both give the same loss and params gradients first and
exits non-zero if not. Results are printed; JSON is written only with --out.

  python scripts/bench_nnx.py                    # default sizes
  python scripts/bench_nnx.py --sizes small      # smoke test
  python scripts/bench_nnx.py --out scripts/results/bench_nnx.json
"""
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

# Measure the checkout this script lives in, installed or not.
SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]
import perturbkit  # noqa: E402
import _bench_common as common  # noqa: E402

VARIANTS = ('plain', 'perturbkit')
TOLERANCE = dict(rtol=1e-4, atol=1e-6)
TIME_TARGET = 1.05  # perturbkit / plain

SIZES: dict[str, dict[str, dict[str, Any]]] = {
    'small': {
        'mlp': dict(batch=32, features=64, widths=(128, 128), classes=10),
        'cnn': dict(batch=8, image=16, channels=(8, 16), classes=10),
    },
    'default': {
        'mlp': dict(batch=256, features=784, widths=(1024, 1024, 1024, 512), classes=10),
        'cnn': dict(batch=64, image=32, channels=(32, 64, 128), classes=10),
    },
}


class MLP(nnx.Module):
  def __init__(self, features: int, widths: tuple[int, ...], classes: int, *, rngs: nnx.Rngs):
    dims = [features, *widths]
    self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(dims, dims[1:])])
    self.head = nnx.Linear(dims[-1], classes, rngs=rngs)

  def __call__(self, x):
    for layer in self.layers:
      x = nnx.relu(layer(x))
    return self.head(x)


class CNN(nnx.Module):
  """Two 3x3 convs per stage, average pooling between stages, a linear head."""

  def __init__(self, channels: tuple[int, ...], classes: int, *, rngs: nnx.Rngs):
    dims = [3, *channels]
    self.stages = nnx.List([
        nnx.Sequential(nnx.Conv(a, b, (3, 3), rngs=rngs), nnx.relu,
                       nnx.Conv(b, b, (3, 3), rngs=rngs), nnx.relu)
        for a, b in zip(dims, dims[1:])])
    self.head = nnx.Linear(dims[-1], classes, rngs=rngs)

  def __call__(self, x):
    for i, stage in enumerate(self.stages):
      if i:
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
      x = stage(x)
    return self.head(jnp.mean(x, axis=(1, 2)))


def loss_fn(model: nnx.Module, x: jax.Array, y: jax.Array) -> jax.Array:
  logits = model(x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_problem(name: str, size: dict[str, Any], seed: int = 0):
  """The named model at ``size``, split, with a random batch."""
  rngs = nnx.Rngs(seed)
  kx, ky = jax.random.split(jax.random.key(seed + 1))
  if name == 'mlp':
    model = MLP(size['features'], size['widths'], size['classes'], rngs=rngs)
    x = jax.random.normal(kx, (size['batch'], size['features']))
  else:
    model = CNN(size['channels'], size['classes'], rngs=rngs)
    x = jax.random.normal(kx, (size['batch'], size['image'], size['image'], 3))
  y = jax.random.randint(ky, (size['batch'],), 0, size['classes'])
  graphdef, state = nnx.split(model)
  return graphdef, state, x, y


def steps(graphdef: nnx.GraphDef) -> dict[str, Any]:
  def plain(state, x, y):
    return nnx.value_and_grad(loss_fn)(nnx.merge(graphdef, state), x, y)

  def ours(state, x, y):
    return perturbkit.nnx.value_and_grad(loss_fn)(nnx.merge(graphdef, state), x, y)

  return {'plain': plain, 'perturbkit': ours}


def check(outputs: dict[str, Any]) -> str | None:
  """``None`` when perturbkit's loss and params gradients equal plain's, else why not."""
  (loss_a, grads_a), (loss_b, grads_b) = outputs['plain'], outputs['perturbkit']
  pairs = [(loss_a, loss_b)] + list(zip(jax.tree.leaves(grads_a),
                                         jax.tree.leaves(grads_b['params'])))
  if len(pairs) - 1 != len(jax.tree.leaves(grads_a)):
    return 'different params trees'
  for a, b in pairs:
    if not np.allclose(np.asarray(a), np.asarray(b), **TOLERANCE):
      return f'max difference {float(np.max(np.abs(np.asarray(a) - np.asarray(b))))}'
  return None


def measure_model(name: str, size: dict[str, Any], repeats: int) -> dict[str, Any]:
  graphdef, state, x, y = make_problem(name, size)
  fns = steps(graphdef)
  compiled = {v: common.compile_timed(fns[v], state, x, y) for v in VARIANTS}
  outputs = {v: compiled[v].call(state, x, y) for v in VARIANTS}
  mismatch = check(outputs)
  points = len(jax.tree.leaves(outputs['perturbkit'][1]['perturbations']))
  samples = common.time_round_robin(
      {v: (lambda v=v: compiled[v].call(state, x, y)) for v in VARIANTS}, repeats)
  variants = {v: {**common.summarize(samples[v]), 'lower_s': compiled[v].lower_s,
                  'compile_s': compiled[v].compile_s, **compiled[v].memory}
              for v in VARIANTS}
  ratio = variants['perturbkit']['median_s'] / variants['plain']['median_s']
  return {'size': size, 'points': points, 'variants': variants, 'time_ratio': ratio,
          'argument_bytes_equal': (variants['plain'].get('argument_bytes')
                                   == variants['perturbkit'].get('argument_bytes')),
          'mismatch': mismatch, 'within_time_target': ratio <= TIME_TARGET}


def _mb(n: int | None) -> str:
  return '-' if n is None else f'{n / 2 ** 20:.1f} MB'


def report(results: dict[str, Any]) -> None:
  rows = []
  for name, r in results.items():
    p, q = r['variants']['plain'], r['variants']['perturbkit']
    rows.append({
        'model (points)': f"{name} ({r['points']})",
        'plain ms': f"{1e3 * p['median_s']:.2f}",
        'perturbkit ms': f"{1e3 * q['median_s']:.2f}",
        'ratio': f"{r['time_ratio']:.3f}",
        'argument bytes plain / pk': f"{_mb(p.get('argument_bytes'))} / "
                                     f"{_mb(q.get('argument_bytes'))}",
        'temp bytes plain / pk': f"{_mb(p.get('temp_bytes'))} / {_mb(q.get('temp_bytes'))}",
        'compile s plain / pk': f"{p['compile_s']:.2f} / {q['compile_s']:.2f}",
    })
  print(common.format_table(rows, list(rows[0])))


def main(argv: list[str] | None = None) -> int:
  args = common.parse_args(__doc__.split('\n')[0], SIZES, None, 20, argv)
  results = {name: measure_model(name, SIZES[args.sizes][name], args.repeats)
             for name in args.models}
  report(results)
  if args.out:
    common.write_json(args.out, {'results': results, 'environment': common.environment()})
    print(f'wrote {args.out}')
  bad = {n: r['mismatch'] for n, r in results.items() if r['mismatch']}
  if bad:
    print(f'gradients differ from plain nnx.value_and_grad: {bad}')
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
