"""NNX segments: a submodule call replayed as a pure function of its params.

A segment call is split into the trained variables its module owns (``wrt``,
evaluated with the model's paths: ``_ownership``), those it holds from other
modules (tied weights: inputs of the segment) and everything else (batch
statistics, RNG streams); the replay merges a copy
of the module and calls the original method, so the same RNG counts give the
same dropout masks in every replay, and the updated non-trained state is
written back into the running model. The custom VJP that updates the segment
in the backward pass is ``_segment_vjp.segment_call``, shared with Linen.

The schedule's optimizer bookkeeping (``_sweep``) works on nested dicts with
string keys; ``params_tree`` / ``with_values`` convert an ``nnx.State`` (whose
``nnx.List`` items have integer keys) to and from that form.
"""
from typing import Any, Callable, Mapping

import jax
from flax import nnx, traverse_util

from perturbkit.errors import SegmentationError
from perturbkit.nnx._ownership import Ownership, owned_state, ownership, split_owned
from perturbkit.core._hooks import Hook, apply_hooks, hook_runner, selecting
from perturbkit.nnx._calls import (Call, NNXPath, ReplayHook, instrument, replay_hooks,
                                   replay_instrumented, submodules)
from perturbkit.core._segment_choice import note_segment_call, sliced_iterations
from perturbkit.core._segment_vjp import Backward, segment_call, split_arrays


def segment_name(path: NNXPath) -> str:
  """``('layers', 0)`` -> ``'layers/0'``: the segment's name (and its group in ``_sweep``)."""
  return '/'.join(map(str, path))


def same_paths(state: nnx.State, like: nnx.State) -> nnx.State:
  """The variables of ``state`` at the paths of ``like``."""
  paths = {tuple(path) for path, _ in nnx.to_flat_state(like)}
  return nnx.from_flat_state([(path, var) for path, var in nnx.to_flat_state(state)
                              if tuple(path) in paths])


def variables_tree(state: nnx.State, leaf: Callable[[nnx.Variable], Any] = lambda var: var
                   ) -> dict:
  """The variables of ``state`` (or ``leaf`` of each) as nested dicts with string keys."""
  flat = {tuple(map(str, path)): leaf(var) for path, var in nnx.to_flat_state(state)}
  return traverse_util.unflatten_dict(flat) if flat else {}


def params_tree(state: nnx.State) -> dict:
  """The values of ``state`` as nested dicts with string keys."""
  return variables_tree(state, lambda var: var.get_value())


def with_values(state: nnx.State, tree: Mapping) -> nnx.State:
  """A new ``state`` of the same variables holding the values of ``params_tree``-shaped ``tree``."""
  flat = traverse_util.flatten_dict(tree) if tree else {}
  return nnx.from_flat_state(
      [(path, var.replace(flat[tuple(map(str, path))])) for path, var in nnx.to_flat_state(state)])


ITERATION_STATE = '_perturbkit_iteration_state'


class IterationState(nnx.Variable):
  """A scanned segment's carrier and optimizer state, stacked ``(L, ...)`` on its module.

  Set as an attribute of the module whose params ``nnx.scan`` slices, it is
  sliced with them, so each iteration's call of the module's copy finds its own.
  """


def with_iteration_states(modules: Mapping[NNXPath, nnx.Module], states: Mapping[NNXPath, Any]):
  """Sets ``states[path]`` as the :class:`IterationState` of the module at each path."""
  for path, state in states.items():
    setattr(modules[path], ITERATION_STATE, IterationState(state))


def iteration_state(module: nnx.Module) -> Any:
  """The value of the module's :class:`IterationState`, or ``None``."""
  variable = vars(module).get(ITERATION_STATE)
  return None if variable is None else variable.get_value()


def stacked_iterations(copy: nnx.Module, full: nnx.Module, path: NNXPath,
                       owners: Ownership) -> int:
  """``L`` if ``copy`` holds the trained params of ``full`` (at ``path``) sliced from
  ``(L, ...)`` (``sliced_iterations``), as ``nnx.scan`` over modules made with ``nnx.vmap``
  does."""
  return sliced_iterations(params_tree(owned_state(full, path, owners)),
                           params_tree(owned_state(copy, path, owners)))


def rng_objects(tree: Any) -> list:
  """The NNX objects (an ``nnx.Rngs``, a module) among the leaves of ``tree``, in order."""
  node = lambda x: isinstance(x, nnx.Pytree)
  return [x for x in jax.tree.leaves(tree, is_leaf=node) if node(x)]


def run_segment(call: Call, graphdef: Any, owners: Ownership, backward: Backward, carrier: Any,
                axis_name: str | None = None, hooks: tuple[Hook, ...] = (),
                inner_hooks: tuple[ReplayHook, ...] = ()) -> Any:
  """Runs one NNX segment call with the interleaved custom VJP.

  Args:
    call: The instrumented call; the trained variables its module owns
      (``_ownership``) are the segment.
    graphdef: The module's graphdef taken before instrumenting (plain classes),
      so that replays, also those in the backward pass, dispatch nothing.
    owners: Where the model's state lists each trained variable. A trained
      variable the module holds but another module owns (a tied weight) enters
      the segment as an input: its gradient flows back to its owner, and the
      read shows in the jaxpr as one outside that owner's call.
    backward: See ``segment_call``.
    carrier: Zeros shaped like what ``backward`` carries out.
    axis_name: Mapped axis to average ``dw`` over, if any.
    hooks: Backward hooks that select this call. They act inside the replay,
      so the segment's own ``dw`` and the input cotangent both see the
      transformed gradient, as in an ordinary backward pass.

  Returns:
    The call's output; the module's other state is updated as the call would.
  """
  module = call.module
  w_state, foreign, others = split_owned(module, call.path, owners)
  # An nnx.Rngs among the call's arguments is rebuilt from its counts for every
  # replay (the same masks in each); the draws of the call advance the caller's one.
  arg_objects = rng_objects((call.args, call.kwargs))
  # New variables: the write-back below changes the module's own ones, and the
  # backward replay must see the state as it was when the segment ran.
  others = jax.tree.map(lambda leaf: leaf, others)
  dynamic, fixed, rebuild = split_arrays((call.args, call.kwargs))
  reads = params_tree(foreign)
  if reads:
    # The step sees the call's own inputs, as for any segment.
    backward = backward._replace(step=lambda g, dw, w, dyn, *rest, step=backward.step:
                                 step(g, dw, w, dyn[0], *rest))

  def pure(w, dyn, context):
    others, fixed = context
    dyn, read = dyn if reads else (dyn, {})
    args, kwargs = rebuild(dyn, fixed)
    # copy=True: the call must not write into the running model's variables.
    replica = nnx.merge(graphdef, with_values(w_state, w), with_values(foreign, read), others,
                        copy=True)
    with replay_instrumented(replica, inner_hooks):
      out = getattr(replica, call.method_name)(*args, **kwargs)
    # The filters were evaluated on the instrumented call (path filters need it).
    out = apply_hooks(hooks, call.name, out)
    drawn = [nnx.state(o, nnx.RngState) for o in rng_objects((args, kwargs))]
    return out, (same_paths(nnx.state(replica), others), drawn)

  out, (new_others, drawn) = segment_call(segment_name(call.path), pure, params_tree(w_state),
                                 (dynamic, reads) if reads else dynamic, carrier, backward,
                                 axis_name, (others, fixed))
  nnx.update(module, new_others)
  for obj, state in zip(arg_objects, drawn):
    nnx.update(obj, state)
  return out


def segmented_loss(loss_fn: Callable[..., Any], graphdef: Any, template: nnx.State,
                   others: nnx.State, args: tuple, wrt: Any, names: Mapping[NNXPath, str],
                   backward_for: Callable[[str, Any], Backward], axis_name: str | None = None,
                   hooks: tuple[Hook, ...] = (), iterations: Mapping[str, int] | None = None,
                   opt_states: Mapping[str, Any] | None = None
                   ) -> Callable[[Any, Any], tuple[Any, nnx.State]]:
  """``loss_fn`` as a function of ``(params, carriers)`` with each segment call replayed.

  Args:
    loss_fn: The user's loss, ``(model, *args) -> out``.
    graphdef: From ``nnx.split(model, wrt, ...)``.
    template: The ``wrt`` state (its variables' types and metadata).
    others: The rest of the model's state.
    args: The loss's other arguments.
    wrt: The filter of the trained variables.
    names: Segment module path -> segment name.
    backward_for: ``(segment name, its optimizer state or None) -> Backward``;
      a scanned segment's step gets its iteration's state.
    axis_name: Mapped axis to average each ``dw`` over, if any.
    hooks: Backward hooks (``perturbkit.backward_hook``) for the calls they select.
    iterations: ``{segment name: L}`` for the segments inside ``nnx.scan``
      (:func:`stacked_iterations`): each iteration's call of the module's copy
      is a segment, with its carrier and optimizer state taken from the
      module's :class:`IterationState`.
    opt_states: Those segments' optimizer states, stacked (absent when only
      the forward pass is traced).

  Returns:
    ``fn(params, carriers) -> (out, (new_others, drawn))`` with ``params`` a
    ``params_tree`` of the ``wrt`` state, ``new_others`` the model's
    non-trained state after the loss (batch statistics, RNG counts) and
    ``drawn`` the RNG state of each NNX object among ``args`` (an ``nnx.Rngs``)
    after the loss (:func:`rng_objects` order).

  Raises:
    SharedSegmentError: a segment module is called more than once.
  """
  iterations = iterations or {}
  paths = {name: path for path, name in names.items()}

  def fn(params, carriers):
    model = nnx.merge(graphdef, with_values(template, params), others, copy=True)
    owners = ownership(model, wrt)
    modules = dict(submodules(model))
    if opt_states is not None:
      # Each scanned segment's carrier and optimizer state ride on its module, stacked,
      # so that the scan hands each iteration its own.
      with_iteration_states(modules, {paths[n]: (carriers[n], opt_states[n])
                                      for n in iterations})
    plain = {path: nnx.graphdef(modules[path]) for path in names if path in modules}
    called: dict = {}
    run_hooked = hook_runner(hooks)

    def on_call(call: Call, run: Callable[[], Any]) -> Any:
      name = names.get(call.path)
      if name is None or (call.copied and name not in iterations):
        return run_hooked(call, run)
      # Calls inside a segment replay are not instrumented (see note_segment_call).
      note_segment_call(called, name, call.path, call.key, name in iterations)
      carrier, opt_state = carriers[name], None
      if name in iterations:
        if not call.copied or stacked_iterations(call.module, modules[call.path], call.path,
                                                 owners) != iterations[name]:
          raise SegmentationError(
              f'The segment {name!r} was chosen as {iterations[name]} iterations of an '
              'nnx.scan over its stacked params, but its call does not see them sliced so; '
              'choose the segments again with `init`.')
        carrier, opt_state = iteration_state(call.module) or ((), None)
      inner_hooks = replay_hooks()
      if hooks:
        inner_hooks += ((hook_runner(hooks), call.path),)
      selected = tuple(hooks[i] for i in selecting(hooks, call.module, call.method_name))
      return run_segment(call, plain[call.path], owners, backward_for(name, opt_state), carrier,
                         axis_name, selected, inner_hooks)

    # New NNX objects (an nnx.Rngs argument) of this trace: the loss's draws advance
    # them as they would the caller's, which another trace must not write into.
    fresh = jax.tree.map(lambda leaf: leaf, args)
    with instrument([model], on_call):
      out = loss_fn(model, *fresh)
    # The iteration states set above are this trace's, not the model's: left out.
    return out, (nnx.state(model, nnx.All(nnx.Not(wrt), nnx.Not(IterationState))),
                 [nnx.state(o, nnx.RngState) for o in rng_objects(fresh)])

  return fn


