"""The named errors perturbkit raises. Each message says what was wrong and how to fix it."""


class PerturbkitError(Exception):
  """Base class of every error perturbkit raises."""


class NonScalarLossError(PerturbkitError, TypeError):
  """The loss function returned something other than a real scalar."""

  def __init__(self, shape, dtype):
    super().__init__(
        f'The loss function must return a real scalar, but it returned an array of '
        f'shape {tuple(shape)} and dtype {dtype}. Reduce it first, e.g. with '
        '`jnp.mean(...)`, or return `(loss, aux)` and pass `has_aux=True`.')


class NoPerturbationPointsError(PerturbkitError, ValueError):
  """The filter selected no submodule call."""

  def __init__(self, seen):
    listed = ', '.join(seen[:12]) + (' ...' if len(seen) > 12 else '')
    super().__init__(
        'The filter selected no submodule call, so there is no activation gradient to '
        f'compute. Calls seen: [{listed or "none"}]. Check the filter, or make sure the '
        'loss function calls `model.apply(variables, ...)` with the variables it is given.')


class UnmatchedFilterError(PerturbkitError, ValueError):
  """A hook's or a wrapped model's filter selected no call."""

  def __init__(self, what, seen):
    listed = ', '.join(seen[:12]) + (' ...' if len(seen) > 12 else '')
    super().__init__(
        f'The filter of {what} selects no submodule call, so it would do nothing (a typo in '
        f'a path?). Calls seen: [{listed or "none"}]. Check the filter, e.g. '
        "`perturbkit.filters.by_path('Block_0/*')` matches the module paths listed.")


class PerturbationStructureError(PerturbkitError, ValueError):
  """A 'perturbations' tree does not match the perturbation points of the model call."""

  def __init__(self, detail):
    super().__init__(
        f'The perturbations do not match the model call: {detail}. Create them with '
        '`wrapped.init(...)["perturbations"]` for the same inputs, shapes and filter as the '
        'call that uses them.')


class NonDifferentiableOutputError(PerturbkitError, TypeError):
  """A selected submodule call returned no inexact (floating or complex) array."""

  def __init__(self, where, dtypes):
    super().__init__(
        f'The call {where} was selected for a perturbation, but its output has no '
        f'floating-point leaf (leaf dtypes: {dtypes}), so it has no activation gradient. '
        'Exclude it with the filter, e.g. `perturbkit.filters.negate(perturbkit.filters.'
        'by_path(...))`.')


class PerturbationsNotAppliedError(PerturbkitError, RuntimeError):
  """The loss function did not pass the perturbations on to `model.apply`."""

  def __init__(self, missing):
    listed = ', '.join(missing[:8]) + (' ...' if len(missing) > 8 else '')
    super().__init__(
        f'{len(missing)} perturbation point(s) were never reached: [{listed}]. The loss '
        'function must hand the `variables` it receives to `model.apply` unchanged (extra '
        "collections included), e.g. `model.apply(variables, x)` or "
        "`model.apply({**variables, 'params': p}, x)`, and make the same calls for the "
        'same inputs every time it is traced.')


class SegmentationError(PerturbkitError, ValueError):
  """The model call cannot be split into segments as asked."""


class SharedSegmentError(SegmentationError):
  """A segment's params are used other than by one call of the segment's module."""

  def __init__(self, path, why='it is called more than once in one step (shared weights)'):
    super().__init__(
        f'The segment {path!r} cannot be updated inside the backward pass: {why}. '
        "Interleaved updates need every use of a segment's params to be that segment's one "
        'call, because the weights change between uses. Choose segments that contain every '
        'use (e.g. the parent module, `segments=perturbkit.filters.by_path(...)`), or leave '
        'the module out of the segments: the default segments put such params in '
        'perturbkit.REST, updated at the end with their full gradient.')


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

  def __init__(self, where):
    super().__init__(
        f'return_activations=True (or return_inputs=True) cannot return the output (or '
        f'inputs) of {where}: it runs inside a '
        'lifted transform (nn.remat, nn.jit, nn.scan, ...), whose intermediate values do '
        'not exist outside it. Exclude such calls with the filter, or leave '
        'return_activations off (their activation gradients are still returned).')


class UnperturbedCallsWarning(UserWarning):
  """Selected calls inside a lifted transform that cannot carry perturbations."""

  def __init__(self, names):
    listed = ', '.join(names[:8]) + (' ...' if len(names) > 8 else '')
    super().__init__(
        f'{len(names)} selected call(s) run inside a lifted transform (nn.scan, nn.vmap, '
        f'...) that does not map the "perturbations" collection, so they get no '
        f'perturbation point and no activation gradient: [{listed}]. For per-iteration '
        'gradients add `"perturbations": <axis>` to the transform\'s `variable_axes` '
        '(e.g. `nn.scan(Block, variable_axes={"params": 0, "perturbations": 0}, ...)`); '
        'to silence this, exclude the calls with the filter.')


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
  """The loss function given is not callable (often: its value was passed instead)."""

  def __init__(self, function: str, got: str, signature: str):
    super().__init__(
        f'{function} takes the loss function itself, a callable `{signature}`, but it was '
        f'given {got}. Pass the function, not its value: `{function}(loss_fn)`, not '
        f'`{function}(loss_fn(...))`.')


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

  def __init__(self, got: str, hint: str = ''):
    super().__init__(
        'The optimizer must be an `optax.GradientTransformation` (e.g. `optax.adam(1e-3)`) '
        f'or a function `segment_name -> GradientTransformation`, but {got}.'
        + (f' {hint}' if hint else ''))


class KFACTargetsError(PerturbkitError, ValueError):
  """Targets that do not fit a K-FAC output loss (e.g. one-hot labels for the categorical)."""

  def __init__(self, loss: str, want: str, got: str, fix: str):
    super().__init__(f'The K-FAC loss {loss} takes targets {want}, but it got {got}. {fix}')


class InvalidOptionError(PerturbkitError, ValueError):
  """A numeric option is outside the range where it means anything."""

  def __init__(self, name: str, value: object, allowed: str):
    super().__init__(
        f'{name}={value!r} is not a valid value: {name} must be {allowed}. Pass a value in '
        'that range where the option is given.')


class ReductionMismatchError(PerturbkitError, ValueError):
  """The loss combines the examples' terms otherwise than ``reduction`` says."""

  def __init__(self, reduction: str, found: str, detail: str):
    super().__init__(
        f"reduction={reduction!r} was given, but the loss is a {found} over the examples: "
        f'{detail}. With the wrong reduction every per-example gradient (its norm, its '
        f'clipping) is off by the number of examples. Pass reduction={found!r}, or make '
        f'the loss a {reduction} over the examples (e.g. `jnp.{reduction}(terms)`).')


class PRNGKeyError(PerturbkitError, TypeError):
  """A random key that is not a JAX PRNG key (a plain integer seed)."""

  def __init__(self, where: str, got: str):
    super().__init__(
        f'{where} needs a JAX random key, got {got}. Pass `jax.random.key(seed)` (or '
        'a raw `jax.random.PRNGKey(seed)`), and a different one at every step, e.g. '
        '`jax.random.fold_in(key, state.step)`.')
