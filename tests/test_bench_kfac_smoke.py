"""Smoke test of scripts/bench_kfac.py: it runs, writes its JSON, and every variant trains.

No timing is asserted (the numbers depend on the machine). What is asserted can
fail: every variant's losses over the timed steps are finite (the script's own
``ok``), the loss falls under each training variant, and the K-FAC layers are found.
"""
import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'scripts',
                      'bench_kfac.py')
VARIANTS = ['adam', 'kfac_sampled', 'kfac_empirical', 'kfac_sampled_every', 'kfac_precondition',
            'interleaved_adam', 'kfac_segments', 'kfac_host_switch']


def test_small_run_writes_results_and_every_variant_is_finite(tmp_path):
  out = tmp_path / 'results' / 'bench_kfac.json'
  run = subprocess.run([sys.executable, SCRIPT, '--sizes', 'small', '--models', 'mlp',
                        '--repeats', '2', '--out', str(out)],
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

  data = json.loads(out.read_text())
  assert data['benchmark'] == 'kfac' and data['all_ok'] is True
  assert data['config']['variants'] == VARIANTS and data['config']['k'] == 10
  mlp = data['models']['mlp']
  assert mlp['layers'] == {'Dense_0': 'dense', 'Dense_1': 'dense', 'Dense_2': 'dense'}
  assert mlp['finite_losses'] == {v: True for v in VARIANTS}
  for v, (first, last) in mlp['first_and_last_loss'].items():
    # kfac_precondition times the preconditioning with its initial inverses and never
    # refreshes them: it measures a cost, it is not meant to train.
    if v != 'kfac_precondition':
      assert last < first, (v, first, last)
  assert set(mlp['per_step']) == set(VARIANTS)
  assert all(m['median_s'] > 0 for m in mlp['per_step'].values())
  assert all(mlp['compiled_memory'][v]['temp_bytes'] >= 0 for v in VARIANTS)
  assert mlp['memory']['factor_bytes'] == mlp['memory']['inverse_bytes'] > 0
  assert all(r > 0 for r in mlp['ratios'].values())
