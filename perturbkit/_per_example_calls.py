"""The uses of each param-owning module, found by an abstract run of the loss.

Per-example gradients are assembled call by call: every module that owns params
directly is reached through its own method calls (its *uses*), and each use is
rebuilt later as ``module.apply({'params': w, ...}, *args, method=...)`` from
the inputs and output gradient that ``value_and_grad(return_inputs=True)``
returns. This module records, at trace time, what that rebuild needs beyond the
arrays: an unbound copy of the module, the method, the non-array arguments, and
which array inputs are computed from the batched arguments (see
``_per_example_inputs``). The same run rejects models that mix examples
(BatchNorm in training mode).
"""
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util

from perturbkit import _filters
from perturbkit._interceptor import Call, intercept
from perturbkit._per_example_batch import BatchAxes, per_argument
from perturbkit._per_example_inputs import source_kinds
from perturbkit._per_example_errors import (ExamplesMixedError, PerExampleError,
                                            UncoveredParamsError)
from perturbkit._types import Path, Variables

PERTURBATIONS = 'perturbations'


class Use(NamedTuple):
  """One call of a param-owning module, as recorded while tracing.

  Attributes:
    path: The module's path (its params' key path).
    key: The call's point key (``'__call__'``, ``'__call__#1'``, ``'attend'``).
    method_name: The method called.
    module: An unbound copy of the module, to replay the call with.
    template: ``(args, kwargs)`` with every array replaced by ``None``.
    sources: For each array leaf of ``(args, kwargs)`` (``jax.tree.leaves``
      order), what it is computed from (see ``_per_example_inputs.source_kinds``):
      ``'example'``, ``'shared'`` or ``'constant'``.
  """
  path: Path
  key: str
  method_name: str
  module: nn.Module
  template: Any
  sources: tuple[str, ...] = ()


def _is_array(leaf: Any) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray))


def static_part(tree: Any) -> Any:
  """``tree`` with arrays replaced by ``None``; plain containers keep their shape."""
  if _is_array(tree):
    return None
  if type(tree) in (tuple, list):
    return type(tree)(static_part(t) for t in tree)
  if isinstance(tree, dict):
    return {k: static_part(v) for k, v in tree.items()}
  return tree


def merge_static(arrays: Any, template: Any, where: str) -> Any:
  """Puts the arrays of a call's recorded inputs back into its ``static_part``."""
  if arrays is None:
    return template
  if _is_array(arrays):
    return arrays
  if type(arrays) in (tuple, list) and type(template) is type(arrays):
    return type(arrays)(merge_static(a, t, where) for a, t in zip(arrays, template))
  if isinstance(arrays, dict) and isinstance(template, dict):
    return {k: merge_static(arrays[k], template[k], where) for k in arrays}
  raise PerExampleError(
      f'The call {where} takes an input of a pytree type perturbkit cannot rebuild '
      f'({type(template).__name__}); per-example gradients of such a call need plain '
      'tuples, lists, dicts and arrays as inputs.')


def owner_paths(params: Any) -> set[Path]:
  """Paths of the modules that own at least one param array directly."""
  return {path[:-1] for path in traverse_util.flatten_dict(dict(params))}


def direct_params(params: Any, path: Path) -> dict[str, Any]:
  """The param arrays owned directly by the module at ``path`` (not by its children)."""
  node = params
  for name in path:
    node = node[name]
  return {k: v for k, v in node.items() if _is_array(v)}


def module_variables(variables: Variables, path: Path) -> dict[str, Any]:
  """Every collection's subtree at ``path`` except params and perturbations."""
  out = {}
  for collection, tree in variables.items():
    if collection in ('params', PERTURBATIONS):
      continue
    node = tree
    try:
      for name in path:
        node = node[name]
    except (KeyError, TypeError):
      continue
    out[collection] = node
  return out


def _mixing_reason(call: Call, batch_stats_owners: set[Path]) -> str | None:
  """Why this call makes one example's output depend on the others, if it does."""
  module = call.module
  if isinstance(module, nn.BatchNorm):
    given = call.kwargs.get('use_running_average',
                            call.args[1] if len(call.args) > 1 else None)
    running = module.use_running_average if given is None else given
    if not running:
      return f'{call.name} is a BatchNorm in training mode (batch statistics)'
    return None
  if call.path in batch_stats_owners and module.is_mutable_collection('batch_stats'):
    return f'{call.name} updates batch statistics (its "batch_stats" are mutable)'
  return None


def _array_leaves(tree: Any) -> list[Any]:
  return [leaf for leaf in jax.tree.leaves(tree) if _is_array(leaf)]


def find_uses(loss_fn: Callable[..., Any], variables: Variables, args: tuple,
              kwargs: dict, batch_axes: BatchAxes = 0) -> dict[Path, list[Use]]:
  """Every outermost call of each param-owning module, in execution order.

  A call of a module made inside another call of the same module (a method
  calling ``self.other_method``) is part of the outer use and not recorded.
  The loss is traced to a jaxpr, whose data dependences say which array inputs
  of each use come from the arguments batched by ``batch_axes`` (``Use.sources``).

  Raises:
    ExamplesMixedError: a call mixes examples (BatchNorm in training mode).
    UncoveredParamsError: a module owns params but is never called.
  """
  owners = owner_paths(variables['params'])
  batch_stats_owners = {p[:-1] for p in traverse_util.flatten_dict(
      dict(variables.get('batch_stats', {})))}
  uses: dict[Path, list[Use]] = {}
  inputs: list[tuple[Path, int, list[Any]]] = []  # (path, use index, array inputs) by call
  active: list[Path] = []

  def handler(call: Call, run: Callable[[], Any]) -> Any:
    reason = _mixing_reason(call, batch_stats_owners)
    if reason:
      raise ExamplesMixedError(reason)
    if call.path not in owners or call.path in active:
      return run()
    uses.setdefault(call.path, []).append(Use(
        call.path, call.key, call.method_name, call.module.clone(parent=None),
        static_part((call.args, call.kwargs))))
    inputs.append((call.path, len(uses[call.path]) - 1,
                   _array_leaves((call.args, call.kwargs))))
    active.append(call.path)
    try:
      return run()
    finally:
      active.pop()

  # Keyword arguments are shared; their arrays are jaxpr inputs, the rest (flags) stay static.
  kw_leaves, kw_tree = jax.tree.flatten(kwargs)
  kw_arrays = [leaf for leaf in kw_leaves if _is_array(leaf)]

  def traced(variables, kw_arrays, *args):
    given = iter(kw_arrays)
    kw = jax.tree.unflatten(kw_tree, [next(given) if _is_array(leaf) else leaf
                                      for leaf in kw_leaves])
    with intercept(_filters.all_calls, handler):
      loss_fn(variables, *args, **kw)
    return [leaf for _, _, leaves in inputs for leaf in leaves]

  plain = {c: t for c, t in variables.items() if c != PERTURBATIONS}
  jaxpr = jax.make_jaxpr(traced)(plain, kw_arrays, *args).jaxpr
  batched = [False] * len(jax.tree.leaves((plain, kw_arrays)))
  for arg, axis in zip(args, per_argument(batch_axes, len(args))):
    batched += [axis is not None and _is_array(leaf) for leaf in jax.tree.leaves(arg)]
  kinds = iter(source_kinds(jaxpr, batched))
  for path, index, leaves in inputs:
    uses[path][index] = uses[path][index]._replace(
        sources=tuple(next(kinds) for _ in leaves))
  missing = sorted('/'.join(p) or '<root>' for p in owners - set(uses))
  if missing:
    raise UncoveredParamsError(missing)
  return uses
