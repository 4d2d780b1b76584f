"""Compiled memory of the DP-SGD step on the benchmark CNN stays within the target.

Compiled bytes (``memory_analysis``) are deterministic for the pinned jax, so
this guards what ``scripts/bench_per_example.py`` reports: the per-example conv
kernel gradients read each output gradient from one buffer. Reshaping it for the
kernel scan made XLA compute it twice, into two output-sized buffers (1.27× the
plain step, against 1.08× now). No time is measured here.
"""
import os
import sys

import jax
import optax

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'scripts')
sys.path.insert(0, SCRIPTS)
import _bench_common as common  # noqa: E402
import _bench_models as models  # noqa: E402
import bench_per_example as bench  # noqa: E402


def test_cnn_dp_sgd_step_memory_is_within_the_target():
  size = bench.SIZES['default']['cnn']
  kp, kd, kn = jax.random.split(jax.random.key(0), 3)
  problem = bench.make_problem('cnn', size, 64, kd)
  loss_fn = models.cross_entropy(problem.model)
  optimizer = optax.sgd(bench.LEARNING_RATE)
  params = problem.model.init(kp, problem.x)['params']
  args = (params, optimizer.init(params), kn, problem.x, problem.y)

  def total(step):
    memory = common.compile_timed(step(loss_fn, optimizer), *args).memory
    return sum(memory[k] for k in ('argument_bytes', 'output_bytes', 'temp_bytes'))

  ratio = total(bench.perturbkit_step) / total(bench.plain_step)
  assert ratio <= bench.TARGETS['memory'], ratio
