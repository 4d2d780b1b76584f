"""``wrap``: the same model with a perturbation point after every selected call."""
import warnings
from typing import Any, Callable, Mapping

import flax.linen as nn
from flax import nnx

from perturbkit.core._callables import selects
from perturbkit.core import filters as _filters
from perturbkit.errors import (PerturbationStructureError, UnmatchedFilterError,
                                UnperturbedCallsWarning, WrongFrontEndError)
from perturbkit.linen._branches import check_branch_point
from perturbkit.linen._interceptor import intercept, intercepting
from perturbkit.core._points import COLLECTION, add_perturbation, has_differentiable_leaf
from perturbkit.core._types import CallFilter
from perturbkit.core._validate import flag
from perturbkit.errors import BoundModuleError, NotAModuleError, WrappedModelError


def perturbing(filter: CallFilter, *, strict: bool, applied: set | None = None,
               missed: list | None = None, seen: list | None = None):
  """An ``intercept`` block that adds perturbations at the selected calls.

  The ``(path..., key)`` of every point applied is added to ``applied``; the
  names of selected calls that could not carry one (inside a lifted transform
  that does not map the collection) are appended to ``missed``, and those of
  all calls to ``seen``.
  """
  def handler(call, run):
    if seen is not None:
      seen.append(call.name)
    if not selects(filter, call.module, call.method_name):
      return run()
    if call.module.is_initializing():
      check_branch_point(call)
    output = run()
    out, was_applied = add_perturbation(call.module, call.key, output, call.name,
                                        strict=strict, reachable=not call.mapped)
    if was_applied and applied is not None:
      applied.add(call.path + (call.key,))
    if not was_applied and missed is not None and has_differentiable_leaf(output):
      missed.append(call.name)
    return out
  return intercept(_filters.all_calls, handler, initializing=True)


def _leaf_paths(tree, prefix=()) -> set:
  if isinstance(tree, Mapping):
    return set().union(*(_leaf_paths(v, prefix + (k,)) for k, v in tree.items()))
  return {prefix}


class Perturbed(nn.Module):
  """An unmodified module with perturbation points; build it with :func:`wrap`.

  Attributes:
    module: The wrapped module. Its variables live at the same paths as if it
      were used alone: it is bound to this module's own scope.
    filter: Selects the calls that get a point.
    strict: Whether a selected call with no floating-point output is an error.
  """
  module: nn.Module
  filter: CallFilter = _filters.all_calls
  strict: bool = False

  def __call__(self, *args, **kwargs):
    return self._run('__call__', *args, **kwargs)

  def _run(self, method: str | Callable[..., Any], *args, **kwargs):
    if intercepting():
      raise WrappedModelError('A perturbkit function (or another wrapped model) runs')
    # Bound to this very scope (not as a child), the module sees the same paths
    # and rng streams as when it is the root, so params and dropout masks match.
    inner = self.module.clone(parent=self.scope, _deep_clone=True)
    applied: set = set()
    missed: list = []
    seen: list = []
    with perturbing(self.filter, strict=self.strict, applied=applied, missed=missed, seen=seen):
      out = method(inner, *args, **kwargs) if callable(method) else getattr(
          inner, method)(*args, **kwargs)
    if self.is_mutable_collection(COLLECTION):
      if missed:
        warnings.warn(UnperturbedCallsWarning(sorted(set(missed))), stacklevel=4)
      if seen and not applied and not missed:
        raise UnmatchedFilterError('the wrapped model', sorted(set(seen)))
    if COLLECTION in self.variables and not self.is_mutable_collection(COLLECTION):
      # A point's value may hold dicts (a call returning a dict): a leaf is used
      # when an applied point's path is a prefix of it. Entries not named after a
      # method (the model's own hand-placed `self.perturb` points) are Flax's to check.
      methods = {name.rsplit('/', 1)[-1].split('#')[0] for name in seen}
      unused = {p for p in _leaf_paths(self.variables[COLLECTION])
                if not any(p[:len(a)] == a for a in applied)
                and any(k.split('#')[0] in methods for k in p)}
      if unused:
        raise PerturbationStructureError(
            'these perturbations match no call: ' + ', '.join(sorted('/'.join(p) for p in unused)))
    return out

  @nn.nowrap
  def _forwarding(self, method):
    if method is None:
      return None
    return lambda wrapper, *args, **kwargs: wrapper._run(method, *args, **kwargs)

  @nn.nowrap
  def init_with_output(self, rngs, *args, method=None, **kwargs):
    return super().init_with_output(rngs, *args, method=self._forwarding(method), **kwargs)

  # No `init` override: Flax's `init` calls `init_with_output`, which forwards
  # `method` once; forwarding it in both would hand the wrapped module to itself.

  @nn.nowrap
  def apply(self, variables, *args, method=None, **kwargs):
    return super().apply(variables, *args, method=self._forwarding(method), **kwargs)


def wrap(module: nn.Module, filter: CallFilter | bool | None = None, *,
         strict: bool | None = None) -> nn.Module:
  """Wraps an unmodified Linen module so that every submodule call is perturbed.

  The wrapped model has exactly the params tree of ``module`` (same paths,
  shapes and values for the same rng), so checkpoints load unchanged. Its
  ``init`` also returns a ``'perturbations'`` collection, one entry per selected
  call at the module's path (``'__call__'``, then ``'__call__#1'`` for a second
  call of the same module); ``apply`` with that collection adds the entries to
  the call outputs exactly as a hand-written ``self.perturb`` would, and without
  it ``apply`` is the unwrapped model. ``method=``, ``mutable=`` and ``rngs=``
  work as for ``module``, with ``method`` naming a method of ``module``. A
  filter that selects no call raises ``UnmatchedFilterError``, listing the calls
  seen. Activation gradients without wrapping: ``help(perturbkit.value_and_grad)``.

  Args:
    module: Any Linen module, unbound.
    filter: Which calls get a point: ``None``/``True`` for all (default), a
      ``(module, method_name) -> bool`` callable (see ``perturbkit.filters``),
      or a list of path patterns.
    strict: If true, a selected call whose output has no floating-point leaf
      raises :class:`NonDifferentiableOutputError`; by default such calls are
      skipped when ``filter`` is ``None`` and rejected when a filter is given.

  Returns:
    The wrapped module.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
    >>> wrapped = perturbkit.wrap(model)
    >>> variables = wrapped.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> sorted(variables['perturbations'])
    ['layers_0', 'layers_2']
    >>> variables['perturbations']['layers_0']['__call__'].shape
    (1, 4)
  """
  if isinstance(module, nnx.Module):
    raise WrongFrontEndError(
        'perturbkit.wrap', f'an nnx.Module ({type(module).__name__})',
        'NNX models need no wrapping: `perturbkit.nnx.value_and_grad(loss_fn)(model, *args)` '
        'gives the activation gradients of the unmodified model.')
  if not isinstance(module, nn.Module):
    raise NotAModuleError('perturbkit.wrap', 'a flax.linen.Module',
                          f'{module!r:.60} ({type(module).__name__})',
                          'Pass the model, e.g. `perturbkit.wrap(nn.Dense(3))`, not its variables.')
  if isinstance(module, Perturbed):
    raise WrappedModelError('perturbkit.wrap was given')
  if module.scope is not None:
    raise BoundModuleError(type(module).__name__)
  flag('strict', strict, none=True)
  if strict is None:
    strict = filter is not None and filter is not True
  return Perturbed(module, _filters.as_filter(filter), strict)


__all__ = ['wrap', 'Perturbed', 'COLLECTION']
