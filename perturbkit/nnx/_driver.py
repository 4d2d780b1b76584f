"""Activation gradients of NNX models: gradients with respect to zero perturbations.

``value_and_grad(loss_fn)(model, *args)`` runs the user's ordinary NNX loss on
the model twice while tracing, with every submodule call instrumented
(``_nnx_calls``), each time inside ``nnx.capture``, so that the points are
Flax's own ``Module.perturb`` points:

1. ``discover``: ``nnx.eval_shape`` of the loss under ``nnx.capture(...,
   nnx.Perturbation)``; each selected call adds a ``Module.perturb`` point per
   floating-point leaf of its output, and Flax creates the zero perturbations,
   inside NNX transforms too (stacked along ``nnx.scan``'s axis where the
   module's state is scanned). Nothing flows back to the model.
2. The differentiated run: ``nnx.value_and_grad`` with respect to the model's
   ``nnx.Param`` state and zeros of those shapes, made inside the trace so XLA
   folds the additions away, handed to the loss with ``nnx.capture(init=...)``.

Hand-placed ``self.perturb(name, x)`` points in the model are found by the same
capture and returned under their own names.
"""
import dataclasses
import functools
import warnings
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import bridge as nnx_bridge

from perturbkit.core._callables import selects
from perturbkit.core._validate import flag
from perturbkit.core._loss import (check_loss, check_loss_fn, driver_result, grads_only,
                                  point_options)
from perturbkit.errors import (ActivationsUnavailableError, BranchCallsMismatchError,
                               CaptureConflictError,
                               NonDifferentiableOutputError,
                               NoPerturbationPointsError, NotAModuleError,
                               PerturbationsNotAppliedError, PerturbationStructureError,
                               TransformTracedOnceError, UnmappedPerturbationError,
                               UnperturbedCallsWarning, WrongFrontEndError)
from perturbkit.core._iterations import (Stacking, edit_output, iteration_key, marked_axes, marker,
                                         marker_name, stacking)
from perturbkit.core._hooks import Hook, check_matched, hook_runner, hooks_of, hooks_tuple
from perturbkit.nnx._calls import Call, NNXPath, instrument
from perturbkit.core._points import (array_part, differentiable_part, has_differentiable_leaf,
                               leaf_dtypes, leaf_shapes, merge,
                               with_stacked_axis)
from perturbkit.core._trace_state import capture_check
from perturbkit.core._values import partition_values
from perturbkit.core._types import CallFilter
from perturbkit.core._varying import zeros_like_type

# One entry of the flat perturbation list: module path + perturb name.
PointPath = tuple[str | int, ...]


def check_module(model: Any, function: str):
  """Raises a named error unless ``model`` is an ``nnx.Module``.

  Args:
    model: What the user passed where the model goes.
    function: The public function, for the message (``'perturbkit.nnx.value_and_grad'``).

  Raises:
    WrongFrontEndError: ``model`` is a Linen module or Linen variables.
    NotAModuleError: ``model`` is anything else that is not an ``nnx.Module``.
  """
  if isinstance(model, nnx_bridge.ToNNX):
    # Its calls are Linen calls, which an NNX function cannot see; Flax's nnx.capture,
    # which the NNX functions run the model in, also fails on it.
    linen = function.replace('perturbkit.nnx.', 'perturbkit.', 1)
    raise WrongFrontEndError(
        function, f'a Linen module ({type(model.to_nnx__module).__name__}) wrapped in '
        'nnx.bridge.ToNNX as the whole model',
        f'Its layers are Linen calls: use {linen} on the Linen module, '
        '`model.to_nnx__module.apply(variables, ...)` with `variables = {"params": '
        'nnx.to_pure_dict(nnx.state(model, nnx.Param))}`. Inside a larger NNX model a '
        'ToNNX submodule is one call, like any other.')
  if isinstance(model, nnx.Module):
    return
  if isinstance(model, (Mapping, nn.Module)):
    got = (f'the Linen module {type(model).__name__}' if isinstance(model, nn.Module) else
           f'a {type(model).__name__} (Linen variables?)')
    raise WrongFrontEndError(
        function, got,
        f'For a Linen model use {function.replace("perturbkit.nnx.", "perturbkit.", 1)}, '
        'whose loss function takes the variables and calls `model.apply(variables, ...)`.')
  raise NotAModuleError(function, 'the nnx.Module as its first argument',
                        f'{model!r:.60} ({type(model).__name__})',
                        'Pass the model object itself, e.g. `nnx.Linear(3, 1, rngs=nnx.Rngs(0))`, '
                        'not its state or its output.')


def _is_inexact(leaf: Any) -> bool:
  return isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.inexact)


@dataclasses.dataclass(frozen=True)
class _Point:
  """A call's point: one ``Module.perturb`` name per floating-point leaf."""
  path: NNXPath
  key: str
  names: tuple[str, ...]
  structure: Any  # treedef of differentiable_part(output): the reported layout
  copied: bool
  where: str
  shapes: tuple[tuple[int, ...], ...] = ()  # leaf shapes where the call ran

  def leaf_paths(self) -> list[PointPath]:
    return [self.path + (n,) for n in self.names]


def _perturbation_store(call: Call) -> Any:
  """The ``nnx.Perturbation`` variable ``nnx.capture`` gave the module, if any.

  ``Module.perturb`` outside a capture would set an attribute on the module, so
  perturbkit only calls it where a capture is there to receive it.

  Raises:
    CaptureConflictError: the module is inside a capture without perturbations
      (one the loss opened itself, which replaced perturbkit's).
  """
  captures = vars(call.module).get('__captures__')
  if captures is None:
    return None
  for var in captures:
    if type(var) is nnx.Perturbation:  # pylint: disable=unidiomatic-typecheck
      return var
  raise CaptureConflictError(call.name)


def _leaf_names(key: str, output: Any) -> list[str]:
  """``key`` for an array output; ``key`` + the leaf's key path for a pytree."""
  flat, _ = jax.tree_util.tree_flatten_with_path(output)
  return [key + jax.tree_util.keystr(kp) for kp, leaf in flat if _is_inexact(leaf)]


def _perturb(module: nnx.Module, key: str, output: Any, probe: bool = False) -> Any:
  """``output`` with ``module.perturb`` applied to each floating-point leaf.

  With ``probe``, each point is first set to ``0 * leaf`` (with ``Module.sow``),
  a zero that is mapped wherever the output is: inside ``nnx.vmap`` with the
  module's state broadcast, that makes the transform refuse, where plain zeros
  would silently give a gradient summed over the mapped axis.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(output)
  leaves = []
  for kp, leaf in flat:
    if _is_inexact(leaf):
      name = key + jax.tree_util.keystr(kp)
      if probe:
        module.sow(nnx.Perturbation, name, 0 * leaf, reduce_fn=lambda _, v: v,
                   init_fn=lambda: None)
      leaf = module.perturb(name, leaf)
    leaves.append(leaf)
  return jax.tree.unflatten(treedef, leaves)


def _selected(points: CallFilter, hooks: Sequence[Hook], matched: set[int] | None = None
              ) -> Callable[[Call, Callable[[], Any]], tuple[Any, bool]]:
  """Runs the call with its hooks; says whether the call is a point."""
  run_hooked = hook_runner(hooks, matched)

  def prepare(call: Call, run: Callable[[], Any]) -> tuple[Any, bool]:
    return run_hooked(call, run), selects(points, call.module, call.method_name)
  return prepare


def flat_state(state: nnx.State) -> dict[PointPath, Any]:
  """``{path: value}`` of a state (a capture's, a module's)."""
  return {tuple(path): var.get_value() for path, var in nnx.to_flat_state(state)}


def _nested(flat: Sequence[tuple[tuple, Any]]) -> dict:
  tree: dict = {}
  for path, value in flat:
    node = tree
    for name in path[:-1]:
      node = node.setdefault(name, {})
    node[path[-1]] = value
  return tree


def _joined(path: PointPath) -> str:
  return '/'.join(map(str, path))


@dataclasses.dataclass
class _Discovery:
  """What the abstract run found."""
  points: list[_Point]             # perturbkit's points, in the order the calls start
  hand_placed: list[PointPath]     # ``self.perturb`` points written in the model
  shapes: dict[PointPath, jax.ShapeDtypeStruct]
  seen: list[str]
  unreachable: list[str]
  hooks_matched: set[int]  # the indices of the hooks whose filters selected a call
  # Calls whose points went into a copy of the model that the loss made (``nnx.clone``,
  # ``nnx.merge`` of the whole state): its perturbation state never comes back.
  copies: list[str] = dataclasses.field(default_factory=list)
  # The outside shape of the axis marker next to each point made inside a transform
  # (core/_iterations.marker), by point path: where the transform stacks it.
  marked: dict[PointPath, tuple[int, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Attempt:
  """What a discovery run that raised leaves behind, for one without points in transforms."""
  perturbed_copies: bool = False  # a point was made inside an NNX transform
  failed_in: NNXPath | None = None  # the innermost call outside transforms that raised
  # (conditional, call name) of the points made in branches of an nnx.cond/nnx.switch.
  in_branches: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def _discover_once(loss_fn, model, args, kwargs, *, points, hooks, strict, probe,
                   skip: Callable[[Call], bool] = lambda call: False,
                   attempt: _Attempt | None = None):
  found: list[_Point | None] = []
  seen: list[str] = []
  missed: list[str] = []
  matched: set[int] = set()
  prepare = _selected(points, hooks, matched)
  attempt = _Attempt() if attempt is None else attempt

  def handler(call: Call, run: Callable[[], Any]) -> Any:
    seen.append(call.name)
    # A call's place is taken when it starts, as Linen lists them: an enclosing call
    # before the calls inside it.
    slot = len(found)
    found.append(None)
    try:
      output, selected = prepare(call, run)
    except Exception:
      if not call.copied and attempt.failed_in is None:
        attempt.failed_in = call.path
      raise
    if not selected:
      return output
    if not has_differentiable_leaf(output):
      if strict:
        raise NonDifferentiableOutputError(call.name, leaf_dtypes(output))
      return output
    store = _perturbation_store(call)
    if store is None or (call.copied and skip(call)):
      missed.append(call.name)
      return output
    attempt.perturbed_copies |= call.copied
    if call.conditional is not None:
      attempt.in_branches.append((call.conditional, call.name))
    names = _leaf_names(call.key, output)
    taken = [n for n in names if n in store]
    if taken:
      raise PerturbationStructureError(
          f'the model already has a perturbation named {taken[0]!r} at '
          f'{_joined(call.path)!r} (a hand-placed self.perturb); rename it, perturbkit '
          'uses the method name and the call count as point names')
    structure = jax.tree.structure(differentiable_part(output))
    shapes = tuple(tuple(leaf.shape) for leaf in jax.tree.leaves(output) if _is_inexact(leaf))
    found[slot] = _Point(call.path, call.key, tuple(names), structure, call.copied, call.name,
                         shapes)
    if call.copied:
      call.module.perturb(marker_name(call.key), marker(len(shapes[0])))
    return _perturb(call.module, call.key, output, probe)

  def traced(model, *args, **kwargs):
    with instrument([model], handler):
      return nnx.capture(loss_fn, nnx.Perturbation)(model, *args, **kwargs)

  arrays, rebuild = partition_values((args, kwargs), keep=nnx.graph.is_graph_node)

  def on_arrays(model, arrays):
    args, kwargs = rebuild(arrays)
    return traced(model, *args, **kwargs)

  out, state = nnx.eval_shape(on_arrays, model, arrays)
  # The branches of an nnx.cond/nnx.switch make the same call's point once each.
  points: dict[tuple[NNXPath, str], _Point] = {}
  for p in found:
    if p is not None:
      points.setdefault((p.path, p.key), p)
  return out, flat_state(state), list(points.values()), seen, missed, matched


def _inside_any(sites: tuple[NNXPath | None, ...], call: Call) -> bool:
  """Whether ``call`` runs inside a call at one of ``sites`` (``None``: anywhere)."""
  return any(site is None or call.path[:len(site)] == site for site in sites)


def discover(loss_fn: Callable[..., Any], model: nnx.Module, args: tuple, kwargs: dict, *,
             points: CallFilter, hooks: Sequence[Hook] = (), strict: bool = False,
             has_aux: bool = False, scalar: bool = True) -> _Discovery:
  """The perturbation points ``loss_fn`` reaches, found by an abstract run.

  ``scalar=False`` takes any output (a model's logits), not only a loss.

  Raises:
    NonScalarLossError: ``scalar`` and the loss is not a real scalar.
    NonDifferentiableOutputError: ``strict`` and a selected call has no
      floating-point output.
    UnmappedPerturbationError: a selected call inside ``nnx.vmap`` whose
      module state is broadcast (its gradient would be summed over the map).
    BranchCallsMismatchError: the branches of an ``nnx.cond``/``nnx.switch``
      make different selected calls (their points could not be joined).
  """
  run = functools.partial(_discover_once, loss_fn, model, args, kwargs,
                          points=points, hooks=hooks, strict=strict)
  # A transform that carries the module from step to step (nnx.scan with the module in
  # the carry, as nnx.RNN does with its cell) cannot take a new perturbation, and one
  # perturbation for every step would be a sum over the steps: those calls get none.
  # Each run that raises names the transform's enclosing call (one more per run: the two
  # nnx.RNN of an nnx.Bidirectional); without one, every call inside a transform gets none.
  sites: list[NNXPath | None] = []
  first_error = None
  while True:
    attempt = _Attempt()
    skip = functools.partial(_inside_any, tuple(sites))
    try:
      out, shapes, found, seen, missed, matched = run(probe=False, attempt=attempt, skip=skip)
      break
    except Exception as error:  # pylint: disable=broad-except
      if first_error is None:
        if not attempt.perturbed_copies:
          raise
        conditionals = {c for c, _ in attempt.in_branches}
        if isinstance(error, TypeError) and conditionals and '' not in conditionals:
          # jax.lax.cond's TypeError for branches that return other trees: here the
          # points made in one branch and not in another.
          raise BranchCallsMismatchError(
              attempt.in_branches[-1][0], sorted({n for _, n in attempt.in_branches})) from error
        first_error = error
      if not attempt.perturbed_copies or None in sites or attempt.failed_in in sites:
        raise first_error from None
      sites.append(attempt.failed_in)
  run = functools.partial(run, skip=skip)
  if scalar:
    check_loss(out, has_aux)
  markers = {p.path + (marker_name(p.key),): p.path + (p.key,) for p in found if p.copied}
  marked = {markers[p]: tuple(shapes.pop(p).shape) for p in list(shapes) if p in markers}
  ours = {p for point in found for p in point.leaf_paths()}
  reached = [p for p in found if all(q in shapes for q in p.leaf_paths())]
  copies = sorted({p.where for p in found if p not in reached})
  # A point made inside an NNX transform has the shape of the output seen
  # there when the transform broadcasts the perturbation: fine under nnx.remat,
  # a sum over examples under nnx.vmap. Only a second run can tell them apart.
  suspects = [p.where for p in reached if p.copied and p.shapes == tuple(
      tuple(shapes[q].shape) for q in p.leaf_paths())]
  if suspects:
    try:
      run(probe=True)
    except Exception as e:  # pylint: disable=broad-except
      raise UnmappedPerturbationError(suspects) from e
  hand_placed = [p for p in shapes if p not in ours]
  return _Discovery(reached, hand_placed, shapes, seen, sorted(set(missed)), matched, copies,
                    marked)


def warn_unperturbed(found: _Discovery, stacklevel: int):
  """Warns about the selected calls that got no point, by why."""
  if found.unreachable:
    warnings.warn(UnperturbedCallsWarning(found.unreachable, nnx=True), stacklevel=stacklevel)
  if found.copies:
    warnings.warn(UnperturbedCallsWarning(found.copies, nnx=True, copies=True),
                  stacklevel=stacklevel)


def point_order(found: _Discovery) -> list[PointPath]:
  """The order of the flat perturbation list: each call's leaves, then hand-placed points."""
  return [p for point in found.points for p in point.leaf_paths()] + found.hand_placed


# ``(point path, the floating-point part of the call's output) -> that part edited``.
PointEdit = Callable[[tuple, Any], Any]


class _Captured(nnx.Variable):
  """A call's output or inputs, captured inside an NNX transform (``nnx.remat``, ``nnx.jit``)."""


@dataclasses.dataclass(frozen=True)
class _Sown:
  """A capture made inside an NNX transform, read back from the capture state."""
  kind: str                # 'activations' or 'inputs'
  path: PointPath          # where the capture is reported: module path + point key
  state_path: PointPath    # where it is in the capture state: module path + sown name
  where: str               # the call, for messages
  shapes: Any              # the leaves' shapes inside the transform
  stacking: Stacking | None  # how the point (its gradient) is stacked outside
  marker_path: PointPath   # the capture state's axis marker next to it


def _read_sown(captured: dict[str, list[tuple[tuple, Any]]], sown: Sequence[_Sown],
               state: Mapping[PointPath, Any], per_iteration: bool):
  """Puts the captures made inside NNX transforms in their places (the ``_Sown`` entries).

  With ``per_iteration``, a capture stacked along the axis its call's
  perturbation (and so its gradient) is stacked along is taken as it is.

  Raises:
    ActivationsUnavailableError: a transform that maps the capture state
      (``nnx.scan``, ``nnx.vmap``) returned one value per iteration, not the
      call's output (nor, with ``per_iteration``, stacked like its gradient).
  """
  for s in sown:
    value = state[s.state_path]
    # Stacked like the gradient: the same shapes, and (where the shapes alone could be
    # stacked otherwise) the capture state's marker stacked along the point's axes.
    stacked = (per_iteration and s.stacking is not None
               and leaf_shapes(value) == with_stacked_axis(s.shapes, s.stacking)
               and marked_axes(jnp.shape(state[s.marker_path])) == s.stacking.marked_axes())
    if leaf_shapes(value) != s.shapes and not stacked:
      raise ActivationsUnavailableError(s.where)
    captured[s.kind] = [(p, value if v is s else v) for p, v in captured[s.kind]]


def perturbed_call(loss_fn: Callable[..., Any], model: nnx.Module, perturbations: Sequence[Any],
                   args: tuple, kwargs: dict, *, found: _Discovery, points: CallFilter,
                   hooks: Sequence[Hook] = (), edit: PointEdit | None = None,
                   activations: bool = False, inputs: bool = False, reads: bool = True,
                   per_iteration: bool = False,
                   iterations: Mapping[PointPath, jax.Array] | None = None
                   ) -> tuple[Any, dict]:
  """Runs ``loss_fn`` with ``perturbations`` added at the points ``discover`` found.

  The forward pass of :func:`value_and_grad`, for any perturbation values: the
  output of each point's call is ``edit(path, output)`` (when ``edit`` is
  given) plus its perturbation, exactly where a hand-written ``perturb`` would
  add it.

  Args:
    loss_fn: ``(model, *args, **kwargs) -> anything``.
    model: The model (inside the caller's NNX transform, or merged in its trace).
    perturbations: One array per entry of :func:`point_order`.
    args: Positional arguments after the model.
    kwargs: Keyword arguments.
    found: What ``discover`` found.
    points: The selected calls.
    hooks: Backward hooks to insert.
    edit: ``(point path, floating-point part of the output) -> edited part``.
    activations: Capture each point's call output (before its edit).
    inputs: Capture each point's call ``(args, kwargs)`` (array leaves).
    reads: Whether the captures are read. Where not, a capture inside a JAX
      transform that ``loss_fn`` applies itself is left out rather than
      refused (an edit works there); the others are checked as ever.
    per_iteration: Captures inside ``nnx.scan`` over stacked modules may come
      out stacked per iteration, along the axis of the call's gradient.
    iterations: Iteration indices to put next to the perturbations
      (``core/_iterations.py``), by path; the edit of a call that has them is
      called as ``edit(path, output, iteration=i)``.

  Returns:
    ``(what loss_fn returned, {'activations': tree, 'inputs': tree})``, the
    captures nested by point path.

  Raises:
    PerturbationsNotAppliedError: a point found was not reached.
    ActivationsUnavailableError: a capture inside an NNX transform that maps
      or broadcasts the module's state (``nnx.scan``, ``nnx.vmap``).
    CaptureInJaxTransformError: a capture inside a JAX transform that
      ``loss_fn`` applies itself (``jax.jit``, ``jax.vmap``, ... around the model).
  """
  applied: set[tuple] = set()
  captured: dict[str, list[tuple[tuple, Any]]] = {'activations': [], 'inputs': []}
  sown: list[_Sown] = []
  expected = {(p.path, p.key): p for p in found.points}
  prepare = _selected(points, hooks)
  readable = capture_check(reads)

  def capture(call: Call, kind: str, value: Any):
    path = call.path + (call.key,)
    if not call.copied:
      if readable(call.name):
        captured[kind].append((path, value))
      return
    # A value traced inside an NNX transform cannot leave it through Python; the
    # module's capture state does, as the transform's output.
    name, marked = f'{call.key}:{kind}', marker_name(f'{call.key}:{kind}')
    point = expected[(call.path, call.key)]
    for sown_name, sown_value in ((name, value), (marked, marker(len(point.shapes[0])))):
      call.module.sow(_Captured, sown_name, sown_value, reduce_fn=lambda _, v: v,
                      init_fn=lambda: None)
    outside = [tuple(found.shapes[q].shape) for q in point.leaf_paths()]
    sown.append(_Sown(kind, path, call.path + (name,), call.name, leaf_shapes(value),
                      stacking(list(point.shapes), outside, found.marked.get(path)),
                      call.path + (marked,)))
    captured[kind].append((path, sown[-1]))  # its place, filled by _read_sown

  def handler(call: Call, run: Callable[[], Any]) -> Any:
    output, selected = prepare(call, run)
    point = expected.get((call.path, call.key))
    if not selected or point is None:
      return output
    store = _perturbation_store(call)
    if store is None or any(n not in store for n in point.names):
      return output
    path = call.path + (call.key,)
    if activations:
      capture(call, 'activations', differentiable_part(output))
    if inputs:
      capture(call, 'inputs', array_part(_without_graph_nodes((call.args, call.kwargs))))
    applied.add((call.path, call.key))
    if edit is not None:
      # A scan's call has its iteration indices next to its point (core/_iterations.py).
      name = iteration_key(call.key)
      index = store[name] if name in store else None
      output = merge(output, edit_output(edit, path, differentiable_part(output), index))
    return _perturb(call.module, call.key, output)

  order = point_order(found)
  init = nnx.State(_nested([(p, nnx.Perturbation(z)) for p, z in zip(order, perturbations)]
                           + [(p, nnx.Perturbation(i)) for p, i in (iterations or {}).items()]))
  with instrument([model], handler):
    if not (activations or inputs):
      out = nnx.capture(loss_fn, init=init)(model, *args, **kwargs)
    else:
      try:
        out, state = nnx.capture(loss_fn, _Captured, init=init)(model, *args, **kwargs)
      except ValueError as error:
        # A transform that broadcasts the capture state (``nnx.vmap`` with the
        # module's state broadcast) refuses the mapped value by its name.
        refused = [s.where for s in sown if repr(s.state_path[-1]) in str(error)]
        if refused:
          raise ActivationsUnavailableError(refused[0]) from error
        raise
  missing = sorted(expected[k].where for k in set(expected) - applied)
  if missing:
    # A later call inside a transform whose earlier call (same module, same method) was
    # applied: JAX replayed the transform's cached trace of the first call.
    replayed = {(path, key.split('#')[0]) for path, key in applied}
    if all(expected[k].copied and '#' in k[1] and (k[0], k[1].split('#')[0]) in replayed
           for k in set(expected) - applied):
      raise TransformTracedOnceError(missing)
    raise PerturbationsNotAppliedError(missing, nnx=True)
  if sown:
    _read_sown(captured, sown, flat_state(state), per_iteration)
  return out, {k: _nested(v) for k, v in captured.items()}


def _without_graph_nodes(tree: Any) -> Any:
  """``tree`` with ``None`` in place of NNX objects (an ``nnx.Rngs``, a module, a Variable):
  they are the caller's own, stateful, and no input value of the call."""
  node = lambda x: isinstance(x, (nnx.Pytree, nnx.Variable))
  return jax.tree.map(lambda x: None if node(x) else x, tree, is_leaf=node)


def value_and_grad(loss_fn: Callable[..., Any], *, filter: CallFilter | bool | None = None,
                   has_aux: bool = False, hooks: Sequence[Hook] = (),
                   return_activations: bool = False, return_inputs: bool = False,
                   strict: bool | None = None) -> Callable[..., Any]:
  """Parameter gradients and every activation gradient of an NNX model, in one backward pass.

  ``loss_fn(model, *args, **kwargs)`` is the ordinary NNX loss on the
  unmodified model. The returned function takes the same arguments and returns
  ``(loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``), where
  ``grads['params']`` is what ``nnx.grad(loss_fn)(model, ...)`` gives (an
  ``nnx.State`` of ``nnx.Param``, ready for ``optimizer.update(model, ...)``)
  and ``grads['perturbations']`` holds dL/d(output) of every selected
  submodule call: a nested dict keyed like the params state (attribute names,
  integer indices for ``nnx.List`` items), ending in the call's point key,
  ``'__call__'``, then ``'__call__#1'`` for a second call, e.g.
  ``grads['perturbations']['layers'][0]['__call__']``. ``super().__call__(x)``
  inside a subclass's call is part of that call (one point, the whole output). A pytree output gets
  one array per floating-point leaf, in the output's structure (``None`` for
  other leaves). Hand-placed ``self.perturb(name, x)`` points appear under
  their names. Inside ``nnx.scan`` over stacked modules the gradients are per
  iteration, stacked along the scan axis, and so are the activations and
  inputs that ``return_activations`` and ``return_inputs`` give. The branches
  of an ``nnx.cond``/``nnx.switch`` share one point per call, holding the
  gradient of the branch that ran.

  The model's state changes as under ``nnx.value_and_grad`` (batch statistics,
  RNG counts); its classes, attributes and graphdef are never touched, also
  when the loss raises. Works eagerly, under ``nnx.jit``, and under ``jax.jit``
  on a model rebuilt with ``nnx.merge``.

  Args:
    loss_fn: ``(model, *args, **kwargs) -> loss`` (or ``(loss, aux)``).
    filter: Which calls get a point (default: all; see
      ``perturbkit.nnx.filters``; a list of strings is a list of path patterns).
    has_aux: Whether ``loss_fn`` returns ``(loss, aux)``.
    hooks: Backward hooks (:func:`perturbkit.backward_hook`, one or a list) to
      insert; the activation gradient reported for a hooked call is the one arriving at
      it, before the hook transforms it for the layers below.
    return_activations: Also return the outputs of the selected calls, in a
      tree shaped like ``grads['perturbations']``: ``(value, grads, acts)``.
    return_inputs: Also return the inputs of the selected calls, at the same
      paths, each as ``(args, kwargs)`` with every leaf that is not an array
      (a Python flag, ``None``, an ``nnx.Rngs``) replaced by ``None``:
      ``(value, grads, inputs)``, or ``(value, grads, acts, inputs)`` with
      both, as in the Linen :func:`perturbkit.value_and_grad`. A call's input
      ``a`` next to the gradient ``g`` at its output is what curvature
      (K-FAC) and per-example methods need.
    strict: Whether a selected call without floating-point output is an error
      (default: only when a filter is given).

  Returns:
    A function ``(model, *args, **kwargs) -> (value, grads)``.

  Raises:
    NonScalarLossError: the loss is not a real scalar.
    MissingHasAuxError: the loss function returned ``(loss, aux)`` (or another
      tuple, list or dict) without ``has_aux=True``.
    HasAuxOutputError: ``has_aux=True`` and the loss function returned no pair.
    LossNotCallableError: ``loss_fn`` is not callable.
    WrongFrontEndError: the model is a Linen module or Linen variables (use
      ``perturbkit.value_and_grad``).
    NoPerturbationPointsError: the filter selects no call.
    NotAHookError: ``hooks`` holds something else than hooks.
    UnmatchedFilterError: a hook's filter selects no call.
    PerturbationsNotAppliedError: a point found while tracing was not reached
      when differentiating.
    UnmappedPerturbationError: a selected call runs inside ``nnx.vmap`` with
      the module's state broadcast.
    BranchCallsMismatchError: the branches of an ``nnx.cond``/``nnx.switch``
      make different selected calls (exclude them with the filter).
    UninstrumentableModuleError: a submodule's class cannot be instrumented.
    ActivationsUnavailableError: ``return_activations`` or ``return_inputs``
      for a call inside ``nnx.vmap`` with the module's state broadcast (inside
      ``nnx.remat`` and ``nnx.jit`` they are returned as they are, inside
      ``nnx.scan`` per iteration).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
    >>> x = jnp.ones((2, 3))
    >>> loss_fn = lambda model, x: jnp.mean(model(x) ** 2)
    >>> loss, grads = perturbkit.nnx.value_and_grad(loss_fn)(model, x)
    >>> grads['perturbations']['layers'][2]['__call__'].shape
    (2, 1)
    >>> grads['params']['layers'][0]['kernel'].shape
    (3, 4)
    >>> _, _, inputs = perturbkit.nnx.value_and_grad(loss_fn, return_inputs=True)(model, x)
    >>> args, kwargs = inputs['layers'][2]['__call__']
    >>> args[0].shape, kwargs
    ((2, 4), {})
  """
  check_loss_fn(loss_fn, 'perturbkit.nnx.value_and_grad', '(model, *args) -> loss')
  for name, value in (('has_aux', has_aux), ('return_activations', return_activations),
                      ('return_inputs', return_inputs)):
    flag(name, value)
  flag('strict', strict, none=True)
  points, strict = point_options(filter, strict)
  hooks = hooks_tuple(hooks, 'perturbkit.nnx.value_and_grad')

  @functools.wraps(loss_fn)
  def run(model: nnx.Module, *args, **kwargs):
    check_module(model, 'perturbkit.nnx.value_and_grad')
    found = discover(loss_fn, model, args, kwargs, points=points, hooks=hooks,
                     strict=strict, has_aux=has_aux)
    check_matched(hooks, found.hooks_matched, found.seen)
    warn_unperturbed(found, stacklevel=3)
    if not found.points and not found.hand_placed:
      raise NoPerturbationPointsError(found.seen, nnx=True, copies=found.copies)
    order = point_order(found)

    def differentiable(model, perturbations, args, kwargs):
      out, captured = perturbed_call(loss_fn, model, perturbations, args, kwargs, found=found,
                                     points=points, hooks=hooks, activations=return_activations,
                                     inputs=return_inputs, per_iteration=True)
      loss = check_loss(out, has_aux)
      aux = out[1] if has_aux else None
      return loss, (aux, captured)

    zeros = [zeros_like_type(found.shapes[p]) for p in order]
    (loss, (aux, captured)), (g_params, g_points) = nnx.value_and_grad(
        differentiable, argnums=(0, 1), has_aux=True)(model, zeros, args, kwargs)
    by_path = dict(zip(order, g_points))
    reported = [(point.path + (point.key,),
                 jax.tree.unflatten(point.structure, [by_path[p] for p in point.leaf_paths()]))
                for point in found.points]
    reported += [(p, by_path[p]) for p in found.hand_placed]
    grads = {'params': g_params, 'perturbations': _nested(reported)}
    return driver_result(loss, aux, grads, captured,
                         has_aux=has_aux, return_activations=return_activations,
                         return_inputs=return_inputs)

  return run


def grad(loss_fn: Callable[..., Any], *, filter: CallFilter | bool | None = None,
         has_aux: bool = False, hooks: Sequence[Hook] = (),
         strict: bool | None = None) -> Callable[..., Any]:
  """Like :func:`value_and_grad` but returns only ``grads`` (``(grads, aux)`` with aux).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)),
    ...                        nnx.Linear(3, 1, rngs=nnx.Rngs(1)))
    >>> grads = perturbkit.nnx.grad(lambda m, x: m(x).sum())(model, jnp.ones((1, 2)))
    >>> grads['perturbations']['layers'][1]['__call__'].tolist()
    [[1.0]]
  """
  check_loss_fn(loss_fn, 'perturbkit.nnx.grad', '(model, *args) -> loss')
  vg = value_and_grad(loss_fn, filter=filter, has_aux=has_aux, hooks=hooks, strict=strict)
  return grads_only(vg, loss_fn, has_aux)


def with_hooks(fun: Callable[..., Any], *hooks: Hook) -> Callable[..., Any]:
  """``fun`` with backward hooks inserted into every call of the NNX models it is given.

  Works with reverse-mode differentiation of ``fun`` (``nnx.grad``,
  ``jax.grad`` over split state, :func:`perturbkit.nnx.value_and_grad`) and
  forward over reverse; not with forward mode alone (see
  ``help(perturbkit.backward_hook)``). Every ``nnx.Module``
  among ``fun``'s arguments is instrumented while ``fun`` runs (under
  ``nnx.grad`` those are the transform's own copies); nothing outlives the
  call. Inside the loss of :func:`perturbkit.nnx.interleaved` the hooks act
  on segment calls and on the calls inside a segment, in every replay of it.

  Args:
    fun: A function taking the model (or several) among its arguments.
    *hooks: Hooks from :func:`perturbkit.backward_hook` (or lists of them);
      several on one call apply in order on the forward pass, so the last one
      sees the gradient first.

  Returns:
    A function with the same signature and value as ``fun``.

  Raises:
    NoHooksError: no hook is given.
    NotAHookError: something else than a hook is given (a plain function).
    NotAModuleError: no argument of the call is an ``nnx.Module``.
    UnmatchedFilterError: (when the function runs) a hook's filter selects no
      call.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Sequential(nnx.Linear(3, 3, rngs=nnx.Rngs(0)),
    ...                        nnx.Linear(3, 1, rngs=nnx.Rngs(1)))
    >>> x = jnp.ones((2, 3))
    >>> zero_below = perturbkit.backward_hook(lambda g: 0 * g,
    ...                                       perturbkit.nnx.filters.by_path('layers/1'))
    >>> loss = perturbkit.nnx.with_hooks(lambda m, x: m(x).sum(), zero_below)
    >>> grads = nnx.grad(loss)(model, x)
    >>> float(jnp.abs(grads['layers'][0]['kernel'][...]).sum())
    0.0
  """
  check_loss_fn(fun, 'perturbkit.nnx.with_hooks', '(model, *args) -> value', 'function', 'fun')
  hooks = hooks_of(hooks, 'perturbkit.nnx.with_hooks')

  @functools.wraps(fun)
  def hooked(*args, **kwargs):
    models = []
    for leaf in jax.tree.leaves((args, kwargs), is_leaf=lambda x: isinstance(x, nnx.Module)):
      if isinstance(leaf, nnx.Module) and not any(leaf is m for m in models):
        models.append(leaf)
    if not models:
      raise NotAModuleError('The function perturbkit.nnx.with_hooks returns',
                            'the nnx.Module among its arguments', 'none',
                            'Pass the model to the function instead of closing over it: '
                            '`hooked(model, x)`, with `loss_fn(model, x)`.')
    seen: list[str] = []
    matched: set[int] = set()
    run_hooked = hook_runner(hooks, matched)

    def handler(call: Call, run: Callable[[], Any]) -> Any:
      seen.append(call.name)
      return run_hooked(call, run)

    with instrument(models, handler, transparent=True):
      out = fun(*args, **kwargs)
    check_matched(hooks, matched, seen)
    return out

  return hooked

