"""perturbkit on unmodified Hugging Face Flax models: GPT-2 and ViT, side by side in one run.

Both models are built in code from small configs (nothing is downloaded) and used as
they are: the loss calls ``hf_model.module.apply``. For each model, five jitted
functions are compiled and then timed round-robin:

  plain        ``jax.value_and_grad`` of the loss over params.
  perturbkit   ``perturbkit.value_and_grad``: the same plus dL/d(output) of every call.
  standard     a training step: ``jax.value_and_grad`` + adam + ``optax.apply_updates``,
               state donated.
  interleaved  ``perturbkit.interleaved`` with the default (layer-wise) segments,
               ``propagate='updated'``, state donated.
  original     the same with ``propagate='original'`` (the standard step's maths).
  blocks       the same with the Transformer blocks as segments
               (``segments=filters.by_type(FlaxGPT2Block)`` / ``FlaxViTLayer``).

Before timing, the script checks that perturbkit's param gradients and loss equal
plain's, and that ``propagate='original'`` (default segments) gives the standard
step's new params (with SGD: adam's first step divides each gradient entry by its own
magnitude, so entries of about 1e-9, whose rounding differs between two float32
programs, would move by up to the learning rate); it exits non-zero if a check fails. Reported: time ratios
(targets: perturbkit <= 1.05x plain, interleaved and original <= 1.15x standard, blocks
<= 1.35x standard), ``memory_analysis`` bytes (perturbkit's argument bytes equal plain's;
interleaved's argument + output + temp bytes at most standard's), and lowering +
compile time against the number of segments.

  python scripts/bench_real_models.py --out scripts/results/bench_real_models.json
  python scripts/bench_real_models.py --quick          # tiny sizes, a smoke test
  python scripts/bench_real_models.py --size 124m --repeats 7 --models gpt2   # GPT-2 small
"""
import argparse
import logging
import os
import sys
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

# Measure the checkout this script lives in, installed or not.
SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]
import perturbkit  # noqa: E402
import _bench_common as common  # noqa: E402
from bench_interleaved import compile_donated, copy_tree, stepper  # noqa: E402

GRAD_VARIANTS = ('plain', 'perturbkit')
STEP_VARIANTS = ('standard', 'interleaved', 'original', 'blocks')
VARIANTS = GRAD_VARIANTS + STEP_VARIANTS
MODELS = ('gpt2', 'vit')
DEFAULT_OUT = os.path.join(SCRIPTS, 'results', 'bench_real_models.json')
LEARNING_RATE = 1e-4
# The 'original' == standard check: one SGD step moves weights by about 1e-3 here.
CHECK_OPTIMIZER, CHECK_LEARNING_RATE = optax.sgd, 0.1
# The same float32 ops in a different fusion, for gradients and for new params.
GRAD_TOLERANCE = dict(rtol=1e-4, atol=1e-6)
STEP_TOLERANCE = dict(rtol=1e-5, atol=1e-6)
TARGETS = {'perturbkit_over_plain': 1.05, 'interleaved_over_standard': 1.15,
           'original_over_standard': 1.15, 'blocks_over_standard': 1.35}
DEFAULTS = dict(layers=4, width=256, heads=4, seq=128, positions=0, batch=8, vocab=256,
                image=32, patch=4, vit_width=192, vit_heads=3, classes=10, repeats=20)
FLAG_HELP = {
    'layers': 'Transformer blocks of both models', 'width': 'GPT-2 embedding width',
    'heads': 'GPT-2 attention heads', 'seq': 'GPT-2 tokens per sequence',
    'positions': 'GPT-2 position embeddings (0: as many as --seq)',
    'batch': 'sequences or images per batch', 'vocab': 'GPT-2 vocabulary size',
    'image': 'ViT image side in pixels', 'patch': 'ViT patch side in pixels',
    'vit_width': 'ViT hidden width (MLP: 4x)', 'vit_heads': 'ViT attention heads',
    'classes': 'ViT classifier outputs', 'repeats': 'timed samples per variant',
}
QUICK = dict(layers=1, width=32, heads=2, seq=16, batch=2, vocab=64,
             image=16, patch=8, vit_width=32, vit_heads=2, classes=10, repeats=2)
# The published sizes: GPT-2 small (124M params) and ViT-B/16 (86M), at batch 2.
SIZES = {'124m': dict(layers=12, width=768, heads=12, seq=128, positions=1024, batch=2,
                      vocab=50257, image=224, patch=16, vit_width=768, vit_heads=12,
                      classes=1000)}


class StandardState(NamedTuple):
  """The standard step's state: params and one optimizer state for all of them."""
  params: Any
  opt_state: Any


class Problem(NamedTuple):
  """An unmodified HF Flax model's Linen module, its variables, a loss and one batch."""
  module: Any
  variables: dict
  loss_fn: Callable[..., jax.Array]
  batch: tuple
  block: type


def quiet_transformers() -> None:
  """transformers 4.x says its Flax classes are deprecated (a log line, or a warning)."""
  logging.getLogger('transformers').setLevel(logging.ERROR)
  warnings.filterwarnings('ignore', message='.*TensorFlow and JAX classes are deprecated.*')


def init_params(hf: Any, input_shape: tuple) -> dict:
  """HF's own initializer, jitted once (it runs op by op otherwise, slowly on a small CPU)."""
  init = jax.jit(hf.init_weights, static_argnames='input_shape')
  return dict(init(hf.key, input_shape=input_shape))


def gpt2_problem(size: dict[str, Any], key: jax.Array) -> Problem:
  """GPT-2 with its tied LM head; next-token cross-entropy on random token ids."""
  import transformers as T
  from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2Block
  config = T.GPT2Config(vocab_size=size['vocab'], n_positions=size['positions'] or size['seq'],
                        n_embd=size['width'],
                        n_layer=size['layers'], n_head=size['heads'])
  hf = T.FlaxGPT2LMHeadModel(config, seed=0, _do_init=False)
  variables = {'params': init_params(hf, (1, size['seq']))}
  module = hf.module
  batch, seq = size['batch'], size['seq']
  ids = jax.random.randint(key, (batch, seq), 0, size['vocab'])
  mask = jnp.ones((batch, seq), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))

  def loss_fn(variables, ids, mask, positions):
    logits = module.apply(variables, ids, mask, positions, deterministic=True).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

  return Problem(module, variables, loss_fn, (ids, mask, positions), FlaxGPT2Block)


def vit_problem(size: dict[str, Any], key: jax.Array) -> Problem:
  """ViT with a classification head; cross-entropy on random images and labels."""
  import transformers as T
  from transformers.models.vit.modeling_flax_vit import FlaxViTLayer
  config = T.ViTConfig(image_size=size['image'], patch_size=size['patch'], num_channels=3,
                       hidden_size=size['vit_width'], num_hidden_layers=size['layers'],
                       num_attention_heads=size['vit_heads'],
                       intermediate_size=4 * size['vit_width'], num_labels=size['classes'])
  hf = T.FlaxViTForImageClassification(config, seed=0, _do_init=False)
  variables = {'params': init_params(hf, (1, size['image'], size['image'], 3))}
  module = hf.module
  kx, ky = jax.random.split(key)
  pixels = jax.random.normal(kx, (size['batch'], size['image'], size['image'], 3))
  labels = jax.random.randint(ky, (size['batch'],), 0, size['classes'])

  def loss_fn(variables, pixels, labels):
    logits = module.apply(variables, pixels, deterministic=True).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return Problem(module, variables, loss_fn, (pixels, labels), FlaxViTLayer)


def standard_step(loss_fn: Callable[..., jax.Array],
                  optimizer: optax.GradientTransformation) -> Callable[..., Any]:
  """``(StandardState, *batch) -> (StandardState, metrics)``: grad, then one optimizer step."""
  def step(state, *batch):
    loss, grads = jax.value_and_grad(lambda p: loss_fn({'params': p}, *batch))(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return StandardState(optax.apply_updates(state.params, updates), opt_state), {'loss': loss}
  return step


def mismatch(actual: Any, expected: Any, tolerance: dict[str, float]) -> str | None:
  """``None`` if two trees agree within ``tolerance``, else the first leaf that does not."""
  flat = lambda tree: {jax.tree_util.keystr(p): np.asarray(v)
                       for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
  a, e = flat(actual), flat(expected)
  if set(a) != set(e):
    return f'different leaves: {sorted(set(a) ^ set(e))[:4]}'
  for path in sorted(e):
    bad = ~np.isclose(a[path], e[path], **tolerance)
    if bad.any():
      worst = float(np.max(np.abs(a[path] - e[path])))
      return (f'{path}: {int(bad.sum())} of {bad.size} entries differ, most by {worst:.3g} '
              f'(largest |expected| {float(np.max(np.abs(e[path]))):.3g})')
  return None


def measure_model(problem: Problem, repeats: int) -> dict[str, Any]:
  """Compiles, checks and times the five variants (and 'original', checked only) on one model."""
  params, batch, loss_fn = problem.variables['params'], problem.batch, problem.loss_fn
  optimizer = optax.adam(LEARNING_RATE)
  blocks = perturbkit.filters.by_type(problem.block)
  txs = {'interleaved': perturbkit.interleaved(loss_fn, optimizer),
         'original': perturbkit.interleaved(loss_fn, optimizer, propagate='original'),
         'blocks': perturbkit.interleaved(loss_fn, optimizer, segments=blocks)}
  listings = {v: tx.segments(problem.variables, *batch) for v, tx in txs.items()}

  fns = {'plain': lambda p, *b: jax.value_and_grad(lambda q: loss_fn({'params': q}, *b))(p),
         'perturbkit': perturbkit.value_and_grad(loss_fn)}
  args = {'plain': (params,) + batch, 'perturbkit': (problem.variables,) + batch}
  compiled = {v: common.compile_timed(fns[v], *args[v]) for v in GRAD_VARIANTS}

  steps = {'standard': standard_step(loss_fn, optimizer),
           **{v: tx.step for v, tx in txs.items()}}
  states = {'standard': StandardState(params, optimizer.init(params)),
            **{v: tx.init(problem.variables, *batch) for v, tx in txs.items()}}
  for v in steps:
    compiled[v], _ = compile_donated(steps[v], states[v], *batch)

  # Agreement before timing.
  outputs = {v: compiled[v].call(*args[v]) for v in GRAD_VARIANTS}
  (loss_plain, grads_plain), (loss_pk, grads_pk) = outputs['plain'], outputs['perturbkit']
  mismatches = {
      'loss_perturbkit_vs_plain': mismatch(loss_pk, loss_plain, GRAD_TOLERANCE),
      'params_grad_perturbkit_vs_plain': mismatch(grads_pk['params'], grads_plain,
                                                  GRAD_TOLERANCE),
      'original_step_vs_standard': original_step_mismatch(problem),
  }

  thunks = {v: (lambda v=v: compiled[v].call(*args[v])) for v in GRAD_VARIANTS}
  thunks.update({v: stepper(compiled[v].call, copy_tree(states[v]), *batch)
                 for v in STEP_VARIANTS})
  samples = common.time_round_robin(thunks, repeats)

  segments = {'plain': 0, 'perturbkit': 0, 'standard': 0,
              **{v: len(listing.segments) for v, listing in listings.items()}}
  variants = {}
  for v in compiled:
    variants[v] = {'segments': segments[v], 'lower_s': compiled[v].lower_s,
                   'compile_s': compiled[v].compile_s,
                   'total_compile_s': compiled[v].lower_s + compiled[v].compile_s,
                   **sum_bytes(compiled[v].memory)}
    if v in samples:
      variants[v].update(common.summarize(samples[v]), samples_s=samples[v])
  return {
      'num_params': sum(x.size for x in jax.tree.leaves(params)),
      'num_points': len(jax.tree.leaves(grads_pk['perturbations'])),
      'segments': {v: list(listing.segments) for v, listing in listings.items()},
      'rest': listings['interleaved'].rest,
      'checks': {k: m is None for k, m in mismatches.items()},
      'mismatches': {k: m for k, m in mismatches.items() if m is not None},
      'ok': all(m is None for m in mismatches.values()),
      'variants': variants,
      'compile_vs_segments': sorted(
          ({'variant': v, 'segments': segments[v],
            'total_compile_s': variants[v]['total_compile_s']}
           for v in STEP_VARIANTS), key=lambda row: row['segments']),
      **ratios_and_targets(variants),
  }


def original_step_mismatch(problem: Problem) -> str | None:
  """``interleaved(propagate='original')`` against the standard step: one SGD step each."""
  params, batch = problem.variables['params'], problem.batch
  sgd = CHECK_OPTIMIZER(CHECK_LEARNING_RATE)
  tx = perturbkit.interleaved(problem.loss_fn, sgd, propagate='original')
  standard = jax.jit(standard_step(problem.loss_fn, sgd))(StandardState(params, sgd.init(params)),
                                                          *batch)[0]
  original = jax.jit(tx.step)(tx.init(problem.variables, *batch), *batch)[0]
  return mismatch(original.params, standard.params, STEP_TOLERANCE)


def sum_bytes(memory: dict[str, int]) -> dict[str, int]:
  """``memory`` plus ``sum_bytes``: argument + output + temp, the most one call holds at once."""
  if not memory:
    return {}
  return {**memory, 'sum_bytes': sum(memory.get(k, 0)
                                     for k in ('argument_bytes', 'output_bytes', 'temp_bytes'))}


def ratios_and_targets(variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
  """Time, memory and compile-time ratios, and whether each target is met."""
  t = lambda v: variants[v]['median_s']
  mem = lambda v, field: variants[v].get(field, -1)
  ratios = {
      'perturbkit_over_plain': t('perturbkit') / t('plain'),
      'interleaved_over_standard': t('interleaved') / t('standard'),
      'original_over_standard': t('original') / t('standard'),
      'blocks_over_standard': t('blocks') / t('standard'),
      'interleaved_sum_bytes_over_standard':
          mem('interleaved', 'sum_bytes') / mem('standard', 'sum_bytes'),
      'original_sum_bytes_over_standard':
          mem('original', 'sum_bytes') / mem('standard', 'sum_bytes'),
      'blocks_sum_bytes_over_standard': mem('blocks', 'sum_bytes') / mem('standard', 'sum_bytes'),
      'interleaved_compile_over_standard':
          variants['interleaved']['total_compile_s'] / variants['standard']['total_compile_s'],
      'blocks_compile_over_standard':
          variants['blocks']['total_compile_s'] / variants['standard']['total_compile_s'],
  }
  targets = {f'time_{name}_le_{limit}': ratios[name] <= limit for name, limit in TARGETS.items()}
  targets['argument_bytes_perturbkit_eq_plain'] = (
      mem('perturbkit', 'argument_bytes') == mem('plain', 'argument_bytes'))
  targets['sum_bytes_interleaved_le_standard'] = ratios['interleaved_sum_bytes_over_standard'] <= 1
  return {'ratios': ratios, 'targets_met': targets}


def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
  """One printed row per model and variant; ratios against plain (gradients) or standard."""
  rows = []
  for name, r in results.items():
    for v in VARIANTS:
      m = r['variants'][v]
      base = r['variants']['plain' if v in GRAD_VARIANTS else 'standard']
      rows.append({
          'model': name, 'variant': v, 'segs': m['segments'],
          'median ms': f'{m["median_s"] * 1e3:.2f}',
          'p25-p75 ms': f'{m["p25_s"] * 1e3:.2f}-{m["p75_s"] * 1e3:.2f}',
          'x base': f'{m["median_s"] / base["median_s"]:.3f}',
          'compile s': f'{m["total_compile_s"]:.2f}',
          'arg MB': f'{m.get("argument_bytes", -1) / 2**20:.2f}',
          'temp MB': f'{m.get("temp_bytes", -1) / 2**20:.2f}',
          'arg+out+temp MB': f'{m.get("sum_bytes", -1) / 2**20:.2f}',
          'x mem': f'{m.get("sum_bytes", -1) / base.get("sum_bytes", 1):.3f}',
      })
  return rows


COLUMNS = ('model', 'variant', 'segs', 'median ms', 'p25-p75 ms', 'x base', 'compile s',
           'arg MB', 'temp MB', 'arg+out+temp MB', 'x mem')

NOTE = f"""\
x base, x mem: plain and perturbkit against plain; standard, interleaved and blocks against
standard. compile s: lowering plus XLA compilation. Checks: perturbkit's loss and param
gradients equal plain's (rtol={GRAD_TOLERANCE['rtol']}, atol={GRAD_TOLERANCE['atol']}), and
interleaved(propagate='original') gives the standard step's new params (one
{CHECK_OPTIMIZER.__name__}({CHECK_LEARNING_RATE}) step; rtol={STEP_TOLERANCE['rtol']}, atol={STEP_TOLERANCE['atol']})."""


def report(results: dict[str, Any]) -> None:
  """Prints the table, compile time against segments, checks and targets."""
  print(common.format_table(table_rows(results), COLUMNS))
  print()
  for name, r in results.items():
    status, met = common.check_lines(r)
    compile_s = ', '.join(f'{row["segments"]} segs {row["total_compile_s"]:.1f} s ({row["variant"]})'
                          for row in r['compile_vs_segments'])
    print(f'{name}: checks {status} ({r["num_points"]} points, {r["num_params"]:,} params, '
          f'REST: {sorted(r["rest"])})')
    print(f'  compile time: {compile_s}')
    print(f'  targets: {met}')
  print()
  print(NOTE)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  for flag, value in DEFAULTS.items():
    parser.add_argument(f'--{flag.replace("_", "-")}', type=int, default=value,
                        help=FLAG_HELP[flag])
  parser.add_argument('--models', nargs='+', choices=MODELS, default=list(MODELS),
                      help='models to run')
  parser.add_argument('--quick', action='store_true',
                      help=f'tiny sizes for a smoke test: {QUICK}, overriding the size flags')
  parser.add_argument('--size', choices=sorted(SIZES), default=None,
                      help='a published model size, overriding the size flags (not --repeats): '
                      f'{SIZES}')
  parser.add_argument('--out', default=None,
                      help='where to write the JSON results; nothing is written without it '
                      f'(the README quotes {os.path.relpath(DEFAULT_OUT)})')
  args = parser.parse_args(argv)
  if args.quick:
    vars(args).update(QUICK)
  elif args.size:
    vars(args).update(SIZES[args.size])
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  quiet_transformers()
  # Small states (the step counter) cannot always be reused in place; that is expected.
  warnings.filterwarnings('ignore', message='Some donated buffers were not usable')
  size = {k: getattr(args, k) for k in DEFAULTS if k != 'repeats'}
  builders = {'gpt2': gpt2_problem, 'vit': vit_problem}
  key = jax.random.key(0)
  results = {}
  for i, name in enumerate(args.models):
    print(f'[{name}] building, compiling, checking and timing ...', flush=True)
    problem = builders[name](size, jax.random.fold_in(key, i))
    results[name] = measure_model(problem, args.repeats)
  report(results)
  all_ok = all(r['ok'] for r in results.values())
  print(f'\nchecks: {"OK" if all_ok else "MISMATCH"}')
  common.write_results(
      args.out, 'real_models',
      {'quick': args.quick, 'size': size, 'repeats': args.repeats,
       'optimizer': f'adam({LEARNING_RATE})', 'variants': list(VARIANTS),
       'check_optimizer': f'{CHECK_OPTIMIZER.__name__}({CHECK_LEARNING_RATE})',
       'grad_tolerance': GRAD_TOLERANCE, 'step_tolerance': STEP_TOLERANCE, 'targets': TARGETS},
      results, all_ok)
  return 0 if all_ok else 1


if __name__ == '__main__':
  sys.exit(main())
