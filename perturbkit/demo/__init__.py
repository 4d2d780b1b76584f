"""Train a small CNN on the bundled digits three ways and plot what happened.

    python -m perturbkit.demo [--epochs 20] [--optimizer adam] [--out ./demo_out] [--api nnx]

The runs: a standard jitted optax step (``jax.value_and_grad`` + ``update`` +
``apply_updates``), ``perturbkit.interleaved(..., propagate='updated')`` and
``perturbkit.interleaved(..., propagate='original')``. All three start from the
same initial variables and see the same batches in the same order. With
``--api nnx`` the model is its Flax NNX twin (same initial weights), trained with
``nnx.Optimizer`` and ``perturbkit.nnx.InterleavedOptimizer``. The demo
prints a table (test accuracy, train loss, median step time) and writes:

* ``loss_curves.png``: training loss per step and test accuracy per epoch;
* ``activation_grad_heatmap.png``: per-segment activation-gradient norms over
  training, from the interleaved run's ``metrics['activation_grad_norm']``;
* ``standard_activation_grads.png``: per-layer activation-gradient norms of the
  standard run, from ``perturbkit.value_and_grad`` on a fixed probe batch.
"""
from perturbkit.demo._run import RUNS
from perturbkit.demo._run import main
from perturbkit.demo._run import parse_args

__all__ = ['RUNS', 'main', 'parse_args']
