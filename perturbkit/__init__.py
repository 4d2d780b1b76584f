"""perturbkit: activation gradients, backward hooks, interleaved training, K-FAC and per-example
gradients for unmodified Flax models.

The names here are for Flax Linen models; ``perturbkit.nnx`` has the same functions for Flax NNX
models, taking the module where the Linen ones take the variables.

Namespaces: ``perturbkit.kfac`` (K-FAC), ``perturbkit.per_example`` (per-example
gradient norms and DP-SGD) and ``perturbkit.interpret`` (caching, interventions,
activation and attribution patching, integrated gradients, Grad-CAM, learnable
interventions) hold their family's names and conventions, also
exported here (the edits only in ``perturbkit.interpret``); ``perturbkit.filters`` the
call filters; ``perturbkit.nnx`` the NNX front end;
``perturbkit.errors`` every error class (each a subclass of ``PerturbkitError``
whose message says how to fix the problem; also exported here). The conventions of
activation gradients are in ``help(perturbkit.value_and_grad)``, of interleaved
training in ``help(perturbkit.interleaved)``, of hooks in
``help(perturbkit.backward_hook)``.

Threads and nesting
-------------------
All interception state is per thread (as Flax's own interceptor stack is), so
models can be traced from a thread pool at once; an exception anywhere (even a
``KeyboardInterrupt`` during discovery) leaves nothing behind.

A perturbkit function called inside another one's loss (``value_and_grad`` inside
the loss of ``value_and_grad``, or of ``interleaved``) sees only its own calls,
and the outer level does not see them: the inner call is computed exactly as if
it stood alone, and the outer level's points are the calls its loss makes
directly. To get the outer derivative at calls inside an inner step, write the
inner step with ``jax.grad`` (see "Nested gradients" in
``help(perturbkit.value_and_grad)``).

Hooks (``with_hooks``) are transparent: they apply inside any perturbkit
function, including to the calls an interleaved segment replays. A segment is
replayed as its own ``apply``, but the hooks open when it was called are
reopened for the replay with the segment's path in front, so
``filters.by_path('Blk_0/Dense_0')`` selects the call inside the segment
``Blk_0`` and ``by_path('Dense_0')`` only the top-level one, also in the backward
replay of ``propagate='updated'``, which runs after the hooked loss has returned.
A filter of your own sees these full paths through
``perturbkit.filters.module_path(module)``; ``module.path`` itself is relative to
the segment inside a replay.

Tested models
-------------
``tests/test_real_models.py`` runs the unmodified Hugging Face ``transformers``
4.x Flax models GPT-2 (tied LM head), BERT, ViT, ResNet (BatchNorm, train and
eval), Llama, CLIP and Whisper, built from tiny configs in code (nothing
downloaded):

* every activation gradient against an independent explicit-delta interceptor
  and ``jax.jvp``; GPT-2, BERT, ViT and ResNet also called as Hugging Face's
  example scripts call them, ``model(ids, params=variables['params'])``;
* param gradients against ``jax.grad``;
* ``propagate='original'`` against ``jax.grad`` + optax;
* GPT-2 block segments against a hand-coded per-block backward;
* BERT under Hugging Face's gradient checkpointing with dropout on, each layer a
  segment, against a per-layer backward run on the plain model;
* the layer-wise default segments (GPT-2 14, BERT 21, ViT 19, ResNet 13,
  Llama 21, CLIP 40, Whisper 48; GPT-2's tied ``wte`` and Whisper's tied decoder
  embedding in ``REST``) lowering the loss.
* Wav2Vec2 for CTC: its layer-wise default segments (its unread ``masked_spec_embed`` in
  ``REST``), ``propagate='original'`` against ``jax.grad`` + optax and ``'updated'``
  against a reference written per segment.

Per-example norms and DP-SGD: ``tests/test_real_models_per_example.py`` (GPT-2,
BERT, ViT, Llama, ResNet in eval mode, BART, DistilBERT, OPT, Whisper; see ``help(perturbkit.per_example)`` for
what to pass and what is refused). K-FAC: ``tests/test_real_models_kfac.py``
(BERT, ViT, GPT-2, Llama, ResNet). Two ``jax.distributed`` processes on
localhost (4 CPU devices each) run the interleaved step under ``shard_map`` and
equal one process (``tests/test_multiprocess.py``).

``notebooks/04_real_model.ipynb`` trains an unmodified GPT-2 on text from the
standard library's docstrings, standard and interleaved side by side; at full
size the layer-wise interleaved run levels off at a higher held-out loss than the
standard step (3.41 against 2.87 with the same, untuned adam 3e-3).
"""

# Namespaces
from perturbkit import errors
from perturbkit import filters
from perturbkit import interpret
from perturbkit import kfac
from perturbkit import nnx
from perturbkit import per_example
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
from perturbkit.kfac import (categorical_output, damped_inverse, gaussian_output, kfac_estimator,
                             kfac_layers, kfac_preconditioner, kfac_segment, KFACLayers, KFACState,
                             LayerFactors, LayerInfo, OutputLoss)
# Per-example gradients and DP-SGD
from perturbkit.per_example import (check_per_example, dp_sgd, per_example_grad_norms,
                                    PerExampleNorms, private_grad, PrivateState, PrivateTraining)
# Caching, interventions and attribution
from perturbkit.interpret import (activation_patching, attribution_patching, Cache, grad_cam,
                                  grad_times_activation, IntegratedGradientsResult,
                                  layer_integrated_gradients, PatchingResult, run_with_cache,
                                  run_with_edits, run_with_interventions)
# Errors and warnings (also in perturbkit.errors)
from perturbkit.errors import ActivationsUnavailableError
from perturbkit.errors import CaptureInJaxTransformError
from perturbkit.errors import CaptureOutsideMethodCallError
from perturbkit.errors import AmbiguousInputError
from perturbkit.errors import AxisLengthMismatchError
from perturbkit.errors import BranchCallsMismatchError
from perturbkit.errors import BranchesUnseparatedError
from perturbkit.errors import CallStructureMismatchError
from perturbkit.errors import CheckedShardMapError
from perturbkit.errors import UnboundAxisError
from perturbkit.errors import DeviceLocalStepWarning
from perturbkit.errors import PerSegmentTransformWarning
from perturbkit.errors import UnknownAxisError
from perturbkit.errors import EditShapeError
from perturbkit.errors import EditStructureError
from perturbkit.errors import AmbiguousEditError
from perturbkit.errors import DuplicateEditError
from perturbkit.errors import EditViewError
from perturbkit.errors import BatchNotArrayError
from perturbkit.errors import ExamplesAxisError
from perturbkit.errors import ExamplesCoupledError
from perturbkit.errors import ExamplesMixedError
from perturbkit.errors import FeatureMapShapeError
from perturbkit.errors import HasAuxOutputError
from perturbkit.errors import ImageLayoutError
from perturbkit.errors import InputMismatchError
from perturbkit.errors import InterleavedClippingError
from perturbkit.errors import InterventionParamsError
from perturbkit.errors import InterventionOutputError
from perturbkit.errors import InvalidOptionError
from perturbkit.errors import KFACExactFisherError
from perturbkit.errors import KFACExamplesError
from perturbkit.errors import KFACInputsError
from perturbkit.errors import KFACLayersTypeError
from perturbkit.errors import KFACLossError
from perturbkit.errors import KFACLossShapeError
from perturbkit.errors import KFACNoLayersError
from perturbkit.errors import KFACOutputError
from perturbkit.errors import KFACShapeError
from perturbkit.errors import KFACTargetsError
from perturbkit.errors import KFACUnsupportedLayerError
from perturbkit.errors import KFACUpdateArgsError
from perturbkit.errors import MapVariablesInitError
from perturbkit.errors import MetricGapError
from perturbkit.errors import MetricSignatureError
from perturbkit.errors import LossNotCallableError
from perturbkit.errors import MissingHasAuxError
from perturbkit.errors import NonDifferentiableOutputError
from perturbkit.errors import NoSegmentError
from perturbkit.errors import NonScalarLossError
from perturbkit.errors import NonScalarMetricError
from perturbkit.errors import NoPerturbationPointsError
from perturbkit.errors import NotAnOptimizerError
from perturbkit.errors import SegmentOptimizerError
from perturbkit.errors import NotEditsError
from perturbkit.errors import NotVariablesError
from perturbkit.errors import OptaxPrivacyError
from perturbkit.errors import OptimizerStateError
from perturbkit.errors import OutsideApplyError
from perturbkit.errors import ParamsReadOutsideError
from perturbkit.errors import PerExampleError
from perturbkit.errors import PerturbationsNotAppliedError
from perturbkit.errors import PerturbationStructureError
from perturbkit.errors import PerturbkitError
from perturbkit.errors import PositionOutOfRangeError
from perturbkit.errors import PRNGKeyError
from perturbkit.errors import RandomApplyReplayError
from perturbkit.errors import RandomCallError
from perturbkit.errors import ReductionCheckError
from perturbkit.errors import ReductionMismatchError
from perturbkit.errors import ResultValuesError
from perturbkit.errors import SegmentationError
from perturbkit.errors import SharedCallError
from perturbkit.errors import SharedSegmentError
from perturbkit.errors import StateMismatchError
from perturbkit.errors import TransformTracedOnceError
from perturbkit.errors import UncoveredParamsError
from perturbkit.errors import UninitializedStateError
from perturbkit.errors import UnknownEditPathError
from perturbkit.errors import UnmatchedFilterError
from perturbkit.errors import UnperturbedCallsWarning
from perturbkit.errors import WrongFrontEndError
from perturbkit.errors import BoundModuleError
from perturbkit.errors import WrappedModelError
from perturbkit.errors import FilterError
from perturbkit.errors import TracedFilterError
from perturbkit.errors import PathPatternError
from perturbkit.errors import HookFunctionError
from perturbkit.errors import HookOutputError
from perturbkit.errors import KFACFactorShapeError
from perturbkit.errors import KFACLayerInfoError
from perturbkit.errors import NoHooksError
from perturbkit.errors import NotAHookError
from perturbkit.errors import NotAModuleError
from perturbkit.errors import NotInterventionsError
from perturbkit.errors import PrivateAccumulationError
from perturbkit.errors import LookaheadParamsError

__all__ = [
    # Namespaces
    'errors',
    'filters',
    'interpret',
    'kfac',
    'nnx',
    'per_example',
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
    # Caching, interventions and attribution
    'activation_patching',
    'attribution_patching',
    'Cache',
    'grad_cam',
    'grad_times_activation',
    'IntegratedGradientsResult',
    'layer_integrated_gradients',
    'PatchingResult',
    'run_with_cache',
    'run_with_edits',
    'run_with_interventions',
    # Errors and warnings (also in perturbkit.errors)
    'ActivationsUnavailableError',
    'CaptureInJaxTransformError',
    'CaptureOutsideMethodCallError',
    'AmbiguousInputError',
    'AxisLengthMismatchError',
    'BranchCallsMismatchError',
    'BranchesUnseparatedError',
    'CallStructureMismatchError',
    'CheckedShardMapError',
    'UnboundAxisError',
    'DeviceLocalStepWarning',
    'PerSegmentTransformWarning',
    'UnknownAxisError',
    'EditShapeError',
    'EditStructureError',
    'DuplicateEditError',
    'AmbiguousEditError',
    'EditViewError',
    'BatchNotArrayError',
    'ExamplesAxisError',
    'ExamplesCoupledError',
    'ExamplesMixedError',
    'FeatureMapShapeError',
    'HasAuxOutputError',
    'ImageLayoutError',
    'InputMismatchError',
    'InterleavedClippingError',
    'InterventionParamsError',
    'InterventionOutputError',
    'InvalidOptionError',
    'KFACExactFisherError',
    'KFACExamplesError',
    'KFACInputsError',
    'KFACLayersTypeError',
    'KFACLossError',
    'KFACLossShapeError',
    'KFACNoLayersError',
    'KFACOutputError',
    'KFACShapeError',
    'KFACTargetsError',
    'KFACUnsupportedLayerError',
    'KFACUpdateArgsError',
    'MapVariablesInitError',
    'MetricGapError',
    'MetricSignatureError',
    'LossNotCallableError',
    'MissingHasAuxError',
    'NonDifferentiableOutputError',
    'NoSegmentError',
    'NonScalarLossError',
    'NonScalarMetricError',
    'NoPerturbationPointsError',
    'NotAnOptimizerError',
    'SegmentOptimizerError',
    'NotEditsError',
    'NotVariablesError',
    'OptaxPrivacyError',
    'OptimizerStateError',
    'OutsideApplyError',
    'ParamsReadOutsideError',
    'PerExampleError',
    'PerturbationsNotAppliedError',
    'PerturbationStructureError',
    'PerturbkitError',
    'PositionOutOfRangeError',
    'PRNGKeyError',
    'RandomApplyReplayError',
    'RandomCallError',
    'ReductionCheckError',
    'ReductionMismatchError',
    'ResultValuesError',
    'SegmentationError',
    'SharedCallError',
    'SharedSegmentError',
    'StateMismatchError',
    'TransformTracedOnceError',
    'UncoveredParamsError',
    'UninitializedStateError',
    'UnknownEditPathError',
    'UnmatchedFilterError',
    'UnperturbedCallsWarning',
    'WrongFrontEndError',
    'BoundModuleError',
    'WrappedModelError',
    'FilterError',
    'TracedFilterError',
    'PathPatternError',
    'HookFunctionError',
    'HookOutputError',
    'KFACFactorShapeError',
    'KFACLayerInfoError',
    'NoHooksError',
    'NotAHookError',
    'NotAModuleError',
    'NotInterventionsError',
    'PrivateAccumulationError',
    'LookaheadParamsError',
]
