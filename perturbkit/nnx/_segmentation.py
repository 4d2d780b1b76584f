"""Which NNX calls are segments: the calls of a loss, for the shared choice.

The rules (a segment's params used by its call only; the layer-wise default;
the checks of a chosen set) are framework-neutral and live in
``_segment_choice``, shared with Linen. NNX finds the calls with
``_nnx_calls``; a call inside an NNX transform (``nnx.scan``, ``nnx.vmap``,
``nnx.remat``) runs a copy of the module (under ``nnx.scan``, with each
iteration's slice of the stacked params: a segment per iteration), and
``segments=int`` counts module levels, not containers.
"""
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from perturbkit.core._callables import selects
from perturbkit.core._values import partition_values
from perturbkit.core import filters as _filters, _segment_choice
from perturbkit.core._consumers import reads_outside
from perturbkit.core._segment_vjp import FORWARD_ONLY
from perturbkit.core._unread import unread_owners
from perturbkit.errors import SegmentationError
from perturbkit.nnx._calls import Call, NNXPath, instrument, submodules
from perturbkit.nnx._ownership import owned_state, ownership
from perturbkit.nnx._segments import (iteration_state, params_tree, segment_name, segmented_loss,
                                      stacked_iterations, with_iteration_states, with_values)
from perturbkit.core._segment_choice import (CallRecord, Exactly, Segmentation, exactly,
                                        flat_leaf_owners, leading_length)
from perturbkit.core._types import CallFilter

__all__ = ['Exactly', 'Segmentation', 'SegmentInTransformError', 'choose', 'exactly']


class SegmentInTransformError(SegmentationError):
  """A chosen segment runs inside an NNX transform (``nnx.scan``, ``nnx.vmap``, ``nnx.remat``)."""

  def __init__(self, name: str):
    super().__init__(
        f'The segment {name!r} runs inside an NNX transform (nnx.scan, nnx.vmap, nnx.remat) '
        'that calls a copy of the module whose params are not its slice along their first '
        'axis (nnx.remat, a scan inside a scan, or a StateAxes that does not slice the whole '
        "module), so its weights cannot be updated inside the backward pass there. Slice the "
        'module whole along axis 0 (nnx.scan(..., in_axes=0) over modules made with '
        'nnx.vmap), make the module that applies the transform one segment (its parent), or '
        'choose other segments.')


def record_calls(loss_fn: Callable[..., Any], model: nnx.Module, args: tuple, wrt: Any,
                 filter: CallFilter = _filters.all_calls) -> list[CallRecord]:
  """Every submodule call of ``loss_fn``, in execution order, from an abstract run.

  A call of a copy whose ``wrt`` params are the model's sliced along their first
  axis, and that also sees a probe on the module sliced so (``nnx.scan`` slices
  the module's whole state), is recorded with its number of iterations.
  """
  calls: list[CallRecord] = []
  modules: dict = {}
  owners = ownership(model, wrt)
  open_calls = _segment_choice.OpenCalls()

  def on_call(call: Call, run: Callable[[], Any]) -> Any:
    iterations = 0
    if call.copied and call.path in modules:
      probe = iteration_state(call.module)
      if probe is not None and jnp.shape(probe) == ():
        iterations = stacked_iterations(call.module, modules[call.path], call.path, owners)
    branch = '' if call.conditional is None else (call.conditional or 'nnx.cond and nnx.switch')
    calls.append(CallRecord(call.path, call.copied, selects(filter, call.module, call.method_name),
                            call.key, iterations, open_calls.nested(call.path), branch=branch))
    return open_calls.around(call.path, run)

  graphdef, state = nnx.split(model)

  def traced(state, args):
    copy = nnx.merge(graphdef, state, copy=True)
    modules.update(submodules(copy))
    lengths = {path: leading_length(params_tree(owned_state(m, path, owners)))
               for path, m in modules.items() if path}
    with_iteration_states(modules, {path: jnp.zeros((n,)) for path, n in lengths.items() if n})
    with instrument([copy], on_call):
      return loss_fn(copy, *args)

  arrays, rebuild = partition_values(args, keep=nnx.graph.is_graph_node)
  jax.eval_shape(lambda state, arrays: traced(state, rebuild(arrays)), state, arrays)
  return calls


def param_owners(model: nnx.Module, wrt: Any) -> list[NNXPath]:
  """Paths of the modules holding ``wrt`` variables directly (not through submodules)."""
  modules = {tuple(path) for path, _ in nnx.iter_modules(model)}
  owners = set()
  for path, _ in nnx.to_flat_state(nnx.state(model, wrt)):
    path = tuple(path)
    owners.add(next(path[:n] for n in range(len(path) - 1, -1, -1) if path[:n] in modules))
  return sorted(owners, key=lambda p: tuple(map(str, p)))


# Containers group modules without being a level of the model: Linen names the
# items of a list attribute `blocks_0`, one level, where NNX has `blocks/0`.
_CONTAINERS = (nnx.List, nnx.Dict)


def module_depths(model: nnx.Module) -> dict[NNXPath, int]:
  """Each submodule's depth in module levels; ``nnx.List``/``nnx.Dict`` items sit at their parent's.

  ``self.blocks = nnx.List([...])`` puts ``blocks/0`` at depth 1, as Linen puts
  ``blocks_0``; ``nnx.Sequential`` is a module (it is called), its ``layers``
  list is not a level. Containers themselves get no depth.
  """
  modules = {tuple(path): m for path, m in nnx.iter_modules(model)}
  is_level = lambda p: p in modules and not isinstance(modules[p], _CONTAINERS)
  return {path: sum(is_level(path[:n]) for n in range(1, len(path) + 1))
          for path in modules if path and is_level(path)}


def modules_at_depth(model: nnx.Module, owners: list[NNXPath], depth: int) -> list[NNXPath]:
  """The modules ``depth`` levels down (see :func:`module_depths`) that hold params."""
  depths = module_depths(model)
  found = {next((p[:n] for n in range(1, len(p) + 1) if depths.get(p[:n]) == depth), None)
           for p in owners}
  return sorted(found - {None}, key=lambda p: tuple(map(str, p)))


def outside_reads(loss_fn: Callable[..., Any], model: nnx.Module, args: tuple, wrt: Any,
                  paths: list[NNXPath], iterations: Mapping[str, int]) -> dict[str, set[str]]:
  """For each segment, the primitives that read its params outside its own call."""
  names = {p: segment_name(p) for p in paths}
  graphdef, template, others = nnx.split(model, wrt, ...)
  # Only traced forward: the backward steps are never called.
  fn = segmented_loss(loss_fn, graphdef, template, others, args, wrt, names,
                      lambda *_: FORWARD_ONLY, iterations=iterations)
  carriers = {n: () for n in names.values()}
  params = params_tree(template)
  jaxpr = jax.make_jaxpr(lambda p: fn(p, carriers))(params)
  return reads_outside(jaxpr, flat_leaf_owners(params, list(names.values())))


def unread(loss_fn: Callable[..., Any], model: nnx.Module, args: tuple,
           wrt: Any) -> set[NNXPath]:
  """The modules none of whose own ``wrt`` params ``loss_fn`` reads."""
  modules = {tuple(map(str, path)): tuple(path) for path, _ in nnx.iter_modules(model)}
  graphdef, template, others = nnx.split(model, wrt, ...)
  arrays, rebuild = partition_values(args, keep=nnx.graph.is_graph_node)

  def fn(params, arrays):
    copy = nnx.merge(graphdef, with_values(template, params), others, copy=True)
    return loss_fn(copy, *rebuild(arrays))

  def owner_of(keys):
    return next(modules[keys[:n]] for n in range(len(keys) - 1, -1, -1) if keys[:n] in modules)

  return unread_owners(fn, params_tree(template), [arrays], owner_of)


def choose(loss_fn: Callable[..., Any], model: nnx.Module, args: tuple, wrt: Any,
           spec: int | CallFilter | Exactly | None) -> Segmentation:
  """The segments of ``loss_fn`` for ``spec`` (None: layer-wise; int: depth; filter; names).

  Raises:
    SegmentInTransformError: a chosen segment runs inside an NNX transform.
    NoSegmentError: nothing can be a segment (a ``SegmentationError``).
    SegmentationError: a chosen segment is never called.
    SharedSegmentError: a chosen segment's params are used by more than its call.
  """
  by_filter = callable(spec) and not isinstance(spec, Exactly)
  calls = record_calls(loss_fn, model, args, wrt, spec if by_filter else _filters.all_calls)
  owners = param_owners(model, wrt)
  return _segment_choice.choose(
      spec, calls, owners,
      at_depth=lambda depth: modules_at_depth(model, owners, depth),
      outside_reads=lambda paths, scanned: outside_reads(loss_fn, model, args, wrt, paths,
                                                          scanned),
      transforms=('an NNX transform that does not hand it its slice of the whole module '
                  'along axis 0 (nnx.remat; nnx.scan with a StateAxes that broadcasts some '
                  'of its state, or inside a scan)'),
      in_transform_error=SegmentInTransformError,
      unread=lambda: unread(loss_fn, model, args, wrt))
