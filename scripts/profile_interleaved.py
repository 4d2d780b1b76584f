"""Where the interleaved step's extra time goes: its optimized HLO against the standard step's.

Compiles, on Hugging Face Flax GPT-2 (built in code, nothing downloaded), the donated
standard step (``jax.value_and_grad`` + adam + ``optax.apply_updates``) and the donated
``perturbkit.interleaved`` step (default layer-wise segments; ``'original'`` and
``'updated'``), and compares the compiled programs, which do not depend on the load of
the machine:

  * ops outside fusions (the entry computation and the bodies of while, conditional and
    call ops): how many and the bytes they write, per opcode (``copy``, ``fusion``,
    ``dynamic-update-slice``, ``transpose``, ``conditional``, ``while``, ``call``,
    ``custom-call``, ...);
  * matrix products (``dot``) anywhere, fused or not;
  * donated parameters that XLA aliases to an output (``input_output_alias``);
  * fusions to a scalar (norms, finiteness tests) and the size of what they take;
  * ``cost_analysis()`` (flops, bytes accessed) and ``memory_analysis()``;
  * the largest ``copy`` ops, each with the innermost perturbkit (or, failing that, any)
    source line that made it.

  python scripts/profile_interleaved.py --layers 2 --out /tmp/profile_interleaved.json
  python scripts/profile_interleaved.py --layers 12     # GPT-2 small (124M params)
"""
import argparse
import collections
import os
import re
import sys
import warnings
from typing import Any, Callable

import jax
import optax

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]
import perturbkit  # noqa: E402
import _bench_common as common  # noqa: E402
from bench_real_models import (LEARNING_RATE, StandardState, gpt2_problem,  # noqa: E402
                               quiet_transformers, standard_step)

VARIANTS = ('standard', 'original', 'updated')
OPCODES = ('copy', 'fusion', 'dynamic-update-slice', 'transpose', 'concatenate', 'broadcast',
           'conditional', 'while', 'call', 'custom-call', 'dot', 'tuple', 'bitcast')
DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2,
               's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8, 'c64': 8,
               'c128': 16}
GPT2_124M = dict(layers=12, width=768, heads=12, seq=128, positions=1024, batch=2, vocab=50257)

_COMPUTATION = re.compile(r'^(ENTRY )?%(\S+) \(.*\{$')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%(\S+) = (.*)$')
_ARRAY = re.compile(r'\b([a-z]+\d*)\[([\d,]*)\]')
_SUBCOMPUTATIONS = re.compile(
    r'\b(?:body|condition|true_computation|false_computation|to_apply)=%([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape (an array or a tuple of arrays)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    size = DTYPE_BYTES.get(dtype, 0)
    for d in filter(None, dims.split(',')):
      size *= int(d)
    total += size
  return total


def split_instruction(rest: str) -> tuple[str, str, str]:
  """``(shape, opcode, operands and attributes)`` of the text after ``%name = ``."""
  if rest.startswith('('):
    depth, end = 0, 0
    while end == 0 or depth:
      depth += {'(': 1, ')': -1}.get(rest[end], 0)
      end += 1
    shape, rest = rest[:end], rest[end + 1:]
  else:
    shape, rest = rest.split(' ', 1)
  opcode, tail = rest.split('(', 1)
  return shape, opcode.strip(), tail


def parse_module(text: str) -> dict[str, Any]:
  """Computations (name -> instructions), the entry's name and the source-location tables."""
  computations: dict[str, list[dict]] = {}
  entry, current = None, None
  tables: dict[str, dict[int, str]] = collections.defaultdict(dict)
  table = None
  for line in text.splitlines():
    if line in ('FileNames', 'FunctionNames', 'FileLocations', 'StackFrames'):
      table = line
      continue
    if table and re.match(r'^\d+ ', line):
      index, value = line.split(' ', 1)
      tables[table][int(index)] = value
      continue
    table = None
    match = _COMPUTATION.match(line)
    if match:
      current = match.group(2)
      computations[current] = []
      if match.group(1):
        entry = current
      continue
    if line.startswith('}'):
      current = None
      continue
    match = _INSTRUCTION.match(line)
    if current is not None and match:
      shape, opcode, tail = split_instruction(match.group(2))
      frame = re.search(r'stack_frame_id=(\d+)', tail)
      op_name = re.search(r'op_name="([^"]*)"', tail)
      computations[current].append({
          'name': match.group(1), 'shape': shape, 'opcode': opcode, 'tail': tail,
          'bytes': shape_bytes(shape), 'frame': int(frame.group(1)) if frame else None,
          'op_name': op_name.group(1) if op_name else ''})
  return {'computations': computations, 'entry': entry, 'tables': tables}


def top_level(module: dict[str, Any]) -> dict[str, dict | None]:
  """The entry and every computation it runs as control flow (not fused, not reducers).

  Returns:
    Computation name -> the while, conditional or call op that runs it (``None``
    for the entry).
  """
  computations, seen = module['computations'], {}
  todo: list[tuple[str, dict | None]] = [(module['entry'], None)]
  while todo:
    name, caller = todo.pop()
    if name in seen or name not in computations:
      continue
    seen[name] = caller
    for op in computations[name]:
      if op['opcode'] in ('while', 'conditional', 'call'):
        todo += [(sub, op) for sub in _SUBCOMPUTATIONS.findall(op['tail'])]
        for branches in _BRANCHES.findall(op['tail']):
          todo += [(b.strip().lstrip('%'), op) for b in branches.split(',')]
  return seen


def source_of(module: dict[str, Any], frame: int | None) -> str:
  """The innermost perturbkit source line of a stack frame, else its innermost line."""
  tables = module['tables']
  chain, seen = [], set()
  while frame is not None and frame in tables['StackFrames'] and frame not in seen:
    seen.add(frame)
    fields = dict(re.findall(r'(\w+)=(\d+)', tables['StackFrames'][frame]))
    location = dict(re.findall(r'(\w+)=(\d+)',
                               tables['FileLocations'].get(int(fields['file_location_id']), '')))
    if location:
      file = tables['FileNames'].get(int(location['file_name_id']), '?').strip('"')
      function = tables['FunctionNames'].get(int(location['function_name_id']), '?').strip('"')
      chain.append(f'{file.split("site-packages/")[-1]}:{location["line"]} {function}')
    parent = int(fields.get('parent_frame_id', 0))
    frame = parent if parent != frame else None
  ours = [c for c in chain if 'perturbkit/' in c]
  return (ours or chain or ['?'])[0]


def profile(compiled: jax.stages.Compiled, top_copies: int) -> dict[str, Any]:
  """Op counts and bytes, aliasing, cost and memory of one compiled program."""
  text = compiled.as_text()
  module = parse_module(text)
  outer = top_level(module)
  counts: dict[str, dict[str, int]] = {}
  copies = []
  sizes = {op['name']: op['bytes'] for ops in module['computations'].values() for op in ops}
  reductions = {'count': 0, 'operand_bytes': 0}
  for name, caller in outer.items():
    for op in module['computations'][name]:
      if op['opcode'] == 'fusion' and re.fullmatch(r'[a-z]+\d*\[\]', op['shape']):
        # A fusion to a scalar reads whole arrays for a norm, a sum or a finiteness test.
        operands = re.findall(r'%([\w.\-]+)', op['tail'].split(')')[0])
        reductions['count'] += 1
        reductions['operand_bytes'] += sum(sizes.get(o, 0) for o in operands)
      entry = counts.setdefault(op['opcode'], {'count': 0, 'bytes': 0})
      entry['count'] += 1
      entry['bytes'] += op['bytes']
      if op['opcode'] == 'copy':
        # A copy XLA added (no metadata) inside a branch or loop: blame the op running it.
        where = caller if op['frame'] is None and caller is not None else op
        copies.append({**op, 'frame': where['frame'],
                       'in': f'{caller["opcode"]} {caller["op_name"]}' if caller else 'entry'})
  dots = sum(op['opcode'] == 'dot' for ops in module['computations'].values() for op in ops)
  header = text.split('\n', 1)[0]
  alias = re.search(r'input_output_alias=\{(.*?)\}, entry_computation_layout', header)
  aliased = len(re.findall(r'may-alias|must-alias', alias.group(1))) if alias else 0
  entry_params = sum(op['opcode'] == 'parameter'
                     for op in module['computations'][module['entry']])
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  by_source: dict[str, dict[str, int]] = {}
  for op in copies:
    key = f"{source_of(module, op['frame'])} [{op['in'].split(' ')[0]}]"
    where = by_source.setdefault(key, {'count': 0, 'bytes': 0})
    where['count'] += 1
    where['bytes'] += op['bytes']
  return {
      'ops': counts, 'dots_anywhere': dots, 'scalar_fusions': reductions,
      'entry_parameters': entry_params,
      'aliased_outputs': aliased, 'top_level_computations': len(outer),
      'flops': float(cost.get('flops', -1)), 'bytes_accessed': float(cost.get('bytes accessed', -1)),
      'memory': common.memory_bytes(compiled),
      'copies_by_source': dict(sorted(by_source.items(), key=lambda kv: -kv[1]['bytes'])),
      'largest_copies': [{'shape': op['shape'], 'bytes': op['bytes'],
                          'source': source_of(module, op['frame']), 'op_name': op['op_name'],
                          'in': op['in']}
                         for op in sorted(copies, key=lambda op: -op['bytes'])[:top_copies]],
  }


def compile_steps(size: dict[str, int], variants: list[str]) -> dict[str, jax.stages.Compiled]:
  """The donated standard and interleaved steps of GPT-2 at ``size``, compiled."""
  problem = gpt2_problem(size, jax.random.key(0))
  params, batch, optimizer = problem.variables['params'], problem.batch, optax.adam(LEARNING_RATE)
  steps: dict[str, tuple[Callable[..., Any], Any]] = {
      'standard': (standard_step(problem.loss_fn, optimizer),
                   StandardState(params, optimizer.init(params)))}
  for v in ('original', 'updated'):
    tx = perturbkit.interleaved(problem.loss_fn, optimizer, propagate=v)
    steps[v] = (tx.step, tx.init(problem.variables, *batch))
  out = {}
  for v in variants:
    fn, state = steps[v]
    print(f'  compiling {v} ...', flush=True)
    out[v] = jax.jit(fn, donate_argnums=0).lower(state, *batch).compile()
  return out


def table(profiles: dict[str, dict[str, Any]]) -> str:
  """Side by side: one row per measure, one column per variant, and each over standard."""
  names = list(profiles)
  mb = lambda b: f'{b / 2**20:.2f}'
  rows = []

  def row(measure, get, fmt=str):
    values = [get(profiles[v]) for v in names]
    cells = {'measure': measure, **{v: fmt(x) for v, x in zip(names, values)}}
    base = values[0]
    for v, x in zip(names[1:], values[1:]):
      cells[f'{v} - {names[0]}'] = fmt(x - base) if isinstance(x, (int, float)) else ''
    rows.append(cells)

  opcodes = sorted({op for p in profiles.values() for op in p['ops']} & set(OPCODES),
                   key=OPCODES.index)
  for op in opcodes:
    row(f'{op} ops', lambda p, op=op: p['ops'].get(op, {}).get('count', 0))
    row(f'{op} MB', lambda p, op=op: p['ops'].get(op, {}).get('bytes', 0), mb)
  row('fusions to a scalar', lambda p: p['scalar_fusions']['count'])
  # Whole operands, even where the fusion reads one entry of them: a bound, not a measure.
  row('  their operands MB', lambda p: p['scalar_fusions']['operand_bytes'], mb)
  row('all top-level ops', lambda p: sum(o['count'] for o in p['ops'].values()))
  row('dot (anywhere)', lambda p: p['dots_anywhere'])
  row('top-level computations', lambda p: p['top_level_computations'])
  row('entry parameters', lambda p: p['entry_parameters'])
  row('aliased outputs', lambda p: p['aliased_outputs'])
  row('GFLOP', lambda p: p['flops'] / 1e9, lambda x: f'{x:.3f}')
  row('bytes accessed MB', lambda p: p['bytes_accessed'], mb)
  for field in ('argument_bytes', 'output_bytes', 'temp_bytes', 'alias_bytes'):
    row(f'{field} MB', lambda p, f=field: p['memory'].get(f, 0), mb)
  columns = ['measure', *names, *(f'{v} - {names[0]}' for v in names[1:])]
  return common.format_table(rows, columns)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  for flag, value in GPT2_124M.items():
    parser.add_argument(f'--{flag}', type=int, default=value)
  parser.add_argument('--variants', nargs='+', choices=VARIANTS, default=list(VARIANTS))
  parser.add_argument('--top-copies', type=int, default=12, help='largest copies listed')
  parser.add_argument('--out', default=None, help='where to write the JSON results')
  args = parser.parse_args(argv)
  quiet_transformers()
  warnings.filterwarnings('ignore', message='Some donated buffers were not usable')
  size = {k: getattr(args, k) for k in GPT2_124M}
  variants = ['standard'] + [v for v in args.variants if v != 'standard']
  print(f'GPT-2 {size}', flush=True)
  compiled = compile_steps(size, variants)
  profiles = {v: profile(c, args.top_copies) for v, c in compiled.items()}
  print(table(profiles))
  for v, p in profiles.items():
    print(f'\n{v}: copies by source (count, MB)')
    for where, c in list(p['copies_by_source'].items())[:args.top_copies]:
      print(f'  {c["count"]:5d} {c["bytes"] / 2**20:9.2f}  {where}')
  common.write_json(args.out, {'size': size, 'environment': common.environment(),
                               'profiles': profiles})
  if args.out:
    print(f'wrote {args.out}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
