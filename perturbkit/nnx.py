"""perturbkit for Flax NNX: activation gradients, backward hooks, interleaved training and
K-FAC for unmodified NNX models.

``perturbkit.nnx.value_and_grad(loss_fn)`` mirrors ``nnx.value_and_grad``:
``loss_fn(model, *args)`` is the ordinary NNX loss, and the result holds the
usual parameter gradients next to dL/d(output) of every submodule call.
Backward hooks are the front-end-neutral ``perturbkit.backward_hook``; path
filters for NNX modules are in ``perturbkit.nnx.filters``.
"""
from perturbkit import _nnx_filters as filters
from perturbkit._nnx_driver import grad
from perturbkit._nnx_driver import value_and_grad
from perturbkit._nnx_driver import with_hooks
from perturbkit._nnx_errors import CaptureConflictError
from perturbkit._nnx_errors import NNXNoPerturbationPointsError as NoPerturbationPointsError
from perturbkit._nnx_errors import NNXPerturbationsNotAppliedError as PerturbationsNotAppliedError
from perturbkit._nnx_errors import NNXUnperturbedCallsWarning as UnperturbedCallsWarning
from perturbkit._nnx_errors import UninstrumentableModuleError
from perturbkit._nnx_errors import UnmappedPerturbationError
from perturbkit._nnx_kfac_estimator import kfac_estimator
from perturbkit._nnx_kfac_layers import kfac_layers
from perturbkit._nnx_kfac_preconditioner import kfac_preconditioner
from perturbkit._nnx_schedule import InterleavedOptimizer
from perturbkit._nnx_schedule import InterleavedState
from perturbkit._nnx_schedule import interleaved
from perturbkit._nnx_segmentation import SegmentInTransformError

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
