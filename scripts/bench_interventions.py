"""Activation and attribution patching on an unmodified Hugging Face GPT-2, side by side in one run.

A tiny GPT-2 (4 blocks, 32 tokens by default) is built in code (nothing is downloaded) and
used as it is: the metric, a logit difference at the last token, calls
``hf_model.module.apply``. The clean and corrupted inputs differ in one token. Variants,
compiled first, then timed round-robin twice: each call waited for before the next starts
(the cost of one call on its own: the table, ``ratios`` and the targets), then calls queued
back to back (``ratios_queued``; on a CPU the runtime can run two queued calls at once,
which flatters the calls too small to keep every core busy):

  sweep        ``perturbkit.activation_patching(metric, filter=<every block>, axis=1)``:
               the clean run, the corrupted run, and each block's (block, position)
               patched runs, 8 per step (the default ``batch_size``; the blocks before
               it run once). The patches of positions before the changed token, where
               the clean and corrupted outputs are equal, are not run.
  sweep_all    the same with ``batch_size=None``: each block's runs as one ``jax.vmap``
               (every run done).
  loop         the same numbers from a Python loop: one jitted clean run recording the
               block outputs, one jitted corrupted run, then one call per (block, position)
               of a single jitted patched forward that takes the block, the position and
               the clean outputs as arguments (compiled once; written with
               ``nn.intercept_methods`` alone, no perturbkit code).
  loop_needed  the loop over the (block, position) pairs whose clean and corrupted outputs
               differ only (the others' effects set to 0): what the sweep runs.
  attribution  ``perturbkit.attribution_patching(metric, axis=1)`` of every call (default
               filter) at every position.
  attribution_blocks  the same of the block outputs only (the sweep's calls).
  by_hand      attribution patching of the block outputs written by hand (no perturbkit
               code): a jitted clean run recording them, ``jax.value_and_grad`` of the metric
               on the corrupted inputs with respect to zero deltas added to them (an
               interceptor), and ``vdot(a_clean - a_corrupted, g)`` per block and position.
  grad         by_hand's gradient alone: one forward and one backward through the
               activations, the least any attribution patching does after the clean run.
  param_grad   ``jax.grad`` of the metric with respect to the params on the corrupted inputs:
               the ordinary gradient, for scale.
  forward      one jitted forward pass of the metric on the corrupted inputs.
  cache        attribution patching's first part, by itself: ``perturbkit.run_with_cache``
               of the metric on the clean inputs (every call's output).
  cache_grads  its second part: ``run_with_cache(metric, grads=True)`` on the corrupted
               inputs (every call's output and the metric's gradient there, one backward).
               Attribution patching is these two and the per-position products.

Before timing, the script checks that both sweeps equal the loop, and that attribution
patching (every call's block rows, and the blocks alone) equals by_hand;
it exits non-zero if a check fails. Targets: loop / sweep >= 5 (either sweep), attribution /
forward <= 3.2; loop_needed / sweep is reported beside them.
Memory: ``memory_analysis`` bytes of each compiled function (the loop's are its single
patched forward's).

  python scripts/bench_interventions.py --out scripts/results/bench_interventions.json
  python scripts/bench_interventions.py --sizes tiny --repeats 2     # a smoke test
"""
import logging
import os
import sys
import warnings
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

# Measure the checkout this script lives in, installed or not.
SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]
import perturbkit  # noqa: E402
import _bench_common as common  # noqa: E402
from perturbkit import filters  # noqa: E402

VARIANTS = ('sweep', 'sweep_all', 'loop', 'loop_needed', 'attribution', 'attribution_blocks',
            'cache', 'cache_grads', 'by_hand', 'grad', 'param_grad', 'forward')
DEFAULT_OUT = os.path.join(SCRIPTS, 'results', 'bench_interventions.json')
TOLERANCE = dict(rtol=1e-4, atol=1e-6)
TARGETS = {'loop_over_sweep_ge': 5.0, 'attribution_over_forward_le': 3.2}
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    'tiny': {'gpt2': dict(layers=2, width=32, heads=2, seq=8, batch=2, vocab=64)},
    'default': {'gpt2': dict(layers=4, width=64, heads=4, seq=32, batch=4, vocab=128)},
    # The same depth and sequence, 4 times wider, twice the batch: less per-op overhead.
    'wide': {'gpt2': dict(layers=4, width=256, heads=4, seq=32, batch=8, vocab=1024)},
}


class Problem(NamedTuple):
  """GPT-2's Linen module and variables, the metric, and the two inputs."""
  module: Any
  variables: dict
  metric: Callable[..., jax.Array]
  clean: jax.Array
  corrupted: jax.Array
  blocks: tuple[str, ...]


def quiet_transformers() -> None:
  """transformers 4.x says its Flax classes are deprecated (a log line, or a warning)."""
  logging.getLogger('transformers').setLevel(logging.ERROR)
  warnings.filterwarnings('ignore', message='.*TensorFlow and JAX classes are deprecated.*')


def gpt2_problem(size: dict[str, Any], key: jax.Array) -> Problem:
  """A tiny GPT-2, its logit-difference metric, and inputs that differ in one token."""
  import transformers as T
  config = T.GPT2Config(vocab_size=size['vocab'], n_positions=size['seq'], n_embd=size['width'],
                        n_layer=size['layers'], n_head=size['heads'])
  hf = T.FlaxGPT2LMHeadModel(config, seed=0, _do_init=False)
  init = jax.jit(hf.init_weights, static_argnames='input_shape')
  variables = {'params': dict(init(hf.key, input_shape=(1, size['seq'])))}
  batch, seq = size['batch'], size['seq']
  clean = jax.random.randint(key, (batch, seq), 0, size['vocab'])
  corrupted = clean.at[:, seq // 4].set((clean[:, seq // 4] + 1) % size['vocab'])
  mask = jnp.ones((batch, seq), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
  module = hf.module

  def metric(variables, ids):
    logits = module.apply(variables, ids, mask, positions, deterministic=True).logits
    return jnp.mean(logits[:, -1, 0] - logits[:, -1, 1])

  blocks = tuple(f'transformer/h/{i}' for i in range(size['layers']))
  return Problem(module, variables, metric, clean, corrupted, blocks)


def intercepted(fn: Callable[..., Any], blocks: tuple[str, ...],
                edit: Callable[[int, jax.Array], jax.Array]) -> Callable[..., Any]:
  """``fn`` with each block's hidden state ``h`` (its output's first item) as ``edit(i, h)``."""
  index = {path: i for i, path in enumerate(blocks)}

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    i = index.get('/'.join(context.module.path))
    if context.method_name != '__call__' or i is None:
      return out
    return (edit(i, out[0]),) + tuple(out[1:])

  def edited(*args):
    with nn.intercept_methods(interceptor):
      return fn(*args)

  return edited


def recorded(p: Problem, edit: Callable[[int, jax.Array], jax.Array]) -> Callable[..., Any]:
  """``(variables, ids) -> (metric, block outputs)``: each block output ``h`` recorded, then
  ``edit(i, h)``; the outputs stacked as ``(blocks, batch, seq, width)``."""

  def run(variables, ids):
    hidden = {}

    def record(i, h):
      hidden[i] = h
      return edit(i, h)
    value = intercepted(p.metric, p.blocks, record)(variables, ids)
    return value, jnp.stack([hidden[i] for i in range(len(p.blocks))])

  return run


def loop_functions(p: Problem) -> dict[str, Callable[..., Any]]:
  """The loop's three jitted functions: clean run with block outputs, metric, patched run."""

  def clean_run(variables, ids):
    return recorded(p, lambda i, h: h)(variables, ids)[1]

  def patched(variables, clean_hidden, block, position, ids):
    def put(i, h):
      at = (jnp.arange(h.shape[1]) == position)[None, :, None] & (block == i)
      return jnp.where(at, clean_hidden[i], h)
    return intercepted(p.metric, p.blocks, put)(variables, ids)

  return {'clean_run': clean_run, 'metric': p.metric, 'patched': patched}


def differing_pairs(compiled: dict[str, Any], p: Problem, clean_hidden: jax.Array) -> np.ndarray:
  """``(blocks, positions)``: where the corrupted block outputs differ from ``clean_hidden``."""
  corrupted_hidden = compiled['clean_run'].call(p.variables, p.corrupted)
  return np.asarray(jnp.any(clean_hidden != corrupted_hidden, axis=(1, 3)))


def run_loop(compiled: dict[str, Any], p: Problem, seq: int,
             only_needed: bool = False) -> jax.Array:
  """``(blocks, positions)`` effects from one patched forward per (block, position).

  ``only_needed``: one more run records the corrupted block outputs, and only the pairs
  where they differ from the clean ones are run (the others are the corrupted run: 0).
  """
  clean_hidden = compiled['clean_run'].call(p.variables, p.clean)
  corrupted_metric = compiled['metric'].call(p.variables, p.corrupted)
  needed = np.ones((len(p.blocks), seq), bool)
  if only_needed:
    needed = differing_pairs(compiled, p, clean_hidden)
  rows = [[compiled['patched'].call(p.variables, clean_hidden, np.int32(i), np.int32(j),
                                    p.corrupted) if needed[i, j] else corrupted_metric
           for j in range(seq)]
          for i in range(len(p.blocks))]
  return jnp.array(rows) - corrupted_metric


def by_hand(p: Problem) -> dict[str, Callable[..., Any]]:
  """Attribution patching of the blocks written by hand, and the gradient it is made of.

  ``grad``: the metric on the corrupted inputs and its gradient with respect to zero
  deltas added to the block outputs (``jax.value_and_grad``), the corrupted block outputs
  recorded on the way: one forward and one backward through the activations.
  ``attribution``: a clean run recording the block outputs, then ``grad``, then
  ``vdot(a_clean - a_corrupted, g)`` per block and position.
  """
  functions = loop_functions(p)

  def grad(variables, ids):
    def with_deltas(deltas):
      return recorded(p, lambda i, h: h + deltas[i])(variables, ids)
    shape = jax.eval_shape(functions['clean_run'], variables, ids)
    (value, hidden), g = jax.value_and_grad(with_deltas, has_aux=True)(
        jnp.zeros(shape.shape, shape.dtype))
    return value, hidden, g

  def attribution(variables, clean_ids, corrupted_ids):
    clean = functions['clean_run'](variables, clean_ids)
    _, corrupted, g = grad(variables, corrupted_ids)
    # (blocks, batch, seq, width): sum over batch and width, per block and position.
    return jnp.einsum('lbsw,lbsw->ls', clean - corrupted, g)

  return {'grad': grad, 'attribution': attribution}


def mismatch(actual: jax.Array, expected: jax.Array) -> str | None:
  """``None`` if the two match within ``TOLERANCE``, else numpy's summary of the worst entry."""
  try:
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), **TOLERANCE)
  except AssertionError as err:
    return '; '.join(ln.strip() for ln in str(err).splitlines() if ln.strip().startswith('Max'))
  return None


def ratios_of(t: dict[str, float]) -> dict[str, float]:
  """The ratios the report shows, from each variant's median seconds ``t``."""
  return {'loop_over_sweep': t['loop'] / t['sweep'],
          'loop_over_sweep_all': t['loop'] / t['sweep_all'],
          'loop_needed_over_sweep': t['loop_needed'] / t['sweep'],
          'attribution_over_forward': t['attribution'] / t['forward'],
          'attribution_blocks_over_forward': t['attribution_blocks'] / t['forward'],
          'attribution_over_its_parts': t['attribution'] / (t['cache'] + t['cache_grads']),
          'attribution_blocks_over_by_hand': t['attribution_blocks'] / t['by_hand'],
          'by_hand_over_forward': t['by_hand'] / t['forward'],
          'grad_over_forward': t['grad'] / t['forward'],
          'attribution_over_param_grad': t['attribution'] / t['param_grad'],
          'sweep_over_forward': t['sweep'] / t['forward']}


def measure_model(size: dict[str, Any], repeats: int, key: jax.Array) -> dict[str, Any]:
  """Compiles, checks and times the variants on GPT-2 at ``size``."""
  p = gpt2_problem(size, key)
  blocks = filters.by_path(*p.blocks)
  sweep = perturbkit.activation_patching(p.metric, filter=blocks, axis=1)
  every = perturbkit.activation_patching(p.metric, filter=blocks, axis=1, batch_size=None)
  attribution = perturbkit.attribution_patching(p.metric, axis=1)
  attribution_blocks = perturbkit.attribution_patching(p.metric, filter=blocks, axis=1)
  cache = perturbkit.run_with_cache(p.metric)
  cache_grads = perturbkit.run_with_cache(p.metric, grads=True)
  args = (p.variables, p.clean, p.corrupted)
  compiled = {
      'sweep': common.compile_timed(lambda *a: sweep(*a).effects, *args),
      'sweep_all': common.compile_timed(lambda *a: every(*a).effects, *args),
      'attribution': common.compile_timed(lambda *a: attribution(*a).effects, *args),
      'attribution_blocks': common.compile_timed(lambda *a: attribution_blocks(*a).effects,
                                                 *args),
      'cache': common.compile_timed(cache, p.variables, p.clean),
      'cache_grads': common.compile_timed(cache_grads, p.variables, p.corrupted),
      'forward': common.compile_timed(p.metric, p.variables, p.corrupted),
  }
  functions = loop_functions(p)
  compiled['clean_run'] = common.compile_timed(functions['clean_run'], p.variables, p.clean)
  compiled['metric'] = compiled['forward']
  clean_hidden = compiled['clean_run'].call(p.variables, p.clean)
  compiled['patched'] = common.compile_timed(functions['patched'], p.variables, clean_hidden,
                                             np.int32(0), np.int32(0), p.corrupted)
  hand = by_hand(p)
  compiled['by_hand'] = common.compile_timed(hand['attribution'], *args)
  compiled['grad'] = common.compile_timed(hand['grad'], p.variables, p.corrupted)
  compiled['param_grad'] = common.compile_timed(jax.grad(p.metric), p.variables, p.corrupted)
  seq = size['seq']
  reference = compiled['by_hand'].call(*args)

  sweep_effects = compiled['sweep'].call(*args)
  all_effects = compiled['sweep_all'].call(*args)
  loop_effects = run_loop(compiled, p, seq)
  needed_effects = run_loop(compiled, p, seq, only_needed=True)
  attribution_effects = compiled['attribution'].call(*args)
  # The labels are static: a trace gives them, without running either function.
  block_rows = [jax.eval_shape(sweep, *args).paths.index(f'{b}/__call__') for b in p.blocks]
  all_paths = jax.eval_shape(attribution, *args).paths
  attribution_rows = jnp.stack([attribution_effects[all_paths.index(f'{b}/__call__')]
                                for b in p.blocks])
  mismatches = {
      'sweep_vs_loop': mismatch(sweep_effects[jnp.array(block_rows)], loop_effects),
      'sweep_all_vs_loop': mismatch(all_effects[jnp.array(block_rows)], loop_effects),
      'loop_needed_vs_loop': mismatch(needed_effects, loop_effects),
      'attribution_vs_vdot_grad': mismatch(attribution_rows, reference),
      'attribution_blocks_vs_vdot_grad': mismatch(compiled['attribution_blocks'].call(*args),
                                                  reference),
  }
  # The corruption has to matter for the comparison to mean anything.
  if not float(jnp.abs(loop_effects).max()) > 1e-6:
    mismatches['corruption_has_an_effect'] = 'every patch leaves the metric unchanged'

  thunks = {
      'sweep': lambda: compiled['sweep'].call(*args),
      'sweep_all': lambda: compiled['sweep_all'].call(*args),
      'loop': lambda: run_loop(compiled, p, seq),
      'loop_needed': lambda: run_loop(compiled, p, seq, only_needed=True),
      'attribution': lambda: compiled['attribution'].call(*args),
      'attribution_blocks': lambda: compiled['attribution_blocks'].call(*args),
      'cache': lambda: compiled['cache'].call(p.variables, p.clean),
      'cache_grads': lambda: compiled['cache_grads'].call(p.variables, p.corrupted),
      'by_hand': lambda: compiled['by_hand'].call(*args),
      'grad': lambda: compiled['grad'].call(p.variables, p.corrupted),
      'param_grad': lambda: compiled['param_grad'].call(p.variables, p.corrupted),
      'forward': lambda: compiled['forward'].call(p.variables, p.corrupted),
  }
  # Each call waited for (the cost of one call alone), then queued back to back as
  # before: on a CPU the runtime can overlap two queued calls, which flatters small ones.
  samples = common.time_round_robin(thunks, repeats, wait_each=True)
  queued = common.time_round_robin(thunks, repeats)
  # The loops' memory is their single patched forward's; every other variant is compiled whole.
  memory_of = {'loop': 'patched', 'loop_needed': 'patched'}
  variants = {}
  for v in VARIANTS:
    c = compiled[memory_of.get(v, v)]
    variants[v] = {**common.summarize(samples[v]),
                   **{f'queued_{k}': x for k, x in common.summarize(queued[v]).items()},
                   'lower_s': c.lower_s, 'compile_s': c.compile_s, **c.memory,
                   'samples_s': samples[v], 'queued_samples_s': queued[v]}
  ratios = ratios_of({v: variants[v]['median_s'] for v in VARIANTS})
  targets = {
      f'loop_over_sweep_ge_{TARGETS["loop_over_sweep_ge"]}':
          max(ratios['loop_over_sweep'], ratios['loop_over_sweep_all'])
          >= TARGETS['loop_over_sweep_ge'],
      f'attribution_over_forward_le_{TARGETS["attribution_over_forward_le"]}':
          ratios['attribution_over_forward'] <= TARGETS['attribution_over_forward_le'],
  }
  return {
      'size': dict(size),
      'num_params': sum(x.size for x in jax.tree.leaves(p.variables)),
      'patched_runs': len(p.blocks) * seq,
      'patched_runs_needed': int(differing_pairs(compiled, p, clean_hidden).sum()),
      'attribution_calls': len(all_paths),
      'checks': {k: m is None for k, m in mismatches.items()},
      'mismatches': {k: m for k, m in mismatches.items() if m is not None},
      'ok': all(m is None for m in mismatches.values()),
      'variants': variants,
      'ratios': ratios,
      'ratios_queued': ratios_of({v: variants[v]['queued_median_s'] for v in VARIANTS}),
      'targets_met': targets,
  }


COLUMNS = ('model', 'variant', 'median ms', 'p25-p75 ms', 'x forward', 'queued ms',
           'queued x forward', 'lower s', 'compile s', 'arg bytes', 'temp bytes', 'out bytes')


def report(results: dict[str, Any]) -> None:
  """Prints the table, the checks, ratios and targets."""
  rows = []
  for name, r in results.items():
    forward = r['variants']['forward']['median_s']
    queued_forward = r['variants']['forward']['queued_median_s']
    for v in VARIANTS:
      m = r['variants'][v]
      rows.append({
          'model': name, 'variant': v, 'median ms': f'{m["median_s"] * 1e3:.2f}',
          'p25-p75 ms': f'{m["p25_s"] * 1e3:.2f}-{m["p75_s"] * 1e3:.2f}',
          'x forward': f'{m["median_s"] / forward:.2f}',
          'queued ms': f'{m["queued_median_s"] * 1e3:.2f}',
          'queued x forward': f'{m["queued_median_s"] / queued_forward:.2f}',
          'lower s': f'{m["lower_s"]:.2f}', 'compile s': f'{m["compile_s"]:.2f}',
          'arg bytes': f'{m.get("argument_bytes", -1):,}',
          'temp bytes': f'{m.get("temp_bytes", -1):,}',
          'out bytes': f'{m.get("output_bytes", -1):,}'})
  print(common.format_table(rows, COLUMNS))
  print()
  for name, r in results.items():
    status, met = common.check_lines(r)
    print(f'{name}: {status} ({r["patched_runs"]} patched runs, '
          f'{r["patched_runs_needed"]} of them with a clean output unlike the corrupted one, '
          f'{r["attribution_calls"]} calls attributed, {r["num_params"]:,} params)')
    print('  ratios: ' + ', '.join(f'{k}={v:.2f}' for k, v in r['ratios'].items()))
    print('  ratios, calls queued: '
          + ', '.join(f'{k}={v:.2f}' for k, v in r['ratios_queued'].items()))
    print(f'  targets: {met}')


def main(argv: list[str] | None = None) -> int:
  quiet_transformers()
  args = common.parse_args(__doc__.split('\n')[0], SIZES, DEFAULT_OUT, 15, argv)
  results = common.measure_each(args.models, lambda name, key: measure_model(
      SIZES[args.sizes][name], args.repeats, key))
  report(results)
  config = {
      'sizes': args.sizes, 'repeats': args.repeats, 'tolerance': TOLERANCE,
      'variants': list(VARIANTS), 'targets': TARGETS}
  return common.write_checked(args.out, 'interventions', config, results)


if __name__ == '__main__':
  sys.exit(main())
