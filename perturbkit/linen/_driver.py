"""Activation gradients: gradients with respect to zero perturbations.

``value_and_grad(loss_fn)`` runs the user's ordinary loss, which calls
``model.apply(variables, ...)`` on the unmodified model, twice while tracing:

1. ``discover``: an abstract run (``jax.eval_shape``) in which each top-level
   ``apply`` is replayed with the ``'perturbations'`` collection mutable, so
   Flax itself creates the zero perturbations of every selected call (lifted
   transforms included, exactly as ``wrap(model).init`` would).
2. The differentiated run: zeros of those shapes, made inside the trace so XLA
   folds the additions away, are handed to ``loss_fn`` as the
   ``'perturbations'`` collection, and one backward pass gives the parameter
   gradients and every activation gradient.
"""
import functools
import warnings
from typing import Any, Callable, Collection, Mapping, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx, traverse_util

from perturbkit.core._callables import selects
from perturbkit.core import filters as _filters
from perturbkit.core._validate import flag
from perturbkit.core._loss import (check_loss, check_loss_fn, describe, driver_result, grads_only,
                                  point_options)
from perturbkit.errors import (ActivationsUnavailableError, BranchCallsMismatchError,
                                CaptureOutsideMethodCallError,
                                MapVariablesInitError,
                                NoPerturbationPointsError,
                                NotVariablesError, PerturbationsNotAppliedError,
                                UnperturbedCallsWarning, WrongFrontEndError)
from perturbkit.core._hooks import Hook, check_matched, hook_runner, hooks_tuple
from perturbkit.core._iterations import edit_output, iteration_key, marker, marker_name
from perturbkit.linen._branches import branching_transform, check_branch_point
from perturbkit.linen._interceptor import JIT_CALLS, Call, in_jit, intercept, suspended
from perturbkit.core._points import (COLLECTION, PointShape, add_perturbation, array_part,
                               differentiable_part, has_differentiable_leaf,
                               inside_lifted_transform, leaf_shapes, merge, stacked_axis,
                               with_stacked_axis)
from perturbkit.core._trace_state import capture_check
from perturbkit.core._values import partition_values
from perturbkit.core._trees import find_in, get_in
from perturbkit.core._types import CallFilter, Variables


# Where a call inside a lifted transform (``nn.remat``, ``nn.jit``) leaves its output and
# inputs: Flax carries a mutable collection out of the transform, which a Python-side
# record of the values traced inside it could not leave.
CAPTURES = 'perturbkit_captures'


def _captures_name(key: str) -> str:
  """Where a call's captures sit among the perturbations of its module (no point has it)."""
  return f'{key}:captures'


def _holds_module(tree: Any) -> bool:
  """Whether ``tree`` (a method's output) holds a Linen module."""
  return any(isinstance(leaf, nn.Module) for leaf in jax.tree.leaves(tree))


def _also_mutable(mutable: Any, collection: str) -> Any:
  """``mutable`` (an ``apply`` argument) with ``collection`` mutable as well."""
  if mutable is True:
    return True
  if mutable is False or mutable is None:
    return [collection]
  if isinstance(mutable, str):
    return [mutable, collection]
  if isinstance(mutable, flax.core.DenyList):
    deny = mutable.deny
    deny = [deny] if isinstance(deny, str) else list(deny)
    return flax.core.DenyList([d for d in deny if d != collection])
  return [*mutable, collection]


def check_variables(variables: Any, function: str):
  """Raises a named error unless ``variables`` are Linen variables with a ``'params'`` collection.

  Args:
    variables: What the user passed where the model's variables go.
    function: The public function, for the message (``'perturbkit.value_and_grad'``).

  Raises:
    WrongFrontEndError: ``variables`` is an NNX model.
    NotVariablesError: ``variables`` is anything else that is not Linen variables.
  """
  if isinstance(variables, Mapping) and 'params' in variables:
    return
  if isinstance(variables, nnx.Module):
    raise WrongFrontEndError(
        function, f'an nnx.Module ({type(variables).__name__})',
        f'For an NNX model use {function.replace("perturbkit.", "perturbkit.nnx.", 1)}, '
        'whose loss function takes the module itself: `loss_fn(model, *args)`.')
  if isinstance(variables, nn.Module):
    got = f'the Linen module {type(variables).__name__}'
    hint = ('Pass its variables, `variables = model.init(key, *args)`, and call '
            '`model.apply(variables, ...)` in the loss function.')
  elif isinstance(variables, Mapping):
    got = f"{describe(variables)} and no 'params'"
    hint = ("If it is `variables['params']`, pass the whole dict instead: "
            "`{'params': params, **other_collections}`.")
  else:
    got = describe(variables)
    hint = 'Pass `variables = model.init(key, *args)`.'
  raise NotVariablesError(function, got, hint)


def nested(flat: dict[tuple, Any]) -> dict:
  """A nested dict from ``{path: value}`` (values may themselves be trees)."""
  return traverse_util.unflatten_dict(flat) if flat else {}


# ``(point path, the floating-point part of the call's output) -> that part edited``.
PointEdit = Callable[[tuple, Any], Any]


def _point_handler(points: CallFilter, hooks: Sequence[Hook], strict: bool,
                   on_point: Callable[[Call, Any, bool], None], edit: PointEdit | None = None):
  """The per-call handler: run the call, insert hooks, edit its output, add its perturbation."""
  run_hooked = hook_runner(hooks)

  def handler(call: Call, run: Callable[[], Any]) -> Any:
    output = run_hooked(call, run)
    if selects(points, call.module, call.method_name):
      before = output
      if edit is not None and has_differentiable_leaf(output):
        # A scan's call has its iteration indices next to its point (core/_iterations.py).
        index = call.module.get_variable(COLLECTION, iteration_key(call.key))
        output = merge(output, edit_output(edit, call.path + (call.key,),
                                           differentiable_part(output), index))
      output, applied = add_perturbation(call.module, call.key, output, call.name,
                                         strict=strict, reachable=not call.mapped)
      on_point(call, before, applied)
    return output
  return handler


def _interception(points, hooks):
  return _filters.any_of(points, *(h.filter for h in hooks)) if hooks else points


def discover(loss_fn: Callable[..., Any], variables: Variables, args: tuple, kwargs: dict, *,
             filter: CallFilter, strict: bool = False,
             hooks: Sequence[Hook] = (),
             unreachable: list[str] | None = None,
             point_paths: set[tuple] | None = None,
             hooks_matched: set[int] | None = None,
             lifted: set[tuple] | None = None,
             inside: dict[tuple, PointShape] | None = None,
             marked: dict[tuple, tuple[int, ...]] | None = None,
             nested_applies: bool = False,
             jitted: set[tuple] | None = None,
             in_nested_applies: list[str] | None = None
             ) -> tuple[dict[tuple, PointShape], list[str]]:
  """The perturbation points ``loss_fn`` reaches, found by an abstract run.

  Points placed by hand in the model (its own ``self.perturb(name, x)``) are
  found too: they are every entry Flax creates in the collection that is not a
  selected call's point. Selected calls that cannot carry a perturbation
  (inside a lifted transform that does not map the collection) are appended to
  ``unreachable`` if given, else reported with an
  :class:`UnperturbedCallsWarning`. The path of every call's point (module path
  plus point key) is added to ``point_paths`` if given: a point's value may
  itself hold dicts (a call returning a dict), so the paths cannot be read back
  from the tree; those of the calls inside a lifted transform are also added
  to ``lifted`` if given, with the shape of their output there to ``inside``
  (a scan's point, outside it, is stacked per iteration), and the outside shape
  of an axis marker made next to each (``core/_iterations.marker``) to
  ``marked`` if given. With ``nested_applies``, a submodule's own ``apply`` made
  inside a call of the model (a tied output layer) is a call of that submodule.
  The paths of the points inside ``nn.jit`` are added to ``jitted`` if given.
  Selected calls of an ``apply`` made inside a call of the model on variables
  it is given (``inner.apply(inner_variables, h)``; not a submodule's own
  ``apply`` with ``nested_applies``) cannot carry one either: they go to
  ``in_nested_applies`` if given, else with the others.

  Returns:
    ``(points, seen)``: ``{path: PointShape}`` for every point, calls and
    hand-placed ones, and the names of every call seen.
  """
  found: dict[tuple, PointShape] = {}
  seen: list[str] = []
  reached: dict[tuple, None] = {}  # in call order: the program does not depend on hashing
  calls: set[tuple] = set()
  missed: list[str] = []
  nested_missed: list[str] = []
  in_branches: list[tuple[str, str]] = []  # (transform, call) of points made in a branch

  def on_point(call, output, applied):
    path = call.path + (call.key,)
    if applied:
      reached[path] = None
      if jitted is not None and in_jit(call.module):
        jitted.add(path)
      branching = branching_transform(call.module)
      if branching:
        in_branches.append((branching, call.name))
      if lifted is not None and inside_lifted_transform(call.module):
        lifted.add(path)
        part = differentiable_part(output)
        if inside is not None:
          inside[path] = PointShape.of(part)
        if marked is not None:
          rank = jnp.ndim(jax.tree.leaves(part)[0])
          call.module.put_variable(COLLECTION, marker_name(call.key), marker(rank))
    elif call.outside_apply and has_differentiable_leaf(output):
      # Outside every method call (a `bind`-bound module): no apply to replay with the
      # collection mutable, so the point's zeros are made here, from the output.
      calls.add(path)
      found[path] = PointShape.of(differentiable_part(output))
    elif has_differentiable_leaf(output):
      # Outside every lifted transform: an `apply` made inside a call of the model, on
      # variables given to it (another model's, closed over), which hold no points.
      (missed if inside_lifted_transform(call.module) else nested_missed).append(call.name)

  def on_root(module, method, run, a, kw):
    unbound, own = module.unbind()
    own = {c: t for c, t in own.items() if c != COLLECTION}
    reached.clear()
    in_branches.clear()
    try:
      mutable = _also_mutable(_also_mutable(module.scope.mutable, COLLECTION), JIT_CALLS)
      out, new = unbound.apply(own, *a, rngs=dict(module.scope.rngs), method=method,
                               mutable=mutable, **kw)
    except TypeError as error:
      # jax.lax.cond's TypeError for branches that return other trees: here the points
      # made in one branch and not the other.
      if in_branches:
        raise BranchCallsMismatchError(in_branches[0][0],
                                       sorted({name for _, name in in_branches})) from error
      raise
    except flax.errors.ScopeCollectionNotFound as error:
      # nn.map_variables(..., init=True) initializes its variables again in an apply with a
      # mutable collection, where the mapped collection cannot be written.
      if 'map_variables(' in str(error):
        raise MapVariablesInitError(str(error)) from error
      raise
    created = new.get(COLLECTION, {})
    calls.update(reached)
    markers = {path[:-1] + (marker_name(path[-1]),): path for path in reached}
    for path in reached:
      found[path] = PointShape.of(get_in(created, path))
    for path, value in traverse_util.flatten_dict(created).items():
      if path in markers:
        if marked is not None:
          marked[markers[path]] = tuple(jnp.shape(value))
      elif not any(path[:len(p)] == p for p in reached):
        found[path] = PointShape.of(value)
    if module.scope.mutable is False and not _holds_module(out):
      # The replay's output is the call's (abstract: only its shapes count here), and the
      # call would change nothing in the user's scope: no second trace of the model. A
      # submodule it returns (Hugging Face's `_get_encoder_module()`) is bound to the
      # replay's scope, which is gone: the call runs again to return the caller's own.
      return out
    with suspended():
      return run()

  handler = _point_handler(filter, hooks, strict, on_point)

  def recording(call, run):
    seen.append(call.name)
    if selects(filter, call.module, call.method_name):
      check_branch_point(call)
    if hooks_matched is not None:
      hooks_matched.update(
          i for i, h in enumerate(hooks) if selects(h.filter, call.module, call.method_name))
    return handler(call, run)

  def traced(variables, *args):
    with intercept(_filters.all_calls, recording, on_root, outside_apply=True,
                   nested_applies=nested_applies):
      return loss_fn(variables, *args, **kwargs)

  plain = {c: t for c, t in variables.items() if c != COLLECTION}
  arrays, rebuild = partition_values(args)
  jax.eval_shape(lambda v, arrays: traced(v, *rebuild(arrays)), plain, arrays)
  if point_paths is not None:
    point_paths.update(calls)
  if in_nested_applies is not None:
    in_nested_applies.extend(sorted(set(nested_missed)))
  else:
    missed += nested_missed
  if unreachable is not None:
    unreachable.extend(sorted(set(missed)))
  elif missed:
    warnings.warn(UnperturbedCallsWarning(sorted(set(missed))), stacklevel=3)
  return found, seen


def perturbed_apply(loss_fn: Callable[..., Any], variables: Variables, perturbations: Any,
                    args: tuple, kwargs: dict, *, points: CallFilter, strict: bool,
                    expected: set[tuple], hooks: Sequence[Hook] = (),
                    edit: PointEdit | None = None, activations: bool = False,
                    inputs: bool = False, reads: bool = True, lifted: Collection[tuple] = (),
                    per_iteration: bool = False, nested_applies: bool = False,
                    jitted: bool = False) -> tuple[Any, dict[str, dict[tuple, Any]]]:
  """Runs ``loss_fn`` with ``perturbations`` added at the points of the selected calls.

  The forward pass of :func:`value_and_grad`, for any perturbation values: the
  output of each selected call is ``edit(path, output)`` (when ``edit`` is
  given) plus its perturbation, so nonzero perturbations and edits change the
  model's computation exactly where a hand-written ``self.perturb`` would.

  Args:
    loss_fn: ``(variables, *args, **kwargs) -> anything``.
    variables: The variables without the perturbation collection.
    perturbations: The ``'perturbations'`` collection: every point ``discover``
      found (the selected calls' and the model's own ones).
    args: Positional arguments after the variables.
    kwargs: Keyword arguments.
    points: The selected calls.
    strict: Whether a selected call without floating-point output is an error.
    expected: The selected calls' point paths (``discover``'s ``point_paths``);
      each must be reached.
    hooks: Backward hooks to insert.
    edit: ``(point path, floating-point part of the output) -> edited part``.
    activations: Capture each selected call's output (before its edit).
    inputs: Capture each selected call's ``(args, kwargs)`` (array leaves).
    reads: Whether the captures are read. Where not, a capture inside a JAX
      transform that ``loss_fn`` applies itself is left out rather than
      refused (an edit works there); the others are checked as ever.
    lifted: The point paths of the selected calls inside a lifted transform
      (``discover``'s ``lifted``). With captures asked for, each top-level
      ``apply`` then runs with the :data:`CAPTURES` collection mutable, and
      those calls' captures come out of their transform through it (a
      transform that carries no mutable collection, such as ``nn.scan``
      without it in ``variable_axes``, cannot; one that maps it stacks them,
      which is refused).
    per_iteration: Captures inside a transform that maps the perturbations
      but carries no other collection (``nn.scan`` with ``'perturbations'`` in
      ``variable_axes``) leave with them, stacked per iteration along the axis
      of the call's gradient; a transform that maps the captures stacks them
      the same way, which is then taken too.
    nested_applies: As ``discover``'s, which found ``expected``.
    jitted: Whether some point is inside ``nn.jit`` (``discover``'s ``jitted``):
      each top-level ``apply`` then runs with ``JIT_CALLS`` mutable, so that a
      module in ``nn.jit`` called twice is traced, and perturbed, per call.

  Returns:
    ``(what loss_fn returned, {'activations': {path: output}, 'inputs': {path:
    (args, kwargs)}})``, the captures flat by point path.

  Raises:
    PerturbationsNotAppliedError: a point in ``expected`` was not reached.
    ActivationsUnavailableError: a capture inside a lifted transform that does
      not carry the captures out.
    CaptureInJaxTransformError: a capture inside a JAX transform that
      ``loss_fn`` applies itself (``jax.jit``, ``jax.vmap``, ... around
      ``model.apply``).
  """
  applied: set[tuple] = set()
  captured: dict[str, dict[tuple, Any]] = {'activations': {}, 'inputs': {}}
  kinds = [kind for kind, wanted in (('activations', activations), ('inputs', inputs)) if wanted]
  shapes_inside: dict[tuple, Any] = {}
  outputs_inside: dict[tuple, list] = {}  # the output's leaf shapes inside the transform
  in_points: set[tuple] = set()  # captures that leave with the perturbations (per iteration)
  readable = capture_check(reads)

  def on_point(call, output, was_applied):
    if not was_applied:
      return
    path = call.path + (call.key,)
    applied.add(path)
    if not kinds:
      return
    captures = {kind: differentiable_part(output) if kind == 'activations'
                else array_part((call.args, call.kwargs)) for kind in kinds}
    if not inside_lifted_transform(call.module):
      if call.in_function:
        # A module bound outside nn.cond/nn.switch, called by a branch: no collection of
        # its own scope can carry the branch's values out.
        raise ActivationsUnavailableError(call.name)
      if not readable(call.name):
        return
      for kind, value in captures.items():
        captured[kind][path] = value
      return
    if path in lifted and call.module.is_mutable_collection(CAPTURES):
      call.module.put_variable(CAPTURES, call.key, captures)
    elif path in lifted and per_iteration and call.module.is_mutable_collection(COLLECTION):
      # A transform that maps the perturbations (nn.scan with them in variable_axes) but
      # carries no other collection: the captures leave with them, one per iteration.
      call.module.put_variable(COLLECTION, _captures_name(call.key), captures)
      in_points.add(path)
    elif call.outside_apply:
      raise CaptureOutsideMethodCallError(call.name)
    else:
      raise ActivationsUnavailableError(call.name)
    shapes_inside[path] = leaf_shapes(captures)
    outputs_inside[path] = leaf_shapes(differentiable_part(output))

  def stacked_like_the_gradient(path: tuple) -> list | None:
    """The captures' leaf shapes with the axis the point's perturbation is stacked along."""
    stacking = stacked_axis(outputs_inside[path][0], leaf_shapes(find_in(perturbations, path))[0])
    return None if stacking is None else with_stacked_axis(shapes_inside[path], stacking)

  def replayed(module):
    # An apply given other variables than the loss function's (`{'params': v['params']}`,
    # or Hugging Face's `model(ids, params=...)`, which builds them itself) is replayed with
    # the perturbations.
    return (lifted and (kinds or jitted)) or COLLECTION not in module.variables

  def on_root(module, method, run, a, kw):
    unbound, own = module.unbind()
    if COLLECTION not in own:
      own = {**own, COLLECTION: perturbations}
    mutable = _also_mutable(_also_mutable(module.scope.mutable, CAPTURES), JIT_CALLS)
    if per_iteration:
      mutable = _also_mutable(mutable, COLLECTION)
    out, new = unbound.apply(own, *a, rngs=dict(module.scope.rngs), method=method,
                             mutable=mutable, **kw)
    for path in lifted:
      if path in in_points:
        captures = find_in(new.get(COLLECTION, {}), path[:-1] + (_captures_name(path[-1]),))
      else:
        captures = find_in(new.get(CAPTURES, {}), path)
      if captures is None:
        continue
      if not readable('/'.join(map(str, path))):
        continue
      # A transform that maps the collection (nn.scan, nn.vmap with every collection in
      # variable_axes) stacks one value per iteration: not the call's output, though
      # stacked like the call's gradient where ``per_iteration`` takes that.
      shapes = leaf_shapes(captures)
      if shapes != shapes_inside[path] and not (
          per_iteration and shapes == stacked_like_the_gradient(path)):
        raise ActivationsUnavailableError('/'.join(map(str, path)))
      for kind, value in captures.items():
        captured[kind][path] = value
    # The collections the caller's apply may change, written where it returns them from
    # (the perturbations are not changed: the caller's apply holds them as they were given).
    for collection, tree in new.items():
      if collection not in (CAPTURES, COLLECTION, JIT_CALLS):
        for name, value in tree.items():
          module.put_variable(collection, name, value)
    if _holds_module(out):
      # A submodule it returns is bound to the replay's scope, which is gone: the caller's
      # own, whose calls run as root calls in turn (see `intercept`).
      with suspended():
        return run()
    return out

  handler = _point_handler(points, hooks, strict, on_point, edit)
  full = {**variables, COLLECTION: perturbations}
  with intercept(_interception(points, hooks), handler, on_root, takes_root=replayed,
                 outside_apply=True, nested_applies=nested_applies):
    out = loss_fn(full, *args, **kwargs)
  missing = sorted('/'.join(p) for p in expected - applied)
  if missing:
    raise PerturbationsNotAppliedError(missing)
  return _without_points(out, perturbations), captured


def _without_points(out: Any, perturbations: Any) -> Any:
  """``out`` without the perturbations collection among the collections an ``apply`` returned.

  A loss whose ``apply`` has ``mutable=True`` gets every collection of the
  variables back, perturbkit's zero perturbations included; they are not the
  caller's (whose own are replaced by perturbkit's), and merged into a train
  state they would add an activation-sized array per call. A mapping loses
  its ``'perturbations'`` entry where that entry has the tree and shapes of
  the perturbations perturbkit handed in (values from inside ``nn.remat`` come
  back as new arrays, so identity cannot tell).
  """
  def layout(tree: Any) -> tuple[Any, list]:
    return jax.tree.structure(tree), leaf_shapes(tree)

  ours = layout(perturbations)

  def returned(node: Any) -> bool:
    if not isinstance(node, Mapping) or COLLECTION not in node:
      return False
    try:
      return layout(node[COLLECTION]) == ours
    except (TypeError, ValueError):  # leaves that are not arrays
      return False

  def strip(node: Any) -> Any:
    # Down plain containers only: other pytrees (a model's output dataclass) are left
    # as they are, as rebuilding some of them fails.
    if returned(node):
      return type(node)({k: v for k, v in node.items() if k != COLLECTION})
    if type(node) in (tuple, list):
      return type(node)(strip(n) for n in node)
    if isinstance(node, tuple) and hasattr(node, '_fields'):
      return type(node)(*(strip(n) for n in node))
    if type(node) is dict:
      return {k: strip(v) for k, v in node.items()}
    return node

  return strip(out) if jax.tree.leaves(perturbations) else out


def value_and_grad(loss_fn: Callable[..., Any], *, filter: CallFilter | bool | None = None,
                   has_aux: bool = False, hooks: Sequence[Hook] = (),
                   return_activations: bool = False, return_inputs: bool = False,
                   strict: bool | None = None) -> Callable[..., Any]:
  """Parameter gradients and every activation gradient, from one backward pass.

  ``loss_fn(variables, *args, **kwargs)`` is the ordinary loss: it calls
  ``model.apply(variables, ...)`` on the unmodified model. The returned function
  takes the same arguments (arguments that are no arrays, such as a ``train``
  flag or a string, reach ``loss_fn`` as they are, as under ``jax.grad``) and
  returns ``(loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``), where ``grads['params']`` is the usual gradient
  and ``grads['perturbations']`` holds dL/d(output) of every selected submodule
  call, at the module's path under its point key (``'__call__'``, then
  ``'__call__#1'`` for a second call). The zero perturbations are made inside
  the trace, so under ``jax.jit`` XLA removes them; the function works under
  ``jax.jit``, ``jax.vmap``, ``shard_map`` and an outer ``jax.grad``. Inside
  ``shard_map`` each device's ``grads['perturbations']`` are its own shard's
  (the zeros vary over the devices as the outputs do). With ``check_vma=True``
  (JAX's default) a call whose output is the same on every device (a position
  embedding of fixed positions) gets the sum over the devices, as
  ``grads['params']`` does there; with ``check_vma=False`` it too gets the
  device's own. It works with a
  ``loss_fn`` that contains its own inner gradient step (the points inside the
  inner step get the derivative of the outer loss through that step). The
  collections an ``apply(..., mutable=...)`` in the loss returns are the ones
  it returns without perturbkit (with ``mutable=True`` too: the perturbations
  are not among them), ready to merge into the train state. The loss may also
  reach the model through ``model.bind(variables)``, ``nn.apply(fn, model)``
  or ``apply(..., method=fn)``: calls made there are points as well.

  Args:
    loss_fn: ``(variables, *args, **kwargs) -> loss`` (or ``(loss, aux)``).
    filter: Which calls get a point (default: all; see ``perturbkit.filters``).
    has_aux: Whether ``loss_fn`` returns ``(loss, aux)``.
    hooks: Backward hooks (:func:`backward_hook`, one or a list) to insert; the
      activation gradient reported for a hooked call is the one arriving at it,
      before the hook transforms it for the layers below.
    return_activations: Also return the outputs of the selected calls, in a
      tree shaped like ``grads['perturbations']``: ``(value, grads, acts)``.
    return_inputs: Also return the inputs of the selected calls, at the same
      paths, each as ``(args, kwargs)`` with every leaf that is not an array
      (a Python flag, ``None``) replaced by ``None``: ``(value, grads, inputs)``,
      or ``(value, grads, acts, inputs)`` with both. These are the pairs
      curvature and per-example methods need: a Dense call's input ``a`` next
      to the gradient ``g`` at its output.
    strict: Whether a selected call without floating-point output is an error
      (default: only when a filter is given).

  Returns:
    A function ``(variables, *args, **kwargs) -> (value, grads)``.

  Raises:
    NonScalarLossError: the loss is not a real scalar.
    MissingHasAuxError: the loss function returned ``(loss, aux)`` (or another
      tuple, list or dict) without ``has_aux=True``.
    HasAuxOutputError: ``has_aux=True`` and the loss function returned no pair.
    LossNotCallableError: ``loss_fn`` is not callable.
    WrongFrontEndError: the variables are an NNX model (use
      ``perturbkit.nnx.value_and_grad``).
    NotVariablesError: the first argument is not Linen variables with ``'params'``.
    NoPerturbationPointsError: the filter selects no call.
    NotAHookError: ``hooks`` holds something else than hooks.
    UnmatchedFilterError: a hook's filter selects no call.
    PerturbationsNotAppliedError: ``loss_fn`` made other calls in its second trace.
    BranchCallsMismatchError: the branches of an ``nn.cond``/``nn.switch``
      make different selected calls.
    BranchesUnseparatedError: two ``nn.switch`` in a row on one module, the
      second given branch functions the first was not.
    MapVariablesInitError: ``nn.map_variables(..., init=True)`` in the model.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)])
    >>> x = jnp.ones((2, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> loss_fn = lambda v, x: jnp.mean(model.apply(v, x) ** 2)
    >>> loss, grads = perturbkit.value_and_grad(loss_fn)(variables, x)
    >>> grads['perturbations']['layers_2']['__call__'].shape
    (2, 1)

  How it works:
    Flax's own ``nn.intercept_methods`` inserts a ``Module.perturb`` point after
    every selected submodule call; the zero perturbations are created inside
    the traced computation, so XLA folds them away (the compiled function has
    the same argument bytes, op and fusion count as plain
    ``jax.value_and_grad``). Like PyTorch backward hooks, it gives the
    activation gradients of an unmodified model next to the ordinary parameter
    gradients. ``grad`` is the same without the loss.

  Where the gradients are:
    * ``grads['params']`` is the usual parameter gradient.
    * ``grads['perturbations']['Dense_0']['__call__']`` sits next to
      ``grads['params']['Dense_0']``.
    * A module called twice gets ``'__call__'`` and ``'__call__#1'``; other
      methods get their own name (``'encode'``). A call of a method made while
      the same method of the same module runs (``super().__call__(x)`` in a
      LoRA-style subclass of ``nn.Dense``) is part of that call, not a point:
      the layer has one point, its whole output, as in NNX.
    * Pytree outputs get one perturbation per floating-point leaf, and a user's
      own pytree node is never rebuilt with anything but arrays: tuples, lists
      and dicts keep their shape (``None`` where a leaf is not a float array);
      a dataclass, ``flax.struct`` or Hugging Face ``ModelOutput`` whose leaves
      are all float arrays is kept as it is, and one with integer leaves is
      replaced by the tuple of its float leaves.
    * The root module's own call is never a point: its output is the model's
      output.
    * A submodule's own ``apply`` inside a call of the model, as Hugging Face
      ties an output layer to the input embedding
      (``self.lm_head.apply({'params': {'kernel': embedding.T}}, h)``), is a
      call of that submodule: GPT-2's ``grads['perturbations']['lm_head']``
      holds dL/d(logits). So is one in a function given to ``apply(...,
      method=fn)`` after it called a submodule a root method returned, as
      Hugging Face's ``decode`` runs the decoder and then the tied head (T5,
      BART, mBART, Marian). The calls inside such an ``apply`` have no point.
    * With ``return_activations``/``return_inputs`` the outputs and the
      ``(args, kwargs)`` inputs of the selected calls are at the same paths as
      their gradients.

  Your own points:
    Points the model places itself (``self.perturb('x_hat', x)``, the Flax
    guide's recipe) keep working, with or without the ``'perturbations'``
    collection from ``init`` in the variables, and their gradients are returned
    at the path where Flax puts them (``grads['perturbations']['x_hat']``), next
    to the automatic ones.

  Variables the loss builds itself:
    The loss may hand ``model.apply`` other variables than it is given
    (``{'params': variables['params']}``), or call a Hugging Face model its own
    way, which builds them from the params (``model(ids,
    params=variables['params'], dropout_rng=rng, train=True)``, as Hugging
    Face's example scripts do): every call gets its point all the same. A
    ``model.init`` inside the loss (Hugging Face's ``init_cache``, which makes
    a KV cache) is no call of the model: its calls get no points, and the
    calls after it are keyed as if it had not run.

  Lifted transforms:
    ``nn.remat``, ``nn.jit``, ``nn.Sequential``, setup- and compact-style
    modules need nothing (``return_activations`` and ``return_inputs`` of the
    calls inside ``nn.remat`` and ``nn.jit`` too). A module wrapped in
    ``nn.remat``, ``nn.jit`` or ``nn.vmap`` and called twice gets a point per
    call, as unwrapped (``nn.jit``, which would reuse the first call's trace for
    the second, is made to trace each call). Inside
    ``nn.scan``/``nn.vmap``, Flax only passes collections listed in
    ``variable_axes``: add ``'perturbations': 0`` there to get per-iteration
    gradients stacked along the scan axis (checked against a hand-unrolled
    loop); ``return_activations`` and ``return_inputs`` then give the calls'
    outputs and inputs stacked the same way (inside a scan inside a scan, along
    two leading axes, outer then inner). Without it the calls inside cannot
    carry a perturbation; perturbkit then says so with an
    ``UnperturbedCallsWarning`` naming them, instead of silently dropping them
    as plain Flax does. ``nn.cond``/``nn.switch`` work when every branch makes
    the same selected calls: the branches share their points, so each holds
    the gradient of the call in the branch that ran, keyed on from the calls
    before the conditional (``'a/__call__#1'`` for a Dense ``a`` called once
    before it). Where the branches call different submodules (or one a
    different number of times), their perturbations differ and
    ``BranchCallsMismatchError`` says so (exclude those calls with the filter,
    or compute every branch and pick the result with ``jnp.where``). Calls
    inside ``nn.while_loop`` get no point (its iterations would share one),
    with an ``UnperturbedCallsWarning``; nor does a layer that
    ``nn.WeightNorm`` or ``nn.SpectralNorm`` runs inside ``nn.map_variables``
    (its function may map the perturbations like the weights): the wrapper's
    own call has the same output and its point.

  NNX modules inside the model:
    An NNX module run through ``nnx.bridge.ToLinen`` is one call, with its
    point on the bridge's output (its own NNX layers are no Linen calls).
    Flax warns there ``Found unknown module paths in incoming state: __call__``:
    ToLinen hands every collection of its scope to the NNX module, the point's
    zero included, which that module has no variable for; the values are not
    affected (``tests/test_value_and_grad.py``).

  Nested gradients (test-time training):
    A loss may contain its own ``jax.grad`` step: the points inside the inner
    step receive the derivative of the OUTER result through that step, the "add
    a perturbation argument to the intermediate and differentiate at zero"
    construction, done for every call at once. See
    ``notebooks/03_nested_gradients.ipynb`` and ``tests/test_nested.py``. A
    perturbkit function called inside another one's loss is a different
    matter: see "Threads and nesting" in ``help(perturbkit)``.

    The inner step should update ``variables['params']`` only
    (``{**v, 'params': new_params}``): the variables the loss is given also
    hold the zero ``'perturbations'``, and an update of the whole tree moves
    them off zero. In a Python loop each inner call has a point of its own,
    which such an update leaves at zero; in a ``jax.lax`` loop
    (``fori_loop``, ``scan``, ``while_loop``) written in the loss, every
    iteration runs the same calls, with the same points, so a moved point
    changes the model's output. Those iterations also share one point per
    call, whose gradient is the sum over the iterations; for a gradient per
    iteration, use ``nn.scan`` with ``'perturbations'`` in ``variable_axes``
    or a Python loop.
  """
  check_loss_fn(loss_fn, 'perturbkit.value_and_grad', '(variables, *args) -> loss')
  for name, value in (('has_aux', has_aux), ('return_activations', return_activations),
                      ('return_inputs', return_inputs)):
    flag(name, value)
  flag('strict', strict, none=True)
  points, strict = point_options(filter, strict)
  hooks = hooks_tuple(hooks, 'perturbkit.value_and_grad')

  @functools.wraps(loss_fn)
  def run(variables: Variables, *args, **kwargs):
    check_variables(variables, 'perturbkit.value_and_grad')
    # Inside another perturbkit function's loss, this level sees only its own
    # calls, and the outer level does not see them (see help(perturbkit),
    # "Threads and nesting").
    with suspended():
      return _value_and_grad(variables, args, kwargs)

  def _value_and_grad(variables, args, kwargs):
    expected: set[tuple] = set()
    matched: set[int] = set()
    lifted: set[tuple] = set()
    jitted: set[tuple] = set()
    unperturbed: list[str] = []
    applied: list[str] = []  # calls of an apply nested in a call, on variables given to it
    points_found, seen = discover(loss_fn, variables, args, kwargs, filter=points,
                                  strict=strict, hooks=hooks, point_paths=expected,
                                  hooks_matched=matched, lifted=lifted, unreachable=unperturbed,
                                  nested_applies=True, jitted=jitted, in_nested_applies=applied)
    if unperturbed:
      warnings.warn(UnperturbedCallsWarning(unperturbed), stacklevel=3)
    if applied:
      warnings.warn(UnperturbedCallsWarning(applied, nested_apply=True), stacklevel=3)
    if not points_found:
      raise NoPerturbationPointsError(seen, lifted=unperturbed)
    check_matched(hooks, matched, seen)

    def differentiable(params, perturbations):
      out, captured = perturbed_apply(
          loss_fn, {**variables, 'params': params}, perturbations, args, kwargs, points=points,
          strict=strict, expected=expected, hooks=hooks, activations=return_activations,
          inputs=return_inputs, lifted=lifted, per_iteration=True, nested_applies=True,
          jitted=bool(jitted))
      loss = check_loss(out, has_aux)
      aux = out[1] if has_aux else None
      return loss, (aux, {k: nested(v) for k, v in captured.items()})

    zeros = nested({path: shape.zeros() for path, shape in points_found.items()})
    (loss, (aux, captured)), (g_params, g_points) = jax.value_and_grad(
        differentiable, argnums=(0, 1), has_aux=True)(variables['params'], zeros)
    return driver_result(loss, aux, {'params': g_params, COLLECTION: g_points}, captured,
                         has_aux=has_aux, return_activations=return_activations,
                         return_inputs=return_inputs)

  return run


def grad(loss_fn: Callable[..., Any], *, filter: CallFilter | bool | None = None,
         has_aux: bool = False, hooks: Sequence[Hook] = (),
         strict: bool | None = None) -> Callable[..., Any]:
  """Like :func:`value_and_grad` but returns only ``grads`` (``(grads, aux)`` with aux).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import perturbkit
    >>> model = nn.Dense(2)
    >>> wrapped = nn.Sequential([nn.Dense(3), nn.Dense(1)])
    >>> x = jnp.ones((1, 2))
    >>> v = wrapped.init(jax.random.key(0), x)
    >>> g = perturbkit.grad(lambda v: wrapped.apply(v, x).sum())(v)
    >>> g['perturbations']['layers_1']['__call__'].tolist()
    [[1.0]]
  """
  check_loss_fn(loss_fn, 'perturbkit.grad', '(variables, *args) -> loss')
  vg = value_and_grad(loss_fn, filter=filter, has_aux=has_aux, hooks=hooks, strict=strict)
  return grads_only(vg, loss_fn, has_aux)
