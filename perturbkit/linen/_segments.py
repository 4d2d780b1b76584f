"""Linen segments: a submodule call replayed as a pure function of its params.

The replay is the ordinary call (same rng streams, so the same dropout masks);
mutable collections such as ``batch_stats`` are written back into the scope.
The custom VJP that updates the segment in the backward pass is
``_segment_vjp.segment_call``.
"""
from typing import Any, Callable, Mapping

import flax
import jax
import jax.numpy as jnp

from perturbkit.errors import SegmentationError
from perturbkit.linen._interceptor import Call, intercept, open_hooks, replaying
from perturbkit.core._points import COLLECTION
from perturbkit.core._segment_choice import note_segment_call, sliced_iterations
from perturbkit.core._trees import get_in
from perturbkit.core._segment_vjp import Backward, segment_call, split_arrays


def _write_back(scope, collection: str, tree: Any):
  """Stores ``tree`` (a collection's nested dict) into ``scope`` and its children."""
  for name, value in tree.items():
    if scope.has_variable(collection, name):
      scope.put_variable(collection, name, value)
    else:
      _write_back(scope.push(name, reuse=True), collection, value)


def run_segment(call: Call, backward: Backward, carrier: Any,
                axis_name: str | None = None) -> Any:
  """Runs one segment call with the interleaved custom VJP.

  Args:
    call: The intercepted call (a module whose params form the segment).
    backward: See ``segment_call``.
    carrier: Zeros shaped like what ``backward`` carries out.
    axis_name: Mapped axis to average ``dw`` over, if any.

  Returns:
    The call's output.
  """
  module = call.module
  unbound, variables = module.unbind()
  # A copy: the write-back below mutates the scope's own dicts, and the backward
  # replay must see the collections as they were when the segment ran.
  others = jax.tree.map(lambda leaf: leaf, {
      c: flax.core.unfreeze(v) for c, v in variables.items() if c not in ('params', COLLECTION)})
  mutable = [c for c in others if module.is_mutable_collection(c)]
  rngs = dict(module.scope.rngs)
  dynamic, fixed, rebuild = split_arrays((call.args, call.kwargs))
  # Taken now: the backward pass may replay the call after the hook blocks closed.
  hooks = open_hooks()

  def pure(w, dyn, context):
    others, rngs, fixed = context
    args, kwargs = rebuild(dyn, fixed)
    with replaying(call.path, hooks):
      out, state = unbound.apply({'params': w, **others}, *args, rngs=rngs, mutable=mutable,
                                 method=call.method_name, **kwargs)
    return out, dict(state)

  params = {k: v for k, v in flax.core.unfreeze(variables.get('params', {})).items()
            if k != ITERATION_STATE}
  out, state = segment_call('/'.join(call.path), pure, params, dynamic, carrier, backward,
                            axis_name, (others, rngs, fixed))
  for collection, tree in state.items():
    _write_back(module.scope, collection, tree)
  return out


ITERATION_STATE = '__perturbkit_iteration_state__'
"""The params entry that brings a scanned segment its iteration's carrier and optimizer state.

Stacked ``(L, ...)`` beside the segment's own params, it is sliced by the scan as
they are, so the call inside the scan body sees its iteration's.
"""


def with_iteration_state(params: Mapping, states: Mapping[tuple, Any]) -> dict:
  """``params`` with ``states[path]`` (stacked along the first axis) at each scanned segment."""
  params = dict(params)
  for path, state in states.items():
    node = params
    for k in path[:-1]:
      node[k] = dict(node[k])
      node = node[k]
    node[path[-1]] = {**node[path[-1]], ITERATION_STATE: state}
  return params


def stacked_iterations(call: Call, params: Mapping) -> int:
  """``L`` if the call sees its params sliced from ``(L, ...)`` stacked ones (``sliced_iterations``)."""
  try:
    full = get_in(params, call.path)
  except (KeyError, TypeError):
    return 0
  own = lambda tree: {k: v for k, v in flax.core.unfreeze(tree).items() if k != ITERATION_STATE}
  return sliced_iterations(own(full), own(call.module.variables.get('params', {})))


def segmented_loss(loss_fn: Callable[..., Any], variables: Mapping, args: tuple,
                   names: Mapping[tuple, str],
                   backward_for: Callable[[str, Any], Backward],
                   axis_name: str | None = None,
                   iterations: Mapping[str, int] | None = None
                   ) -> Callable[[Any, Any], tuple[Any, dict]]:
  """``loss_fn`` as a function of ``(params, carriers)`` with each segment call replayed.

  Args:
    loss_fn: The user's loss, ``(variables, *args) -> out``.
    variables: All collections; ``'params'`` is replaced by the argument.
    args: The loss's other arguments.
    names: Segment module path -> segment name.
    backward_for: ``(segment name, its optimizer state or None) -> Backward``;
      a scanned segment's step gets its iteration's state.
    axis_name: Mapped axis to average each ``dw`` over, if any.
    iterations: ``{segment name: L}`` for the segments inside a scan
      (:func:`stacked_iterations`). The params given to ``fn`` then hold,
      beside each one's params, its stacked carrier and optimizer state
      (:func:`with_iteration_state`), and each iteration's call takes its own.

  Returns:
    ``fn(params, carriers) -> (out, mutated)``, ``mutated`` holding the mutable
    collections the model's own ``apply(..., mutable=...)`` would return.

  Raises:
    SharedSegmentError: a segment module is called more than once.
    SegmentationError: a segment runs inside ``nn.scan``/``nn.vmap`` with sliced params.
  """
  is_segment = lambda module, method_name: tuple(module.path) in names
  iterations = iterations or {}

  def fn(params, carriers):
    mutated: dict = {}
    called: dict = {}

    def on_call(call, run):
      name = names[call.path]
      note_segment_call(called, name, call.path, call.key, name in iterations)
      if name in iterations:
        return _run_scanned(call, name)
      if params_sliced(call, params):
        raise SegmentationError(
            f'The segment {call.name!r} runs inside a lifted transform (nn.scan, nn.vmap) '
            'whose params are sliced; make the whole transformed module one segment '
            '(its parent), or choose other segments.')
      return run_segment(call, backward_for(name, None), carriers[name], axis_name)

    def _run_scanned(call, name):
      if stacked_iterations(call, params) != iterations[name]:
        raise SegmentationError(
            f'The segment {call.name!r} was chosen as {iterations[name]} iterations of a '
            'scan over its stacked params, but its call does not see them sliced so; '
            'choose the segments again with `init`.')
      # Absent when only the forward pass is traced (the reads check).
      state = call.module.variables['params'].get(ITERATION_STATE, ((), None))
      carrier, opt_state = state
      return run_segment(call, backward_for(name, opt_state), carrier, axis_name)

    def on_root(module, method, run, a, kw):
      out = run()
      current = module.variables
      mutated.update({c: current[c] for c in current
                      if c not in ('params', COLLECTION) and module.is_mutable_collection(c)})
      return out

    with intercept(is_segment, on_call, on_root):
      out = loss_fn({**variables, 'params': params}, *args)
    return out, mutated

  return fn


def params_sliced(call: Call, params: Mapping) -> bool:
  """Whether the call sees other params than those at its path (``nn.scan``/``nn.vmap``)."""
  w = call.module.variables.get('params', {})
  try:
    full = get_in(params, call.path)
  except (KeyError, TypeError):
    return True
  return jax.tree.map(jnp.shape, w) != jax.tree.map(jnp.shape, full)
