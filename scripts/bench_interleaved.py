"""Cost of interleaved training: ``perturbkit.interleaved`` against a standard jitted step.

For an MLP (Dense-layer segments), a CNN (conv-layer segments) and a Transformer
(every layer a segment; ``transformer_scan``: the same blocks in ``nn.scan``, each
iteration's layers segments of their own), each at several depths, three jitted
training steps are measured side by side in one run, round-robin:

  standard   ``jax.value_and_grad`` + ``optimizer.update`` + ``optax.apply_updates``.
  updated    ``perturbkit.interleaved(..., propagate='updated')``.
  original   ``perturbkit.interleaved(..., propagate='original')``.

All three are jitted with the state donated. Reported per model and depth:
median step time and its ratio to standard, lowering + compile time, its ratio
and its value per segment, and XLA's ``memory_analysis`` bytes. The script also
checks that 'original' gives the standard step's new params and exits non-zero
if not.

  python scripts/bench_interleaved.py                  # default sizes, a few minutes
  python scripts/bench_interleaved.py --sizes small    # a quick look, < 90 s
  python scripts/bench_interleaved.py --sizes tiny     # the smoke test
"""
import os
import re
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

# Measure the checkout this script lives in, installed or not.
SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]
import perturbkit  # noqa: E402
import _bench_common as common  # noqa: E402
import _bench_models as models  # noqa: E402

VARIANTS = ('standard', 'updated', 'original')
INTERLEAVED = ('updated', 'original')
DEFAULT_OUT = os.path.join(SCRIPTS, 'results', 'bench_interleaved.json')
LEARNING_RATE = 1e-4
# 'original' vs standard, one SGD(0.1) step on the same batch (see original_mismatch).
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
TIME_TARGETS = {'mlp': 1.10, 'cnn': 1.10, 'transformer': 1.5,  # updated / standard
                'transformer_scan': 1.5}
# Compile time per segment at the deepest model may exceed the shallowest's by
# this factor (timing noise) and still count as growing at most linearly.
LINEAR_SLACK = 1.25

SIZES: dict[str, dict[str, dict[str, Any]]] = {
    'tiny': {  # the smoke test: two depths of each model, seconds
        'mlp': dict(batch=8, features=16, width=16, classes=10, depths=(1, 2)),
        'cnn': dict(batch=2, image=8, channels=(4, 4), classes=10, depths=(1, 2)),
        'transformer': dict(batch=2, seq=4, features=8, dim=16, heads=2, classes=10,
                            depths=(1, 2)),
        'transformer_scan': dict(batch=2, seq=4, features=8, dim=16, heads=2, classes=10,
                                 depths=(1, 2)),
    },
    'small': {
        'mlp': dict(batch=16, features=32, width=32, classes=10, depths=(2, 4)),
        'cnn': dict(batch=4, image=8, channels=(8, 8), classes=10, depths=(2, 4)),
        'transformer': dict(batch=2, seq=8, features=8, dim=16, heads=2, classes=10,
                            depths=(2, 4)),
        'transformer_scan': dict(batch=2, seq=8, features=8, dim=16, heads=2, classes=10,
                                 depths=(2, 4)),
    },
    'default': {
        'mlp': dict(batch=256, features=512, width=512, classes=10, depths=(2, 4, 8)),
        'cnn': dict(batch=32, image=32, channels=(32, 64), classes=10, depths=(2, 4, 8)),
        'transformer': dict(batch=16, seq=64, features=32, dim=128, heads=4, classes=10,
                            depths=(2, 4, 8)),
        'transformer_scan': dict(batch=16, seq=64, features=32, dim=128, heads=4, classes=10,
                                 depths=(2, 4, 8)),
    },
}


class StandardState(NamedTuple):
  """The standard step's state: params and one optimizer state for all of them."""
  params: Any
  opt_state: Any


def make_model(name: str, size: dict[str, Any], depth: int) -> tuple[nn.Module, tuple]:
  """The named model with ``depth`` repeated layers, and its input shape.

  ``depth`` counts the hidden Dense layers of the MLP, the convolutions of the
  CNN (split evenly over its two stages) and the blocks of the Transformer; the
  models' other top-level layers (head, embedding, final norm) are segments too.
  """
  if name == 'mlp':
    return (models.MLP((size['width'],) * depth, size['classes']),
            (size['batch'], size['features']))
  if name == 'cnn':
    stages = len(size['channels'])
    if depth % stages:
      raise ValueError(f'CNN depth {depth} is not a multiple of its {stages} stages.')
    return (models.CNN(size['channels'], depth // stages, size['classes']),
            (size['batch'], size['image'], size['image'], 3))
  if name in ('transformer', 'transformer_scan'):
    return (models.Transformer(size['dim'], depth, size['heads'], size['classes'],
                               scan=name == 'transformer_scan'),
            (size['batch'], size['seq'], size['features']))
  raise ValueError(f'Unknown model {name!r}.')


def make_problem(name: str, size: dict[str, Any], depth: int, key: jax.Array) -> models.Problem:
  """The named model at ``size`` and ``depth`` with a random batch."""
  model, shape = make_model(name, size, depth)
  return models.random_problem(model, shape, size['classes'], key)


def standard_step(loss_fn: Callable[..., jax.Array],
                  optimizer: optax.GradientTransformation) -> Callable[..., Any]:
  """``(StandardState, x, y) -> (StandardState, metrics)``: grad, then one optimizer step."""
  def step(state, x, y):
    loss, grads = jax.value_and_grad(lambda p: loss_fn({'params': p}, x, y))(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return StandardState(optax.apply_updates(state.params, updates), opt_state), {'loss': loss}
  return step


def compile_donated(fn: Callable[..., Any],
                    *args: Any) -> tuple[common.CompiledFn, dict[str, int]]:
  """``jax.jit(fn, donate_argnums=0)`` compiled for ``args``, timed, with its op counts."""
  start = time.perf_counter()
  lowered = jax.jit(fn, donate_argnums=0).lower(*args)
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  done = time.perf_counter()
  compiled_fn = common.CompiledFn(compiled, lowered_at - start, done - lowered_at,
                                  common.memory_bytes(compiled))
  return compiled_fn, op_counts(lowered.as_text(), compiled.as_text())


def op_counts(lowered_text: str, compiled_text: str) -> dict[str, int]:
  """Matrix products and convolutions before and after XLA's optimizations.

  The lowered StableHLO shows what the trace asked for; the compiled HLO shows
  what survived dead-code elimination (e.g. a replayed forward nobody reads).
  """
  count = lambda pattern, text: len(re.findall(pattern, text))
  return {
      'dot_lowered': count(r'stablehlo\.dot_general', lowered_text),
      'conv_lowered': count(r'stablehlo\.convolution', lowered_text),
      'dot_compiled': count(r'= \S+ dot\(', compiled_text),
      'conv_compiled': count(r'= \S+ convolution\(', compiled_text),
  }


def copy_tree(tree: Any) -> Any:
  """Fresh buffers for ``tree``, so a donating call does not consume the original."""
  return jax.tree.map(jnp.copy, tree)


def params_mismatch(actual: Any, expected: Any) -> str | None:
  """``None`` if the two params trees match within ``TOLERANCE``, else the first mismatch."""
  a = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(actual)[0]}
  e = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(expected)[0]}
  if set(a) != set(e):
    return f'different leaves: {sorted(set(a) ^ set(e))[:4]}'
  for path in sorted(e):
    try:
      np.testing.assert_allclose(np.asarray(a[path]), np.asarray(e[path]), **TOLERANCE)
    except AssertionError as err:
      return f'{path}: {str(err).strip().splitlines()[-1]}'
  return None


def original_mismatch(loss_fn: Callable[..., Any], variables: Any, x: Any, y: Any) -> str | None:
  """Whether ``propagate='original'`` takes the standard step, checked with SGD.

  Adam divides by the root of the second moment, so float rounding in a gradient
  that is zero in exact arithmetic (an attention key bias: softmax ignores it)
  becomes a learning-rate-sized difference; SGD keeps every difference the size
  of the gradient's own rounding, so the check stays tight.
  """
  sgd = optax.sgd(0.1)
  params = variables['params']
  tx = perturbkit.interleaved(loss_fn, sgd, propagate='original')
  new = jax.jit(tx.step)(tx.init(variables, x, y), x, y)[0].params
  want = jax.jit(standard_step(loss_fn, sgd))(StandardState(params, sgd.init(params)), x, y)
  return params_mismatch(new, want[0].params)


def stepper(compiled: Callable[..., Any], state: Any, *args: Any) -> Callable[[], Any]:
  """A thunk taking one donated step from ``state``, which it replaces for the next call.

  ``state`` is consumed: its buffers must not be shared with any other state.
  """
  holder = [state]

  def thunk():
    holder[0], metrics = compiled(holder[0], *args)
    return holder[0], metrics
  return thunk


def measure_depth(name: str, size: dict[str, Any], depth: int, repeats: int,
                  key: jax.Array) -> dict[str, Any]:
  """Compiles, checks and times the three variants on one model at one depth."""
  kp, kd = jax.random.split(key)
  problem = make_problem(name, size, depth, kd)
  loss_fn = models.cross_entropy(problem.model)
  optimizer = optax.adam(LEARNING_RATE)
  variables = problem.model.init(kp, problem.x)
  txs = {v: perturbkit.interleaved(loss_fn, optimizer, propagate=v) for v in INTERLEAVED}
  states = {'standard': StandardState(variables['params'], optimizer.init(variables['params'])),
            **{v: txs[v].init(variables, problem.x, problem.y) for v in INTERLEAVED}}
  steps = {'standard': standard_step(loss_fn, optimizer), **{v: txs[v].step for v in INTERLEAVED}}
  compiled, ops = {}, {}
  for v in VARIANTS:
    compiled[v], ops[v] = compile_donated(steps[v], states[v], problem.x, problem.y)
  mismatch = original_mismatch(loss_fn, variables, problem.x, problem.y)
  samples = common.time_round_robin(
      {v: stepper(compiled[v].call, copy_tree(states[v]), problem.x, problem.y)
       for v in VARIANTS},
      repeats)
  segments = len(txs['updated'].segments(variables, problem.x, problem.y).segments)
  variants = {v: {**common.summarize(samples[v]), 'lower_s': compiled[v].lower_s,
                  'compile_s': compiled[v].compile_s,
                  'total_compile_s': compiled[v].lower_s + compiled[v].compile_s,
                  **memory_totals(compiled[v].memory), 'ops': ops[v],
                  'samples_s': samples[v]} for v in VARIANTS}
  return {
      'depth': depth, 'segments': segments,
      'num_params': sum(x.size for x in jax.tree.leaves(variables['params'])),
      'original_equals_standard': mismatch is None, 'mismatch': mismatch,
      'variants': variants,
      'ratios': ratios(variants, segments),
  }


def memory_totals(memory: dict[str, int]) -> dict[str, int]:
  """``memory`` plus ``sum_bytes`` (temp + argument + output) and ``live_bytes`` (minus alias).

  With the state donated, the new state is written over the old one, so the
  output bytes that alias arguments are counted once in ``live_bytes``.
  """
  if not memory:
    return {}
  total = memory['temp_bytes'] + memory['argument_bytes'] + memory['output_bytes']
  return {**memory, 'sum_bytes': total, 'live_bytes': total - memory.get('alias_bytes', 0)}


def ratios(variants: dict[str, dict[str, Any]], segments: int) -> dict[str, float]:
  """Each interleaved variant over standard: time, compile time, memory; compile s / segment."""
  base = variants['standard']
  out = {}
  for v in VARIANTS:
    m = variants[v]
    if v != 'standard':
      out[f'{v}_time'] = m['median_s'] / base['median_s']
      out[f'{v}_compile'] = m['total_compile_s'] / base['total_compile_s']
      for field in ('sum_bytes', 'live_bytes', 'temp_bytes'):
        if field in m:
          out[f'{v}_{field}'] = m[field] / base[field]
    out[f'{v}_compile_s_per_segment'] = m['total_compile_s'] / segments
  return out


def targets(name: str, depths: list[dict[str, Any]]) -> dict[str, bool]:
  """Whether the 'updated' step meets its targets on every depth of one model."""
  limit = TIME_TARGETS[name]
  per_segment = [d['ratios']['updated_compile_s_per_segment'] for d in depths]
  out = {
      f'time_updated_le_{limit}x_standard':
          all(d['ratios']['updated_time'] <= limit for d in depths),
      'sum_bytes_updated_le_standard':
          all(d['ratios'].get('updated_sum_bytes', np.inf) <= 1.0 for d in depths),
      f'compile_per_segment_deepest_le_{LINEAR_SLACK}x_shallowest':
          per_segment[-1] <= LINEAR_SLACK * per_segment[0],
      'original_equals_standard': all(d['original_equals_standard'] for d in depths),
  }
  return out


def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
  """One printed row per model, depth and variant."""
  rows = []
  for name, r in results.items():
    for d in r['depths']:
      base = d['variants']['standard']
      for v in VARIANTS:
        m = d['variants'][v]
        rows.append({
            'model': name, 'depth': d['depth'], 'segs': d['segments'], 'variant': v,
            'median ms': f'{m["median_s"] * 1e3:.2f}',
            'x time': f'{m["median_s"] / base["median_s"]:.3f}',
            'compile s': f'{m["total_compile_s"]:.2f}',
            'x compile': f'{m["total_compile_s"] / base["total_compile_s"]:.2f}',
            'cmp s/seg': f'{m["total_compile_s"] / d["segments"]:.3f}',
            'temp MB': f'{m.get("temp_bytes", -1) / 2**20:.2f}',
            'arg+out+temp MB': f'{m.get("sum_bytes", -1) / 2**20:.2f}',
            'x mem': f'{m.get("sum_bytes", -1) / base.get("sum_bytes", 1):.3f}',
            'dots': f'{m["ops"]["dot_lowered"]}/{m["ops"]["dot_compiled"]}',
            'convs': f'{m["ops"]["conv_lowered"]}/{m["ops"]["conv_compiled"]}',
            'check': ('OK' if d['original_equals_standard'] else 'MISMATCH')
                     if v == 'original' else '',
        })
  return rows


COLUMNS = ('model', 'depth', 'segs', 'variant', 'median ms', 'x time', 'compile s', 'x compile',
           'cmp s/seg', 'temp MB', 'arg+out+temp MB', 'x mem', 'dots', 'convs', 'check')

NOTE = f"""\
x time, x compile, x mem: ratio to standard at the same model and depth. compile s: lowering
plus XLA compilation. dots, convs: dot_general / convolution ops in the lowered StableHLO /
in the compiled HLO (what survived XLA's optimizations). check: 'original' gives the
standard step's new params (rtol={TOLERANCE['rtol']}, atol={TOLERANCE['atol']}).
Targets: 'updated' time <= {TIME_TARGETS['mlp']}x standard for Dense/Conv segments,
<= {TIME_TARGETS['transformer']}x for Transformer layers (also in nn.scan); arg+out+temp bytes <= standard;
compile s per segment at the deepest model <= {LINEAR_SLACK}x that at the shallowest."""


def report(results: dict[str, Any]) -> None:
  """Prints the table, the per-model targets and the note on the columns."""
  print(common.format_table(table_rows(results), COLUMNS))
  print()
  for name, r in results.items():
    met = ', '.join(f'{k}={"yes" if ok else "NO"}' for k, ok in r['targets_met'].items())
    print(f'{name}: {met}')
    for d in r['depths']:
      if d['mismatch']:
        print(f'  depth {d["depth"]}: original vs standard MISMATCH {d["mismatch"]}')
  print()
  print(NOTE)


def source_commit() -> str | None:
  """The git commit of the checkout being measured, with '+dirty' if it has local edits."""
  try:
    run = lambda *cmd: subprocess.run(['git', *cmd], cwd=SCRIPTS, capture_output=True,
                                      text=True, check=True).stdout.strip()
    dirty = run('status', '--porcelain', '--', '../perturbkit')
    return run('rev-parse', 'HEAD') + ('+dirty' if dirty else '')
  except (OSError, subprocess.CalledProcessError):
    return None


def main(argv: list[str] | None = None) -> int:
  args = common.parse_args(__doc__.split('\n')[0], SIZES, DEFAULT_OUT, 15, argv)
  # Small states (the step counter) cannot always be reused in place; that is expected.
  warnings.filterwarnings('ignore', message='Some donated buffers were not usable')
  key = jax.random.key(0)
  results = {}
  for i, name in enumerate(args.models):
    size = SIZES[args.sizes][name]
    depths = []
    for depth in size['depths']:
      print(f'[{name} depth {depth}] compiling, checking and timing ...', flush=True)
      depths.append(measure_depth(name, size, depth, args.repeats,
                                  jax.random.fold_in(key, 100 * i + depth)))
    results[name] = {
        'size': {k: list(v) if isinstance(v, tuple) else v for k, v in size.items()},
        'depths': depths, 'targets_met': targets(name, depths)}
  report(results)
  all_ok = all(d['original_equals_standard'] for r in results.values() for d in r['depths'])
  print(f'\noriginal == standard: {"OK" if all_ok else "MISMATCH"}')
  common.write_results(args.out, 'interleaved',
                       {'sizes': args.sizes, 'repeats': args.repeats, 'tolerance': TOLERANCE,
                        'optimizer': f'adam({LEARNING_RATE})', 'variants': list(VARIANTS),
                        'time_targets': TIME_TARGETS, 'linear_slack': LINEAR_SLACK},
                       results, all_ok, perturbkit_commit=source_commit())
  return 0 if all_ok else 1


if __name__ == '__main__':
  sys.exit(main())
