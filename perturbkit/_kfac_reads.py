"""Whether a K-FAC layer's params are used by its own calls only.

K-FAC preconditions a layer's whole param gradient with factors formed from
its calls' inputs and output gradients. When the model also reads the params
elsewhere (a tied LM head multiplying by the transposed ``wte`` embedding, a
kernel reused by hand), that part of the gradient has no factors, and
preconditioning the sum with the call's factors would be a guess. Such reads
are found in the jaxpr of one abstract run, in which every call of a layer is
a ``custom_vjp`` function named after the layer that takes the params as an
explicit argument: any other equation reading them is a read outside the
calls (``_consumers.reads_outside``).
"""
from typing import Any, Callable, Mapping

import flax
import jax

from perturbkit._consumers import reads_outside, segment_function_name
from perturbkit._interceptor import Call, intercept
from perturbkit._segment_choice import flat_leaf_owners
from perturbkit._segment_vjp import split_floats
from perturbkit._types import Path, Variables


def _named_call(name: str, call: Call, run: Callable[[], Any]) -> Any:
  """The call as a ``custom_vjp`` function of its params, named after the layer."""
  unbound, variables = call.module.unbind()
  others = {c: v for c, v in variables.items() if c != 'params'}
  dynamic, rebuild = split_floats((call.args, call.kwargs))

  def pure(w, dyn):
    args, kwargs = rebuild(dyn)
    return unbound.apply({'params': w, **others}, *args, method=call.method_name, **kwargs)

  pure.__name__ = segment_function_name(name)
  function = jax.custom_vjp(pure)
  # Only traced forward (the jaxpr is inspected, never differentiated).
  function.defvjp(lambda w, dyn: (pure(w, dyn), None), lambda res, g: (None, None))
  del run
  return function(flax.core.unfreeze(variables.get('params', {})), dynamic)


def outside_reads(predict_fn: Callable[[Variables, Any], Any], variables: Variables,
                  inputs: Any, paths: Mapping[Path, str]) -> dict[str, set[str]]:
  """``{layer name: {primitives}}`` reading a layer's params outside its own calls.

  Args:
    predict_fn: ``(variables, inputs) -> output``.
    variables: The model variables.
    inputs: An example batch.
    paths: ``{module path: layer name}`` of the layers to check (each name is
      the path joined with ``/``).

  Returns:
    The layers whose params something else reads, with what reads them; a
    layer absent from the result is used through its calls only.
  """
  if not paths:
    return {}
  select = lambda module, method_name: (method_name == '__call__'
                                        and tuple(module.path) in paths)

  def on_call(call: Call, run: Callable[[], Any]) -> Any:
    return _named_call(paths[tuple(call.path)], call, run)

  def traced(params, others, inputs):
    with intercept(select, on_call):
      return predict_fn({**others, 'params': params}, inputs)

  params = flax.core.unfreeze(variables['params'])
  others = {c: v for c, v in variables.items() if c != 'params'}
  jaxpr = jax.make_jaxpr(traced)(params, others, inputs)
  return reads_outside(jaxpr, flat_leaf_owners(params, list(paths.values())))
