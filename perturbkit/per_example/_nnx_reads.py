"""NNX params read outside the calls of the module that owns them: refused.

Per-example gradients of an NNX model are assembled from each call of a module that
owns ``nnx.Param`` s directly (its input and output gradient). Any other read that
reaches the loss (the root module's own params, ``h @ self.embed.embedding[...].T``
written in a parent, a weight penalty in the loss) carries a part of the gradient no
call sees. One abstract run finds such reads, as for Linen (``_outside``): every call
of an owner is a ``custom_vjp`` function named after it that takes the module's
params explicitly (:func:`named_module_call`), so any other equation reading them is
a read outside its calls (``_consumers.reads_outside``, which follows a named call
given another owner's params into its body, where the child's own call is named).
"""
from typing import Any, Callable, Mapping

import jax
from flax import nnx

from perturbkit.core._values import is_array, partition_values
from perturbkit.core._consumers import reads_outside, segment_function_name
from perturbkit.core._segment_choice import direct_leaf_owners
from perturbkit.nnx._calls import Call, NNXPath, instrument
from perturbkit.nnx._segments import params_tree, with_values


def named_module_call(name: str, call: Call) -> Any:
  """The call as a ``custom_vjp`` function of its module's params, named after ``name``.

  The module's params (children's included) are the function's argument: a
  replica merged from them runs the method, so every read of them inside the call
  is an operand of one ``custom_vjp_call`` equation. The replica keeps the
  module's instrumentation, so its children's calls are named calls of their
  own inside. Nothing the call writes (batch statistics, RNG counts) reaches the
  model. Only traced forward: the jaxpr is inspected, never differentiated.
  """
  graphdef, params, others = nnx.split(call.module, nnx.Param, ...)
  found: list[Any] = []

  def pure(values):
    replica = nnx.merge(graphdef, with_values(params, values), others, copy=True)
    # New NNX objects (an nnx.Rngs argument): the call may draw from them in this trace.
    args, kwargs = jax.tree.map(lambda leaf: leaf, (call.args, call.kwargs))
    leaves, tree = jax.tree.flatten(getattr(replica, call.method_name)(*args, **kwargs))
    found[:] = [tree, leaves]
    return [leaf for leaf in leaves if is_array(leaf)]

  pure.__name__ = segment_function_name(name)
  function = jax.custom_vjp(pure)
  function.defvjp(lambda values: (pure(values), None), lambda res, g: (None,))
  arrays = iter(function(params_tree(params)))
  tree, leaves = found
  return jax.tree.unflatten(tree, [next(arrays) if is_array(leaf) else leaf
                                   for leaf in leaves])


ROOT = '<model-call>'  # the whole model's calls' name (one word), with ``outside_model_calls``


def nnx_outside_reads(loss_fn: Callable[..., Any], model: nnx.Module, args: tuple,
                      kwargs: dict, owners: Mapping[NNXPath, str], *,
                      outside_model_calls: bool = False) -> dict[str, set[str]]:
  """``{module name: {primitives}}`` reading an owner's params outside its calls.

  Args:
    loss_fn: ``(model, *args, **kwargs) -> loss``.
    model: The ``nnx.Module`` (a copy is traced).
    args: The loss's positional arguments.
    kwargs: Its keyword arguments.
    owners: ``{module path: name}`` of every module owning params directly; the
      root's (path ``()``) are always read outside a submodule call.
    outside_model_calls: Only the reads outside every call of the whole model
      (``model(x)`` in the loss): a weight penalty, a weight used inline in the
      loss. The reads inside them are covered by a per-example replay of the call.
  """
  graphdef, template, others = nnx.split(model, nnx.Param, ...)
  kw_arrays, kw_of = partition_values(kwargs)

  running: list[NNXPath] = []

  def on_call(call: Call, run: Callable[[], Any]) -> Any:
    # Inside its own named call, the replica's method runs as itself.
    if (call.path not in owners and call.path != ()) or call.path in running:
      return run()
    running.append(call.path)
    try:
      return named_module_call(ROOT if call.path == () else owners[call.path], call)
    finally:
      running.pop()

  def traced(params, kw_arrays, *args):
    kw = kw_of(kw_arrays)
    copy = nnx.merge(graphdef, with_values(template, params), others, copy=True)
    with instrument([copy], on_call, include_roots=outside_model_calls):
      return loss_fn(copy, *args, **kw)

  params = params_tree(template)
  jaxpr = jax.make_jaxpr(traced)(params, kw_arrays, *args)
  # A model call's replica is given every param: what it does with them is covered.
  spared = ({segment_function_name(ROOT): len(jax.tree.leaves(params))}
            if outside_model_calls else {})
  return reads_outside(jaxpr, direct_leaf_owners(params, owners), spared=spared)
