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

from perturbkit.errors import SegmentationError, SharedSegmentError
from perturbkit.linen._interceptor import Call, intercept, open_hooks, replaying
from perturbkit.core._points import COLLECTION
from perturbkit.core._segment_vjp import Backward, segment_call, split_floats


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
  dynamic, rebuild = split_floats((call.args, call.kwargs))
  # Taken now: the backward pass may replay the call after the hook blocks closed.
  hooks = open_hooks()

  def pure(w, dyn):
    args, kwargs = rebuild(dyn)
    with replaying(call.path, hooks):
      out, state = unbound.apply({'params': w, **others}, *args, rngs=rngs, mutable=mutable,
                                 method=call.method_name, **kwargs)
    return out, dict(state)

  params = variables.get('params', {})
  out, state = segment_call('/'.join(call.path), pure, flax.core.unfreeze(params), dynamic,
                            carrier, backward, axis_name)
  for collection, tree in state.items():
    _write_back(module.scope, collection, tree)
  return out


def _subtree(tree: Mapping, path: tuple) -> Any:
  for k in path:
    tree = tree[k]
  return tree


def segmented_loss(loss_fn: Callable[..., Any], variables: Mapping, args: tuple,
                   names: Mapping[tuple, str], backward_for: Callable[[str], Backward],
                   axis_name: str | None = None) -> Callable[[Any, Any], tuple[Any, dict]]:
  """``loss_fn`` as a function of ``(params, carriers)`` with each segment call replayed.

  Args:
    loss_fn: The user's loss, ``(variables, *args) -> out``.
    variables: All collections; ``'params'`` is replaced by the argument.
    args: The loss's other arguments.
    names: Segment module path -> segment name.
    backward_for: Segment name -> its ``Backward``.
    axis_name: Mapped axis to average each ``dw`` over, if any.

  Returns:
    ``fn(params, carriers) -> (out, mutated)``, ``mutated`` holding the mutable
    collections the model's own ``apply(..., mutable=...)`` would return.

  Raises:
    SharedSegmentError: a segment module is called more than once.
    SegmentationError: a segment runs inside ``nn.scan``/``nn.vmap`` with sliced params.
  """
  is_segment = lambda module, method_name: tuple(module.path) in names

  def fn(params, carriers):
    mutated: dict = {}
    called: set = set()

    def on_call(call, run):
      # Calls made inside a segment are not intercepted, so any second call on
      # a segment's module (a second `__call__`, or another method such as a
      # tied embedding's `attend`) is a genuine second use of its weights.
      if call.path in called:
        raise SharedSegmentError(names[call.path], 'it is called more than once in one step')
      called.add(call.path)
      if params_sliced(call, params):
        raise SegmentationError(
            f'The segment {call.name!r} runs inside a lifted transform (nn.scan, nn.vmap) '
            'whose params are sliced; make the whole transformed module one segment '
            '(its parent), or choose other segments.')
      name = names[call.path]
      return run_segment(call, backward_for(name), carriers[name], axis_name)

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
    full = _subtree(params, call.path)
  except (KeyError, TypeError):
    return True
  return jax.tree.map(jnp.shape, w) != jax.tree.map(jnp.shape, full)
