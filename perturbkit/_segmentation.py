"""Which Linen calls are segments: the layer-wise default, and the checks every choice passes.

A segment is one module call whose params the schedule updates inside the
backward pass. That is exact only when the call is the ONLY use of those
params: not called twice (shared weights), not sliced by ``nn.scan``/``nn.vmap``
(stacked params), and not read anywhere else (a tied LM head reading the
embedding matrix, a loss term on the weights). The default choice keeps every
module that owns params directly (Dense, Conv, Embed, LayerNorm, ...) as its
own segment and puts the params that fail a check in ``REST``, saying why;
segments the user chose raise instead.
"""
import collections
from typing import Any, Callable, Mapping, NamedTuple

import jax
from flax import traverse_util

from perturbkit import _filters
from perturbkit._consumers import reads_outside
from perturbkit._errors import SegmentationError, SharedSegmentError
from perturbkit._interceptor import intercept
from perturbkit._segments import params_sliced, segmented_loss
from perturbkit._types import CallFilter, Path, Variables

class Exactly(NamedTuple):
  """A segment choice naming the segments (a state's, checked again at each step)."""
  names: tuple[str, ...]


def exactly(names) -> Exactly:
  return Exactly(tuple(names))


SegmentSpec = int | CallFilter | Exactly | None


class Segmentation(NamedTuple):
  """The segments of a loss and the params left to the final update.

  Attributes:
    segments: Segment names (module paths ``'a/b'``) in execution order.
    rest: ``{module path: why its params are not in a segment}``; these params
      get their ordinary gradient and are updated at the end of the step.
  """
  segments: tuple[str, ...]
  rest: dict[str, str]


def name_of(path: Path) -> str:
  return '/'.join(path)


def path_of(name: str) -> Path:
  return tuple(name.split('/')) if name else ()


def param_owners(params: Mapping) -> list[Path]:
  """Paths of the modules that hold params directly (not only through children)."""
  return sorted({path[:-1] for path in traverse_util.flatten_dict(params)})


def module_paths(params: Mapping, depth: int) -> list[Path]:
  """Paths of the module scopes ``depth`` levels down that hold params."""
  return sorted({path[:depth] for path in traverse_util.flatten_dict(params)
                 if len(path) > depth})


class _CallRecord(NamedTuple):
  path: Path
  sliced: bool
  selected: bool


def record_calls(loss_fn: Callable[..., Any], variables: Variables, args: tuple,
                 filter: CallFilter = _filters.all_calls) -> list[_CallRecord]:
  """Every submodule call of ``loss_fn``, in execution order, from an abstract run."""
  calls: list[_CallRecord] = []
  params = variables['params']

  def on_call(call, run):
    calls.append(_CallRecord(call.path, params_sliced(call, params),
                             bool(filter(call.module, call.method_name))))
    return run()

  def traced(variables, *args):
    with intercept(_filters.all_calls, on_call):
      return loss_fn(variables, *args)

  jax.eval_shape(traced, variables, *args)
  return calls


def _nearest_ancestor(path: Path, chosen: set) -> Path | None:
  for n in range(1, len(path)):
    if path[:n] in chosen:
      return path[:n]
  return None


def outside_reads(loss_fn: Callable[..., Any], variables: Variables, args: tuple,
                  paths: list[Path]) -> dict[str, set[str]]:
  """For each segment, the primitives that read its params outside its own call."""
  names = {p: name_of(p) for p in paths}
  fn = segmented_loss(loss_fn, variables, args, names, lambda name: lambda g, dw, w: (None, ()))
  carriers = {n: () for n in names.values()}
  params = variables['params']
  jaxpr = jax.make_jaxpr(lambda p: fn(p, carriers))(params)
  owner_of = {}
  for i, (key_path, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0]):
    keys = tuple(str(getattr(k, 'key', k)) for k in key_path)
    owner = next((p for p in paths if keys[:len(p)] == p), None)
    if owner is not None:
      owner_of[i] = names[owner]
  return reads_outside(jaxpr, owner_of)


def _outside_reason(what: set[str]) -> str:
  return ('its params are also read outside its call (by ' + ', '.join(sorted(what)) +
          '), e.g. tied weights or a loss term on them')


def choose(loss_fn: Callable[..., Any], variables: Variables, args: tuple,
           spec: SegmentSpec) -> Segmentation:
  """The segments of ``loss_fn`` for ``spec`` (None: layer-wise; int: depth; filter).

  Raises:
    SegmentationError: a chosen segment runs inside ``nn.scan``/``nn.vmap``, or
      nothing can be a segment.
    SharedSegmentError: a chosen segment's params are used by more than its call.
  """
  params = variables['params']
  calls = record_calls(loss_fn, variables, args,
                       spec if callable(spec) and not isinstance(spec, Exactly)
                       else _filters.all_calls)
  count = collections.Counter(c.path for c in calls)
  first = {}
  for i, c in enumerate(calls):
    first.setdefault(c.path, i)
  sliced = {c.path for c in calls if c.sliced}
  if spec is None:
    chosen, rest = _layerwise(params, count, sliced)
  else:
    chosen, rest = _user_choice(spec, params, calls, count, sliced), {}
  reads = outside_reads(loss_fn, variables, args, sorted(chosen))
  for name, what in reads.items():
    if spec is not None:
      raise SharedSegmentError(name, _outside_reason(what))
    chosen.discard(path_of(name))
    rest[name] = _outside_reason(what)
  if not chosen:
    raise SegmentationError(
        'No call can be a segment: ' + '; '.join(f'{k}: {v}' for k, v in rest.items())[:600])
  ordered = sorted(chosen, key=lambda p: first[p])
  return Segmentation(tuple(name_of(p) for p in ordered), rest)


def _user_choice(spec: SegmentSpec, params: Mapping, calls: list[_CallRecord],
                 count: Mapping[Path, int], sliced: set[Path]) -> set[Path]:
  """The segments a depth, a filter or a state names, each checked (raising if it fails)."""
  if isinstance(spec, Exactly):
    wanted = [path_of(n) for n in spec.names]
  elif isinstance(spec, int):
    wanted = module_paths(params, spec)
  else:
    wanted = sorted({c.path for c in calls if c.selected and _owns_params(params, c.path)})
  wanted = [p for p in wanted if _nearest_ancestor(p, set(wanted)) is None]
  if not wanted:
    seen = sorted({name_of(c.path) for c in calls})
    raise SegmentationError(
        f'The segment choice {spec!r} selects no call that owns params. Calls seen: '
        f'[{", ".join(seen[:16])}{" ..." if len(seen) > 16 else ""}].')
  for p in wanted:
    if p in sliced:
      raise SegmentationError(
          f'The segment {name_of(p)!r} runs inside a lifted transform (nn.scan, nn.vmap) '
          'whose params are sliced; make the whole transformed module one segment '
          '(its parent), or choose other segments.')
    if count[p] > 1:
      raise SharedSegmentError(name_of(p), f'it is called {count[p]} times in one step')
    if count[p] == 0:
      raise SegmentationError(
          f'The segment {name_of(p)!r} is never called by the loss; choose other segments.')
  return set(wanted)


def _owns_params(params: Mapping, path: Path) -> bool:
  tree = params
  for k in path:
    if not isinstance(tree, Mapping) or k not in tree:
      return False
    tree = tree[k]
  return bool(jax.tree.leaves(tree))


def _layerwise(params: Mapping, count: Mapping[Path, int],
               sliced: set[Path]) -> tuple[set[Path], dict[str, str]]:
  """Every module owning params directly, or its nearest enclosing call that can be one."""
  chosen: set[Path] = set()
  rest: dict[str, str] = {}
  for owner in param_owners(params):
    target = owner
    # Stacked params (nn.scan, nn.vmap): the nearest enclosing call takes them.
    while target and owner in sliced and (target in sliced or count.get(target, 0) == 0):
      target = target[:-1]
    if not target or count.get(target, 0) == 0:
      why = ('it runs inside nn.scan/nn.vmap (params stacked) and no enclosing call can be '
             'a segment' if owner in sliced else
             'its params are created in the root module' if not owner else
             'it is not called as a submodule by the loss')
      rest[name_of(owner)] = why
      continue
    chosen.add(target)
  # A segment's replay covers everything called inside it.
  chosen = {p for p in chosen if _nearest_ancestor(p, chosen) is None}
  for p in sorted(chosen):
    if count[p] > 1:
      chosen.discard(p)
      rest[name_of(p)] = f'it is called {count[p]} times in one step (shared weights)'
  return chosen, rest
