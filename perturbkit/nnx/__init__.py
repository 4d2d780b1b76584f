"""perturbkit for Flax NNX: activation gradients, backward hooks, interleaved training and
K-FAC for unmodified NNX models.

``perturbkit.nnx.value_and_grad(loss_fn)`` mirrors ``nnx.value_and_grad``:
``loss_fn(model, *args)`` is the ordinary NNX loss, and the result holds the
usual parameter gradients next to dL/d(output) of every submodule call.
Backward hooks are the front-end-neutral ``perturbkit.backward_hook``; path
filters for NNX modules are in ``perturbkit.nnx.filters``.
"""
from perturbkit.nnx import filters
from perturbkit.nnx._driver import grad
from perturbkit.nnx._driver import value_and_grad
from perturbkit.nnx._driver import with_hooks
from perturbkit.errors import CaptureConflictError
from perturbkit.errors import NoPerturbationPointsError
from perturbkit.errors import PerturbationsNotAppliedError
from perturbkit.errors import UnperturbedCallsWarning
from perturbkit.errors import UninstrumentableModuleError
from perturbkit.errors import UnmappedPerturbationError
from perturbkit.kfac._nnx_estimator import kfac_estimator
from perturbkit.kfac._nnx_layers import kfac_layers
from perturbkit.kfac._nnx_preconditioner import kfac_preconditioner
from perturbkit.nnx._schedule import InterleavedOptimizer
from perturbkit.nnx._schedule import InterleavedState
from perturbkit.nnx._schedule import interleaved
from perturbkit.nnx._segmentation import SegmentInTransformError

__all__ = [
    'CaptureConflictError',
    'filters',
    'grad',
    'interleaved',
    'InterleavedOptimizer',
    'InterleavedState',
    'kfac_estimator',
    'kfac_layers',
    'kfac_preconditioner',
    'NoPerturbationPointsError',
    'PerturbationsNotAppliedError',
    'SegmentInTransformError',
    'UninstrumentableModuleError',
    'UnmappedPerturbationError',
    'UnperturbedCallsWarning',
    'value_and_grad',
    'with_hooks',
]
