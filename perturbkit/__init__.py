"""perturbkit: activation gradients, backward hooks, interleaved training, K-FAC and per-example
gradients for unmodified Flax models.

The names here are for Flax Linen models; ``perturbkit.nnx`` has the same functions for Flax NNX
models, taking the module where the Linen ones take the variables.
"""

# Namespaces
from perturbkit import errors
from perturbkit.core import filters
from perturbkit import kfac
from perturbkit import nnx
# Activation gradients and backward hooks
from perturbkit.core._hooks import backward_hook
from perturbkit.linen._driver import grad
from perturbkit.core._hooks import Hook
from perturbkit.linen._driver import value_and_grad
from perturbkit.linen._hooks import with_hooks
from perturbkit.linen._wrap import wrap
# Interleaved training
from perturbkit.core._sweep import Interleaved
from perturbkit.linen._schedule import interleaved
from perturbkit.core._sweep import InterleavedState
from perturbkit.core._sweep import REST
# K-FAC
from perturbkit.kfac._losses import categorical_output
from perturbkit.kfac._preconditioner import damped_inverse
from perturbkit.kfac._losses import gaussian_output
from perturbkit.kfac._estimator import kfac_estimator
from perturbkit.kfac._layers import kfac_layers
from perturbkit.kfac._preconditioner import kfac_preconditioner
from perturbkit.kfac._segment import kfac_segment
from perturbkit.kfac._layers import KFACLayers
from perturbkit.kfac._preconditioner import KFACState
from perturbkit.kfac._rules import LayerFactors
from perturbkit.kfac._rules import LayerInfo
from perturbkit.kfac._losses import OutputLoss
# Per-example gradients and DP-SGD
from perturbkit.per_example._check import check_per_example
from perturbkit.per_example._dp import dp_sgd
from perturbkit.per_example._norms import per_example_grad_norms
from perturbkit.per_example._norms import PerExampleNorms
from perturbkit.per_example._dp import private_grad
from perturbkit.per_example._dp import PrivateState
from perturbkit.per_example._dp import PrivateTraining
# Errors and warnings (also in perturbkit.errors)
from perturbkit.errors import ActivationsUnavailableError
from perturbkit.errors import AmbiguousInputError
from perturbkit.errors import ExamplesAxisError
from perturbkit.errors import ExamplesMixedError
from perturbkit.errors import HasAuxOutputError
from perturbkit.errors import InputMismatchError
from perturbkit.errors import InterleavedClippingError
from perturbkit.errors import InvalidOptionError
from perturbkit.errors import KFACLossError
from perturbkit.errors import KFACOutputError
from perturbkit.errors import KFACShapeError
from perturbkit.errors import KFACTargetsError
from perturbkit.errors import KFACUnsupportedLayerError
from perturbkit.errors import LossNotCallableError
from perturbkit.errors import MissingHasAuxError
from perturbkit.errors import NonDifferentiableOutputError
from perturbkit.errors import NonScalarLossError
from perturbkit.errors import NoPerturbationPointsError
from perturbkit.errors import NotAnOptimizerError
from perturbkit.errors import NotVariablesError
from perturbkit.errors import OptaxPrivacyError
from perturbkit.errors import OptimizerStateError
from perturbkit.errors import ParamsReadOutsideError
from perturbkit.errors import PerExampleError
from perturbkit.errors import PerturbationsNotAppliedError
from perturbkit.errors import PerturbationStructureError
from perturbkit.errors import PerturbkitError
from perturbkit.errors import PRNGKeyError
from perturbkit.errors import RandomCallError
from perturbkit.errors import ReductionMismatchError
from perturbkit.errors import SegmentationError
from perturbkit.errors import SharedCallError
from perturbkit.errors import SharedSegmentError
from perturbkit.errors import StateMismatchError
from perturbkit.errors import UncoveredParamsError
from perturbkit.errors import UninitializedStateError
from perturbkit.errors import UnmatchedFilterError
from perturbkit.errors import UnperturbedCallsWarning
from perturbkit.errors import WrongFrontEndError

__all__ = [
    # Namespaces
    'errors',
    'filters',
    'kfac',
    'nnx',
    # Activation gradients and backward hooks
    'backward_hook',
    'grad',
    'Hook',
    'value_and_grad',
    'with_hooks',
    'wrap',
    # Interleaved training
    'Interleaved',
    'interleaved',
    'InterleavedState',
    'REST',
    # K-FAC
    'categorical_output',
    'damped_inverse',
    'gaussian_output',
    'kfac_estimator',
    'kfac_layers',
    'kfac_preconditioner',
    'kfac_segment',
    'KFACLayers',
    'KFACState',
    'LayerFactors',
    'LayerInfo',
    'OutputLoss',
    # Per-example gradients and DP-SGD
    'check_per_example',
    'dp_sgd',
    'per_example_grad_norms',
    'PerExampleNorms',
    'private_grad',
    'PrivateState',
    'PrivateTraining',
    # Errors and warnings (also in perturbkit.errors)
    'ActivationsUnavailableError',
    'AmbiguousInputError',
    'ExamplesAxisError',
    'ExamplesMixedError',
    'HasAuxOutputError',
    'InputMismatchError',
    'InterleavedClippingError',
    'InvalidOptionError',
    'KFACLossError',
    'KFACOutputError',
    'KFACShapeError',
    'KFACTargetsError',
    'KFACUnsupportedLayerError',
    'LossNotCallableError',
    'MissingHasAuxError',
    'NonDifferentiableOutputError',
    'NonScalarLossError',
    'NoPerturbationPointsError',
    'NotAnOptimizerError',
    'NotVariablesError',
    'OptaxPrivacyError',
    'OptimizerStateError',
    'ParamsReadOutsideError',
    'PerExampleError',
    'PerturbationsNotAppliedError',
    'PerturbationStructureError',
    'PerturbkitError',
    'PRNGKeyError',
    'RandomCallError',
    'ReductionMismatchError',
    'SegmentationError',
    'SharedCallError',
    'SharedSegmentError',
    'StateMismatchError',
    'UncoveredParamsError',
    'UninitializedStateError',
    'UnmatchedFilterError',
    'UnperturbedCallsWarning',
    'WrongFrontEndError',
]
