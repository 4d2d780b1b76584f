"""Smoke test of scripts/bench_activation_grads.py: it runs, writes the JSON, and agrees.

Timings are noise at these sizes; only the structure and the correctness checks
(the three variants give the same loss, params and activation gradients) are tested.
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'scripts', 'bench_activation_grads.py')
VARIANTS = ('plain', 'flax_perturb', 'perturbkit')
VARIANT_KEYS = {'median_s', 'p25_s', 'p75_s', 'lower_s', 'compile_s', 'argument_bytes',
                'output_bytes', 'temp_bytes', 'samples_s'}
CHECKS = {'loss', 'params_flax_perturb_vs_plain', 'params_perturbkit_vs_plain',
          'activations_perturbkit_vs_flax_perturb'}


def _run_small(out: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, SCRIPT, '--sizes', 'small', '--repeats', '2', '--out', out],
      cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_small_run_writes_results_and_variants_agree(tmp_path):
  out = str(tmp_path / 'results' / 'bench.json')
  proc = _run_small(out)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  with open(out, encoding='utf-8') as f:
    results = json.load(f)
  assert results['all_ok'] is True
  assert results['config']['sizes'] == 'small'
  assert set(results['models']) == {'mlp', 'cnn', 'transformer'}
  for name, model in results['models'].items():
    assert model['ok'] is True, (name, model['mismatches'])
    assert set(model['checks']) == CHECKS and all(model['checks'].values()), name
    assert model['num_points'] > 0
    assert set(model['variants']) == set(VARIANTS)
    for variant in model['variants'].values():
      assert VARIANT_KEYS <= set(variant), name
      assert len(variant['samples_s']) == 2
    assert set(model['ratios']) == {'perturbkit_over_plain', 'flax_perturb_over_plain',
                                    'perturbkit_over_flax_perturb'}
    assert model['targets_met'], name
  assert proc.stdout.count(': OK (') == 3, proc.stdout
