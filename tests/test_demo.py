"""The demo runs end to end on both front ends, learns something in every run, and writes its
plots; ``python -m perturbkit.demo`` runs its ``main``.

One quick Linen run (the README's command with ``--quick``: Adam, 3 epochs on 640 digits) in
this process serves every Linen check; the NNX twin, from the same initial weights on the same
batches, must give every run's numbers of the Linen one.
"""
import os
import runpy
import sys

import numpy as np
import pytest

import perturbkit
from perturbkit import demo

CHANCE = 0.1
PLOTS = ('loss_curves.png', 'activation_grad_heatmap.png', 'standard_activation_grads.png')


def _assert_pngs(folder):
  for name in PLOTS:
    path = os.path.join(folder, name)
    assert os.path.isfile(path), path
    with open(path, 'rb') as f:
      assert f.read(8) == b'\x89PNG\r\n\x1a\n', path


@pytest.fixture(scope='module')
def quick_results(tmp_path_factory):
  out = tmp_path_factory.mktemp('demo')
  return demo.main(['--quick', '--out', str(out)]), out


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


def test_nnx_demo_equals_linen_demo(quick_results, tmp_path):
  # Same initial weights, same batches: every run's numbers agree with the Linen demo's,
  # and 'original' agrees with the standard nnx.Optimizer run.
  nnx_run = demo.main(['--quick', '--api', 'nnx', '--out', str(tmp_path)])
  linen_run = quick_results[0]
  assert set(nnx_run['results']) == set(demo.RUNS)
  for name in demo.RUNS:
    got, want = nnx_run['results'][name], linen_run['results'][name]
    np.testing.assert_allclose(got['train_loss'], want['train_loss'], rtol=1e-4)
    np.testing.assert_allclose(got['test_accuracy'], want['test_accuracy'], atol=1e-2)
  standard, original = (nnx_run['results'][n] for n in (demo.RUNS[0], demo.RUNS[2]))
  np.testing.assert_allclose(original['train_loss'], standard['train_loss'], rtol=1e-4)
  assert nnx_run['results'][demo.RUNS[1]]['train_loss'] != standard['train_loss']
  _assert_pngs(tmp_path)


def test_module_runs_main_with_its_arguments(tmp_path, monkeypatch):
  """``python -m perturbkit.demo ARGS`` is ``main(ARGS)``: run as ``__main__`` (as ``-m`` runs
  it), an option ``main`` refuses stops it with that error, before any training."""
  monkeypatch.setattr(sys, 'argv', ['perturbkit.demo', '--quick', '--batch-size', '100000',
                                    '--out', str(tmp_path)])
  with pytest.raises(perturbkit.InvalidOptionError, match='--batch-size=100000 .* at most the 640'):
    runpy.run_module('perturbkit.demo', run_name='__main__', alter_sys=True)

