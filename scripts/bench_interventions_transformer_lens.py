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
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_torch  # noqa: E402

def build(size: dict, seed: int = 0):
  """The HookedTransformer, the metric and the two inputs."""
  import torch
  from transformer_lens import HookedTransformer, HookedTransformerConfig, patching
  patching.tqdm = lambda iterable, *a, **k: iterable  # no bar per timed sample
  torch.manual_seed(seed)
  config = HookedTransformerConfig(
      n_layers=size['layers'], d_model=size['width'], n_heads=size['heads'],
      d_head=size['width'] // size['heads'], d_mlp=4 * size['width'], n_ctx=size['seq'],
      d_vocab=size['vocab'], act_fn='gelu_new', normalization_type='LN', seed=seed)
  model = HookedTransformer(config).eval()
  clean, corrupted = _bench_torch.inputs(size, seed)
  return model, _bench_torch.metric, clean, corrupted


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
  return _bench_torch.main(__doc__, 'interventions_transformer_lens', FUNCTIONS, build,
                           checks, ('transformer-lens',), argv)


if __name__ == '__main__':
  sys.exit(main())
