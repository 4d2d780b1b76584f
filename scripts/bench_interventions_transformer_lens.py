"""The patching sweep of bench_interventions.py in PyTorch with TransformerLens, for comparison.

Not run by the tests: it needs ``torch`` and ``transformer-lens``, which perturbkit does not
depend on (``pip install torch "transformer-lens<4"``: 4.0 removed ``HookedTransformer``). The model is the GPT-2 configuration of
``bench_interventions.py`` (same sizes: layers, width, heads, sequence, batch, vocabulary) as a
``HookedTransformer`` with random weights; the metric is the same (the mean over the batch of
the logit difference of tokens 0 and 1 at the last position), the inputs differ in one token
at a quarter of the sequence. Variants, timed round-robin after a warm-up:

  forward       one forward pass on the corrupted inputs (``torch.no_grad``).
  loop          activation patching as TransformerLens users write it: the clean run's cache,
                then one ``run_with_hooks`` per (block, position), the hook putting the clean
                ``blocks.{i}.hook_resid_post`` at that position into the corrupted run.
  library       ``transformer_lens.patching.get_act_patch_resid_pre``: the library's own sweep
                (resid_pre of each block, so its numbers are the loop's shifted by one block).
  attribution   attribution patching: the clean cache, one forward and backward on the
                corrupted inputs with backward hooks on every ``hook_resid_post``, and
                ``(a_clean - a_corrupted) . grad`` per block and position.

Checks, before timing: ``library``'s effects at blocks 1.. equal ``loop``'s at blocks ..-1 (a
block's resid_post is the next block's resid_pre), and patching the last block at the last
position recovers the clean metric. The ratios to ``forward`` are the figures to set beside
bench_interventions.py's (each framework against its own forward pass, since the two run in
different processes and this machine's load changes between them).

  python scripts/bench_interventions_transformer_lens.py \\
      --out scripts/results/bench_interventions_transformer_lens.json
"""
import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np

SIZES = {
    'tiny': dict(layers=2, width=32, heads=2, seq=8, batch=2, vocab=64),
    'default': dict(layers=4, width=64, heads=4, seq=32, batch=4, vocab=128),
}
VARIANTS = ('forward', 'loop', 'library', 'attribution')


def build(size: dict, seed: int = 0):
  """The HookedTransformer, the metric and the two inputs."""
  import torch
  from transformer_lens import HookedTransformer, HookedTransformerConfig
  torch.manual_seed(seed)
  config = HookedTransformerConfig(
      n_layers=size['layers'], d_model=size['width'], n_heads=size['heads'],
      d_head=size['width'] // size['heads'], d_mlp=4 * size['width'], n_ctx=size['seq'],
      d_vocab=size['vocab'], act_fn='gelu_new', normalization_type='LN', seed=seed)
  model = HookedTransformer(config).eval()
  generator = torch.Generator().manual_seed(seed)
  clean = torch.randint(0, size['vocab'], (size['batch'], size['seq']), generator=generator)
  corrupted = clean.clone()
  at = size['seq'] // 4
  corrupted[:, at] = (clean[:, at] + 1) % size['vocab']

  def metric(logits):
    return (logits[:, -1, 0] - logits[:, -1, 1]).mean()

  return model, metric, clean, corrupted


def loop_patching(model, metric, clean, corrupted):
  """``(blocks, positions)`` effects of patching each block's resid_post at each position."""
  import torch
  with torch.no_grad():
    _, cache = model.run_with_cache(clean, names_filter=lambda n: n.endswith('hook_resid_post'))
    base = metric(model(corrupted))
    layers, seq = model.cfg.n_layers, clean.shape[1]
    effects = torch.zeros(layers, seq)
    for layer in range(layers):
      name = f'blocks.{layer}.hook_resid_post'
      for position in range(seq):
        def put(act, hook, position=position, name=name):
          act[:, position] = cache[name][:, position]
          return act
        effects[layer, position] = metric(model.run_with_hooks(
            corrupted, fwd_hooks=[(name, put)])) - base
  return effects


def library_patching(model, metric, clean, corrupted):
  from transformer_lens import patching
  _, cache = model.run_with_cache(clean)
  base = metric(model(corrupted)).item()
  return patching.get_act_patch_resid_pre(model, corrupted, cache,
                                          lambda logits: metric(logits) - base)


def attribution_patching(model, metric, clean, corrupted):
  """``(blocks, positions)``: ``(a_clean - a_corrupted) . d metric / d a`` at each resid_post."""
  import torch
  names = lambda n: n.endswith('hook_resid_post')
  with torch.no_grad():
    _, clean_cache = model.run_with_cache(clean, names_filter=names)
  corrupted_acts, grads = {}, {}

  def keep(act, hook):
    corrupted_acts[hook.name] = act.detach()

  def keep_grad(grad, hook):
    grads[hook.name] = grad.detach()

  model.reset_hooks()
  model.add_hook(names, keep, 'fwd')
  model.add_hook(names, keep_grad, 'bwd')
  metric(model(corrupted)).backward()
  model.reset_hooks()
  model.zero_grad(set_to_none=True)
  rows = [((clean_cache[f'blocks.{i}.hook_resid_post'] - corrupted_acts[f'blocks.{i}.hook_resid_post'])
           * grads[f'blocks.{i}.hook_resid_post']).sum(dim=(0, 2))
          for i in range(model.cfg.n_layers)]
  return torch.stack(rows)


def forward(model, metric, clean, corrupted):
  import torch
  del clean
  with torch.no_grad():
    return metric(model(corrupted))


FUNCTIONS = {'forward': forward, 'loop': loop_patching, 'library': library_patching,
             'attribution': attribution_patching}


def checks(model, metric, clean, corrupted) -> dict[str, bool]:
  import torch
  loop = loop_patching(model, metric, clean, corrupted)
  library = library_patching(model, metric, clean, corrupted)
  with torch.no_grad():
    recovered = metric(model(clean)) - metric(model(corrupted))
  return {
      'library_equals_loop_one_block_on': bool(torch.allclose(library[1:], loop[:-1],
                                                              rtol=1e-4, atol=1e-5)),
      'last_block_last_position_recovers_clean': bool(torch.allclose(
          loop[-1, -1], recovered, rtol=1e-4, atol=1e-5)),
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument('--sizes', choices=sorted(SIZES), default='default')
  parser.add_argument('--repeats', type=int, default=9, help='timed samples per variant')
  parser.add_argument('--out', default=None, help='where to write the JSON results')
  args = parser.parse_args(argv)
  import importlib.metadata
  import torch
  from transformer_lens import patching
  patching.tqdm = lambda iterable, *a, **k: iterable  # no bar per timed sample
  size = SIZES[args.sizes]
  model, metric, clean, corrupted = build(size)
  found = checks(model, metric, clean, corrupted)
  samples = {v: [] for v in VARIANTS}
  for v in VARIANTS:  # warm-up
    FUNCTIONS[v](model, metric, clean, corrupted)
  for _ in range(args.repeats):
    for v in VARIANTS:
      start = time.perf_counter()
      FUNCTIONS[v](model, metric, clean, corrupted)
      samples[v].append(time.perf_counter() - start)
  median = {v: statistics.median(s) for v, s in samples.items()}
  ratios = {f'{v}_over_forward': median[v] / median['forward'] for v in VARIANTS[1:]}
  for v in VARIANTS:
    q = np.percentile(samples[v], [25, 75])
    print(f'{v:12s} {median[v] * 1e3:9.2f} ms  (p25 {q[0] * 1e3:.2f}, p75 {q[1] * 1e3:.2f})'
          + (f'  {ratios[f"{v}_over_forward"]:7.1f}x forward' if v != 'forward' else ''))
  print('checks: ' + ', '.join(f'{k}={"OK" if ok else "MISMATCH"}' for k, ok in found.items()))
  if args.out:
    with open(args.out, 'w') as f:
      json.dump({'benchmark': 'interventions_transformer_lens',
                 'config': {'sizes': args.sizes, 'repeats': args.repeats, 'size': size,
                            'patched_runs': size['layers'] * size['seq']},
                 'machine': {'python': sys.version.split()[0], 'platform': platform.platform(),
                             'torch': torch.__version__,
                             'transformer_lens': importlib.metadata.version('transformer-lens'),
                             'threads': torch.get_num_threads()},
                 'checks': found, 'all_ok': all(found.values()),
                 'median_s': median, 'samples_s': samples, 'ratios': ratios}, f, indent=1)
    print(f'wrote {args.out}')
  return 0 if all(found.values()) else 1


if __name__ == '__main__':
  sys.exit(main())
