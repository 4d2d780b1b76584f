"""The named errors of the NNX front end.

Where a failure is the same as in Linen, the class is a subclass of the Linen
one (so ``except perturbkit.NoPerturbationPointsError`` catches both) whose
message gives NNX advice.
"""
from perturbkit._errors import (NoPerturbationPointsError, PerturbationsNotAppliedError,
                                PerturbkitError, UnperturbedCallsWarning)


def _listed(names, limit=8):
  names = list(names)
  return ', '.join(map(str, names[:limit])) + (' ...' if len(names) > limit else '')


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


class NNXNoPerturbationPointsError(NoPerturbationPointsError):
  """The filter selected no submodule call of the NNX model."""

  def __init__(self, seen):
    PerturbkitError.__init__(
        self,
        'The filter selected no submodule call, so there is no activation gradient to '
        f'compute. Calls seen: [{_listed(seen, 12) or "none"}]. Check the filter (path '
        'filters for NNX models are in perturbkit.nnx.filters), and make sure the loss '
        'function calls the model it receives as its first argument.')


class NNXPerturbationsNotAppliedError(PerturbationsNotAppliedError):
  """A perturbation point found while tracing was not reached by the differentiated run."""

  def __init__(self, missing):
    PerturbkitError.__init__(
        self,
        f'{len(missing)} perturbation point(s) were never reached: [{_listed(missing)}]. '
        'The loss function must call the model it receives as its first argument, make '
        'the same calls for the same inputs every time it is traced, and not wrap the '
        'model in its own nnx.capture (perturbkit runs the loss inside one).')


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


class NNXUnperturbedCallsWarning(UnperturbedCallsWarning):
  """Selected calls inside an NNX transform that cannot carry a perturbation."""

  def __init__(self, names):
    UserWarning.__init__(
        self,
        f'{len(names)} selected call(s) run inside an NNX transform (nnx.scan, nnx.vmap, '
        '...) that broadcasts the module\'s state, so they get no perturbation point and '
        f'no activation gradient: [{_listed(names)}]. For per-iteration gradients let '
        'the transform map the perturbations, e.g. `nnx.scan(f, in_axes=(nnx.StateAxes('
        '{nnx.Perturbation: 0, ...: None}), nnx.Carry))`; to silence this, exclude the '
        'calls with the filter.')
