"""perturbkit: activation gradients, gradient hooks and interleaved training for Flax Linen."""
from perturbkit import _filters as filters
from perturbkit import nnx
from perturbkit._errors import ActivationsUnavailableError
from perturbkit._errors import InvalidOptionError
from perturbkit._errors import PRNGKeyError
from perturbkit._errors import ReductionMismatchError
from perturbkit._errors import NonDifferentiableOutputError
from perturbkit._errors import NonScalarLossError
from perturbkit._errors import NoPerturbationPointsError
from perturbkit._errors import OptimizerStateError
from perturbkit._errors import PerturbationsNotAppliedError
from perturbkit._errors import PerturbationStructureError
from perturbkit._errors import PerturbkitError
from perturbkit._errors import SegmentationError
from perturbkit._errors import SharedSegmentError
from perturbkit._errors import StateMismatchError
from perturbkit._errors import UnmatchedFilterError
from perturbkit._errors import UnperturbedCallsWarning
from perturbkit._errors import MissingHasAuxError
from perturbkit._errors import HasAuxOutputError
from perturbkit._errors import LossNotCallableError
from perturbkit._errors import WrongFrontEndError
from perturbkit._errors import NotVariablesError
from perturbkit._errors import UninitializedStateError
from perturbkit._errors import InputMismatchError
from perturbkit._errors import NotAnOptimizerError
from perturbkit._errors import KFACTargetsError
from perturbkit._driver import grad
from perturbkit._driver import value_and_grad
from perturbkit._hooks import Hook
from perturbkit._kfac_errors import KFACLossError
from perturbkit._kfac_errors import KFACOutputError
from perturbkit._kfac_errors import KFACShapeError
from perturbkit._kfac_errors import KFACUnsupportedLayerError
from perturbkit._kfac_estimator import kfac_estimator
from perturbkit._kfac_layers import KFACLayers
from perturbkit._kfac_layers import kfac_layers
from perturbkit._kfac_losses import OutputLoss
from perturbkit._kfac_losses import categorical_output
from perturbkit._kfac_losses import gaussian_output
from perturbkit._kfac_preconditioner import KFACState
from perturbkit._kfac_preconditioner import damped_inverse
from perturbkit._kfac_preconditioner import kfac_preconditioner
from perturbkit._kfac_segment import kfac_segment
from perturbkit._kfac_rules import LayerFactors
from perturbkit._kfac_rules import LayerInfo
from perturbkit._per_example_check import check_per_example
from perturbkit._per_example_dp import PrivateState
from perturbkit._per_example_dp import PrivateTraining
from perturbkit._per_example_dp import dp_sgd
from perturbkit._per_example_dp import private_grad
from perturbkit._per_example_errors import AmbiguousInputError
from perturbkit._per_example_errors import ExamplesAxisError
from perturbkit._per_example_errors import ExamplesMixedError
from perturbkit._per_example_errors import InterleavedClippingError
from perturbkit._per_example_errors import OptaxPrivacyError
from perturbkit._per_example_errors import ParamsReadOutsideError
from perturbkit._per_example_errors import RandomCallError
from perturbkit._per_example_errors import PerExampleError
from perturbkit._per_example_errors import SharedCallError
from perturbkit._per_example_errors import UncoveredParamsError
from perturbkit._per_example_norms import PerExampleNorms
from perturbkit._per_example_norms import per_example_grad_norms
from perturbkit._hooks import backward_hook
from perturbkit._hooks import with_hooks
from perturbkit._sweep import REST
from perturbkit._schedule import Interleaved
from perturbkit._sweep import InterleavedState
from perturbkit._schedule import interleaved
from perturbkit._wrap import wrap

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
