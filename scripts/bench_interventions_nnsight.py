"""The patching sweep of bench_interventions.py in PyTorch with nnsight, for comparison.

Not run by the tests: it needs ``torch``, ``transformers<5`` and ``nnsight``, which perturbkit
does not depend on (``pip install torch nnsight "transformers<5"``). The model is the GPT-2
configuration of ``bench_interventions.py`` (same layers, width, heads, sequence, batch and
vocabulary) as Hugging Face's PyTorch ``GPT2LMHeadModel`` with random weights, wrapped in
``nnsight.NNsight``; the metric is the same (the mean over the batch of the logit difference of
tokens 0 and 1 at the last position), the inputs differ in one token at a quarter of the
sequence. Variants, timed round-robin after a warm-up:

  forward       one forward pass of the PyTorch model on the corrupted inputs
                (``torch.no_grad``, no nnsight).
  loop          activation patching as nnsight users write it: one trace of the clean run
                saving every block's hidden state, then one trace per (block, position)
                putting the clean value at that position into the corrupted run.
  attribution   attribution patching: the clean trace, then one trace of the corrupted run
                saving the block outputs and, inside ``metric.backward()``, their gradients;
                ``(a_clean - a_corrupted) . grad`` per block and position.

Checks, before timing, against plain PyTorch forward hooks (no nnsight): one patched entry
per block equals the model run with a hook writing the clean value in; attribution equals
``torch.autograd.grad`` of the metric with respect to the corrupted block outputs; and
patching the last block at the last position recovers the clean metric. The ratios to
``forward`` are the figures to set beside bench_interventions.py's (each framework against
its own forward pass, since the two run in different processes).

  python scripts/bench_interventions_nnsight.py \\
      --out scripts/results/bench_interventions_nnsight.json
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_torch  # noqa: E402

def build(size: dict, seed: int = 0):
  """The PyTorch GPT-2, it wrapped by nnsight, the metric and the two inputs."""
  import torch
  from nnsight import NNsight
  from transformers import GPT2Config, GPT2LMHeadModel
  torch.manual_seed(seed)
  config = GPT2Config(vocab_size=size['vocab'], n_positions=size['seq'], n_embd=size['width'],
                      n_layer=size['layers'], n_head=size['heads'])
  model = GPT2LMHeadModel(config).eval()
  clean, corrupted = _bench_torch.inputs(size, seed)
  return model, NNsight(model), _bench_torch.metric, clean, corrupted


def block_outputs(traced, inputs, layers: int) -> list:
  """Every block's hidden state on ``inputs``, from one nnsight trace."""
  import nnsight
  import torch
  with torch.no_grad(), traced.trace(inputs):
    hidden = nnsight.save([])
    for i in range(layers):
      hidden.append(traced.transformer.h[i].output[0])
  return hidden


def loop_patching(model, traced, metric, clean, corrupted):
  """``(blocks, positions)`` effects of patching each block's output at each position."""
  import torch
  layers, seq = model.config.n_layer, clean.shape[1]
  hidden = block_outputs(traced, clean, layers)
  with torch.no_grad():
    base = metric(model(corrupted).logits)
  effects = torch.zeros(layers, seq)
  for layer in range(layers):
    for position in range(seq):
      with torch.no_grad(), traced.trace(corrupted):
        traced.transformer.h[layer].output[0][:, position] = hidden[layer][:, position]
        logits = traced.lm_head.output.save()
      effects[layer, position] = metric(logits) - base
  return effects


def attribution_patching(model, traced, metric, clean, corrupted):
  """``(blocks, positions)``: ``(a_clean - a_corrupted) . d metric / d a`` at each block output."""
  import nnsight
  import torch
  layers = model.config.n_layer
  hidden = block_outputs(traced, clean, layers)
  with traced.trace(corrupted):
    acts, grads, live = nnsight.save([]), nnsight.save([]), []
    for i in range(layers):
      h = traced.transformer.h[i].output[0]
      live.append(h)
      acts.append(h)
    value = metric(traced.lm_head.output)
    with value.backward():
      for i in reversed(range(layers)):  # gradients arrive from the last block down
        grads.append(live[i].grad)
  model.zero_grad(set_to_none=True)
  grads = grads[::-1]
  return torch.stack([((hidden[i] - acts[i]) * grads[i]).sum(dim=(0, 2)).detach()
                      for i in range(layers)])


def forward(model, traced, metric, clean, corrupted):
  import torch
  del traced, clean
  with torch.no_grad():
    return metric(model(corrupted).logits)


FUNCTIONS = {'forward': forward, 'loop': loop_patching, 'attribution': attribution_patching}


def with_hooks(model, edit, inputs):
  """The model on ``inputs`` with ``edit(i, hidden)`` applied to block ``i``'s hidden state."""
  handles = [block.register_forward_hook(
      lambda module, args, out, i=i: (edit(i, out[0]),) + tuple(out[1:]))
      for i, block in enumerate(model.transformer.h)]
  try:
    return model(inputs).logits
  finally:
    for handle in handles:
      handle.remove()


def checks(model, traced, metric, clean, corrupted) -> dict[str, bool]:
  """The loop and attribution against plain PyTorch forward hooks."""
  import torch
  layers, seq = model.config.n_layer, clean.shape[1]
  loop = loop_patching(model, traced, metric, clean, corrupted)
  attribution = attribution_patching(model, traced, metric, clean, corrupted)
  recorded = {}
  with torch.no_grad():
    with_hooks(model, lambda i, h: recorded.setdefault(('clean', i), h), clean)
    base = metric(model(corrupted).logits)
    recovered = metric(model(clean).logits) - base
    by_hand = []
    for i in range(layers):
      position = (seq // 4 + i) % seq

      def put(j, h, i=i, position=position):
        if j != i:
          return h
        h = h.clone()
        h[:, position] = recorded[('clean', i)][:, position]
        return h
      by_hand.append(metric(with_hooks(model, put, corrupted)) - base)
  got = torch.stack([loop[i, (seq // 4 + i) % seq] for i in range(layers)])
  outputs = {}
  logits = with_hooks(model, lambda i, h: outputs.setdefault(i, h), corrupted)
  grads = torch.autograd.grad(metric(logits), [outputs[i] for i in range(layers)])
  want = torch.stack([((recorded[('clean', i)] - outputs[i]) * grads[i]).sum(dim=(0, 2))
                      for i in range(layers)]).detach()
  model.zero_grad(set_to_none=True)
  return {
      'loop_equals_forward_hooks': bool(torch.allclose(got, torch.stack(by_hand),
                                                       rtol=1e-4, atol=1e-5)),
      'attribution_equals_autograd': bool(torch.allclose(attribution, want, rtol=1e-4,
                                                         atol=1e-6)),
      'last_block_last_position_recovers_clean': bool(torch.allclose(
          loop[-1, -1], recovered, rtol=1e-4, atol=1e-5)),
      'corruption_has_an_effect': bool(loop.abs().max() > 1e-6),
  }


def main(argv=None) -> int:
  return _bench_torch.main(__doc__, 'interventions_nnsight', FUNCTIONS, build, checks,
                           ('nnsight', 'transformers'), argv)


if __name__ == '__main__':
  sys.exit(main())
