"""Smoke test of scripts/bench_per_example.py: it runs, writes its JSON, and the private steps agree.

No timing is asserted (the numbers depend on the machine); the correctness flag
is: the script compares perturbkit's DP-SGD step with the ``vmap(grad)`` one
(same key, same noise) and exits 1 if their new params differ.
"""
import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'scripts',
                      'bench_per_example.py')
VARIANTS = {'plain', 'noised', 'vmap_grad', 'perturbkit'}
VARIANT_KEYS = {'median_s', 'p25_s', 'p75_s', 'samples_s', 'compile_s', 'argument_bytes',
                'output_bytes', 'temp_bytes', 'sum_bytes'}
RATIOS = {f'{v}_{k}' for v in ('noised', 'vmap_grad', 'perturbkit') for k in ('time', 'memory')}
RATIOS |= {'perturbkit_over_noised_time', 'perturbkit_over_noised_memory'}


def test_tiny_run_writes_results_and_private_steps_agree(tmp_path):
  out = tmp_path / 'results' / 'bench_per_example.json'
  run = subprocess.run([sys.executable, SCRIPT, '--sizes', 'tiny', '--models', 'mlp', 'cnn',
                        '--repeats', '2', '--out', str(out)],
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert 'perturbkit == vmap_grad: OK' in run.stdout

  data = json.loads(out.read_text())
  assert data['benchmark'] == 'per_example'
  assert data['config']['sizes'] == 'tiny' and data['config']['repeats'] == 2
  assert data['config']['variants'] == ['plain', 'noised', 'vmap_grad', 'perturbkit']
  assert data['all_ok'] is True
  assert set(data['models']) == {'mlp', 'cnn'}
  for name, runs in data['models'].items():
    assert [r['batch'] for r in runs] == [4 if name == 'mlp' else 3], name
    for r in runs:
      assert r['private_steps_agree'] is True and r['mismatch'] is None, (name, r['mismatch'])
      assert set(r['variants']) == VARIANTS, name
      for v, m in r['variants'].items():
        assert VARIANT_KEYS <= set(m), (name, v, VARIANT_KEYS - set(m))
        assert len(m['samples_s']) == 2 and m['median_s'] > 0 and m['sum_bytes'] > 0
      assert set(r['ratios']) == RATIOS and all(x > 0 for x in r['ratios'].values()), name
      assert set(r['targets_met']) == {'time_le_1.5x_plain', 'memory_le_1.2x_plain',
                                       'faster_than_vmap_grad', 'smaller_than_vmap_grad'}
