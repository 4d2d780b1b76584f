"""Smoke test of scripts/bench_interleaved.py: it runs, writes its JSON, and 'original' matches.

No timing is asserted (the numbers depend on the machine); the correctness flag
is, because it compares new params against a standard jitted step.
"""
import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'scripts',
                      'bench_interleaved.py')
VARIANTS = {'standard', 'updated', 'original'}
VARIANT_KEYS = {'median_s', 'p25_s', 'p75_s', 'samples_s', 'lower_s', 'compile_s',
                'total_compile_s', 'temp_bytes', 'argument_bytes', 'output_bytes', 'sum_bytes',
                'ops'}


def test_small_run_writes_results_and_original_matches_standard(tmp_path):
  out = tmp_path / 'results' / 'bench_interleaved.json'
  # Two of the three models keep the suite short: Dense-layer and block segments.
  run = subprocess.run([sys.executable, SCRIPT, '--sizes', 'small', '--repeats', '2',
                        '--models', 'mlp', 'transformer', '--out', str(out)],
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert 'original == standard: OK' in run.stdout

  data = json.loads(out.read_text())
  assert data['benchmark'] == 'interleaved'
  assert data['config']['sizes'] == 'small'
  assert data['config']['repeats'] == 2
  assert data['all_ok'] is True
  assert set(data['models']) == {'mlp', 'transformer'}
  for name, model in data['models'].items():
    assert set(model) == {'size', 'depths', 'targets_met'}, name
    assert model['targets_met']['original_equals_standard'] is True, name
    depths = [d['depth'] for d in model['depths']]
    assert depths == sorted(depths) and len(depths) >= 2, name
    segments = [d['segments'] for d in model['depths']]
    assert segments == sorted(set(segments)), name  # deeper models have more segments
    for d in model['depths']:
      assert d['original_equals_standard'] is True and d['mismatch'] is None, (name, d['depth'])
      assert set(d['variants']) == VARIANTS
      for v, m in d['variants'].items():
        assert VARIANT_KEYS <= set(m), (name, d['depth'], v, VARIANT_KEYS - set(m))
        assert len(m['samples_s']) == 2
        assert m['median_s'] > 0 and m['total_compile_s'] > 0
      for v in ('updated', 'original'):
        for ratio in ('time', 'compile', 'sum_bytes', 'compile_s_per_segment'):
          assert d['ratios'][f'{v}_{ratio}'] > 0, (name, d['depth'], v, ratio)
