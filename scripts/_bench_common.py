"""Small shared helpers for the benchmark scripts: compile, time, measure memory, report.

Every benchmark compares variants side by side in one run. ``time_round_robin``
interleaves the variants call by call (rotating which goes first), so that drift
in the machine's speed affects all of them alike, and reports per-call times.
"""
import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import jax

MEMORY_FIELDS = {
    'argument_bytes': 'argument_size_in_bytes',
    'output_bytes': 'output_size_in_bytes',
    'temp_bytes': 'temp_size_in_bytes',
    'alias_bytes': 'alias_size_in_bytes',
    'peak_bytes': 'peak_memory_in_bytes',
}


@dataclasses.dataclass(frozen=True)
class CompiledFn:
  """A jitted function compiled for one set of arguments, with its costs.

  Attributes:
    call: The compiled executable; call it with the arguments it was lowered for.
    lower_s: Seconds to trace and lower to StableHLO.
    compile_s: Seconds for XLA to compile the lowered module.
    memory: Bytes from ``memory_analysis()``, keyed like ``MEMORY_FIELDS``.
  """
  call: Callable[..., Any]
  lower_s: float
  compile_s: float
  memory: dict[str, int]


def memory_bytes(compiled: jax.stages.Compiled) -> dict[str, int]:
  """Argument, output, temp, alias (and peak, where reported) bytes of ``compiled``."""
  stats = compiled.memory_analysis()
  if stats is None:
    return {}
  out = {}
  for name, attr in MEMORY_FIELDS.items():
    value = getattr(stats, attr, None)
    if value is not None:
      out[name] = int(value)
  return out


def compile_timed(fn: Callable[..., Any], *args: Any) -> CompiledFn:
  """``jax.jit(fn)`` lowered and compiled for ``args``, timing each stage.

  Args:
    fn: The function to jit.
    *args: Example arguments (arrays or pytrees of arrays).

  Returns:
    The compiled function with its lowering and compile times and memory bytes.
  """
  start = time.perf_counter()
  lowered = jax.jit(fn).lower(*args)
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  done = time.perf_counter()
  return CompiledFn(compiled, lowered_at - start, done - lowered_at, memory_bytes(compiled))


def _run_blocked(thunk: Callable[[], Any], number: int, wait_each: bool = False) -> float:
  """Seconds per call of ``number`` calls of ``thunk``, waiting for the last result.

  ``wait_each``: waiting for each call's result before the next call starts.
  """
  start = time.perf_counter()
  out = None
  for _ in range(number):
    out = thunk()
    if wait_each:
      jax.block_until_ready(out)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / number


def time_round_robin(thunks: Mapping[str, Callable[[], Any]], repeats: int, *,
                     warmup: int = 2, min_sample_s: float = 0.02,
                     wait_each: bool = False) -> dict[str, list[float]]:
  """Per-call seconds of each thunk, measured round-robin in one run.

  Each thunk is warmed up, then every round takes one sample of each thunk, the
  order rotating from round to round. A sample runs the thunk ``number`` times
  (the same for all thunks, chosen so the fastest sample lasts ``min_sample_s``)
  to keep timer and dispatch noise small next to the work.

  Args:
    thunks: Name to a zero-argument function returning JAX arrays.
    repeats: Samples per thunk.
    warmup: Untimed calls per thunk before measuring.
    min_sample_s: Target duration of the fastest thunk's sample.
    wait_each: Wait for each call's result before making the next call: the time
      of one call on its own. Otherwise the calls of a sample are queued back to
      back (JAX dispatches asynchronously): on a CPU the runtime may then run two
      calls at once, so a call too small to keep every core busy looks cheaper
      than it is when called alone.

  Returns:
    Name to the list of per-call seconds, one per sample.
  """
  first = {}
  for name, thunk in thunks.items():
    for _ in range(max(warmup - 1, 0)):
      jax.block_until_ready(thunk())
    first[name] = _run_blocked(thunk, 1, wait_each)
  number = max(1, math.ceil(min_sample_s / max(min(first.values()), 1e-9)))
  names = list(thunks)
  samples: dict[str, list[float]] = {name: [] for name in names}
  for round_index in range(repeats):
    shift = round_index % len(names)
    for name in names[shift:] + names[:shift]:
      samples[name].append(_run_blocked(thunks[name], number, wait_each))
  return samples


def measure_each(names: Sequence[str], measure: Callable[[str, jax.Array], Any]) -> dict:
  """``{name: measure(name, key)}`` in order, each model with its own key
  (``fold_in(key(0), i)``), saying which one is being compiled and timed."""
  key = jax.random.key(0)
  results = {}
  for i, name in enumerate(names):
    print(f'[{name}] compiling and timing ...', flush=True)
    results[name] = measure(name, jax.random.fold_in(key, i))
  return results


def summarize(samples: Sequence[float]) -> dict[str, float]:
  """Median and quartiles of per-call seconds."""
  if len(samples) == 1:
    return {'median_s': samples[0], 'p25_s': samples[0], 'p75_s': samples[0]}
  q = statistics.quantiles(samples, n=4, method='inclusive')
  return {'median_s': statistics.median(samples), 'p25_s': q[0], 'p75_s': q[2]}


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
  """An aligned plain-text table; strings left-aligned, everything else right-aligned."""
  cells = [[str(row.get(c, '')) for c in columns] for row in rows]
  widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
  left = [all(isinstance(row.get(c), str) for row in rows) for c in columns]

  def line(values: Sequence[str]) -> str:
    return '  '.join(v.ljust(w) if lft else v.rjust(w)
                     for v, w, lft in zip(values, widths, left)).rstrip()

  rule = '  '.join('-' * w for w in widths)
  return '\n'.join([line(list(columns)), rule] + [line(r) for r in cells])


def environment() -> dict[str, Any]:
  """Versions and hardware, to store next to the numbers."""
  import flax
  device = jax.devices()[0]
  return {
      'python': platform.python_version(),
      'jax': jax.__version__,
      'flax': flax.__version__,
      'backend': jax.default_backend(),
      'device_kind': device.device_kind,
      'device_count': jax.device_count(),
      'cpu_count': os.cpu_count(),
      'platform': platform.platform(),
      'argv': sys.argv,
      'xla_flags': os.environ.get('XLA_FLAGS', ''),
      'matmul_precision': str(jax.config.jax_default_matmul_precision),
  }


def write_json(path: str | None, data: Any) -> None:
  """Writes ``data`` as indented JSON, creating the parent folder (nothing if no path)."""
  if not path:
    return
  folder = os.path.dirname(path)
  if folder:
    os.makedirs(folder, exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(data, f, indent=2, sort_keys=False)
    f.write('\n')


def write_results(path: str | None, benchmark: str, config: Mapping[str, Any],
                  models: Mapping[str, Any], all_ok: bool, **environment_extra: Any) -> None:
  """Writes one benchmark's results where ``--out`` says, and says so; nothing without a path.

  Every benchmark writes the same top-level keys: ``benchmark``, ``config``,
  ``environment`` (versions and hardware, plus ``environment_extra``), ``all_ok``
  and ``models``.
  """
  if not path:
    return
  write_json(path, {'benchmark': benchmark, 'config': dict(config),
                    'environment': {**environment(), **environment_extra},
                    'all_ok': all_ok, 'models': dict(models)})
  print(f'wrote {path}')


def write_checked(path: str | None, benchmark: str, config: Mapping[str, Any],
                  models: Mapping[str, Any]) -> int:
  """:func:`write_results` with ``all_ok`` read from each model's ``'ok'``; returns the
  script's exit status, 0 when every model's checks passed."""
  all_ok = all(model['ok'] for model in models.values())
  write_results(path, benchmark, config, models, all_ok)
  return 0 if all_ok else 1


def check_lines(result: Mapping[str, Any]) -> tuple[str, str]:
  """A model's check status ('OK' or the mismatches) and its targets line ('name=yes, ...')."""
  status = 'OK' if result['ok'] else f'MISMATCH {result["mismatches"]}'
  met = ', '.join(f'{k}={"yes" if ok else "NO"}' for k, ok in result['targets_met'].items())
  return status, met


def parse_args(description: str, sizes: Mapping[str, Mapping[str, Any]], default_out: str,
               default_repeats: int, argv: list[str] | None = None,
               parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.Namespace:
  """The flags every benchmark script takes: --sizes, --repeats, --models, --out.

  A script's own flags come in ``parents`` (parsers made with ``add_help=False``),
  so that ``--help`` lists them too.

  Results are written only where ``--out`` says (``default_out`` is suggested
  in the help, for the file the README quotes), never over a tracked file by default.
  """
  parser = argparse.ArgumentParser(description=description, parents=list(parents),
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument('--sizes', choices=sorted(sizes), default='default')
  parser.add_argument('--repeats', type=int, default=default_repeats,
                      help='timed samples per variant')
  parser.add_argument('--models', nargs='+', choices=list(sizes['default']),
                      default=list(sizes['default']))
  suggested = f' (the README quotes {default_out})' if default_out else ''
  parser.add_argument('--out', default=None,
                      help='where to write the JSON results; nothing is written without it'
                      + suggested)
  return parser.parse_args(argv)
