"""Which params a model reads outside the calls of the modules that own them.

K-FAC and per-example gradients both build a layer's param gradient from its
calls alone (their inputs and output gradients). A read of the params anywhere
else (a tied LM head multiplying by the transposed embedding, a kernel reused
by hand, a penalty on the weights in the loss) adds a part of the gradient
those calls do not see. Such reads are found in the jaxpr of one abstract run
in which every call of a layer is a ``custom_vjp`` function named after the
layer that takes the params as an explicit argument (:func:`named_call`): any
other equation reading them is a read outside the calls
(``_consumers.reads_outside``).
"""
import contextlib
from typing import Any, ContextManager

import flax
import flax.linen as nn
import jax

from perturbkit.core._consumers import segment_function_name
from perturbkit.core.filters import linen_path_prefix
from perturbkit.core._segment_vjp import split_floats
from perturbkit.core._types import Path


def named_call(name: str, module: nn.Module, method_name: str, args: tuple, kwargs: dict,
               path: Path = (), context: ContextManager | None = None) -> Any:
  """The call as a ``custom_vjp`` function of the module's params, named after ``name``.

  The module is replayed as its own ``apply`` with its params (children's
  included) as the function's first argument, so every read of them inside
  the call is an operand of one ``custom_vjp_call`` equation. Calls made inside
  the replay see their paths with ``path`` in front, as in the whole model;
  ``context`` is entered around the replay. Updates of mutable collections
  inside the replay are dropped. Only traced forward: the jaxpr is
  inspected, never differentiated.
  """
  unbound, variables = module.unbind()
  others = {c: v for c, v in variables.items() if c != 'params'}
  mutable = [c for c in others if module.is_mutable_collection(c)]
  rngs = dict(module.scope.rngs)  # the same streams (dropout inside the call)
  dynamic, rebuild = split_floats((args, kwargs))

  def pure(w, dyn):
    a, kw = rebuild(dyn)
    with linen_path_prefix(path), (context or contextlib.nullcontext()):
      out, _ = unbound.apply({'params': w, **others}, *a, rngs=rngs, mutable=mutable,
                             method=method_name, **kw)
    return out

  pure.__name__ = segment_function_name(name)
  function = jax.custom_vjp(pure)
  function.defvjp(lambda w, dyn: (pure(w, dyn), None), lambda res, g: (None, None))
  return function(flax.core.unfreeze(variables.get('params', {})), dynamic)
