"""Smoke test of scripts/bench_real_models.py: ``--quick`` runs, writes its JSON, and agrees.

Timings are noise at these sizes; only the structure and the correctness checks
(perturbkit's param gradients equal plain ``jax.grad``; interleaved ``'original'``
equals the standard optax step) are tested, on GPT-2 and ViT.
"""
import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'scripts',
                      'bench_real_models.py')
VARIANTS = {'plain', 'perturbkit', 'standard', 'interleaved', 'blocks'}
CHECKS = {'loss_perturbkit_vs_plain', 'params_grad_perturbkit_vs_plain',
          'original_step_vs_standard'}
RATIOS = {'perturbkit_over_plain', 'interleaved_over_standard', 'blocks_over_standard',
          'interleaved_sum_bytes_over_standard', 'blocks_sum_bytes_over_standard',
          'interleaved_compile_over_standard', 'blocks_compile_over_standard'}


def test_quick_run_writes_results_and_checks_pass(tmp_path):
  out = tmp_path / 'results' / 'bench_real_models.json'
  run = subprocess.run([sys.executable, SCRIPT, '--quick', '--out', str(out)],
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert 'checks: OK' in run.stdout, run.stdout[-3000:]

  data = json.loads(out.read_text())
  assert data['benchmark'] == 'real_models'
  assert data['config']['quick'] is True
  assert data['all_ok'] is True
  assert set(data['models']) == {'gpt2', 'vit'}
  for name, model in data['models'].items():
    assert model['ok'] is True and model['mismatches'] == {}, (name, model['mismatches'])
    assert set(model['checks']) == CHECKS and all(model['checks'].values()), name
    assert model['num_points'] > 10, name
    assert set(model['variants']) == VARIANTS, name
    for v, m in model['variants'].items():
      assert m['total_compile_s'] > 0 and m['argument_bytes'] > 0, (name, v)
      assert len(m['samples_s']) == 2 and m['median_s'] > 0, (name, v)
    assert set(model['ratios']) == RATIOS and all(r > 0 for r in model['ratios'].values())
    assert model['targets_met']['argument_bytes_perturbkit_eq_plain'] is True, name
    segments = [row['segments'] for row in model['compile_vs_segments']]
    assert segments == sorted(segments) and segments[0] == 0, name
    # Layer-wise default segments are finer than one segment per block.
    assert len(model['segments']['interleaved']) > len(model['segments']['blocks']) >= 1, name
  # GPT-2's LM head reads the token embedding (tied weights): it is updated at the end.
  assert list(data['models']['gpt2']['rest']) == ['transformer/wte']
  assert data['models']['vit']['rest'] == {}
