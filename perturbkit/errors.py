"""Every error perturbkit raises. Each message says what was wrong and how to fix it.

Every failure has its own class, a subclass of ``PerturbkitError``, whose message
says how to fix the problem. All of them are also importable from ``perturbkit``.

Any function: ``LossNotCallableError`` (the loss's value was passed instead of
the function), ``NonScalarLossError``, ``MissingHasAuxError`` (the loss returned
``(loss, aux)`` without ``has_aux=True``), ``HasAuxOutputError``,
``WrongFrontEndError`` (a Linen function given an NNX model, or the other way
round), ``NotAModuleError`` (something other than a Flax module where the model
goes), ``NotVariablesError``, ``InvalidOptionError`` (an option out of its range,
or not one of its allowed values), ``NotAnOptimizerError``, ``SegmentOptimizerError`` (interleaved training's optimizer built
for the whole params tree, a mask or label tree), ``UninitializedStateError`` and
``InputMismatchError`` (``step`` given something other than ``init``'s state, or
inputs of other shapes), ``LookaheadParamsError`` (``optax.lookahead``, whose params are
``optax.LookaheadParams``, given to a trainer that holds the model's own params), ``UnboundAxisError`` (the loss run outside the ``shard_map`` that binds its axis),
``UnknownAxisError`` (an ``axis_name`` that no ``shard_map`` or ``pmap`` around the step
binds), ``CheckedShardMapError`` (``axis_name`` given inside
``jax.shard_map`` with its default ``check_vma=True``, where it would count the
devices twice). The warning ``DeviceLocalStepWarning``: a function that takes ``axis_name`` run without
it inside ``jax.shard_map`` with ``check_vma=False``, where each device steps on its own
shard. The warning ``PerSegmentTransformWarning``: interleaved training given one optimizer
with ``optax.clip_by_global_norm`` (or another transformation of the whole gradient), which
acts per segment there.

Activation gradients, hooks and interleaved training: ``NoPerturbationPointsError``,
``UnmatchedFilterError`` (a hook's or ``wrap``'s filter selects no call; the
message lists the calls seen), ``FilterError`` (a filter of a type it cannot be;
``TracedFilterError`` for one answering with a traced value, ``PathPatternError`` for
a ``by_path`` pattern written as a regular expression),
``NoHooksError``, ``NotAHookError`` and ``HookFunctionError`` (``with_hooks`` without
hooks; something else than a hook where hooks go; a hook that is not callable),
``HookOutputError`` (a hook returning another structure, shape or dtype than it got),
``BoundModuleError``
(``wrap`` given a bound module), ``WrappedModelError`` (a model from ``wrap`` wrapped again,
or run inside another perturbkit function), ``PerturbationStructureError``,
``BranchCallsMismatchError`` (an ``nn.cond``/``nn.switch``, or ``nnx.cond``/``nnx.switch``,
whose branches call different submodules), ``BranchesUnseparatedError`` (two ``nn.switch`` in a row on one
module, given different branch functions), ``MapVariablesInitError``
(``nn.map_variables(..., init=True)``), ``NonDifferentiableOutputError``,
``PerturbationsNotAppliedError`` (a loss that
makes other calls each time it is traced), ``OutsideApplyError`` (interleaved
training given a submodule called outside a method of the model: ``model.bind``,
``nn.apply``),
``ActivationsUnavailableError`` (``CaptureInJaxTransformError``: the loss applies
``jax.jit``, ``jax.vmap``, ... around ``model.apply`` itself;
``CaptureOutsideMethodCallError``: a submodule reached by attribute outside every method
of the model runs a lifted transform), ``SegmentationError``, ``SharedSegmentError``,
``NoSegmentError`` (no call of the loss can be a segment; the message says why
and what to change),
``StateMismatchError``, ``OptimizerStateError``; the warning ``UnperturbedCallsWarning`` (calls inside
``nn.scan``/``nn.vmap`` without ``'perturbations'`` in ``variable_axes``).

Per-example gradients and DP-SGD (subclasses of ``PerExampleError``):
``ExamplesMixedError`` (``ExamplesCoupledError`` for DP-SGD), ``ExamplesAxisError``,
``AmbiguousInputError``,
``SharedCallError``, ``UncoveredParamsError``, ``ParamsReadOutsideError``,
``RandomCallError`` (``RandomApplyReplayError`` where the whole apply is replayed,
e.g. layers inside ``nn.remat``), ``InterleavedClippingError``, ``OptaxPrivacyError``,
``PrivateAccumulationError`` (``dp_sgd`` given ``optax.MultiSteps``); also
``ReductionMismatchError`` (the loss combines the examples' terms otherwise than
``reduction`` says), ``ReductionCheckError`` (the loss cannot run on the one or two
examples that check runs it on, e.g. a model with a hard-coded batch size) and ``PRNGKeyError`` (a key that is not a JAX PRNG key, e.g.
a plain integer random seed).

K-FAC: ``KFACUnsupportedLayerError``, ``KFACNoLayersError`` (no layer to precondition,
e.g. a bare ``nn.Dense`` as the whole model), ``KFACShapeError``, ``KFACExamplesError`` (a
layer's input without the batch's examples where its rule needs them, e.g. an interleaved
step whose first argument is not the batch), ``KFACInputsError`` (arrays of the batch
``inputs`` with different first axes), ``KFACLayersTypeError`` (the ``layers.layers`` dict
where the ``KFACLayers`` go, or the ``KFACLayers`` where one ``LayerInfo`` goes),
``KFACOutputError``,
``KFACExactFisherError``, ``KFACFactorShapeError`` (``damped_inverse`` given a factor
that is not square), ``KFACLayerInfoError`` (a hand-built ``LayerInfo`` without
what its rule needs), ``KFACUpdateArgsError`` (a K-FAC transform's ``update`` without
its extra arguments), ``KFACLossError``, ``KFACLossShapeError`` (a loss function that does
not return one loss per example), ``KFACTargetsError`` (targets that do not fit the output
loss).

Interventions and attribution (``perturbkit.interpret``): ``NotEditsError`` (edits
that are not a dict ``{path: edit}``), ``DuplicateEditError`` (two edits of one call, under a
joined and a nested key), ``UnknownEditPathError``
(an edit at a path no selected call has), ``EditShapeError`` (an edit that does not
broadcast to the call's output; ``EditStructureError`` for a value of another pytree structure than
the output), ``AmbiguousEditError`` (one array for a call returning
arrays of different shapes), ``EditViewError`` (an edit's ``view`` of another size than
the call's output), ``PositionOutOfRangeError``, ``AxisLengthMismatchError`` (without
``positions``, calls of other lengths along the swept axis), ``NonScalarMetricError``
(a subclass of ``NonScalarLossError``), ``MetricSignatureError`` (a function that
does not take ``(variables, inputs)``) and ``CallStructureMismatchError`` (clean and
corrupted inputs that make different calls), ``FeatureMapShapeError`` (Grad-CAM at a
call whose output is not a ``(batch, height, width, channels)`` feature map) and
``InterventionParamsError`` (learnable interventions given params of another
structure), ``InterventionOutputError`` (an intervention's ``apply`` returning another
structure, shape or dtype than the output, or None), ``NotInterventionsError`` (interventions that are not a dict of
``perturbkit.interpret`` interventions), ``MetricGapError`` (``PatchingResult.normalized()`` with equal clean and
corrupted metrics) and ``ResultValuesError`` (``PatchingResult.top()``/``plot()`` on
traced or batched values).

NNX (``perturbkit.nnx``): the same ``NoPerturbationPointsError``,
``PerturbationsNotAppliedError`` and ``UnperturbedCallsWarning`` as Linen, with
advice for NNX, and ``CaptureConflictError`` (the loss runs the model inside its
own ``nnx.capture``), ``UninstrumentableModuleError``,
``UnmappedPerturbationError`` (selected calls inside ``nnx.vmap`` whose module
state is not mapped) and ``perturbkit.nnx.SegmentInTransformError``.

Example:
  >>> import perturbkit
  >>> issubclass(perturbkit.errors.SharedSegmentError, perturbkit.PerturbkitError)
  True
"""
import re


class PerturbkitError(Exception):
  """Base class of every error perturbkit raises."""


def _listed(names, limit=8):
  names = list(names)
  return ', '.join(map(str, names[:limit])) + (' ...' if len(names) > limit else '')


class NonScalarLossError(PerturbkitError, TypeError):
  """The loss function returned something other than a real scalar."""

  def __init__(self, shape, dtype):
    super().__init__(
        f'The loss function must return a real scalar, but it returned an array of '
        f'shape {tuple(shape)} and dtype {dtype}. Reduce it first, e.g. with '
        '`jnp.mean(...)`, or return `(loss, aux)` and pass `has_aux=True`.')


class NoPerturbationPointsError(PerturbkitError, ValueError):
  """The filter selected no submodule call."""

  def __init__(self, seen, nnx: bool = False, copies=(), lifted=()):
    seen = list(dict.fromkeys(seen))  # a lifted transform may trace its body twice
    if lifted:
      super().__init__(
          'No selected call got a perturbation point, so there is no activation gradient to '
          f'compute: the calls [{_listed(lifted, 12)}] run inside a lifted transform (nn.scan, '
          'nn.vmap, ...) that does not map the "perturbations" collection. Add '
          '`"perturbations": 0` to its `variable_axes` (e.g. `nn.scan(Block, variable_axes='
          '{"params": 0, "perturbations": 0}, ...)`), or select calls outside it.')
      return
    if copies:
      super().__init__(
          'No selected call got a perturbation point, so there is no activation gradient to '
          f'compute: the calls [{_listed(copies, 12)}] ran on a copy of the model that the '
          f'loss made, whose calls perturbkit does not see. {_COPY_FIX}')
      return
    advice = ('Check the filter (path filters for NNX models are in perturbkit.nnx.filters), '
              'and make sure the loss function calls the model it receives as its first '
              'argument.' if nnx else
              'Check the filter, or make sure the loss function calls '
              '`model.apply(variables, ...)` with the variables it is given.')
    if not seen:
      advice += (' A model call inside a function the loss reuses under jax.jit or '
                 'jax.checkpoint (`apply = jax.jit(model.apply)` made once) is not traced '
                 'again, so no call is seen: call the model directly in the loss, and put '
                 'jax.jit around the perturbkit function instead.')
    super().__init__(
        'The filter selected no submodule call, so there is no activation gradient to '
        f'compute. Calls seen: [{_listed(seen, 12) or "none"}]. {advice}')


# How an NNX loss that runs a copy of the model can run the model itself.
_COPY_FIX = ('A copy made with `nnx.clone(model)`, or with `nnx.merge` of the whole state of '
             '`nnx.split(model)`, has its own perturbation state. Call the model the loss is '
             'given, or split off only the parameters and merge them with the rest: '
             '`graphdef, params, rest = nnx.split(model, nnx.Param, ...)`, then '
             '`nnx.merge(graphdef, new_params, rest)`.')


class UnmatchedFilterError(PerturbkitError, ValueError):
  """A hook's or a wrapped model's filter selected no call."""

  def __init__(self, what, seen):
    super().__init__(
        f'The filter of {what} selects no submodule call, so it would do nothing (a typo in '
        f'a path?). Calls seen: [{_listed(seen, 12) or "none"}]. Check the filter, e.g. '
        "`perturbkit.filters.by_path('Block_0/*')` matches the module paths listed.")


class PerturbationStructureError(PerturbkitError, ValueError):
  """A 'perturbations' tree does not match the perturbation points of the model call."""

  def __init__(self, detail):
    super().__init__(
        f'The perturbations do not match the model call: {detail}. Create them with '
        '`wrapped.init(...)["perturbations"]` for the same inputs, shapes and filter as the '
        'call that uses them.')


class BranchCallsMismatchError(PerturbkitError, TypeError):
  """The branches of an ``nn.cond``/``nn.switch`` (``nnx.cond``/``nnx.switch``) make different
  selected calls."""

  def __init__(self, transform, names):
    modules = ', '.join(repr(p) for p in sorted({n.rsplit('/', 1)[0] for n in names}))
    super().__init__(
        f'Selected calls inside {transform} ([{_listed(names)}]) differ between its branches '
        '(a different submodule in each, or the same one called a different number of '
        'times), so the branches would create different perturbations (the '
        "'perturbations' collection, nnx.Perturbation state) and Flax cannot join them. "
        'Either exclude the calls inside the branches with the filter, e.g. '
        '`filter=perturbkit.filters.negate('
        f'perturbkit.filters.by_path({modules}))`, or compute every branch and select the '
        f'result with `jnp.where(pred, a(x), b(x))` instead of {transform}.')


class BranchesUnseparatedError(PerturbkitError, ValueError):
  """Two ``nn.switch`` (``nn.cond``) calls in a row on one module cannot be told apart."""

  def __init__(self, transform, names):
    modules = ', '.join(repr(p) for p in sorted({n.rsplit('/', 1)[0] for n in names}))
    super().__init__(
        f'The selected calls [{_listed(names)}] inside {transform} would share their points '
        f'with the calls of the {transform} run right before it on the same module: no call '
        'of the model runs between the two, and the second one is given branch functions '
        'the first one was not, so nothing tells where the first ends (its gradients would '
        'be summed). Define the branch functions once and give the same ones to every '
        f'{transform} (e.g. outside a Python loop), or exclude the calls with the filter, '
        'e.g. `filter=perturbkit.filters.negate('
        f'perturbkit.filters.by_path({modules}))`.')


class MapVariablesInitError(PerturbkitError, ValueError):
  """``nn.map_variables(..., init=True)`` in a model run with a mutable collection."""

  def __init__(self, flax_message):
    super().__init__(
        'A call inside nn.map_variables found its mapped collection empty while the model '
        "ran with perturbkit's 'perturbations' collection mutable (Flax: "
        f'{flax_message.splitlines()[0]}). nn.map_variables(..., init=True) initializes its '
        'variables again in every apply that has a mutable collection, where the mapped '
        'collection cannot be written. Pass `init=self.is_initializing()` instead of '
        '`init=True`: the same in `model.init`, and no initialization in `model.apply`.')


class NonDifferentiableOutputError(PerturbkitError, TypeError):
  """A selected submodule call returned no inexact (floating or complex) array."""

  def __init__(self, where, dtypes):
    super().__init__(
        f'The call {where} was selected for a perturbation, but its output has no '
        f'floating-point leaf (leaf dtypes: {dtypes}), so it has no activation gradient. '
        'Exclude it with the filter, e.g. `perturbkit.filters.negate(perturbkit.filters.'
        'by_path(...))`.')


class PerturbationsNotAppliedError(PerturbkitError, RuntimeError):
  """A perturbation point found while tracing was not reached by the differentiated run."""

  def __init__(self, missing, nnx: bool = False):
    advice = ('The loss function must call the model it receives as its first argument, make '
              'the same calls for the same inputs every time it is traced, and not wrap the '
              'model in its own nnx.capture (perturbkit runs the loss inside one).' if nnx else
              'perturbkit traces the loss function once to find the calls and once to '
              'differentiate it: the loss must make the same calls for the same inputs every '
              'time it is traced (a loss that keeps Python state from one call to the next, '
              'a counter or a choice drawn with Python\'s `random`, makes others).')
    super().__init__(
        f'{len(missing)} perturbation point(s) were never reached: [{_listed(missing)}]. '
        + advice)


class TransformTracedOnceError(PerturbationsNotAppliedError):
  """A module inside ``nnx.remat``/``nnx.jit`` is called more than once through one wrapper."""

  def __init__(self, missing):
    PerturbkitError.__init__(
        self, f'{len(missing)} perturbation point(s) were never reached: [{_listed(missing)}]. '
        'Each is a later call of a module through the same nnx.remat or nnx.jit function '
        '(e.g. `f = nnx.remat(g)` called twice on the module). JAX traces such a function '
        'once and replays that trace for the next call with the same shapes, so the later '
        'call would apply the first call\'s perturbation and its own never runs. Wrap each '
        'call in its own transform, e.g. `nnx.remat(g)(self.block, x)` at every call site '
        'instead of one shared `f`, or exclude the calls with the filter.')


class OutsideApplyError(PerturbkitError, TypeError):
  """A Linen submodule was called outside a method call of the model (``bind``, ``nn.apply``)."""

  def __init__(self, where):
    super().__init__(
        f'The call {where} ran outside a method call of the model: on a module bound with '
        '`model.bind(variables)`, in `nn.apply(fn, model)`, or in `model.apply(..., '
        'method=fn)` with a function that is not a method of the model. Activation '
        'gradients, hooks and the interpretability functions take such calls; interleaved '
        "training, per-example gradients and K-FAC replay calls from the model's method "
        "calls. Call a method of the model: `model.apply(variables, x)`, or "
        "`model.apply(variables, x, method='encode')` (or `method=Model.encode`), and put "
        'any code around it in the loss.')


class SegmentationError(PerturbkitError, ValueError):
  """The model call cannot be split into segments as asked."""


class SharedSegmentError(SegmentationError):
  """A segment's params are used other than by one call of the segment's module, or its
  call runs a module with params outside it (one handed to it as an attribute)."""

  def __init__(self, path, why='it is called more than once in one step (shared weights)'):
    super().__init__(
        f'The segment {path!r} cannot be updated inside the backward pass: {why}. '
        "Interleaved updates need every use of a segment's params to be that segment's one "
        'call, because the weights change between uses. Choose segments that contain every '
        'use (e.g. the parent module, `segments=perturbkit.filters.by_path(...)`), or leave '
        'the module out of the segments: the default segments put such params in '
        'perturbkit.REST, updated at the end with their full gradient.')


class NoSegmentError(SegmentationError):
  """No call of the loss can be a segment: every param-owning module failed a check.

  ``reasons`` maps each module to ``(kind, why)``; the message says, for each
  kind, what to change.
  """

  FIXES = {
      'shared': (
          'A loss that applies the model twice (a siamese or contrastive loss) calls every '
          'layer twice: apply it once to the inputs concatenated along the batch axis and '
          'split the output (`out = model.apply(v, jnp.concatenate([a, b])); oa, ob = '
          'jnp.split(out, 2)`). A layer the model itself calls twice is taken whole by a '
          'segment containing every call: `segments=1`, or a filter selecting the module '
          'that makes the calls. A loss that differentiates the model inside itself (an '
          'inner gradient step, as in test-time training or MAML) runs every layer in more '
          'than one pass, with weights that change between them: it has no segments; train '
          'it with the ordinary gradient.'),
      'outside': (
          'Move a loss term on the weights into the optimizer: for `c * sum(w ** 2)`, '
          'chain `optax.add_decayed_weights(2 * c)` before it (`optax.chain('
          'optax.add_decayed_weights(2 * c), optax.adam(1e-3))`), the same gradient. Tied '
          'weights read by two modules are taken whole by a segment containing both reads '
          '(their common parent: `segments=1`, or a filter selecting it).'),
      'output': 'Return from the loss only what changes, not the params (see the reason).',
      'root': (
          'Params created by the root module itself belong to no submodule call: create '
          'them in a submodule (a small module holding the param, called by the root).'),
      'uncalled': 'Call the module in the loss, or leave its params out of the variables.',
      'branch': (
          'Run the conditional or loop inside a module of its own (a submodule that calls '
          '`nn.cond`/`nnx.cond` on itself), whose call then takes it whole.'),
      'transform': (
          'Slice the params along their first axis (Linen: `variable_axes={"params": 0}`; '
          'NNX: `nnx.scan(..., in_axes=0)` over modules made with `nnx.vmap`), or apply '
          'the transform inside a module of its own, whose call then takes it whole.'),
  }

  def __init__(self, reasons):
    by_kind = {}
    for name, (kind, why) in reasons.items():
      by_kind.setdefault(kind, []).append((name or '(root)', why))
    parts = [f'[{_listed(name for name, _ in items)}]: {items[0][1]}. '
             f'{self.FIXES.get(kind, "")}'.strip()
             for kind, items in by_kind.items()]
    super().__init__(
        'No call can be a segment, so the interleaved schedule has nothing to update '
        'inside the backward pass. ' + ' '.join(parts) + ' Otherwise, train with the '
        'ordinary gradient (`jax.grad` and optax).')


class StateMismatchError(PerturbkitError, ValueError):
  """An interleaved state whose params do not fit the model the loss applies."""

  def __init__(self, detail):
    super().__init__(
        'The state does not match the model: its params do not have the shapes the loss '
        f'function\'s model creates ({detail}). Build the state with `init` on variables '
        'from this model (`model.init(...)`), or pass the matching loss function.')


class OptimizerStateError(PerturbkitError, ValueError):
  """An optimizer state does not match the parameters it is used with."""


class ActivationsUnavailableError(PerturbkitError, ValueError):
  """Activations were requested for calls inside a lifted transform."""

  def __init__(self, where, function=None):
    self.where = where
    if function is None:
      super().__init__(
          f'return_activations=True (or return_inputs=True) cannot return the output (or '
          f'inputs) of {where}: it runs inside a transform whose intermediate values do not '
          "come out: it carries out neither a mutable collection nor the call's "
          "perturbation stacked like its output (nnx.vmap with the module's state "
          'broadcast, a branch of nn.cond/nn.switch calling a module made outside it rather '
          'than through the module the transform passes it, '
          'nested scans that stack along other axes than the leading ones, an '
          'nnx.StateAxes that stacks nnx.Perturbation along another axis than the rest of '
          "the module's state, ...). "
          'Exclude such calls with the filter, or leave return_activations off (their '
          'activation gradients are still returned).')
    else:
      super().__init__(
          f'{function} cannot read or edit the output of {where}: it runs inside a transform '
          'whose intermediate values do not come out, neither as they are nor stacked per '
          "iteration (nnx.vmap with the module's state broadcast, a branch of "
          'nn.cond/nn.switch calling a module made outside it rather than through the module '
          'the transform passes it, nested scans that stack '
          'along other axes than the leading ones, an nnx.StateAxes that stacks '
          "nnx.Perturbation along another axis than the rest of the module's state, a "
          'transform that carries no collection out, ...). Leave such calls out with the '
          'filter (e.g. filter=perturbkit.filters.by_path(...) naming calls outside the '
          'transform, such as the module that calls the transformed one), or run a copy of '
          'the model built without the transform on the same variables.')


class CaptureOutsideMethodCallError(ActivationsUnavailableError):
  """A call whose output is read runs inside a lifted transform of a submodule called outside
  every method of the model."""

  def __init__(self, where, function=None):
    self.where = where
    reader = (f'{function} cannot read or edit' if function is not None else
              'return_activations=True (or return_inputs=True) cannot return')
    super(ActivationsUnavailableError, self).__init__(
        f'{reader} the output (or inputs) of {where}: it runs inside a lifted transform '
        '(nn.remat, as with gradient checkpointing, nn.scan, ...) of a submodule that the '
        'function calls outside every method of the model (reached by attribute in the '
        'function given to apply, `method=lambda m, x: m.encoder(x)`, or through '
        '`model.bind(variables)`), where no collection can carry its values out of the '
        'transform. Call the submodule through a method of the model that calls it '
        '(`def encode(self, x): return self.encoder(x)`, `method=Model.encode`), or, where '
        'the transform is inside the submodule (its layers), one that returns it '
        '(`method=lambda m, x: m.get_encoder()(x)`, as Hugging Face\'s model.encode does '
        'with `_get_encoder_module()`).')


class CaptureInJaxTransformError(ActivationsUnavailableError):
  """A call whose output is read runs inside a JAX transform that the function applies itself."""

  def __init__(self, where, function=None):
    self.where = where
    reader = (f'{function} cannot read' if function is not None else
              'return_activations=True (or return_inputs=True) cannot return')
    super(ActivationsUnavailableError, self).__init__(
        f'{reader} the output (or inputs) of {where}: the function runs it inside a JAX '
        'transform of its own (jax.jit, jax.checkpoint, jax.vmap, jax.lax.map, jax.lax.scan, '
        '... around model.apply), whose intermediate values cannot leave it but through its '
        'outputs (kept, they would be leaked tracers). Call model.apply (or the model) '
        'directly in the function, and put the transform around the perturbkit function '
        'instead, e.g. `jax.jit(perturbkit.run_with_cache(model.apply))`, or '
        '`jax.vmap(perturbkit.run_with_cache(lambda v, x: model.apply(v, x[None])[0]), '
        'in_axes=(None, 0))` for one example at a time. A loop the function cannot leave '
        "(jax.lax.while_loop, as in Hugging Face's generate) needs its step read on its own: "
        '`model(ids, params=variables["params"], past_key_values=cache)`. (run_with_edits and '
        'run_with_interventions work inside such transforms: they read nothing out.)')


class DeviceLocalStepWarning(UserWarning):
  """A family that all-reduces over ``axis_name`` runs without it inside ``jax.shard_map`` with
  ``check_vma=False``: each device steps on its own shard alone."""

  def __init__(self, function, axes):
    super().__init__(
        f'{function} runs inside jax.shard_map over {_listed(map(repr, axes))} with '
        'check_vma=False and no axis_name: nothing sums the devices\' gradients (or '
        'statistics) there, so each device steps on its own shard of the batch, the '
        'devices\' params drift apart, and out_specs=P() returns one device\'s. For data '
        f'parallelism pass axis_name={axes[0]!r}; to train each device on its own on '
        'purpose, filter this warning.')


class PerSegmentTransformWarning(UserWarning):
  """Interleaved training given an optimizer with a transformation that looks at the whole
  gradient (``optax.clip_by_global_norm``), which acts on each segment's gradient alone."""

  def __init__(self, function: str, names: list[str]):
    super().__init__(
        f'The optimizer given to {function} contains {_listed(names)}, which looks at the '
        "whole gradient; each segment takes its step before the gradients below it exist, so "
        "it acts on each segment's gradient alone (optax.clip_by_global_norm clips each "
        "segment by that segment's own norm). To clip by the whole gradient's norm, drop it "
        'from the optimizer and pass `clip_global_norm=c` (it uses the previous step\'s '
        'global norm). To act per segment on purpose, filter this warning, or pass a '
        'function `segment_name -> GradientTransformation`.')


class UnperturbedCallsWarning(UserWarning):
  """Selected calls inside a lifted transform that cannot carry perturbations."""

  def __init__(self, names, nnx: bool = False, copies: bool = False,
               nested_apply: bool = False):
    if nested_apply:
      super().__init__(
          f'{len(names)} selected call(s) run inside an `apply` made within a call of the '
          'model on variables given to it (`inner.apply(inner_variables, h)` in a method of '
          'the model, the variables closed over rather than the model\'s own), so they get '
          'no perturbation point, no activation gradient and no cached output: '
          f'[{_listed(names)}] (named by their paths in that inner model). To read, edit or '
          'differentiate them, make the inner model a submodule of the model (an attribute '
          'or a field, its params then in the model\'s variables), or call it as '
          '`self.inner.apply(...)` on a submodule `self.inner` of the same type, which is '
          'that call; to silence this, exclude the calls with the filter.')
      return
    if copies:
      super().__init__(
          f'{len(names)} selected call(s) ran on a copy of the model that the loss made, so '
          f'they get no perturbation point and no activation gradient: [{_listed(names)}]. '
          f'{_COPY_FIX} To silence this, exclude the calls with the filter.')
      return
    if nnx:
      where = ('an NNX transform that broadcasts the module\'s state (nnx.scan, nnx.vmap, '
               '...), carries the module from step to step (nnx.fori_loop, '
               'nnx.while_loop, or nnx.scan with it in the carry, as nnx.RNN does with its '
               'cell: one point for every step would sum the steps) or runs it in branches '
               'that cannot share their points (nnx.cond or nnx.switch with graph=False or '
               'graph_updates=False, or an nnx.cond and an nnx.switch nested in each other)')
      fix = ('with nnx.scan or nnx.vmap, let the transform map the perturbations, e.g. '
             '`nnx.scan(f, in_axes=(nnx.StateAxes({nnx.Perturbation: 0, ...: None}), '
             'nnx.Carry))`; nnx.fori_loop and nnx.while_loop cannot map the module\'s state: '
             'write the loop as a Python `for` loop (one point per iteration) or as such an '
             'nnx.scan; the call that runs the transform (an nnx.RNN) has its own point, every '
             'step included; for nnx.cond or nnx.switch, run it in graph mode (the default), '
             'write the nested one as the same kind as the outer one, or compute the branches '
             'and select the result with `jnp.where(pred, a(x), b(x))`')
    else:
      where = ('a lifted transform (nn.scan, nn.vmap, ...) that does not map the '
               '"perturbations" collection, in nn.while_loop, whose iterations would share '
               'one point, or in nn.map_variables (nn.WeightNorm, nn.SpectralNorm), whose '
               'function may transform the perturbations with the weights')
      fix = ('add `"perturbations": <axis>` to the transform\'s `variable_axes` (e.g. '
             '`nn.scan(Block, variable_axes={"params": 0, "perturbations": 0}, ...)`); '
             'nn.while_loop cannot map it: write the loop as such an nn.scan or as a Python '
             '`for` loop (one point per iteration); inside nn.map_variables, the call that '
             'runs it (WeightNorm_0/__call__) has its own point, with the same output as '
             'the layer it wraps')
    super().__init__(
        f'{len(names)} selected call(s) run inside {where}, so they get no perturbation '
        f'point and no activation gradient: [{_listed(names)}]. For per-iteration gradients '
        f'{fix}; to silence this, exclude the calls with the filter.')


class MissingHasAuxError(NonScalarLossError):
  """The loss function returned a tuple, list or dict where a scalar loss was expected."""

  def __init__(self, returned: str, has_aux_option: bool = True):
    fix = ('If it returns `(loss, aux)`, pass `has_aux=True`; otherwise return the loss alone, '
           'e.g. `jnp.mean(...)`.' if has_aux_option else
           'This function takes no auxiliary output (it has no has_aux option): return the '
           'loss alone and compute the other values separately.')
    PerturbkitError.__init__(
        self, f'The loss function must return a real scalar, but it returned {returned}. {fix}')


class HasAuxOutputError(PerturbkitError, TypeError):
  """With ``has_aux=True`` the loss function did not return a ``(loss, aux)`` pair."""

  def __init__(self, returned: str):
    super().__init__(
        f'With has_aux=True the loss function must return a pair `(loss, aux)`, but it '
        f'returned {returned}. Return the tuple `(loss, aux)`, or drop has_aux=True if the '
        'function returns the loss alone.')


class LossNotCallableError(PerturbkitError, TypeError):
  """The loss function (or the metric, prediction or hooked function) given is not callable
  (often: its value was passed instead)."""

  def __init__(self, function: str, got: str, signature: str, what: str = 'loss function',
               name: str = 'loss_fn'):
    super().__init__(
        f'{function} takes the {what} itself, a callable `{signature}`, but it was '
        f'given {got}. Pass the function, not its value: `{function}({name})`, not '
        f'`{function}({name}(...))`.')


class WrongFrontEndError(PerturbkitError, TypeError):
  """A Linen function was given an NNX model, or an NNX function a Linen one."""

  def __init__(self, function: str, got: str, use: str):
    api = 'NNX' if function.startswith('perturbkit.nnx.') else 'Linen'
    super().__init__(f'{function} is for Flax {api} models, but it was given {got}. {use}')


class NotVariablesError(PerturbkitError, TypeError):
  """A Linen function was given something other than the model's variables."""

  def __init__(self, function: str, got: str, hint: str):
    super().__init__(
        f"{function} takes the model's variables, the dict `model.init(key, *args)` returns "
        f"(with a 'params' collection), but it was given {got}. {hint}")


class UninitializedStateError(PerturbkitError, TypeError):
  """``step`` was given something other than the state ``init`` returns."""

  def __init__(self, got: str, init_call: str):
    super().__init__(
        f'`step` takes the state that `init` returns, but it was given {got}. Call '
        f'`state = {init_call}` first and pass that state to `step`, then the state each '
        'step returns to the next: `state, metrics = trainer.step(state, *args)`.')


class InputMismatchError(PerturbkitError, ValueError):
  """``step`` was given inputs of other shapes than those the state was initialised with."""

  def __init__(self, changes: list[str], init_call: str):
    super().__init__(
        f'The inputs differ from those the state was initialised with: {"; ".join(changes)}. '
        'The state\'s params were made for the inputs given to `init`, and the model cannot '
        'run on these. Pass inputs of the shapes given to `init` (a different batch size is '
        'fine); if the model is meant to take the new inputs, build its variables and '
        f'state for them: `state = {init_call}`.')


class NotAnOptimizerError(PerturbkitError, TypeError):
  """The optimizer is not an optax transformation or a function returning one."""

  def __init__(self, got: str, hint: str = '', per_segment: bool = True):
    alternative = (' or a function `segment_name -> GradientTransformation`' if per_segment
                   else '')
    super().__init__(
        'The optimizer must be an `optax.GradientTransformation` (e.g. `optax.adam(1e-3)`)'
        f'{alternative}, but {got}.' + (f' {hint}' if hint else ''))


class SegmentOptimizerError(PerturbkitError, ValueError):
  """Interleaved training's optimizer fails to set up on one segment's params alone."""

  def __init__(self, name: str, error: Exception):
    group = ('the params no segment owns' if name == '<rest>' else f'segment {name!r}')
    super().__init__(
        f"The optimizer could not be set up for the params of {group} alone "
        f'({type(error).__name__}: {str(error).splitlines()[0][:200]}). Interleaved training '
        "gives each segment's params their own optimizer state, so a transformation built "
        'for the whole params tree (a mask tree in `optax.masked` or `optax.adamw(mask=...)`, '
        'a label tree in `optax.multi_transform`) does not fit a segment\'s subtree. Give '
        'the mask or labels as a function of the params it is given, e.g. '
        '`mask=lambda params: jax.tree.map(lambda w: w.ndim > 1, params)`, or pass a '
        'function `segment_name -> GradientTransformation`.')


class KFACTargetsError(PerturbkitError, ValueError):
  """Targets that do not fit a K-FAC output loss (e.g. one-hot labels for the categorical)."""

  def __init__(self, loss: str, want: str, got: str, fix: str):
    super().__init__(f'The K-FAC loss {loss} takes targets {want}, but it got {got}. {fix}')


class InvalidOptionError(PerturbkitError, ValueError):
  """An option has a value it cannot take (a number out of range, a missing companion)."""

  def __init__(self, name: str, value: object, allowed: str):
    super().__init__(
        f'{name}={value!r} is not a valid value: {name} must be {allowed}. Change the '
        'option where it is given.')


class ReductionMismatchError(PerturbkitError, ValueError):
  """The loss combines the examples' terms otherwise than ``reduction`` says."""

  def __init__(self, reduction: str, found: str, detail: str):
    super().__init__(
        f"reduction={reduction!r} was given, but the loss is a {found} over the examples: "
        f'{detail}. With the wrong reduction every per-example gradient (its norm, its '
        f'clipping) is off by the number of examples. Pass reduction={found!r}, or make '
        f'the loss a {reduction} over the examples (e.g. `jnp.{reduction}(terms)`).')


class ReductionCheckError(PerturbkitError, ValueError):
  """The loss fails on the few examples that the check of its reduction runs it on."""

  def __init__(self, reduction: str, error: Exception):
    super().__init__(
        f"On the first call (or trace), perturbkit checks that the loss is a {reduction} over "
        f"the examples (reduction={reduction!r}): it runs the loss on the first example alone "
        'and on that example given twice, and for a sum also on the first two examples, '
        'i.e. on batches of 1 and 2 examples. The loss failed on such a batch: '
        f'{type(error).__name__}: {str(error)[:300]}. A model or loss that hard-codes the '
        'batch size (a reshape to a fixed number of rows, a constant with one row per '
        'example) cannot run there. Take the batch size from the input instead '
        '(`h.reshape(x.shape[0], ...)`, or `-1` for the batch axis), and pass arrays shared '
        'by all examples as arguments with `batch_axes=None` for them. The check cannot '
        'be skipped: the loss must run on any number of examples.')


class PRNGKeyError(PerturbkitError, TypeError):
  """A random key that is not one JAX PRNG key (a plain integer seed, an array of keys)."""

  def __init__(self, where: str, got: str, several: bool = False):
    shard = (' Under jax.shard_map give one key to every device (its in_specs entry `P()`), '
             'not keys split per device (`P(\'data\')`).' if several else '')
    super().__init__(
        f'{where} needs a JAX random key, got {got}. Pass one `jax.random.key(seed)` (or '
        'a raw `jax.random.PRNGKey(seed)`), and a different one at every step, e.g. '
        f'`jax.random.fold_in(key, state.step)`.{shard}')


class KFACUnsupportedLayerError(PerturbkitError, TypeError):
  """A call selected for K-FAC has no curvature rule."""

  def __init__(self, where: str, reason: str, exclude: str | None = None):
    exclude = exclude or '`perturbkit.filters.by_type(nn.Dense, nn.Conv, nn.Embed)`'
    super().__init__(
        f'The call {where} was selected for K-FAC, but {reason}. K-FAC has rules for '
        '`nn.Dense`, `nn.Conv` (feature_group_count=1, no mask), `nn.Embed`, Hugging Face\'s '
        '`FlaxConv1D` and `nn.LayerNorm`/`nn.RMSNorm` over the last axis (and their NNX '
        'twins) `__call__`s whose params no other code reads (inside nn.scan/nn.vmap, '
        'with the params and the perturbations stacked along axis 0). Leave the filter at its '
        'default (unsupported layers are then listed in `layers.skipped` and their params '
        f'go to the fallback transform) or exclude the call, e.g. {exclude}.')


class KFACNoLayersError(PerturbkitError, ValueError):
  """K-FAC was given no layer to precondition."""

  def __init__(self, function: str, skipped: dict):
    super().__init__(
        f'{function} has no K-FAC layers to estimate: every module that owns params was '
        f'skipped, with the reasons {skipped}. Fix what a reason says: a model that is one '
        'layer (`model = nn.Dense(3)`) must be wrapped in a module (`nn.Sequential('
        '[nn.Dense(3)])`, NNX: `nnx.Sequential(nnx.Linear(...))`), with the variables and '
        'the layers built from that model; or train without K-FAC (a plain optax '
        'optimizer) where no layer has a rule.')


class KFACLossError(PerturbkitError, ValueError):
  """The loss given to K-FAC has no predictive distribution to sample from."""

  def __init__(self, loss: object, fisher: str):
    super().__init__(
        f'K-FAC cannot sample labels from the model for the loss {loss!r} '
        f"(fisher={fisher!r}): it does not name a predictive distribution. Pass "
        "`perturbkit.categorical_output()` (or 'softmax_cross_entropy', "
        '`optax.softmax_cross_entropy_with_integer_labels`) for logits, '
        "`perturbkit.gaussian_output(variance)` (or `optax.l2_loss`, 'squared_error' for "
        "`optax.squared_error`) for regression, or use `fisher='empirical'` with a per-example "
        'loss `(output, targets) -> losses of shape (batch,)`.')


class KFACLossShapeError(PerturbkitError, ValueError):
  """A K-FAC loss function that does not return one loss per example."""

  def __init__(self, loss: str, shape: tuple, output_shape: tuple):
    super().__init__(
        f'The K-FAC loss {loss} returned losses of shape {shape} for an output of shape '
        f'{output_shape}; it must return one loss per example, of shape '
        f'({output_shape[0]},). Sum it over the other axes, as the named losses do (a '
        "sequence's loss is the sum over its tokens), e.g. `lambda out, y: "
        'my_loss(out, y).reshape(out.shape[0], -1).sum(axis=1)`; taking their mean '
        'instead is the same loss divided by their number, which also divides the '
        'gradient and the Fisher.')


class KFACShapeError(PerturbkitError, ValueError):
  """Kronecker factors, params or gradients whose shapes do not match the layers."""

  def __init__(self, layer: str, detail: str):
    super().__init__(
        f'K-FAC layer {layer!r}: {detail}. The K-FAC state was built for another model '
        '(or the model changed). Call `perturbkit.kfac_layers(...)` again on the current '
        'model and re-create the preconditioner and its state with `tx.init(params)`.')


class KFACExamplesError(PerturbkitError, ValueError):
  """A K-FAC layer's input does not have the batch's examples where its rule needs them."""

  def __init__(self, layer: str, detail: str, fix: str):
    super().__init__(f'K-FAC layer {layer!r}: {detail}, so its factors would be averaged over '
                     f'another number of examples than the batch has. {fix}')


class KFACInputsError(PerturbkitError, ValueError):
  """The arrays of K-FAC's batch ``inputs`` do not agree on the number of examples."""

  def __init__(self, function: str, first_axes: str):
    super().__init__(
        f'{function} counts the batch\'s examples on the first axis of the arrays of '
        f'`inputs`, and they disagree: {first_axes}. Every array in `inputs` must have the '
        'examples on its first axis. Pass arrays shared by every example (a mask over '
        'positions, a table) through predict_fn instead, as a closure or with '
        '`functools.partial(predict, mask=mask)`, and keep only the batch in `inputs`.')


class KFACLayersTypeError(PerturbkitError, TypeError):
  """A K-FAC function was given something else than the layers it takes."""

  def __init__(self, function: str, want: str, got: str, fix: str):
    super().__init__(f'{function} takes {want}, but it was given {got}. {fix}')


class KFACOutputError(PerturbkitError, TypeError):
  """``predict_fn`` does not return the one floating-point output K-FAC differentiates."""

  def __init__(self, got: str, has_aux: bool):
    hint = ('With has_aux=True, predict_fn must return (output, aux).' if has_aux else
            'A model with BatchNorm in train mode (or another mutable collection) returns '
            '(output, updates) from `model.apply(..., mutable=[...])`: pass '
            '`has_aux=True` to kfac_estimator, and estimate returns the updates as a fourth '
            'value.')
    super().__init__(
        f'For K-FAC, predict_fn must return one floating-point array (the logits or '
        f'predictions), got {got}. {hint}')


class KFACExactFisherError(PerturbkitError, ValueError):
  """``fisher='exact'`` for an output that is not ``(batch, k)``."""

  def __init__(self, shape: tuple):
    super().__init__(
        f"fisher='exact' takes the expectation over every output unit, one backward lane "
        f'each, and needs an output of shape (batch, k); got {tuple(shape)}. Use '
        "fisher='sampled' (the same Fisher in expectation, one lane) or fisher='empirical' "
        'for outputs with more axes, such as a sequence\'s logits.')


class KFACUpdateArgsError(PerturbkitError, TypeError):
  """A K-FAC transform's ``update`` was called without the arguments it needs."""

  def __init__(self, detail: str):
    super().__init__(detail)


class PerExampleError(PerturbkitError, ValueError):
  """Per-example gradients are not defined, or not available, for this loss."""


class ExamplesMixedError(PerExampleError):
  """The loss mixes examples, so no example has a gradient of its own."""

  def __init__(self, detail):
    super().__init__(
        f'Per-example gradients are not defined for this loss: {detail}. They exist only '
        'when the loss is a sum or mean of one term per example, each term depending on '
        'its own example alone. BatchNorm in training mode, a loss over batch '
        'statistics or over pairs of examples (a contrastive loss) makes every term '
        'depend on the whole batch. Use a per-example normalization instead '
        '(nn.LayerNorm, nn.GroupNorm), or BatchNorm with `use_running_average=True`; a '
        'pairwise loss has no per-example gradients.')


class ExamplesCoupledError(ExamplesMixedError):
  """DP-SGD's loss computes an example's term from other examples' values too."""

  def __init__(self, detail):
    PerExampleError.__init__(
        self,
        "DP-SGD needs each example's loss term computed from that example alone, and here "
        f"{detail}. Then removing one example also changes the other examples' gradients, "
        'so clipping each to clip_norm no longer bounds the change of their sum, and the '
        'noise does not give the privacy it is set for. For a token mean over the whole '
        "batch (`jnp.sum(l * mask) / jnp.sum(mask)`), average each example's tokens by its "
        'own count, `jnp.mean(jnp.sum(l * mask, 1) / jnp.maximum(jnp.sum(mask, 1), 1))`, or '
        'divide by a fixed number (the expected token count); normalize inputs per example '
        "or with fixed statistics, not with their batch's. `per_example_grad_norms` accepts "
        'such a loss: its norms are those with the batch quantity held fixed.')


class ExamplesAxisError(PerExampleError):
  """The examples axis of the inputs or of a layer's activations does not line up."""

  def __init__(self, detail):
    super().__init__(
        f'The examples axis does not line up: {detail}. The loss arguments are split '
        'along `batch_axes` (default: axis 0 of every array argument; `None` for an '
        'argument shared by all examples), and every layer must see the examples on axis '
        '0 of its input and output. Pass `batch_axes=` to match your data layout, or '
        'move the examples axis to the front inside the model.')


class BatchNotArrayError(ExamplesAxisError):
  """A batched argument is a Python list (or tuple) of numbers (a batch written as nested
  lists), which has no examples axis."""

  def __init__(self, where, kind):
    PerExampleError.__init__(
        self,
        f'{where} is a Python {kind} of numbers (a batch written as nested lists?), not an '
        'array, so it has no examples axis to split: per-example functions find the examples '
        'along `batch_axes` of array arguments. Pass it as an array (`np.asarray(batch)` or '
        '`jnp.asarray(batch)`), or give it `None` in `batch_axes` if all examples share it.')


class UncoveredParamsError(PerExampleError):
  """Some params are not used by any submodule call, so their per-example gradient is unknown."""

  def __init__(self, names, nnx: bool = False):
    how = ('Per-example gradients of an NNX model come from the calls of the submodules '
           'that own the params, so params that no call in the loss uses have none. Leave '
           'unused params out of the model, or call their module.' if nnx else
           'Per-example gradients come from the model\'s calls inside the loss\'s '
           '`model.apply` (each call, or the whole apply replayed per example), so params that '
           'no call and no apply in the loss uses have none. Leave unused params out of the '
           'variables the loss is given, or use them inside the model.')
    super().__init__(
        f'{len(names)} param-owning module(s) are not reached through a submodule call: '
        f'[{_listed(names)}]. {how}')


class ParamsReadOutsideError(PerExampleError):
  """A module's params are also read outside its calls, a part of their gradient no call sees."""

  def __init__(self, reads, nnx: bool = False):
    listed = '; '.join(f'{name} (read by {", ".join(sorted(what))})'
                       for name, what in sorted(reads.items()))
    if nnx:
      super().__init__(
          f'The params of {listed} are read outside the calls of the submodule that owns '
          'them, where no per-example replay of a call of the whole model (`model(x)` in '
          'the loss) covers them. Per-example gradients of an NNX model come from the calls '
          'of its modules and of the model (their inputs and output gradients), so the part '
          'of the gradient flowing through such a read would be missing from the norms and '
          'from the clipping. Such reads are a weight penalty in the loss, a weight used '
          'inline in the loss (`h @ model.embed.embedding[...].T`), or reads inside the '
          'model when the loss never calls the whole model, or calls it on inputs that do '
          'not hold the examples on axis 0. Compute a weight penalty outside the per-example '
          'loss (or use `optax.add_decayed_weights`), and move other uses of a weight into '
          'the model.')
      return
    super().__init__(
        f'The params of {listed} are also read in the loss outside every `model.apply`. '
        'Per-example gradients come from the model\'s calls and applies (a weight tied or '
        'reused inside the model is covered), so the part of the gradient flowing through a '
        'read in the loss itself would be missing from the norms and from the clipping. Such '
        'reads are a penalty on the weights (L2) or a weight used inline in the loss '
        '(`h @ variables["params"]["embed"]["embedding"].T`). Compute a weight penalty '
        'outside the per-example loss (add its gradient to the result, or use '
        '`optax.add_decayed_weights`), and move other uses of a weight into the model.')


class AmbiguousInputError(PerExampleError):
  """A call's input has as many rows as there are examples but is not computed from the batch."""

  def __init__(self, where, index, shape):
    super().__init__(
        f'Input {index} of the call {where} has shape {shape}: as many rows as there are '
        'examples, but it is computed from none of the loss\'s arguments or variables (a '
        'constant such as `jnp.arange`, or an array the loss closes over). perturbkit cannot '
        'tell whether its rows are the examples (positions broadcast to the batch) or it is '
        'shared by all examples and happens to have that many rows, so it does not guess. '
        'Pass the array as an argument of the loss: batched (`batch_axes` 0) if its rows are '
        'the examples, or with `batch_axes` None if it is shared. Arrays made with '
        '`jnp.zeros_like(ids)` or `jnp.ones_like(ids)` are such constants too: they do not '
        'read the values of `ids`. For Hugging Face models this is usually an id array left '
        'to its default or made inside the loss, e.g. `position_ids` (position_embeddings) '
        'or `token_type_ids` (token_type_embeddings): build it outside the loss, e.g. '
        '`jnp.broadcast_to(jnp.arange(length), ids.shape)` or `jnp.zeros_like(ids)`, pass it '
        'to the loss as a batched argument, and from there to the model. (A call run inside a JAX '
        'transform within the loss, such as `jax.checkpoint` or `jax.jit` around '
        '`model.apply`, also shows its inputs this way; per-example gradients need the '
        'calls traced directly.)')


class SharedCallError(PerExampleError):
  """A param-owning call has no per-example input, so its output gradient sums over the examples."""

  def __init__(self, where, nnx: bool = False):
    if nnx:
      replay = ('the model call it runs in (`model(x)`, replayed per example); this error means '
                'that call cannot be replayed per example either: the call is made by the loss '
                'itself, outside any call of the model, or the model call is given an input made '
                'in the loss from no batched argument, or it runs inside a transform within the '
                'loss (`nnx.remat`, `nnx.jit` or `jax.checkpoint` around the model call). A term '
                'of the loss computed from the params alone (a penalty, a method of the model '
                'called on no batched input)')
    else:
      replay = ('its `model.apply` (replayed per example); this error means that apply cannot '
                'be replayed per example either: it is given an input made in the loss from no '
                'batched argument, or it runs inside a JAX transform within the loss '
                '(`jax.checkpoint`, `jax.jit` around `model.apply`). A term of the loss '
                'computed from the params alone (a penalty the model computes, '
                '`model.apply(variables, method=...)` on no batched input)')
    super().__init__(
        f'The call {where} has no per-example input: none of its inputs is computed from '
        'the batched arguments of the loss (`batch_axes`), so its output is the same for '
        'every example and the gradient at it is already summed over the examples. The '
        'per-example gradients of its params cannot be separated from that sum. Apply the '
        'module to per-example inputs (for a positional embedding, pass the positions as '
        'a batched argument of the loss), and pass the batch to the loss as an argument '
        'rather than closing over it. A call inside the model that builds such inputs itself '
        '(Whisper\'s encoder looks up `jnp.arange(max_source_positions)`) is covered by '
        f'{replay} belongs to no example: leave it out of this loss and add its gradient to '
        'the result.')


class RandomCallError(PerExampleError):
  """A call replayed per example draws random numbers (dropout inside a param-owning module)."""

  def __init__(self, where, detail):
    super().__init__(
        f'The call {where} draws random numbers ({detail}) and its params have no fast '
        'per-example rule, so their per-example gradients come from replaying the call on '
        'its own. A replay cannot draw the random numbers the batched forward pass drew '
        '(its dropout mask), so its gradients would not be those of the loss. Make the call '
        'deterministic for the per-example step (e.g. `deterministic=True` for the dropout '
        'inside this module), or draw the randomness outside the module that owns the '
        'params (dropout applied by the parent to the module\'s output, or to its input, '
        'is supported: it is part of the recorded forward pass).')


class RandomApplyReplayError(RandomCallError):
  """A whole ``apply`` (NNX: model call) replayed per example draws random numbers (e.g.
  dropout in layers run inside ``nn.remat``, as with Hugging Face's gradient checkpointing)."""

  def __init__(self, where, detail, nnx: bool = False):
    if nnx:
      cases = ('the whole model call is replayed per example: some params it runs get no '
               'per-example gradient from their own calls. That is the case for the params of '
               'modules run inside nnx.remat or nnx.scan, of the model itself, read outside '
               'their module\'s calls, or of a call on an input the model makes itself (a '
               'position embedding looked up at `jnp.arange`), as help(perturbkit.per_example), '
               '"Flax NNX", says. ')
      fix = ('Take the per-example step with the model in `model.eval()` (or its dropout '
             'layers `deterministic=True`).')
    else:
      cases = ('the whole apply is replayed per example: some params it holds get no '
               'per-example gradient from their own calls. That is the case for every module '
               'run inside nn.remat, nn.checkpoint or nn.scan (Hugging Face\'s '
               '`gradient_checkpointing=True`, scanned layers), for params of the root module, '
               'for params read outside their module\'s calls, for a module.apply nested in the '
               'model (other than a tied output head), and for the other cases in '
               'help(perturbkit.per_example), "Replaying the whole apply". ')
      fix = ('Build the model without gradient checkpointing for the per-example step (its '
             'layers\' calls then record the batched pass\'s random numbers, dropout between '
             'layers included), or make the apply deterministic (`deterministic=True`, no '
             '`rngs`).')
    super(RandomCallError, self).__init__(
        f'The {where} draws random numbers ({detail}), and {cases}A replay of one example '
        'cannot draw the random numbers the batched forward pass drew (dropout masks, random '
        'attention blocks), so its gradients would not be those of the loss. ' + fix)


class OptaxPrivacyError(PerExampleError):
  """optax's per-example DP transformation was given gradients without an examples axis."""

  def __init__(self, where, given):
    super().__init__(
        f'{where} was given an optimizer containing `optax.contrib.'
        'differentially_private_aggregate` (or `optax.contrib.dpsgd`), which clips and '
        'noises per-example gradients: it takes the first axis of every gradient leaf for '
        f'the examples. It would receive {given} and clip rows of the weight gradients '
        'instead. For DP-SGD on an unmodified model use `perturbkit.dp_sgd(loss_fn, '
        'optax_optimizer, clip_norm=..., noise_multiplier=...)` with a plain optax optimizer '
        '(it clips and noises itself), or `perturbkit.private_grad`. The interleaved '
        'schedule does not combine with per-example clipping.')


class InterleavedClippingError(PerExampleError):
  """Per-example clipping (DP-SGD) was combined with the interleaved schedule."""

  def __init__(self, how):
    super().__init__(
        f'{how}. DP-SGD clips each example\'s gradient by its norm over ALL layers, which is '
        'known only when the whole backward pass is done, while the interleaved sweep '
        'updates each segment as soon as its own gradient exists, before the layers below '
        'it are reached; the two cannot be combined. Train privately with '
        '`perturbkit.dp_sgd(loss_fn, optax_optimizer, ...)` (the standard schedule), or use '
        '`perturbkit.interleaved` without per-example clipping (its `clip_global_norm` clips '
        'the batch gradient, which gives no privacy).')


class UninstrumentableModuleError(PerturbkitError, TypeError):
  """A submodule's class cannot be given perturbkit's dispatching subclass."""

  def __init__(self, where, cls, cause):
    super().__init__(
        f'The submodule at {where!r} ({cls.__module__}.{cls.__qualname__}) cannot be '
        f'instrumented ({type(cause).__name__}: {cause}). For the duration of the call '
        'perturbkit gives every submodule a subclass of its own class, which needs a class '
        'that can be subclassed without extra class arguments and instances that allow '
        '`__class__` assignment. Make the module an ordinary nnx.Module subclass, or place '
        '`self.perturb(...)` by hand in its parent.')


class CaptureConflictError(PerturbkitError, RuntimeError):
  """The loss runs the model inside its own ``nnx.capture``."""

  def __init__(self, where):
    super().__init__(
        f'The call {where} runs inside an nnx.capture that the loss function opened '
        'itself. perturbkit runs the loss inside its own nnx.capture(..., '
        'nnx.Perturbation), and a capture opened inside it replaces it for every module, '
        'so the perturbation points would be lost. Call the model directly in the loss; '
        'to collect intermediates as well, sow them and read them outside '
        '(or use return_activations=True).')


class UnmappedPerturbationError(PerturbkitError, ValueError):
  """Selected calls inside ``nnx.vmap`` whose module state is not mapped."""

  def __init__(self, names):
    super().__init__(
        f'{len(names)} selected call(s) run inside an NNX transform that maps its inputs '
        f'(nnx.vmap) while the module\'s state is broadcast (in_axes=None): '
        f'[{_listed(names)}]. A perturbation there would be shared by every mapped '
        'example, so its gradient would be the SUM over them, not the per-example '
        'activation gradient. Map the perturbations with the module, e.g. '
        '`nnx.vmap(f, in_axes=(nnx.StateAxes({nnx.Perturbation: 0, ...: None}), 0))`, or '
        'exclude the calls with the filter.')


class NotEditsError(PerturbkitError, TypeError):
  """The edits are not a dict ``{call path: edit}`` of ``perturbkit.interpret`` edits."""

  def __init__(self, where, got):
    super().__init__(
        f"Got a {got} for {where}, but edits are a dict from a call's path to an edit, "
        "{'Dense_0/__call__': edit} or nested like run_with_cache's outputs "
        "({'Dense_0': {'__call__': edit}}), each edit built with perturbkit.interpret.replace, "
        'add, scale, zero_ablate or mean_ablate.')


class DuplicateEditError(PerturbkitError, ValueError):
  """The edits give one call two edits (a joined key and a nested one for the same path)."""

  def __init__(self, path):
    super().__init__(
        f'The edits give {path!r} two edits: once as a joined key and once nested (or under '
        "two keys that join to the same path, such as {'Dense_0/__call__': e1, 'Dense_0': "
        "{'__call__': e2}}). One of them would be dropped. Keep one edit per call; to apply "
        'several in turn, use perturbkit.run_with_interventions with one intervention each '
        '(interventions at the same call apply in order).')


class UnknownEditPathError(PerturbkitError, KeyError):
  """An edit names a path that no selected call has."""

  def __init__(self, path, known):
    iterations = [k for k in known if str(k).startswith(f'{path}[')]
    scanned = (f' {path} runs once per iteration of a scan (nn.scan, nnx.scan): edit one '
               f'iteration of it, {iterations[0]!r} to {iterations[-1]!r} (the cache holds '
               'its outputs stacked along the scan axis).') if iterations else ''
    module = str(path).rpartition('/')[0]
    own = [k for k in known if str(k).rpartition('/')[0] == module]
    # A module's calls, where the edit names one it does not make (a third call of a module
    # called twice; Hugging Face's generate: the prompt's call, then one inside its loop).
    calls = (f' The selected calls of {module} are {_listed(own, 12)}.'
             if module and own and not iterations else '')
    super().__init__(
        f'There is an edit at {path!r}, but no selected call has that path.{scanned}{calls} '
        f'The calls with points are: {_listed(known, 12)}. Key an edit by the call\'s path and '
        "point key as in run_with_cache's outputs ({'Dense_0': {'__call__': edit}} or "
        "{'Dense_0/__call__': edit}), or widen the filter to select that call.")

  def __str__(self):
    return str(self.args[0])


class EditShapeError(PerturbkitError, ValueError):
  """An edit's values do not broadcast to the output of the call it edits."""

  def __init__(self, where, field, shape, output_shape):
    super().__init__(
        f'The edit at {where} has {field} of shape {tuple(shape)}, which does not broadcast '
        f'to the call\'s output of shape {tuple(output_shape)}. Give an array of the '
        'output\'s shape or one that broadcasts to it (a scalar, or with 1 on the axes to '
        'share); a value cached for other inputs (another batch size or length) does not fit.')


class EditStructureError(EditShapeError):
  """An edit's value is a pytree of another structure than the output of the call it edits."""

  def __init__(self, where, field, value, output):
    super(EditShapeError, self).__init__(
        f'The edit at {where} has {field} of structure {value} (leaf shapes), while the call\'s '
        f'output, as an edit sees it, is {output}: its floating-point arrays only, as '
        "run_with_cache's outputs hold it for this call (a dataclass output with an integer "
        'or None field becomes the tuple of its floating-point arrays). Give the value in '
        'exactly that structure (every key of a dict, no other; e.g. the cached output of '
        'this call), one array or scalar for every array of the output, or pick the arrays '
        'with leaves= (the sweeps, steering_vector, gates).')


class AmbiguousEditError(PerturbkitError, ValueError):
  """One array given as the edit of a call that returns several arrays of different shapes."""

  def __init__(self, where, field, shape, output_shapes):
    super().__init__(
        f'The edit at {where} has {field} of shape {tuple(shape)}, one array, while the call '
        f'returns {len(output_shapes)} arrays of different shapes '
        f'{[tuple(s) for s in output_shapes]} (an attention\'s output beside its weights, '
        'say). It would be added to (or multiply) each of them where it happens to '
        'broadcast. Give one value per array, in the structure of the call\'s output (0 or 1 '
        'for the arrays to leave alone), or pick the arrays with leaves= (the sweeps, '
        'steering_vector, gates).')


class EditViewError(PerturbkitError, ValueError):
  """An edit's ``view`` does not hold the elements of the output of the call it edits."""

  def __init__(self, where, view, output_shape):
    super().__init__(
        f'The edit at {where} views the output of shape {tuple(output_shape)} as {tuple(view)}, '
        'which does not hold the same number of elements. Give view= a shape of the output\'s '
        'size, with -1 for one axis to infer (e.g. (-1, tokens, heads, head_dim) for a '
        '(batch, tokens, heads * head_dim) output, then positions=[head], axis=2).')


def _leaf(leaf: tuple[int, int] | None) -> str:
  return '' if leaf is None or leaf[1] == 1 else f' (array {leaf[0]} of the {leaf[1]} it returns)'


class PositionOutOfRangeError(PerturbkitError, IndexError):
  """A position index is outside the call's output along the edited axis.

  ``leaf``: ``(index, count)`` of the output's array that lacks the position,
  for a call returning several arrays.
  """

  def __init__(self, where, positions, axis, shape, leaf: tuple[int, int] | None = None):
    size = shape[axis] if -len(shape) <= axis < len(shape) else None
    within = (f'in [-{size}, {size}) along that axis' if size is not None else
              f'along an axis the output has (it has {len(shape)})')
    super().__init__(
        f'Position(s) {positions} are out of range for axis {axis} of the output of {where}'
        f'{_leaf(leaf)}, of shape {tuple(shape)}. Use positions {within}, another axis= (e.g. '
        '1 for the tokens of a (batch, length, features) output), or a filter that leaves out '
        'the calls whose outputs do not have that axis.')


class AxisLengthMismatchError(PositionOutOfRangeError):
  """Without ``positions``, the selected calls' outputs differ in length along ``axis``.

  Every call is then swept at every position of the first call's output. A
  call of another length there has another axis there (a pooler's features on
  axis 1, where the other calls have tokens; attention weights' heads), whose
  first entries would be read as those positions.

  ``others``: ``(call, shape, (array index, arrays))`` of every call that differs.
  """

  def __init__(self, first, size, axis, others):
    name, shape, leaf = others[0]
    more = f', and {len(others) - 1} more call(s)' if len(others) > 1 else ''
    # The module paths, layer numbers as '*': one pattern per kind of call.
    patterns = dict.fromkeys(re.sub(r'(?<=/)\d+(?=/|$)', '*', call.rsplit('/', 1)[0])
                             for call, _, _ in others)
    listed = ', '.join(f"'{p}'" for p in patterns)
    # An array beside others (attention weights beside the attention's output): leaves=.
    beside = sorted({i for _, _, (i, count) in others if count > 1})
    arrays = ('' if not beside else ', pick the arrays swept with leaves=[...]' if 0 in beside
              else ', sweep only the first array each call returns (leaves=0)')
    PerturbkitError.__init__(
        self, f'Without positions=, every selected call is swept at every position along axis '
        f'{axis}, so their outputs must have the same length there: {first} has {size}, but '
        f'{name}{_leaf(leaf)} has {shape[axis]} (shape {tuple(shape)}){more}. Leave them out '
        f'(filter=filters.negate(filters.by_path({listed}))){arrays}, pass another axis=, or '
        'pass positions=[...] to sweep the same indices of every call.')


class NonScalarMetricError(NonScalarLossError):
  """The metric function returned something other than a real scalar."""

  def __init__(self, function, got):
    PerturbkitError.__init__(
        self, f'The metric function given to {function} must return a real scalar, but it '
        f'returned {got}. Reduce the model\'s output to one number, e.g. the mean logit '
        'difference `jnp.mean(logits[:, -1, right] - logits[:, -1, wrong])`.')


class MetricSignatureError(PerturbkitError, TypeError):
  """The function given to an interpret function cannot take the arguments it is called with."""

  def __init__(self, function, fn, signature, called, cause):
    super().__init__(
        f'{function} calls the function it was given as {called}, but '
        f'{getattr(fn, "__qualname__", fn)!r} takes {signature} ({cause}). Give a function of '
        'the model and ONE pytree of inputs, e.g. `lambda v, xs: metric(v, *xs)` called with '
        '`(x, y)` as the clean (and corrupted) inputs, or bind the other arguments with '
        '`functools.partial`.')


class CallStructureMismatchError(PerturbkitError, ValueError):
  """The clean and corrupted inputs make different calls (or outputs of other shapes)."""

  def __init__(self, where, clean, corrupted):
    super().__init__(
        f'The clean and corrupted inputs make different calls: at {where} the clean run '
        f'has {clean} and the corrupted run {corrupted}. Patching puts a call\'s clean '
        'output into the corrupted run, so both must make the same calls with outputs of '
        'the same shapes: give inputs of the same shape (pad or trim the corrupted prompt '
        'to the clean one\'s length, use the same batch size).')


class FeatureMapShapeError(PerturbkitError, ValueError):
  """Grad-CAM at a call whose output is not a ``(batch, height, width, channels)`` map."""

  def __init__(self, function, where, shapes):
    super().__init__(
        f'{function} needs each selected call to return one (batch, height, width, channels) '
        f'feature map, but {where} returns {shapes}. Select convolutions with the filter '
        '(the default selects every nn.Conv or nnx.Conv call; e.g. '
        "filter=perturbkit.filters.by_path('Conv_1')), or reshape a flattened map back to "
        '(batch, height, width, channels) in a module of its own and select that.')


class ImageLayoutError(PerturbkitError, ValueError):
  """Grad-CAM upsampling to inputs whose axes 1 and 2 cannot be the images' height and width."""

  def __init__(self, function, where, images, feature_map):
    super().__init__(
        f'{function}(upsample=True) resizes each map to the height and width of '
        f'(batch, height, width, channels) images, axes 1 and 2 of the inputs: {images[1:3]} '
        f'for inputs of shape {tuple(images)}. But {where} makes a {tuple(feature_map)} map, '
        "larger than that, so those axes are not the images' height and width: "
        "channels-first (batch, channels, height, width) pixel "
        "values, as Hugging Face's image processors make them? Pass the images "
        'channels-last (jnp.transpose(pixels, (0, 2, 3, 1)), and drop any transpose inside '
        'the metric), or give the size to resize to: upsample=(height, width).')


class InterventionParamsError(PerturbkitError, ValueError):
  """Learnable interventions given params whose keys are not the interventions' names."""

  def __init__(self, names, keys):
    super().__init__(
        f'The intervention params have the keys {sorted(map(str, keys))}, but the '
        f'interventions are named {sorted(map(str, names))}. Build the params with '
        'perturbkit.interpret.init_interventions(interventions) and train them with their '
        'structure unchanged (optax keeps it).')


class InterventionOutputError(PerturbkitError, ValueError):
  """A learnable intervention's ``apply`` returned something other than the output it edits."""

  def __init__(self, name, where, expected, got):
    super().__init__(
        f'The intervention {name!r} at {where} returned {got}, but its apply(params, output) '
        f'must return the output edited, of the same structure, shapes and dtypes: {expected} '
        '(the floating-point arrays of the call\'s output, as run_with_cache holds them). '
        'Return a value computed from `output` in its shape, cast back to its dtype (e.g. '
        '`(output + params).astype(output.dtype)`), and `return` it: a function without a '
        'return statement returns None.')


class MetricGapError(PerturbkitError, ValueError):
  """``PatchingResult.normalized()`` of a result whose two metrics are equal."""

  def __init__(self, clean, corrupted):
    super().__init__(
        f'normalized() divides each effect by clean_metric - corrupted_metric, and both are '
        f'{clean!r} vs {corrupted!r}: there is no gap to recover (gradient x activation has '
        'one metric for both). Use the effects as they are, or choose clean and corrupted '
        'inputs on which the metric differs.')


class ResultValuesError(PerturbkitError, TypeError):
  """``PatchingResult.top()``/``plot()`` called on a result whose values are traced, or batched."""

  def __init__(self, method, reason):
    super().__init__(
        f'PatchingResult.{method}() reads the effects on the host, but {reason}. Call it on '
        'the result the jitted function returns (outside jax.jit and jax.vmap), and for a '
        'result with a leading batch axis pick one first: '
        '`jax.tree.map(lambda x: x[i], result)`.')


class UnboundAxisError(PerturbkitError, NameError):
  """The loss uses a collective over a mesh axis outside the ``shard_map`` that binds it."""

  def __init__(self, where, detail):
    super().__init__(
        f'{where} runs the loss once to find its layer calls, and the loss uses a mesh axis '
        f'that only exists inside jax.shard_map ({detail}); a BatchNorm(axis_name=...) does '
        'this. Call it inside the same jax.shard_map as the step, e.g. '
        '`jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(), P(\'data\'), '
        'P(\'data\')), out_specs=P(), check_vma=False))(variables, x, y)` (for NNX, build '
        'the optimizer inside an nnx.shard_map).')


class UnknownAxisError(PerturbkitError, NameError):
  """``axis_name`` names no mesh axis that a ``shard_map`` or ``pmap`` around the call binds."""

  def __init__(self, function, axis, bound):
    where = (f'the jax.shard_map around it binds {_listed(map(repr, sorted(bound)))}' if bound else
             'no jax.shard_map or jax.pmap around it binds any axis')
    super().__init__(
        f'{function} was given axis_name={axis!r}, but {where}. Pass the name of the mesh '
        'axis the batch is split over (the one in `in_specs`, e.g. P(\'data\')), and run '
        'the step inside jax.shard_map (or jax.pmap) over that mesh; on one device, or '
        'under jax.jit with sharded inputs, leave axis_name out.')


class CheckedShardMapError(PerturbkitError, ValueError):
  """``axis_name`` given inside ``jax.shard_map`` with ``check_vma=True`` (JAX's default)."""

  def __init__(self, function, axis):
    super().__init__(
        f'{function} was given axis_name={axis!r} inside jax.shard_map with check_vma=True '
        "(JAX's default). Its all-reduces over axis_name take each device's own gradient, "
        "as every device has with check_vma=False; with check_vma=True, JAX's reverse mode "
        'already sums the gradient of replicated values (the params) over the devices, '
        'and the result would count the devices twice. Pass check_vma=False to '
        'jax.shard_map: jax.shard_map(step, mesh=mesh, in_specs=..., out_specs=..., '
        'check_vma=False).')


class NotAModuleError(PerturbkitError, TypeError):
  """A function that takes a Flax module was given something else."""

  def __init__(self, function: str, want: str, got: str, fix: str):
    super().__init__(f'{function} takes {want}, but it was given {got}. {fix}')


class BoundModuleError(PerturbkitError, ValueError):
  """``perturbkit.wrap`` was given a bound Linen module (one with variables attached)."""

  def __init__(self, name: str):
    super().__init__(
        f'perturbkit.wrap takes an unbound module, but this {name} is bound to variables '
        '(`model.bind(variables)`, or `self.submodule` inside a method). Wrap the unbound '
        'module, `perturbkit.wrap(module.unbind()[0])`, and pass the variables to the '
        "wrapped module's `init`/`apply`.")


class WrappedModelError(PerturbkitError, ValueError):
  """A model made by ``perturbkit.wrap`` was wrapped again, or run inside another perturbkit
  function, which adds its own points at the same calls."""

  def __init__(self, where: str):
    super().__init__(
        f'{where} a model made by `perturbkit.wrap`, which already adds a perturbation after '
        'each of its calls; a second set at the same calls would be added to the same outputs '
        'and count them twice. Use the unwrapped model, `wrapped.module`: its params are the '
        "wrapped model's, and perturbkit's functions find the calls of an unmodified model "
        'themselves.')


class NoHooksError(PerturbkitError, ValueError):
  """``with_hooks`` was called without any hook."""

  def __init__(self, function: str):
    super().__init__(
        f'{function}(fun, *hooks) needs at least one hook, made with '
        '`perturbkit.backward_hook(fn, filter)`, e.g. '
        f"`{function}(loss_fn, perturbkit.backward_hook(lambda g: 0 * g, "
        "perturbkit.filters.by_path('Dense_0')))`; without hooks call `fun` itself.")


class HookFunctionError(PerturbkitError, TypeError):
  """A backward hook's function is not callable (``HookOutputError``: returns another
  structure, shape or dtype than it got)."""

  def __init__(self, detail: str):
    super().__init__(
        f'{detail}. A backward hook is a function `g -> new g` (the cotangent at the '
        'call\'s output, in the structure of that output), e.g. '
        '`perturbkit.backward_hook(lambda g: jnp.clip(g, -1, 1), filter)`.')


class HookOutputError(HookFunctionError):
  """A backward hook returned a cotangent of another structure or shape than it got, or a
  leaf that is not floating point."""

  def __init__(self, fn, where: str, mismatch: str):
    PerturbkitError.__init__(
        self,
        f'The backward hook {fn!r:.60} on the call {where} returned {mismatch}. A hook must '
        'return floating-point arrays of the same structure and shapes as the cotangent it '
        'receives (the gradient at the call\'s output), e.g. `lambda g: jnp.clip(g, -1, 1)`; '
        'one computed in another precision is cast back to the cotangent\'s dtype.')


class NotAHookError(PerturbkitError, TypeError):
  """Something other than a hook where backward hooks go."""

  def __init__(self, function: str, got: object):
    hint = ('; to hook a function, make it a hook with a filter'
            if callable(got) else '')
    super().__init__(
        f'{function} takes backward hooks made with `perturbkit.backward_hook(fn, filter)` '
        f'(one, or a list of them), but it was given {got!r:.80}{hint}: e.g. '
        "`perturbkit.backward_hook(lambda g: 2 * g, perturbkit.filters.by_path('Dense_0'))`.")


class FilterError(PerturbkitError, TypeError):
  """A call filter, or an argument of a filter constructor, of a type it cannot be."""

  def __init__(self, function: str, want: str, got: object):
    super().__init__(
        f'{function} takes {want}, but it was given {got!r:.80}. Examples: '
        "`filters.by_type(nn.Dense, nn.Conv)`, `filters.by_path('encoder/*', 'Dense_0')`, "
        "`filter=['Dense_*']`, or a function `(module, method_name) -> bool`.")


class PathPatternError(FilterError, ValueError):
  """A ``filters.by_path`` pattern written as a regular expression, which selects nothing."""

  def __init__(self, pattern: str, reason: str, suggestion: str):
    super(FilterError, self).__init__(
        f'filters.by_path takes shell-style patterns (fnmatch: `*` matches any characters, '
        f'`?` one character, `[0-9]` one of a set), but {pattern!r} reads as a regular '
        f'expression ({reason}); no module path contains that, so it would select no call. '
        f'Write it as {suggestion}.')


class TracedFilterError(FilterError):
  """A call filter whose answer is a traced value, not a bool known while tracing."""

  def __init__(self, filter: object, module: str, method_name: str):
    super(FilterError, self).__init__(
        f'The call filter {filter!r:.80}, asked about the {method_name} call of a {module}, '
        'answered with a value traced by JAX (or failed on one): a filter must decide from '
        'the module and the method name alone. It runs while the model is traced, where an '
        'array it makes or reads (jnp.array(True), a param, a value closed over under '
        "jax.jit) has no truth value. Decide from the module's type, path or attributes "
        "(filters.by_type, filters.by_path, filters.by_method), and make a choice that "
        'depends on data a Python bool before the call.')


class NotInterventionsError(PerturbkitError, TypeError):
  """The interventions are not a dict ``{name: intervention}`` of ``perturbkit.interpret``'s."""

  def __init__(self, function: str, got: object, detail: str = ''):
    super().__init__(
        f'{function} takes a dict of named interventions, e.g. '
        "{'steer': perturbkit.interpret.steering_vector('Dense_1/__call__', (8,))}, each "
        'built with perturbkit.interpret (steering_vector, gates, or your own Intervention(path, '
        'init, apply)), '
        f'but it was given {got!r:.120}' + (f': {detail}.' if detail else '.'))


class KFACFactorShapeError(PerturbkitError, ValueError):
  """``damped_inverse`` was given a factor that is neither a vector nor a square matrix."""

  def __init__(self, shape: tuple):
    super().__init__(
        f'damped_inverse takes one square factor (d, d) or a diagonal given as a vector (d,), '
        f'but it was given shape {tuple(shape)}. The factors of a layer stacked per iteration '
        '(LayerInfo.iterations, a layer in nn.scan) have the iterations in front: invert '
        'each, `jax.lax.map(lambda f: damped_inverse(f, damping), factor)`.')


class KFACLayerInfoError(PerturbkitError, ValueError):
  """A ``LayerInfo`` (built by hand) that lacks what its layer's rule needs."""

  def __init__(self, layer: str, detail: str):
    super().__init__(
        f'K-FAC layer {layer!r}: {detail}. Build the layers with perturbkit.kfac_layers '
        '(or perturbkit.nnx.kfac_layers), which records it; to change one layer, '
        "`layers.layers[name]._replace(...)` the LayerInfo that kfac_layers made.")


class PrivateAccumulationError(PerExampleError):
  """DP-SGD given ``optax.MultiSteps``: each step's batch is noised on its own."""

  def __init__(self, where: str):
    super().__init__(
        f'{where} was given optax.MultiSteps (gradient accumulation). Each DP-SGD step clips '
        "and noises its own batch's mean gradient, so the update applied every k steps "
        'averages k independently noised means: its noise is σC/(√k·B), √k times the '
        'σC/(k·B) of one DP-SGD step on the k-times larger batch that accumulation stands '
        'for. Pass the optimizer without MultiSteps and the larger batch whole (spread over '
        'devices with axis_name); or accumulate yourself: average the clipped means of '
        '`perturbkit.private_grad(loss_fn, clip_norm=C, noise_multiplier=0.0)` over the k '
        'batches, add `σ·C/(k·B) * jax.random.normal(key, shape)` to each leaf once, and '
        'apply the optimizer to that.')


class LookaheadParamsError(PerturbkitError, TypeError):
  """``optax.lookahead`` given to a trainer that holds the model's own params."""

  def __init__(self, where: str):
    super().__init__(
        f'{where} was given an optimizer containing `optax.lookahead`, whose update takes '
        'the params as `optax.LookaheadParams(fast=..., slow=...)`. The trainer holds the '
        "model's own params and hands them to the optimizer as they are, so the update "
        "would fail (`'dict' object has no attribute 'fast'`). Give the fast optimizer "
        'alone and keep the slow weights yourself: every `sync_period` steps set `slow = '
        'slow + slow_step_size * (params - slow)` and put `slow` back in place of the '
        "trained params (the state's `variables['params']`, or `nnx.update(model, slow)`).")
