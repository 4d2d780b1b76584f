"""What the PyTorch comparison scripts share: arguments, round-robin timing, report and JSON.

Each script (``bench_interventions_transformer_lens.py``, ``bench_interventions_nnsight.py``)
gives its variants (``'forward'`` first: the ratios are to it), how to build the
problem and how to check it; :func:`main` does the rest. torch is imported only here, at run
time, so the scripts' ``--help`` works without it.
"""
import argparse
import importlib.metadata
import json
import platform
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

# The GPT-2 sizes of bench_interventions.py (which imports jax; these scripts need only torch).
SIZES = {
    'tiny': dict(layers=2, width=32, heads=2, seq=8, batch=2, vocab=64),
    'default': dict(layers=4, width=64, heads=4, seq=32, batch=4, vocab=128),
}


def inputs(size: dict, seed: int = 0):
  """Clean token ids and corrupted ones: one token changed, at a quarter of the sequence."""
  import torch
  generator = torch.Generator().manual_seed(seed)
  clean = torch.randint(0, size['vocab'], (size['batch'], size['seq']), generator=generator)
  corrupted = clean.clone()
  at = size['seq'] // 4
  corrupted[:, at] = (clean[:, at] + 1) % size['vocab']
  return clean, corrupted


def metric(logits):
  """The mean over the batch of the logit difference of tokens 0 and 1 at the last position."""
  return (logits[:, -1, 0] - logits[:, -1, 1]).mean()


def main(doc: str, benchmark: str, functions: dict[str, Callable],
         build: Callable[[dict], tuple], checks: Callable[..., dict[str, bool]],
         packages: Sequence[str], argv: Sequence[str] | None = None) -> int:
  """Parses ``--sizes --repeats --out``, checks, times ``functions`` round-robin, reports.

  Args:
    doc: The script's docstring (its first line is the description).
    benchmark: The JSON's ``benchmark`` name.
    functions: ``{variant: f(*problem)}``, ``'forward'`` first.
    build: ``size -> problem`` (the arguments of every function and of ``checks``).
    checks: ``(*problem) -> {check: passed}``.
    packages: Distributions whose versions the JSON records.
    argv: The command line (default: ``sys.argv``).

  Returns:
    0 if every check passed, else 1.
  """
  parser = argparse.ArgumentParser(description=doc.split('\n')[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument('--sizes', choices=sorted(SIZES), default='default')
  parser.add_argument('--repeats', type=int, default=9, help='timed samples per variant')
  parser.add_argument('--out', default=None, help='where to write the JSON results')
  args = parser.parse_args(argv)
  import torch
  size = SIZES[args.sizes]
  problem = build(size)
  found = checks(*problem)
  variants = list(functions)
  samples: dict[str, list[float]] = {v: [] for v in variants}
  for v in variants:  # warm-up
    functions[v](*problem)
  for _ in range(args.repeats):
    for v in variants:
      start = time.perf_counter()
      functions[v](*problem)
      samples[v].append(time.perf_counter() - start)
  median = {v: statistics.median(s) for v, s in samples.items()}
  ratios = {f'{v}_over_forward': median[v] / median['forward'] for v in variants[1:]}
  for v in variants:
    q = np.percentile(samples[v], [25, 75])
    print(f'{v:12s} {median[v] * 1e3:9.2f} ms  (p25 {q[0] * 1e3:.2f}, p75 {q[1] * 1e3:.2f})'
          + (f'  {ratios[f"{v}_over_forward"]:7.1f}x forward' if v != 'forward' else ''))
  print('checks: ' + ', '.join(f'{k}={"OK" if ok else "MISMATCH"}' for k, ok in found.items()))
  if args.out:
    machine: dict[str, Any] = {'python': sys.version.split()[0], 'platform': platform.platform(),
                               'torch': torch.__version__, 'threads': torch.get_num_threads()}
    machine.update({name.replace('-', '_'): importlib.metadata.version(name)
                    for name in packages})
    with open(args.out, 'w') as f:
      json.dump({'benchmark': benchmark,
                 'config': {'sizes': args.sizes, 'repeats': args.repeats, 'size': size,
                            'patched_runs': size['layers'] * size['seq']},
                 'machine': machine, 'checks': found, 'all_ok': all(found.values()),
                 'median_s': median, 'samples_s': samples, 'ratios': ratios}, f, indent=1)
    print(f'wrote {args.out}')
  return 0 if all(found.values()) else 1
