"""Activation and attribution patching of a scanned transformer, against its layers unrolled.

Large Linen models run their layers as ``nn.scan`` over ``nn.remat`` (one compiled layer,
stacked params). perturbkit addresses each iteration of a scanned call as its own call
(``'layers/attn/__call__[2]'``). This script builds one pre-LayerNorm causal transformer
both ways, on the same params (the scanned one's stacked params sliced per layer), and
times, round-robin in one run, each call waited for before the next:

  sweep_scan / sweep_unrolled
      ``perturbkit.activation_patching(metric, filter=<every layer's output>, axis=1)``
      (batches of 8): the unrolled sweep runs the layers before a patched one once; the
      scanned one runs the whole scan per patched run.
  attribution_scan / attribution_unrolled
      ``perturbkit.attribution_patching(metric, axis=1)`` of every call at every position.
  forward_scan / forward_unrolled
      one jitted forward pass of the metric on the corrupted input.

Before timing, every effect of the scanned model is checked against the unrolled model's
row for the same layer and call. Run:

  python scripts/bench_interventions_scan.py --out scripts/results/bench_interventions_scan.json
  python scripts/bench_interventions_scan.py --sizes tiny --repeats 2     # a smoke test
"""
import os
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as common  # pylint: disable=wrong-import-position
import perturbkit  # pylint: disable=wrong-import-position

DEFAULT_OUT = 'scripts/results/bench_interventions_scan.json'
TOLERANCE = dict(rtol=1e-4, atol=1e-5)
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    'default': {'transformer': dict(layers=4, width=64, heads=4, seq=32, batch=4, vocab=128)},
    'tiny': {'transformer': dict(layers=2, width=16, heads=2, seq=8, batch=2, vocab=32)},
}
VARIANTS = ('sweep_scan', 'sweep_unrolled', 'attribution_scan', 'attribution_unrolled',
            'forward_scan', 'forward_unrolled')


class Layer(nn.Module):
  width: int
  heads: int

  @nn.compact
  def __call__(self, x, _):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    h = nn.MultiHeadDotProductAttention(self.heads, deterministic=True, name='attn')(
        nn.LayerNorm(name='ln_1')(x), mask=mask)
    x = x + h
    h = nn.Dense(4 * self.width, name='up')(nn.LayerNorm(name='ln_2')(x))
    return x + nn.Dense(self.width, name='down')(nn.gelu(h)), None


class Transformer(nn.Module):
  size: dict
  scan: bool

  @nn.compact
  def __call__(self, tokens):
    s = self.size
    x = nn.Embed(s['vocab'], s['width'], name='embed')(tokens)
    if self.scan:
      layers = nn.scan(nn.remat(Layer), variable_axes={'params': 0, 'perturbations': 0},
                       split_rngs={'params': True}, length=s['layers'])
      x, _ = layers(s['width'], s['heads'], name='layers')(x, None)
    else:
      for i in range(s['layers']):
        x, _ = Layer(s['width'], s['heads'], name=f'layers_{i}')(x, None)
    return nn.Dense(s['vocab'], name='head')(nn.LayerNorm(name='ln_f')(x))


def unrolled_params(params: dict, layers: int) -> dict:
  out = {k: v for k, v in params.items() if k != 'layers'}
  for i in range(layers):
    out[f'layers_{i}'] = jax.tree.map(lambda a, i=i: a[i], params['layers'])
  return out


def unrolled_row(path: str) -> str:
  """``'layers/attn/__call__[2]'`` as the unrolled model's ``'layers_2/attn/__call__'``."""
  if not path.endswith(']'):
    return path
  call, index = path[:-1].split('[')
  return call.replace('layers/', f'layers_{index}/', 1)


def measure_model(size: dict, repeats: int, key: jax.Array) -> dict:
  scanned, unrolled = Transformer(size, scan=True), Transformer(size, scan=False)
  k_tokens, k_init = jax.random.split(key)
  clean = jax.random.randint(k_tokens, (size['batch'], size['seq']), 0, size['vocab'])
  position = size['seq'] // 4
  corrupted = clean.at[:, position].set((clean[:, position] + 1) % size['vocab'])
  v_scan = scanned.init(k_init, clean)
  v_unrolled = {'params': unrolled_params(v_scan['params'], size['layers'])}

  def metric_of(model):
    def metric(variables, tokens):
      logits = model.apply(variables, tokens)
      return jnp.mean(logits[:, -1, 1] - logits[:, -1, 2])
    return metric

  m_scan, m_unrolled = metric_of(scanned), metric_of(unrolled)
  layer_outputs = perturbkit.filters.by_path('layers', *(f'layers_{i}'
                                                         for i in range(size['layers'])))
  fns = {
      'sweep_scan': (perturbkit.activation_patching(m_scan, filter=layer_outputs, axis=1),
                     (v_scan, clean, corrupted)),
      'sweep_unrolled': (perturbkit.activation_patching(m_unrolled, filter=layer_outputs,
                                                        axis=1),
                         (v_unrolled, clean, corrupted)),
      'attribution_scan': (perturbkit.attribution_patching(m_scan, axis=1),
                           (v_scan, clean, corrupted)),
      'attribution_unrolled': (perturbkit.attribution_patching(m_unrolled, axis=1),
                               (v_unrolled, clean, corrupted)),
      'forward_scan': (m_scan, (v_scan, corrupted)),
      'forward_unrolled': (m_unrolled, (v_unrolled, corrupted)),
  }
  compiled = {name: common.compile_timed(fn, *args) for name, (fn, args) in fns.items()}
  outputs = {name: compiled[name].call(*args) for name, (_, args) in fns.items()}

  checks, mismatches = {}, {}
  for kind in ('sweep', 'attribution'):
    got, want = outputs[f'{kind}_scan'], outputs[f'{kind}_unrolled']
    rows = np.array([want.paths.index(unrolled_row(p)) for p in got.paths])
    difference = float(np.max(np.abs(np.asarray(got.effects)
                                      - np.asarray(want.effects)[rows])))
    checks[f'{kind}_scan_vs_unrolled'] = bool(np.allclose(
        got.effects, np.asarray(want.effects)[rows], **TOLERANCE))
    if not checks[f'{kind}_scan_vs_unrolled']:
      mismatches[kind] = difference
  checks['forward_scan_vs_unrolled'] = bool(np.allclose(
      outputs['forward_scan'], outputs['forward_unrolled'], **TOLERANCE))

  samples = common.time_round_robin(
      {name: (lambda c=compiled[name], a=args: c.call(*a)) for name, (_, args) in fns.items()},
      repeats, wait_each=True)
  variants = {}
  for name in VARIANTS:
    variants[name] = {**common.summarize(samples[name]), 'samples_s': samples[name],
                      'lower_s': compiled[name].lower_s, 'compile_s': compiled[name].compile_s,
                      **compiled[name].memory}
  median = {name: variants[name]['median_s'] for name in VARIANTS}
  ratios = {
      'sweep_scan_over_unrolled': median['sweep_scan'] / median['sweep_unrolled'],
      'attribution_scan_over_unrolled':
          median['attribution_scan'] / median['attribution_unrolled'],
      'attribution_scan_over_forward': median['attribution_scan'] / median['forward_scan'],
      'attribution_unrolled_over_forward':
          median['attribution_unrolled'] / median['forward_unrolled'],
      'forward_scan_over_unrolled': median['forward_scan'] / median['forward_unrolled'],
  }
  return {'size': size, 'ok': all(checks.values()), 'checks': checks,
          'mismatches': mismatches, 'rows': len(outputs['attribution_scan'].paths),
          'variants': variants, 'ratios': ratios,
          'targets_met': {'effects_equal_unrolled': all(checks.values())}}


def report(results: dict) -> None:
  for name, r in results.items():
    rows = [{'variant': v, 'median ms': f'{m["median_s"] * 1e3:.2f}',
             'temp MB': f'{m.get("temp_bytes", 0) / 1e6:.2f}',
             'compile s': f'{m["lower_s"] + m["compile_s"]:.1f}'}
            for v, m in r['variants'].items()]
    print(f'\n{name} ({r["rows"]} calls attributed)')
    print(common.format_table(rows, ['variant', 'median ms', 'temp MB', 'compile s']))
    status, met = common.check_lines(r)
    print(f'{name}: {status}')
    print('  ratios: ' + ', '.join(f'{k}={v:.2f}' for k, v in r['ratios'].items()))
    print(f'  targets: {met}')


def main(argv: list[str] | None = None) -> int:
  args = common.parse_args(__doc__.split('\n')[0], SIZES, DEFAULT_OUT, 15, argv)
  results = common.measure_each(args.models, lambda name, key: measure_model(
      SIZES[args.sizes][name], args.repeats, key))
  report(results)
  config = {
      'sizes': args.sizes, 'repeats': args.repeats, 'tolerance': TOLERANCE,
      'variants': list(VARIANTS)}
  return common.write_checked(args.out, 'interventions_scan', config, results)


if __name__ == '__main__':
  sys.exit(main())
