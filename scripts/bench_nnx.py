"""Cost of NNX activation gradients and NNX interleaved training against plain NNX.

Part 1, activation gradients. For an NNX MLP and an NNX CNN, two jitted
functions (``jax.jit`` over the model's split state) are measured side by side
in one run:

  plain       nnx.value_and_grad of the loss (params gradients only).
  perturbkit  perturbkit.nnx.value_and_grad of the same loss on the same,
              unmodified model (params gradients and every activation gradient).

Reported per model: median step time (round-robin interleaved), the ratio to
plain, lowering and compile time, and XLA's memory_analysis argument/temp bytes.
The script checks that both give the same loss and params gradients first.

Part 2, interleaved training. On the same two models, three training steps,
each ``jax.jit(step, donate_argnums=0)`` over a pure state, are measured
round-robin:

  standard   the pure NNX step: the model ``nnx.split`` once outside, the step
             merges it, takes ``jax.value_and_grad`` of the loss with respect
             to the params state (what ``nnx.value_and_grad`` computes), and
             applies ``optax`` update + ``apply_updates`` to that state. This
             and not ``nnx.Optimizer`` under ``nnx.jit`` is the baseline, so
             that all three variants are the same kind of function (a plain
             ``jax.jit`` over a donated pytree state) and ``memory_analysis``
             and compile times compare like with like, with no graph
             traversal of the NNX objects around the call.
  updated    ``perturbkit.nnx.interleaved(..., propagate='updated')``, layer-wise
             default segments (every ``nnx.Linear`` / ``nnx.Conv`` call).
  original   the same with ``propagate='original'``.

All use ``optax.adam(LEARNING_RATE)``. Reported per model: median step time
and its ratio to standard, lowering + compile time, and XLA's memory_analysis
argument + output + temp bytes and its ratio to standard. Before timing, the
script checks that 'original' gives the standard step's new params after one
``optax.sgd(0.1)`` step (Adam would turn float rounding in near-zero gradients
into learning-rate-sized differences). Targets: 'updated' time <= 1.10x
standard, 'updated' argument + output + temp bytes <= standard.

The script exits non-zero if either check fails (the time and memory targets
are reported, not enforced). Results are printed; JSON is written only with
--out.

  python scripts/bench_nnx.py                    # default sizes
  python scripts/bench_nnx.py --sizes small      # smoke test
  python scripts/bench_nnx.py --out scripts/results/bench_nnx.json
  python scripts/bench_nnx.py --parts interleaved  # part 2 only
"""
import argparse
import os
import sys
import time
from typing import Any, NamedTuple

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
PARTS = ('activations', 'interleaved')
TRAIN_VARIANTS = ('standard', 'updated', 'original')
INTERLEAVED = ('updated', 'original')
LEARNING_RATE = 1e-4
# 'original' vs standard after one SGD(0.1) step on the same batch.
PARAMS_TOLERANCE = dict(rtol=1e-5, atol=1e-6)
INTERLEAVED_TIME_TARGET = 1.10  # updated / standard, Dense and Conv segments

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


class StandardState(NamedTuple):
  """The standard step's state: the model's split state and one optimizer state."""
  variables: nnx.State
  opt_state: Any


def standard_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation):
  """``(StandardState, x, y) -> (StandardState, metrics)``: the pure NNX training step.

  The gradient is ``jax.value_and_grad`` with respect to the split state, as
  ``nnx.value_and_grad`` computes it for ``nnx.Param`` (these models hold
  nothing else), then one ``optax`` update of the whole params state.
  """
  def step(state, x, y):
    loss, grads = jax.value_and_grad(
        lambda variables: loss_fn(nnx.merge(graphdef, variables), x, y))(state.variables)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.variables)
    return (StandardState(optax.apply_updates(state.variables, updates), opt_state),
            {'loss': loss})
  return step


def compile_donated(fn, *args: Any) -> common.CompiledFn:
  """``jax.jit(fn, donate_argnums=0)`` compiled for ``args``, timing each stage."""
  start = time.perf_counter()
  lowered = jax.jit(fn, donate_argnums=0).lower(*args)
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  done = time.perf_counter()
  return common.CompiledFn(compiled, lowered_at - start, done - lowered_at,
                           common.memory_bytes(compiled))


def copy_tree(tree: Any) -> Any:
  """Fresh buffers for ``tree``, so a donating call does not consume the original."""
  return jax.tree.map(jnp.copy, tree)


def stepper(compiled, state: Any, *args: Any):
  """A thunk taking one donated step from ``state`` (consumed), which it replaces."""
  holder = [state]

  def thunk():
    holder[0], metrics = compiled(holder[0], *args)
    return holder[0], metrics
  return thunk


def params_mismatch(actual: Any, expected: Any) -> str | None:
  """``None`` if two params states match within ``PARAMS_TOLERANCE``, else the first mismatch."""
  flat = lambda tree: {jax.tree_util.keystr(p): v
                       for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
  a, e = flat(actual), flat(expected)
  if set(a) != set(e):
    return f'different leaves: {sorted(set(a) ^ set(e))[:4]}'
  for path in sorted(e):
    try:
      np.testing.assert_allclose(np.asarray(a[path]), np.asarray(e[path]), **PARAMS_TOLERANCE)
    except AssertionError as err:
      return f'{path}: {str(err).strip().splitlines()[-1]}'
  return None


def original_mismatch(graphdef: nnx.GraphDef, variables: nnx.State, x: jax.Array,
                      y: jax.Array) -> str | None:
  """Whether ``propagate='original'`` takes the standard step, checked with one SGD(0.1) step."""
  sgd = optax.sgd(0.1)
  tx = perturbkit.nnx.interleaved(loss_fn, sgd, propagate='original')
  model = nnx.merge(graphdef, variables, copy=True)
  new = jax.jit(tx.step)(tx.init(model, x, y), x, y)[0].variables
  want = jax.jit(standard_step(graphdef, sgd))(
      StandardState(variables, sgd.init(variables)), x, y)[0].variables
  return params_mismatch(new, want)


def memory_totals(memory: dict[str, int]) -> dict[str, int]:
  """``memory`` plus ``sum_bytes`` (argument + output + temp) and ``live_bytes`` (minus alias)."""
  if not memory:
    return {}
  total = memory['argument_bytes'] + memory['output_bytes'] + memory['temp_bytes']
  return {**memory, 'sum_bytes': total, 'live_bytes': total - memory.get('alias_bytes', 0)}


def measure_interleaved(name: str, size: dict[str, Any], repeats: int) -> dict[str, Any]:
  """Checks, compiles and times standard / updated / original on one NNX model."""
  graphdef, variables, x, y = make_problem(name, size)
  optimizer = optax.adam(LEARNING_RATE)
  mismatch = original_mismatch(graphdef, variables, x, y)
  model = nnx.merge(graphdef, variables, copy=True)
  txs = {v: perturbkit.nnx.interleaved(loss_fn, optimizer, propagate=v) for v in INTERLEAVED}
  states = {'standard': StandardState(variables, optimizer.init(variables)),
            **{v: txs[v].init(model, x, y) for v in INTERLEAVED}}
  fns = {'standard': standard_step(graphdef, optimizer), **{v: txs[v].step for v in INTERLEAVED}}
  compiled = {v: compile_donated(fns[v], states[v], x, y) for v in TRAIN_VARIANTS}
  segmentation = txs['updated'].segments(model, x, y)
  samples = common.time_round_robin(
      {v: stepper(compiled[v].call, copy_tree(states[v]), x, y) for v in TRAIN_VARIANTS},
      repeats)
  variants = {v: {**common.summarize(samples[v]), 'lower_s': compiled[v].lower_s,
                  'compile_s': compiled[v].compile_s,
                  'total_compile_s': compiled[v].lower_s + compiled[v].compile_s,
                  **memory_totals(compiled[v].memory), 'samples_s': samples[v]}
              for v in TRAIN_VARIANTS}
  base = variants['standard']
  ratios = {}
  for v in INTERLEAVED:
    ratios[f'{v}_time'] = variants[v]['median_s'] / base['median_s']
    ratios[f'{v}_compile'] = variants[v]['total_compile_s'] / base['total_compile_s']
    if 'sum_bytes' in base:
      ratios[f'{v}_sum_bytes'] = variants[v]['sum_bytes'] / base['sum_bytes']
  return {
      'size': size, 'segments': list(segmentation.segments),
      'rest': {str(k): str(v) for k, v in segmentation.rest.items()},
      'num_params': sum(leaf.size for leaf in jax.tree.leaves(variables)),
      'learning_rate': LEARNING_RATE,
      'original_equals_standard': mismatch is None, 'mismatch': mismatch,
      'variants': variants, 'ratios': ratios,
      'targets_met': {
          f'time_updated_le_{INTERLEAVED_TIME_TARGET}x_standard':
              ratios['updated_time'] <= INTERLEAVED_TIME_TARGET,
          'sum_bytes_updated_le_standard': ratios.get('updated_sum_bytes', np.inf) <= 1.0,
          'original_equals_standard': mismatch is None,
      },
  }


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


def report_interleaved(results: dict[str, Any]) -> None:
  """Prints the interleaved table, one row per model and variant, and the targets."""
  rows = []
  for name, r in results.items():
    base = r['variants']['standard']
    for v in TRAIN_VARIANTS:
      m = r['variants'][v]
      rows.append({
          'model': name, 'segs': len(r['segments']), 'variant': v,
          'median ms': f"{1e3 * m['median_s']:.2f}",
          'x time': f"{m['median_s'] / base['median_s']:.3f}",
          'compile s': f"{m['total_compile_s']:.2f}",
          'x compile': f"{m['total_compile_s'] / base['total_compile_s']:.2f}",
          'temp MB': _mb(m.get('temp_bytes')).removesuffix(' MB'),
          'arg+out+temp MB': _mb(m.get('sum_bytes')).removesuffix(' MB'),
          'x mem': (f"{m['sum_bytes'] / base['sum_bytes']:.3f}"
                    if 'sum_bytes' in m else '-'),
          'check': ('OK' if r['original_equals_standard'] else 'MISMATCH')
                   if v == 'original' else '',
      })
  print(common.format_table(rows, list(rows[0])))
  print()
  for name, r in results.items():
    met = ', '.join(f'{k}={"yes" if ok else "NO"}' for k, ok in r['targets_met'].items())
    print(f'{name}: {met}')
    if r['mismatch']:
      print(f'  original vs standard MISMATCH {r["mismatch"]}')
  print()
  print(f"x time, x compile, x mem: ratio to standard (pure jax.jit NNX step, donated state, "
        f"optax.adam({LEARNING_RATE})).\ncompile s: lowering plus XLA compilation. check: "
        f"'original' gives the standard step's new params after one optax.sgd(0.1) step "
        f"(rtol={PARAMS_TOLERANCE['rtol']}, atol={PARAMS_TOLERANCE['atol']}).\nTargets: "
        f"'updated' time <= {INTERLEAVED_TIME_TARGET}x standard; arg+out+temp bytes <= "
        f"standard.")


def _parse(argv: list[str] | None) -> argparse.Namespace:
  """The common flags, plus ``--parts`` (which measurements to run, both by default)."""
  pre = argparse.ArgumentParser(add_help=False)
  pre.add_argument('--parts', nargs='+', choices=PARTS, default=list(PARTS),
                   help='which measurements to run')
  return common.parse_args(__doc__.split('\n')[0], SIZES, None, 20, argv, parents=[pre])


def main(argv: list[str] | None = None) -> int:
  args = _parse(argv)
  results, interleaved = {}, {}
  if 'activations' in args.parts:
    results = {name: measure_model(name, SIZES[args.sizes][name], args.repeats)
               for name in args.models}
    report(results)
  if 'interleaved' in args.parts:
    if results:
      print()
    interleaved = {name: measure_interleaved(name, SIZES[args.sizes][name], args.repeats)
                   for name in args.models}
    report_interleaved(interleaved)
  if args.out:
    common.write_json(args.out, {'results': results, 'interleaved': interleaved,
                                 'config': {'sizes': args.sizes, 'repeats': args.repeats,
                                            'parts': args.parts},
                                 'environment': common.environment()})
    print(f'wrote {args.out}')
  status = 0
  bad = {n: r['mismatch'] for n, r in results.items() if r['mismatch']}
  if bad:
    print(f'gradients differ from plain nnx.value_and_grad: {bad}')
    status = 1
  bad = {n: r['mismatch'] for n, r in interleaved.items() if r['mismatch']}
  if bad:
    print(f"propagate='original' differs from the standard step: {bad}")
    status = 1
  return status


if __name__ == '__main__':
  sys.exit(main())
