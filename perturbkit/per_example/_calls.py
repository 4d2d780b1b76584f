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
from flax import traverse_util

from perturbkit.core._values import is_array, partition_values
from perturbkit.core import filters as _filters
from perturbkit.core._loss import scalar_loss
from perturbkit.linen._interceptor import Call, intercept
from perturbkit.per_example._batch import BatchAxes, count_examples, per_argument
from perturbkit.core._dependence import computation_of, needed_inputs, source_kinds
from perturbkit.per_example._mixing import mixing
from perturbkit.per_example._kinds import GENERAL, LayerKind, Replay
from perturbkit.per_example._linen_kinds import linen_kind, linen_replay
from perturbkit.per_example._nested import nested_applies, nested_params
from perturbkit.per_example._fallback import replayed_owners, source_error, unreplayed_error
from perturbkit.per_example._outside import reads_by_place
from perturbkit.errors import (ExamplesMixedError, ParamsReadOutsideError,
                               PerExampleError, UncoveredParamsError)
from perturbkit.core._points import differentiable_part, inside_lifted_transform, merge
from perturbkit.core._types import Path, Variables
from perturbkit.core._varying import typed_shape

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
    kind: Which fast rule the module's plain calls may use (``_kinds``).
    replay: The call as a function of the module's params (``_kinds.Replay``).
  """
  path: Path
  key: str
  method_name: str
  module: Any
  template: Any
  sources: tuple[str, ...] = ()
  kind: LayerKind = GENERAL
  replay: Replay | None = None


class ReadUse(NamedTuple):
  """A nested ``apply`` inside the loss (a tied head), as recorded while tracing.

  Attributes:
    index: Its place among the nested applies, in execution order.
    method_name: The method called on its root module.
    module: An unbound copy of that module.
    template: ``(args, kwargs)`` with every array replaced by ``None``.
    sources: What each array input is computed from (as ``Use.sources``).
    outputs: The shapes of its floating-point outputs (leaves of :func:`float_part`).
    out_tree: The tree structure of ``float_part`` of its output.
    owners: The paths of the param-owning modules its params are computed from.
  """
  index: int
  method_name: str
  module: nn.Module
  template: Any
  sources: tuple[str, ...]
  outputs: tuple[jax.ShapeDtypeStruct, ...]
  out_tree: Any
  owners: frozenset


def float_part(tree: Any) -> Any:
  """``tree``'s floating-point arrays as a point holds them (:func:`differentiable_part`):
  ``None`` in place of the other leaves of plain tuples, lists and dicts; a user's own node
  (a ``flax.struct`` dataclass, a Hugging Face ``ModelOutput``) kept, or the tuple of its
  floating-point leaves."""
  return differentiable_part(tree)


def add_to_floats(tree: Any, delta: Any) -> Any:
  """``tree`` with ``delta`` (shaped like ``float_part(tree)``) added to its float arrays."""
  return merge(tree, jax.tree.map(lambda t, d: t + d, float_part(tree), delta))


def static_part(tree: Any) -> Any:
  """``tree`` with arrays replaced by ``None``; plain containers keep their shape."""
  if is_array(tree):
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
  if is_array(arrays):
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
  return {k: v for k, v in node.items() if is_array(v)}


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
  return [leaf for leaf in jax.tree.leaves(tree) if is_array(leaf)]


class _Reads(NamedTuple):
  """Where each read was made, to tell what its replay adds to what others already give.

  Attributes:
    inside: By read, the owners whose uses ran around it (their replays carry its gradient).
    top: By read, the position of the top-level apply it ran in (``None`` for top-level ones).
    lifted: The owners called inside a lifted transform (``nn.remat``, ``nn.scan``, ...).
    everything: The top-level applies (positions) in which a nested apply ran inside a
      lifted transform, whose params cannot be traced back there: they cover every owner.
  """
  inside: list[frozenset]
  top: list[int | None]
  lifted: set[Path]
  everything: set[int]


def read_owners(needed: frozenset, where: _Reads, position: int,
                covers: dict[int, frozenset]) -> frozenset:
  """The owners to whose uses' per-example gradients the read at ``position`` adds its own.

  A top-level apply (a unit) adds to those it ``covers``; a nested apply, to those
  its params are computed from (``needed``), less the owners whose use it runs
  inside and those its unit covers: their replays already carry its gradient.
  """
  if where.top[position] is None:
    return covers.get(position, frozenset())
  return needed - where.inside[position] - covers.get(where.top[position], frozenset())


def find_uses(loss_fn: Callable[..., Any], variables: Variables, args: tuple,
              kwargs: dict, batch_axes: BatchAxes = 0, private: bool = False
              ) -> tuple[dict[Path, list[Use]], list[ReadUse], PerExampleError | None,
                         Callable[[Any], list[Any]]]:
  """Every outermost call of each param-owning module, in execution order, the reads, the mixing,
  and the params each read is given as a function of the model's params.

  A call of a module made inside another call of the same module (a method
  calling ``self.other_method``) is part of the outer use and not recorded.
  The loss is traced to a jaxpr, whose data dependences say which array inputs
  of each use come from the arguments batched by ``batch_axes`` (``Use.sources``).
  A nested ``apply`` whose params are computed from the model's params (a tied
  LM head, see ``_per_example_reads``) is a :class:`ReadUse`, for the owners
  whose calls it does not run inside. A module called inside a lifted transform
  (``nn.remat``, ``nn.scan``) has no use of its own (its inputs live inside the
  transform); the top-level ``apply`` it runs in is a :class:`ReadUse` for it
  instead, replacing its uses and reads inside that apply. The third value says
  how the loss mixes examples where gradients flow (``_per_example_mixing``) when a
  layer call also sees the examples on an axis other than 0, else ``None``: the
  caller raises it after its examples-axis checks, which name the axis problem.
  The fourth value maps ``variables['params']`` to the params each returned read is
  given, in order; it is the part of the traced loss that computes them (a transpose
  for a tied head), so its VJP pulls the reads' gradients back to the model's params
  without another trace of the loss.

  Raises:
    ExamplesMixedError: a call mixes examples (BatchNorm in training mode), or the loss
      does where gradients flow (``_per_example_mixing``).
    UncoveredParamsError: a module owns params but is never called.
    ParamsReadOutsideError: a module's params are read outside its calls and outside
      nested applies (``_per_example_outside``).
    PerExampleError: a nested ``apply`` is given params computed from the batch.
  """
  owners = owner_paths(variables['params'])
  batch_stats_owners = {p[:-1] for p in traverse_util.flatten_dict(
      dict(variables.get('batch_stats', {})))}
  uses: dict[Path, list[Use]] = {}
  use_top: dict[tuple[Path, int], int | None] = {}  # the top-level apply of each use
  inputs: list[tuple[Path, int, list[Any]]] = []  # (path, use index, array inputs) by call
  reads: list[ReadUse] = []
  # (array inputs, params leaves, params tree) by read
  read_arrays: list[tuple[list[Any], list[Any], Any]] = []
  where = _Reads([], [], set(), set())
  active: list[Path] = []
  tops: list[int] = []  # the position of the running top-level apply, when recorded
  lifted_depth = [0]
  lifted_calls = [0]  # of owners, inside lifted transforms
  holders: set[Path] = set()  # owners whose calls run another owner that is not their child

  def handler(call: Call, run: Callable[[], Any]) -> Any:
    reason = _mixing_reason(call, batch_stats_owners)
    if reason:
      raise ExamplesMixedError(reason)
    if call.path in owners:
      # A layer another module was given as an attribute (``nn.WeightNorm(layer)``) runs
      # inside that module's call, with params that are not its: that call cannot be
      # replayed with its own params alone.
      holders.update(p for p in active if call.path[:len(p)] != p)
    if inside_lifted_transform(call.module):
      if call.path in owners:
        where.lifted.add(call.path)
        uses.setdefault(call.path, [])
        lifted_calls[0] += 1
      lifted_depth[0] += 1
      try:
        return run()
      finally:
        lifted_depth[0] -= 1
    if call.path not in owners or call.path in active:
      return run()
    unbound = call.module.clone(parent=None)
    uses.setdefault(call.path, []).append(Use(
        call.path, call.key, call.method_name, unbound, static_part((call.args, call.kwargs)),
        kind=linen_kind(call.module),
        replay=linen_replay(unbound, call.method_name, '/'.join(call.path + (call.key,)))))
    use_top[(call.path, len(uses[call.path]) - 1)] = tops[-1] if tops else None
    inputs.append((call.path, len(uses[call.path]) - 1,
                   _array_leaves((call.args, call.kwargs))))
    active.append(call.path)
    try:
      return run()
    finally:
      active.pop()

  def record(index, module, method_name, a, kw, out, top):
    floats, out_tree = jax.tree.flatten(float_part(out))
    reads.append(ReadUse(index, method_name, module.clone(parent=None), static_part((a, kw)),
                         (), tuple(map(typed_shape, floats)),
                         out_tree, frozenset()))
    params, params_tree = jax.tree.flatten(nested_params(module))
    read_arrays.append((_array_leaves((a, kw)), params, params_tree))
    where.inside.append(frozenset(active))
    where.top.append(top)

  def on_nested(index, module, method_name, a, kw, run):
    out = run()
    if lifted_depth[0]:  # its inputs live inside the transform: its unit covers everything
      where.everything.add(tops[-1])
    else:
      record(index, module, method_name, a, kw, out, tops[-1])
    return out

  def on_top(index, module, method_name, a, kw, run):
    if module.scope.debug_path:
      # The root's own method under a lifted transform (`@nn.checkpoint` on it): Flax hands
      # over its copy inside the transform, whose params and inputs are the transform's.
      raise PerExampleError(
          f'The model\'s own method {type(module).__name__}.{method_name} runs inside a '
          f'lifted transform ({module.scope.debug_path[-1]}, e.g. `@nn.checkpoint` or '
          '`@nn.jit` on the root module\'s method), where per-example gradients cannot see '
          'the params and inputs the loss gives it. Put the decorator on the methods of its '
          'submodules instead (the same saving for nn.checkpoint), or call the model from a '
          'module of its own.')
    # Recorded before it runs, so that the uses and reads inside it know their unit.
    tops.append(len(reads))
    record(index, module, method_name, a, kw, None, None)
    try:
      out = run()
    finally:
      position = tops.pop()
    floats, out_tree = jax.tree.flatten(float_part(out))
    reads[position] = reads[position]._replace(
        outputs=tuple(map(typed_shape, floats)),
        out_tree=out_tree)
    return out

  # Keyword arguments are shared; their arrays are jaxpr inputs, the rest (flags) stay static.
  kw_arrays, kw_of = partition_values(kwargs)

  def traced(variables, kw_arrays, *args):
    kw = kw_of(kw_arrays)
    with intercept(_filters.all_calls, handler), nested_applies(on_nested, on_top):
      loss = loss_fn(variables, *args, **kw)
    return ([leaf for _, _, leaves in inputs for leaf in leaves]
            + [leaf for arrays, _, _ in read_arrays for leaf in arrays]
            + [leaf for _, params, _ in read_arrays for leaf in params]
            + [jax.numpy.asarray(scalar_loss(loss, has_aux_option=False))])  # last: for `mixing`

  plain = {c: t for c, t in variables.items() if c != PERTURBATIONS}
  closed = jax.make_jaxpr(traced)(plain, kw_arrays, *args)
  jaxpr = closed.jaxpr
  example_axes: list[int | None] = [None] * len(jax.tree.leaves((plain, kw_arrays)))
  for arg, axis in zip(args, per_argument(batch_axes, len(args))):
    example_axes += [axis % jax.numpy.ndim(leaf) if axis is not None and is_array(leaf)
                     else None for leaf in jax.tree.leaves(arg)]
  batched = [axis is not None for axis in example_axes]
  variable_leaves = [tuple(getattr(k, 'key', k) for k in path) for path, _ in
                     jax.tree_util.tree_flatten_with_path(plain)[0]]
  live = [path[0] == 'params' for path in variable_leaves]
  mixed, misplaced = mixing(jaxpr, example_axes,
                            live + [False] * (len(example_axes) - len(live)),
                            sum(len(leaves) for _, _, leaves in inputs), private)
  if mixed and not misplaced:  # the most basic error: no example has a gradient of its own
    raise mixed
  kinds = iter(source_kinds(jaxpr, batched))
  for path, index, leaves in inputs:
    uses[path][index] = uses[path][index]._replace(
        sources=tuple(next(kinds) for _ in leaves))
  reads = [r._replace(sources=tuple(next(kinds) for _ in arrays))
           for r, (arrays, _, _) in zip(reads, read_arrays)]
  param_leaves = [('params',) + tuple(k.key for k in path) for path, _ in
                  jax.tree_util.tree_flatten_with_path(plain.get('params', {}))[0]]
  assert set(param_leaves) <= set(variable_leaves)
  start = len(jaxpr.outvars) - 1 - sum(len(params) for _, params, _ in read_arrays)
  needed_owners, params_kinds, params_outputs = [], [], []
  for _, params, _ in read_arrays:
    params_kinds.append([next(kinds) for _ in params])
    wanted = [False] * len(jaxpr.outvars)
    wanted[start:start + len(params)] = [True] * len(params)
    params_outputs.append(wanted)
    start += len(params)
    needed = needed_inputs(jaxpr, wanted)
    needed_owners.append(owners & frozenset(
        path[1:-1] for path, n in zip(variable_leaves, needed) if n and path[0] == 'params'))
  # Owners no call of theirs can give per-example gradients to (``_per_example_fallback``)
  # are covered by the replay of a top-level apply, where its inputs allow one.
  num_examples = count_examples(args, batch_axes)
  read_anywhere, read_outside = reads_by_place(loss_fn, plain, args, kwargs, owners, holders)
  by_name = {'/'.join(path): path for path in owners}
  fallback = replayed_owners(
      owners, [(path, uses[path][i].sources, [jax.numpy.shape(x) for x in leaves])
               for path, i, leaves in inputs],
      {by_name[name] for name in read_anywhere} - {by_name[name] for name in read_outside},
      num_examples) | holders
  replayable = {i for i, (arrays, _, _) in enumerate(read_arrays) if where.top[i] is None
                and source_error(reads[i].sources, [jax.numpy.shape(x) for x in arrays],
                                 num_examples, '') is None}
  covers = {i: needed_owners[i] & (owners if i in where.everything else where.lifted
                                    | (fallback if i in replayable else frozenset()))
            for i, top in enumerate(where.top) if top is None}
  covered = frozenset().union(*covers.values())
  for i, read in enumerate(reads):
    reads[i] = read._replace(owners=read_owners(needed_owners[i], where, i, covers))
    if reads[i].owners and 'example' in params_kinds[i]:
      name = f'the nested apply #{read.index} ({type(read.module).__name__}.{read.method_name})'
      raise PerExampleError(
          f'{name} inside the loss is given params computed from the batched arguments; '
          'per-example gradients need params shared by all examples. Compute them from the '
          'variables only, or call the module as a submodule instead.')
  # A unit's replay carries the gradients of every use of the owners it covers.
  uses = {path: [u for i, u in enumerate(module_uses)
                 if path not in covers.get(use_top[(path, i)], frozenset())]
          for path, module_uses in {**uses, **{p: uses.get(p, []) for p in covered}}.items()}
  uncovered = {p for p in owners - covered if not uses.get(p)}
  if uncovered:
    unreplayed = [(f'{type(read.module).__name__}.{read.method_name} (the model.apply of the loss)',
                   needed_owners[i], read.sources,
                   [jax.numpy.shape(x) for x in read_arrays[i][0]])
                  for i, read in enumerate(reads) if where.top[i] is None and i not in replayable]
    raise (unreplayed_error(uncovered, unreplayed, num_examples)
           or UncoveredParamsError(sorted('/'.join(p) or '<root>' for p in uncovered)))
  refused = {**{name: what for name, what in read_anywhere.items()
                if by_name[name] not in covered}, **read_outside}
  if refused:
    raise ParamsReadOutsideError(refused)
  kept = [i for i, read in enumerate(reads) if read.owners]
  computed = computation_of(closed, [any(params_outputs[i][o] for i in kept)
                                     for o in range(len(jaxpr.outvars))])

  def given_params(params: Any) -> list[Any]:
    flat = iter(computed(*jax.tree.leaves(({**plain, 'params': params}, kw_arrays, *args))))
    return [jax.tree.unflatten(read_arrays[i][2], [next(flat) for _ in read_arrays[i][1]])
            for i in kept]

  return uses, [reads[i] for i in kept], mixed if misplaced else None, given_params
