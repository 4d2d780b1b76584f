"""Which NNX calls are segments: the layer-wise default, and the checks every choice passes.

The same rules as the Linen front end (``_segmentation``): a segment is one
submodule call whose trained variables the schedule updates inside the
backward pass, exact only when that call is the ONLY use of them. A module
called twice, one whose variables are read elsewhere (tied weights, a loss
term on them; found in the jaxpr by ``_consumers``), or one that runs inside
an NNX transform (``nnx.scan``, ``nnx.vmap``, ``nnx.remat`` run copies of the
module, with stacked params under ``nnx.scan``) cannot be one. The default
choice puts those params in ``REST`` with the reason, or gives them to the
nearest enclosing call that can be a segment; segments the user chose raise.
"""
import collections
from typing import Any, Callable, NamedTuple

import jax
from flax import nnx

from perturbkit import _filters
from perturbkit._consumers import reads_outside
from perturbkit._errors import SegmentationError, SharedSegmentError
from perturbkit._nnx_calls import Call, NNXPath, instrument
from perturbkit._nnx_segments import flat_leaf_owners, params_tree, segment_name, segmented_loss
from perturbkit._segmentation import Exactly, Segmentation, exactly
from perturbkit._types import CallFilter

__all__ = ['Exactly', 'Segmentation', 'SegmentInTransformError', 'choose', 'exactly']


class SegmentInTransformError(SegmentationError):
  """A chosen segment runs inside an NNX transform (``nnx.scan``, ``nnx.vmap``, ``nnx.remat``)."""

  def __init__(self, name: str):
    super().__init__(
        f'The segment {name!r} runs inside an NNX transform (nnx.scan, nnx.vmap, nnx.remat), '
        'which calls a copy of the module (with stacked params under nnx.scan), so its '
        'weights cannot be updated inside the backward pass there. Make the module that '
        'applies the transform one segment (its parent), or choose other segments.')


class _CallRecord(NamedTuple):
  path: NNXPath
  copied: bool
  selected: bool


def record_calls(loss_fn: Callable[..., Any], model: nnx.Module, args: tuple,
                 filter: CallFilter = _filters.all_calls) -> list[_CallRecord]:
  """Every submodule call of ``loss_fn``, in execution order, from an abstract run."""
  calls: list[_CallRecord] = []

  def on_call(call: Call, run: Callable[[], Any]) -> Any:
    calls.append(_CallRecord(call.path, call.copied, bool(filter(call.module, call.method_name))))
    return run()

  graphdef, state = nnx.split(model)

  def traced(state, args):
    copy = nnx.merge(graphdef, state, copy=True)
    with instrument([copy], on_call):
      return loss_fn(copy, *args)

  jax.eval_shape(traced, state, args)
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


def _nearest_ancestor(path: NNXPath, chosen: set) -> NNXPath | None:
  return next((path[:n] for n in range(1, len(path)) if path[:n] in chosen), None)


def outside_reads(loss_fn: Callable[..., Any], model: nnx.Module, args: tuple, wrt: Any,
                  paths: list[NNXPath]) -> dict[str, set[str]]:
  """For each segment, the primitives that read its params outside its own call."""
  names = {p: segment_name(p) for p in paths}
  graphdef, template, others = nnx.split(model, wrt, ...)
  fn = segmented_loss(loss_fn, graphdef, template, others, args, wrt, names,
                      lambda name: lambda g, dw, w: (None, ()))
  carriers = {n: () for n in names.values()}
  params = params_tree(template)
  jaxpr = jax.make_jaxpr(lambda p: fn(p, carriers))(params)
  return reads_outside(jaxpr, flat_leaf_owners(params, list(names.values())))


def _outside_reason(what: set[str]) -> str:
  return ('its params are also read outside its call (by ' + ', '.join(sorted(what)) +
          '), e.g. tied weights or a loss term on them')


def choose(loss_fn: Callable[..., Any], model: nnx.Module, args: tuple, wrt: Any,
           spec: int | CallFilter | Exactly | None) -> Segmentation:
  """The segments of ``loss_fn`` for ``spec`` (None: layer-wise; int: depth; filter; names).

  Raises:
    SegmentInTransformError: a chosen segment runs inside an NNX transform.
    SegmentationError: nothing can be a segment, or a chosen one is never called.
    SharedSegmentError: a chosen segment's params are used by more than its call.
  """
  by_filter = callable(spec) and not isinstance(spec, Exactly)
  calls = record_calls(loss_fn, model, args, spec if by_filter else _filters.all_calls)
  count = collections.Counter(c.path for c in calls if not c.copied)
  first: dict[NNXPath, int] = {}
  for i, c in enumerate(calls):
    first.setdefault(c.path, i)
  transformed = {c.path for c in calls if c.copied}
  owners = param_owners(model, wrt)
  by_name = {segment_name(p): p for p in {c.path for c in calls} | set(owners)}
  if spec is None:
    chosen, rest = _layerwise(owners, count, transformed)
  else:
    if isinstance(spec, Exactly):
      wanted = [by_name.get(n, tuple(n.split('/'))) for n in spec.names]
    elif isinstance(spec, int):
      wanted = modules_at_depth(model, owners, spec)
    else:
      owning = {q for p in owners for q in [p[:n] for n in range(1, len(p) + 1)]}
      wanted = sorted({c.path for c in calls if c.selected and c.path in owning},
                      key=lambda p: first[p])
    wanted = [p for p in wanted if _nearest_ancestor(p, set(wanted)) is None]
    if not wanted:
      seen = sorted({segment_name(c.path) for c in calls})
      raise SegmentationError(
          f'The segment choice {spec!r} selects no call that owns params. Calls seen: '
          f'[{", ".join(seen[:16])}{" ..." if len(seen) > 16 else ""}].')
    for p in wanted:
      if p in transformed:
        raise SegmentInTransformError(segment_name(p))
      if count[p] > 1:
        raise SharedSegmentError(segment_name(p), f'it is called {count[p]} times in one step')
      if count[p] == 0:
        raise SegmentationError(
            f'The segment {segment_name(p)!r} is never called by the loss; choose other '
            'segments.')
    chosen, rest = set(wanted), {}
  reads = outside_reads(loss_fn, model, args, wrt, sorted(chosen, key=lambda p: first[p]))
  for name, what in reads.items():
    if spec is not None:
      raise SharedSegmentError(name, _outside_reason(what))
    chosen.discard(by_name[name])
    rest[name] = _outside_reason(what)
  if not chosen:
    raise SegmentationError(
        'No call can be a segment: ' + '; '.join(f'{k}: {v}' for k, v in rest.items())[:600])
  ordered = sorted(chosen, key=lambda p: first[p])
  return Segmentation(tuple(segment_name(p) for p in ordered), rest)


def _layerwise(owners: list[NNXPath], count: collections.Counter,
               transformed: set[NNXPath]) -> tuple[set[NNXPath], dict[str, str]]:
  """Every module owning params directly, or its nearest enclosing call that can be one."""
  chosen: set[NNXPath] = set()
  rest: dict[str, str] = {}
  for owner in owners:
    target = owner
    # Copies inside nnx.scan/vmap/remat: the nearest enclosing plain call takes them.
    while target and owner in transformed and (target in transformed or count[target] == 0):
      target = target[:-1]
    if not target or count[target] == 0:
      why = ('it runs inside an NNX transform (nnx.scan, nnx.vmap, nnx.remat) and no '
             'enclosing call can be a segment' if owner in transformed else
             'its params are held by the root module' if not owner else
             'it is not called as a submodule by the loss')
      rest[segment_name(owner)] = why
      continue
    chosen.add(target)
  chosen = {p for p in chosen if _nearest_ancestor(p, chosen) is None}
  for p in sorted(chosen, key=lambda p: tuple(map(str, p))):
    if count[p] > 1:
      chosen.discard(p)
      rest[segment_name(p)] = f'it is called {count[p]} times in one step (shared weights)'
  return chosen, rest
