"""perturbkit: activation gradients, gradient hooks and interleaved training for Flax Linen."""
from perturbkit.core import filters
from perturbkit import nnx
from perturbkit.errors import ActivationsUnavailableError
from perturbkit.errors import InvalidOptionError
from perturbkit.errors import PRNGKeyError
from perturbkit.errors import ReductionMismatchError
from perturbkit.errors import NonDifferentiableOutputError
from perturbkit.errors import NonScalarLossError
from perturbkit.errors import NoPerturbationPointsError
from perturbkit.errors import OptimizerStateError
from perturbkit.errors import PerturbationsNotAppliedError
from perturbkit.errors import PerturbationStructureError
from perturbkit.errors import PerturbkitError
from perturbkit.errors import SegmentationError
from perturbkit.errors import SharedSegmentError
from perturbkit.errors import StateMismatchError
from perturbkit.errors import UnmatchedFilterError
from perturbkit.errors import UnperturbedCallsWarning
from perturbkit.errors import MissingHasAuxError
from perturbkit.errors import HasAuxOutputError
from perturbkit.errors import LossNotCallableError
from perturbkit.errors import WrongFrontEndError
from perturbkit.errors import NotVariablesError
from perturbkit.errors import UninitializedStateError
from perturbkit.errors import InputMismatchError
from perturbkit.errors import NotAnOptimizerError
from perturbkit.errors import KFACTargetsError
from perturbkit.linen._driver import grad
from perturbkit.linen._driver import value_and_grad
from perturbkit.core._hooks import Hook
from perturbkit.errors import KFACLossError
from perturbkit.errors import KFACOutputError
from perturbkit.errors import KFACShapeError
from perturbkit.errors import KFACUnsupportedLayerError
from perturbkit.kfac._estimator import kfac_estimator
from perturbkit.kfac._layers import KFACLayers
from perturbkit.kfac._layers import kfac_layers
from perturbkit.kfac._losses import OutputLoss
from perturbkit.kfac._losses import categorical_output
from perturbkit.kfac._losses import gaussian_output
from perturbkit.kfac._preconditioner import KFACState
from perturbkit.kfac._preconditioner import damped_inverse
from perturbkit.kfac._preconditioner import kfac_preconditioner
from perturbkit.kfac._segment import kfac_segment
from perturbkit.kfac._rules import LayerFactors
from perturbkit.kfac._rules import LayerInfo
from perturbkit.per_example._check import check_per_example
from perturbkit.per_example._dp import PrivateState
from perturbkit.per_example._dp import PrivateTraining
from perturbkit.per_example._dp import dp_sgd
from perturbkit.per_example._dp import private_grad
from perturbkit.errors import AmbiguousInputError
from perturbkit.errors import ExamplesAxisError
from perturbkit.errors import ExamplesMixedError
from perturbkit.errors import InterleavedClippingError
from perturbkit.errors import OptaxPrivacyError
from perturbkit.errors import ParamsReadOutsideError
from perturbkit.errors import RandomCallError
from perturbkit.errors import PerExampleError
from perturbkit.errors import SharedCallError
from perturbkit.errors import UncoveredParamsError
from perturbkit.per_example._norms import PerExampleNorms
from perturbkit.per_example._norms import per_example_grad_norms
from perturbkit.core._hooks import backward_hook
from perturbkit.linen._hooks import with_hooks
from perturbkit.core._sweep import REST
from perturbkit.core._sweep import Interleaved
from perturbkit.core._sweep import InterleavedState
from perturbkit.linen._schedule import interleaved
from perturbkit.linen._wrap import wrap

__all__ = [
    'ActivationsUnavailableError',
    'InvalidOptionError',
    'PRNGKeyError',
    'ReductionMismatchError',
    'backward_hook',
    'grad',
    'interleaved',
    'Interleaved',
    'InterleavedState',
    'REST',
    'Hook',
    'categorical_output',
    'damped_inverse',
    'gaussian_output',
    'kfac_estimator',
    'kfac_layers',
    'kfac_preconditioner',
    'kfac_segment',
    'KFACLayers',
    'KFACLossError',
    'KFACOutputError',
    'KFACShapeError',
    'KFACState',
    'KFACUnsupportedLayerError',
    'LayerFactors',
    'LayerInfo',
    'OutputLoss',
    'value_and_grad',
    'with_hooks',
    'filters',
    'nnx',
    'NonDifferentiableOutputError',
    'NonScalarLossError',
    'NoPerturbationPointsError',
    'OptimizerStateError',
    'PerturbationsNotAppliedError',
    'PerturbationStructureError',
    'PerturbkitError',
    'SegmentationError',
    'SharedSegmentError',
    'StateMismatchError',
    'UnmatchedFilterError',
    'UnperturbedCallsWarning',
    'MissingHasAuxError',
    'HasAuxOutputError',
    'LossNotCallableError',
    'WrongFrontEndError',
    'NotVariablesError',
    'UninitializedStateError',
    'InputMismatchError',
    'NotAnOptimizerError',
    'KFACTargetsError',
    'wrap',
    'AmbiguousInputError',
    'check_per_example',
    'dp_sgd',
    'ExamplesAxisError',
    'ExamplesMixedError',
    'InterleavedClippingError',
    'OptaxPrivacyError',
    'ParamsReadOutsideError',
    'RandomCallError',
    'per_example_grad_norms',
    'PerExampleError',
    'PerExampleNorms',
    'private_grad',
    'PrivateState',
    'PrivateTraining',
    'SharedCallError',
    'UncoveredParamsError',
]
