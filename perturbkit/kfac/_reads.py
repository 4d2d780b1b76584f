"""Whether a K-FAC layer's params are used by its own calls only.

K-FAC preconditions a layer's whole param gradient with factors formed from
its calls' inputs and output gradients. When the model also reads the params
elsewhere (a tied LM head multiplying by the transposed ``wte`` embedding, a
kernel reused by hand), that part of the gradient has no factors, and
preconditioning the sum with the call's factors would be a guess. Such reads
are found in the jaxpr of one abstract run, in which every call of a layer is
a ``custom_vjp`` function named after the layer that takes the params as an
explicit argument: any other equation reading them is a read outside the
calls (``_param_reads``, ``_consumers.reads_outside``).
"""
from typing import Any, Callable, Mapping

import flax
import jax

from perturbkit.core._consumers import reads_outside
from perturbkit.linen._interceptor import Call, intercept
from perturbkit.linen._param_reads import named_call
from perturbkit.core._segment_choice import flat_leaf_owners
from perturbkit.core._types import Path, Variables


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
    del run  # replayed as a named call instead
    return named_call(paths[tuple(call.path)], call.module, call.method_name, call.args,
                      call.kwargs, call.path)

  def traced(params, others, inputs):
    with intercept(select, on_call):
      return predict_fn({**others, 'params': params}, inputs)

  params = flax.core.unfreeze(variables['params'])
  others = {c: v for c, v in variables.items() if c != 'params'}
  jaxpr = jax.make_jaxpr(traced)(params, others, inputs)
  return reads_outside(jaxpr, flat_leaf_owners(params, list(paths.values())))
