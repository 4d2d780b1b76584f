"""``python -m perturbkit.demo --api nnx``: the NNX twin trains exactly like the Linen demo."""
import os

import numpy as np

from perturbkit import demo

PLOTS = ('loss_curves.png', 'activation_grad_heatmap.png', 'standard_activation_grads.png')


def test_nnx_demo_equals_linen_demo(tmp_path):
  # Same initial weights, same batches: every run's numbers agree with the Linen demo's,
  # and 'original' agrees with the standard nnx.Optimizer run.
  flags = ['--quick', '--epochs', '1', '--optimizer', 'momentum']
  nnx_run = demo.main(flags + ['--api', 'nnx', '--out', str(tmp_path / 'nnx')])
  linen_run = demo.main(flags + ['--out', str(tmp_path / 'linen')])
  assert set(nnx_run['results']) == set(demo.RUNS)
  for name in demo.RUNS:
    got, want = nnx_run['results'][name], linen_run['results'][name]
    np.testing.assert_allclose(got['train_loss'], want['train_loss'], rtol=1e-4)
    np.testing.assert_allclose(got['test_accuracy'], want['test_accuracy'], atol=1e-2)
  standard, original = (nnx_run['results'][n] for n in (demo.RUNS[0], demo.RUNS[2]))
  np.testing.assert_allclose(original['train_loss'], standard['train_loss'], rtol=1e-4)
  assert nnx_run['results'][demo.RUNS[1]]['train_loss'] != standard['train_loss']
  for name in PLOTS:
    with open(os.path.join(tmp_path / 'nnx', name), 'rb') as f:
      assert f.read(8) == b'\x89PNG\r\n\x1a\n', name
