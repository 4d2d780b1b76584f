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

The plots go to ``./demo_out/`` by default. Defaults: adam 3e-3, 20 epochs,
batch 64; about 15 s on 2 CPU cores. ``python -m perturbkit.demo --help`` lists
the flags: the number of epochs, the learning rate, the optimizer (sgd, adam,
momentum), the batch size, the output folder, the random initialisation, a quick
mode, and ``--api {linen,nnx}``. A run with the defaults prints::

    run                       test acc  train loss   step ms
    --------------------------------------------------------
    standard                     96.9%      0.0725      1.06
    interleaved (updated)        96.2%      0.0946      1.19
    interleaved (original)       96.9%      0.0725      1.09

``'original'`` reproduces the standard run exactly, as it must. With plain SGD at
a large step the ``'updated'`` schedule can diverge where the standard step does
not (seen at lr 0.05 and 0.1 on this CNN; an independent hand-written version of
the rule diverges at the same step), so the SGD default is small.
"""
from perturbkit.demo._run import RUNS
from perturbkit.demo._run import main
from perturbkit.demo._run import parse_args

__all__ = ['RUNS', 'main', 'parse_args']
