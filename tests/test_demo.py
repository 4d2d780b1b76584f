"""The demo runs end to end, learns something in every run, and writes its plots."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import perturbkit
from perturbkit import demo

CHANCE = 0.1
PLOTS = ('loss_curves.png', 'activation_grad_heatmap.png', 'standard_activation_grads.png')
ROW = re.compile(r'^(standard|interleaved \(updated\)|interleaved \(original\))\s+([\d.]+)%',
                 re.MULTILINE)


def _assert_pngs(folder):
  for name in PLOTS:
    path = os.path.join(folder, name)
    assert os.path.isfile(path), path
    with open(path, 'rb') as f:
      assert f.read(8) == b'\x89PNG\r\n\x1a\n', path


def test_demo_module_quick(tmp_path):
  out = tmp_path / 'plots'
  proc = subprocess.run([sys.executable, '-m', 'perturbkit.demo', '--quick', '--out', str(out)],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  accuracies = {name: float(pct) / 100 for name, pct in ROW.findall(proc.stdout)}
  assert set(accuracies) == set(demo.RUNS), proc.stdout
  for name, acc in accuracies.items():
    assert acc > 2 * CHANCE, (name, acc)
  _assert_pngs(out)


@pytest.fixture(scope='module')
def quick_results(tmp_path_factory):
  out = tmp_path_factory.mktemp('demo')
  return demo.main(['--quick', '--out', str(out), '--optimizer', 'momentum']), out


def test_demo_main_returns_results(quick_results):
  returned, out = quick_results
  assert set(returned['results']) == set(demo.RUNS)
  for name, r in returned['results'].items():
    assert r['test_accuracy'] > 2 * CHANCE, (name, r)
    assert np.isfinite(r['train_loss']) and r['train_loss'] < np.log(10), (name, r)
    assert r['median_step_ms'] > 0
  assert [os.path.basename(p) for p in returned['plots']] == list(PLOTS)
  _assert_pngs(out)


def test_original_schedule_matches_standard_run(quick_results):
  # propagate='original' is jax.grad + optimizer.update, so on identical batches the
  # two runs agree to float rounding; the 'updated' run is a different algorithm.
  results = quick_results[0]['results']
  standard, original = results['standard'], results['interleaved (original)']
  np.testing.assert_allclose(original['train_loss'], standard['train_loss'], rtol=1e-4)
  np.testing.assert_allclose(original['test_accuracy'], standard['test_accuracy'], atol=1e-2)


def test_rejects_batch_larger_than_training_set(tmp_path):
  with pytest.raises(perturbkit.InvalidOptionError, match='--batch-size=100000 .* at most the 640'):
    demo.main(['--quick', '--batch-size', '100000', '--out', str(tmp_path)])
