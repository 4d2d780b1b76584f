"""Which calls are segments, for either front end: the layer-wise default and the checks of a choice.

A segment is one module call whose params the schedule updates inside the
backward pass. That is exact only when the call is the ONLY use of those
params: not called twice (shared weights), not run inside a transform that
copies or slices the module (``nn.scan``/``nn.vmap``; ``nnx.scan``/
``nnx.vmap``/``nnx.remat``), and not read anywhere else (a tied LM head reading
the embedding matrix, a loss term on the weights). The default choice keeps
every module that owns params directly (Dense, Conv, Embed, LayerNorm, ...) as
its own segment, or gives it to the nearest enclosing call that can be one,
and puts the params that fail a check in ``REST``, saying why; segments the
user chose raise instead.

Nothing here knows which Flax API built the model: a front end records the
calls of the loss (``_segmentation`` for Linen, ``_nnx_segmentation`` for NNX)
as :class:`CallRecord`, and says which modules own params, which sit at a
depth, and which segments' params are read outside their call.
"""
import collections
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from perturbkit.errors import NoSegmentError, SegmentationError, SharedSegmentError
from perturbkit.core._types import CallFilter

Path = tuple[str | int, ...]


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
    iterations: ``{segment name: L}`` for each segment whose params are
      stacked along their first axis and sliced by a scan (``nn.scan`` with
      ``variable_axes={'params': 0}``): each iteration is updated on its own
      slice, in the order the backward pass meets them.
  """
  segments: tuple[str, ...]
  rest: dict[str, str]
  iterations: Mapping[str, int] = {}

  def __repr__(self) -> str:
    scanned = f', iterations={dict(self.iterations)}' if self.iterations else ''
    return f'Segmentation(segments={self.segments!r}, rest={self.rest!r}{scanned})'


class CallRecord(NamedTuple):
  """One submodule call of the loss, in execution order.

  Attributes:
    path: The module's path.
    transformed: The call runs inside a transform that copies or slices the
      module, so its params cannot be updated there (unless ``iterations``).
    selected: The user's segment filter selects the call.
    key: The call's point key (``'__call__'``, ``'__call__#1'``): a body that a
      scan traces twice makes the same call twice under one key.
    iterations: ``L`` where the call sees its params sliced from params stacked
      ``(L, ...)`` along their first axis (a scan's iteration), which a
      segment can update slice by slice; 0 otherwise.
    nested: The call is made while a call of the same module runs (a method
      calling another of its own methods, or ``super().__call__``): it is part
      of that call, not a second use of the module's params.
    within: The modules whose calls are running when this one starts, outermost
      first (Linen: a module handed to another as an attribute runs inside that
      one's call, but its params are not the caller's).
    branch: The conditional or loop the call runs in (``'nn.cond'``,
      ``'nnx.switch'``, ``'nn.while_loop'``), where a segment cannot run: each
      branch makes the call once, and a loop's body runs it many times; ``''``
      elsewhere.
  """
  path: Path
  transformed: bool
  selected: bool
  key: str = '__call__'
  iterations: int = 0
  nested: bool = False
  within: tuple[Path, ...] = ()
  branch: str = ''


def leading_length(tree: Any) -> int | None:
  """The length of the first axis every leaf of ``tree`` has, or ``None`` (none, or several)."""
  lengths = {jnp.shape(leaf)[0] if jnp.ndim(leaf) else None for leaf in jax.tree.leaves(tree)}
  return lengths.pop() if len(lengths) == 1 and None not in lengths else None


def sliced_iterations(full: Any, part: Any) -> int:
  """``L`` if every leaf of ``part`` is the same leaf of ``full`` sliced from ``(L, ...)``, else 0.

  That is what a scan over params stacked along their first axis hands each
  iteration's call (``nn.scan`` with ``variable_axes={'params': 0}``; ``nnx.scan``
  over modules made with ``nnx.vmap``); params stacked along another axis,
  nested scans and params shared by the iterations give 0.
  """
  full_leaves, full_def = jax.tree.flatten(full)
  leaves, treedef = jax.tree.flatten(part)
  length = leading_length(full_leaves)
  if not leaves or treedef != full_def or length is None:
    return 0
  if any(jnp.shape(f)[1:] != jnp.shape(w) for f, w in zip(full_leaves, leaves)):
    return 0
  return length


def note_segment_call(called: dict, name: str, path: Path, key: str, scanned: bool):
  """Records a segment's call in ``called`` (path -> key), once per step.

  Calls made inside a segment are not intercepted, so any second call on a
  segment's module (a second ``__call__``, or another method such as a tied
  embedding's ``attend``) is a genuine second use of its weights; a scan that
  traces its body twice makes a scanned segment's call again under the same key.

  Raises:
    SharedSegmentError: the segment's module is called more than once in one step.
  """
  if path in called and (not scanned or called[path] != key):
    raise SharedSegmentError(name, 'it is called more than once in one step')
  called[path] = key


class OpenCalls:
  """The modules whose calls are running, innermost last, as a recorder meets them.

  ``around(path, run)`` runs one call; ``nested(path)`` says whether a call of
  ``path`` starts inside a running call of the same module.
  """

  def __init__(self):
    self.paths: list[Path] = []

  def nested(self, path: Path) -> bool:
    return path in self.paths

  def running(self) -> tuple[Path, ...]:
    return tuple(self.paths)

  def around(self, path: Path, run: Callable[[], Any]) -> Any:
    self.paths.append(path)
    try:
      return run()
    finally:
      self.paths.pop()


def name_of(path: Path) -> str:
  """``('blocks', 0)`` -> ``'blocks/0'``: a segment's name."""
  return '/'.join(map(str, path))


def flat_leaf_owners(params: Any, names: list[str]) -> dict[int, str]:
  """Input position of each leaf of ``params`` (as ``jax.tree`` flattens it) -> its segment.

  Leaves are matched by their key path, with every key as a string, so a
  segment ``'blocks/0'`` owns the leaves under ``params['blocks'][0]`` as well
  as under ``params['blocks']['0']``.
  """
  owners = {}
  paths = [tuple(n.split('/')) for n in names]
  for i, (key_path, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0]):
    keys = tuple(str(getattr(k, 'key', k)) for k in key_path)
    owner = next((p for p in paths if keys[:len(p)] == p), None)
    if owner is not None:
      owners[i] = '/'.join(owner)
  return owners


def direct_leaf_owners(params: Any, names: Mapping[Path, str]) -> dict[int, str]:
  """Input position of each leaf of ``params`` -> the name of the module owning it directly.

  Unlike :func:`flat_leaf_owners` (a segment owns its whole subtree), a leaf
  belongs to the module at its key path less the param's own name, so a
  module and its children are told apart. Keys are matched as strings (an NNX
  list index ``0`` as ``'0'``).
  """
  by_keys = {tuple(map(str, path)): name for path, name in names.items()}
  owners = {}
  for i, (key_path, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0]):
    keys = tuple(str(getattr(k, 'key', k)) for k in key_path)
    if keys[:-1] in by_keys:
      owners[i] = by_keys[keys[:-1]]
  return owners


def _nearest_ancestor(path: Path, chosen: set) -> Path | None:
  return next((path[:n] for n in range(1, len(path)) if path[:n] in chosen), None)


def _foreign_calls(chosen: set[Path], calls: list[CallRecord],
                   owners: list[Path]) -> dict[Path, Path]:
  """For each segment whose call runs a module with params that lies outside it (a
  module handed to it as an attribute), the first such module.

  The segment's replay sees only the params under its own path, and its step would
  not update the other module's, so such a segment cannot be one.
  """
  holding = {p[:n] for p in owners for n in range(1, len(p) + 1)}
  foreign: dict[Path, Path] = {}
  for c in calls:
    if c.path not in holding:
      continue
    for s in c.within:
      if s in chosen and c.path[:len(s)] != s:
        foreign.setdefault(s, c.path)
  return foreign


def _foreign_reason(module: Path) -> str:
  return (f'its call runs {name_of(module)!r}, a module outside it (handed to it as an '
          'attribute, as a shared embedding is), whose params are neither its own nor '
          'updated by its step')


def _outside_reason(what: set[str]) -> str:
  if 'output' in what:
    example = ("the loss returns them; return only what changes (Linen: apply(..., "
               "mutable=True) returns 'params' too, ask for e.g. mutable=['batch_stats']; NNX: "
               "nnx.state(model) holds the params, return e.g. nnx.state(model, nnx.BatchStat))")
  else:
    example = 'e.g. tied weights or a loss term on them'
  return f'its params are also read outside its call (by {", ".join(sorted(what))}): {example}'


def choose(spec: SegmentSpec, calls: list[CallRecord], owners: list[Path], *,
           at_depth: Callable[[int], list[Path]],
           outside_reads: Callable[[list[Path]], Mapping[str, set[str]]],
           transforms: str, in_transform_error: Callable[[str], Exception],
           unread: Callable[[], set[Path]] = set) -> Segmentation:
  """The segments for ``spec`` (None: layer-wise; int: depth; filter; names).

  Args:
    spec: The choice.
    calls: Every submodule call of the loss, in execution order (for a filter
      ``spec``, ``selected`` says which it selects).
    owners: Paths of the modules holding params directly.
    at_depth: ``depth -> paths`` of the modules that many levels down holding
      params, as the front end counts levels.
    outside_reads: ``(segment paths, {name: iterations} of those inside a scan)
      -> {segment name: primitives reading its params outside its call}``, for
      the segments that have such reads.
    transforms: The transforms that copy or slice modules, named in reasons.
    in_transform_error: ``name -> error`` for a chosen segment that runs
      inside such a transform.
    unread: ``() -> paths`` of the modules none of whose own params the loss
      reads (``_unread``); asked only by the layer-wise default, and only when a
      module owning params encloses others that do.

  Returns:
    The :class:`Segmentation`.

  Raises:
    NoSegmentError: nothing can be a segment (a ``SegmentationError``).
    SegmentationError: a chosen segment is never called.
    SharedSegmentError: a chosen segment's params are used by more than its call.
    Exception: ``in_transform_error(name)`` for a chosen segment in a transform.
  """
  # A call inside a call of the same module is part of it (the segment's replay runs it);
  # a filter selecting the inner call selects the module's call.
  selected = {c.path for c in calls if c.selected}
  calls = [c._replace(selected=c.path in selected) for c in calls if not c.nested]
  branched = {c.path: c.branch for c in calls if c.branch}
  count = collections.Counter(c.path for c in calls if not c.transformed and not c.branch)
  stacked_keys: dict[Path, set[str]] = {}
  for c in calls:
    if c.transformed and c.iterations:
      stacked_keys.setdefault(c.path, set()).add(c.key)
  count.update({path: len(keys) for path, keys in stacked_keys.items()})
  first: dict[Path, int] = {}
  for i, c in enumerate(calls):
    first.setdefault(c.path, i)
  # Sliced by a scan along the params' first axis: a segment updating each iteration's slice.
  iterations = {c.path: c.iterations for c in calls if c.transformed and c.iterations}
  transformed = {c.path for c in calls if c.transformed and not c.iterations}
  by_name = {name_of(p): p for p in {c.path for c in calls} | set(owners)}
  # rest: {module: (kind of reason, reason)}; the kind picks NoSegmentError's advice.
  if spec is None:
    chosen, rest = _layerwise(owners, count, transformed, branched, transforms, unread)
  else:
    chosen, rest = _user_choice(spec, calls, owners, count, transformed, branched, at_depth,
                                by_name, in_transform_error), {}
  for path, module in _foreign_calls(chosen, calls, owners).items():
    if spec is not None:
      raise SharedSegmentError(name_of(path), _foreign_reason(module))
    chosen.discard(path)
    rest[name_of(path)] = ('outside', _foreign_reason(module))
  in_order = lambda paths: sorted(paths, key=lambda p: first[p])
  scanned = lambda paths: {name_of(p): iterations[p] for p in paths if p in iterations}
  reads = outside_reads(in_order(chosen), scanned(chosen))
  while reads:
    for name, what in reads.items():
      if spec is not None:
        raise SharedSegmentError(name, _outside_reason(what))
      chosen.discard(by_name[name])
      rest[name] = ('output' if 'output' in what else 'outside', _outside_reason(what))
    # The segments left are checked again, as a step checks them: reads are judged
    # among the segments chosen, so the choice passes its own check.
    reads = outside_reads(in_order(chosen), scanned(chosen)) if chosen else {}
  if not chosen:
    raise NoSegmentError(rest)
  return Segmentation(tuple(name_of(p) for p in in_order(chosen)),
                      {name: why for name, (_, why) in rest.items()}, scanned(in_order(chosen)))


def _user_choice(spec: SegmentSpec, calls: list[CallRecord], owners: list[Path],
                 count: Mapping[Path, int], transformed: set[Path],
                 branched: Mapping[Path, str], at_depth: Callable[[int], list[Path]],
                 by_name: Mapping[str, Path],
                 in_transform_error: Callable[[str], Exception]) -> set[Path]:
  """The segments a depth, a filter or a state names, each checked (raising if it fails)."""
  if isinstance(spec, Exactly):
    wanted = [by_name.get(n, tuple(n.split('/'))) for n in spec.names]
  elif isinstance(spec, int):
    wanted = at_depth(spec)
  else:
    owning = {p[:n] for p in owners for n in range(1, len(p) + 1)}
    wanted = [c.path for c in calls if c.selected and c.path in owning]
  wanted = [p for p in dict.fromkeys(wanted) if _nearest_ancestor(p, set(wanted)) is None]
  if not wanted:
    seen = sorted({name_of(c.path) for c in calls})
    raise SegmentationError(
        f'The segment choice {spec!r} selects no call that owns params. Calls seen: '
        f'[{", ".join(seen[:16])}{" ..." if len(seen) > 16 else ""}].')
  for p in wanted:
    if p in branched:
      raise SegmentationError(
          f'The segment {name_of(p)!r} runs inside {branched[p]}, where a segment cannot run; '
          'choose the module whose call runs it (the conditional or loop then runs inside '
          'that segment), or other segments.')
    if p in transformed:
      raise in_transform_error(name_of(p))
    if count[p] > 1:
      raise SharedSegmentError(name_of(p), f'it is called {count[p]} times in one step')
    if count[p] == 0:
      raise SegmentationError(
          f'The segment {name_of(p)!r} is never called by the loss; choose other segments.')
  return set(wanted)


def _layerwise(owners: list[Path], count: Mapping[Path, int], transformed: set[Path],
               branched: Mapping[Path, str], transforms: str,
               unread: Callable[[], set[Path]]) -> tuple[set[Path], dict[str, tuple[str, str]]]:
  """Every module owning params directly, or its nearest enclosing call that can be one.

  A module whose own params are read in its call, around modules with params of
  their own (ViT's embeddings: a class token around a patch convolution), is one
  segment with them. Own params the loss never reads (Wav2Vec2's
  ``masked_spec_embed`` without ``mask_time_indices``) do not make it one: they go
  to ``REST`` with their zero gradient, and the modules inside are segments. Modules
  owning params that are never called themselves, inside a call none of whose
  owners is called (an NNX module inside a Linen model through
  ``nnx.bridge.ToLinen``), are that call's segment. The modules left out map to
  ``(kind, reason)``.
  """
  chosen: set[Path] = set()
  rest: dict[str, tuple[str, str]] = {}
  cannot = lambda path: path in transformed or path in branched
  enclosing = {o[:n] for o in owners for n in range(1, len(o))} & set(owners)
  idle = unread() & enclosing if enclosing else set()
  # Modules with a called owner at or below them: a call around owners none of which is
  # called itself (an NNX module run by nnx.bridge.ToLinen, whose submodules the Linen
  # front end does not see as calls) is their segment; one with called owners keeps them.
  above_called = {o[:n] for o in owners if count[o] > 0 for n in range(len(o) + 1)}
  for owner in owners:
    if owner in idle:
      continue
    target = owner
    # Copied or sliced params, or a call in a conditional or loop: the nearest enclosing
    # plain call takes them.
    while target and cannot(owner) and (cannot(target) or count[target] == 0):
      target = target[:-1]
    if target and not cannot(owner) and count[owner] == 0:
      while target and count[target] == 0:
        target = target[:-1]
      target = target if target not in above_called else ()
    if not target or count[target] == 0:
      rest[name_of(owner)] = (
          ('branch', f'it runs inside {branched[owner]}, where a segment cannot run, and no '
                     'enclosing call can be a segment')
          if owner in branched else
          ('transform', f'it runs inside {transforms} and no enclosing call can be a segment')
          if owner in transformed else
          ('root', 'its params belong to the root module itself') if not owner else
          ('uncalled', 'it is not called as a submodule by the loss'))
      continue
    chosen.add(target)
  # A segment's replay covers everything called inside it.
  chosen = {p for p in chosen if _nearest_ancestor(p, chosen) is None}
  for p in sorted(idle, key=lambda p: tuple(map(str, p))):
    if p in chosen or _nearest_ancestor(p, chosen) is not None:
      continue  # a segment around it (or itself, for a call in a transform) holds its params
    rest[name_of(p)] = ('unread', 'the loss does not read its own params on these arguments '
                                  '(their gradient is zero), so they do not make its call one '
                                  'segment with the modules inside it')
  for p in sorted(chosen, key=lambda p: tuple(map(str, p))):
    if count[p] > 1:
      chosen.discard(p)
      rest[name_of(p)] = ('shared', f'it is called {count[p]} times in one step (shared weights)')
  return chosen, rest
