"""Params read outside the calls of their module and outside nested applies: refused.

Per-example gradients are assembled from each call of a param-owning module
(its input and output gradient) and from the nested ``apply`` calls given
params computed from the model's (tied LM heads, ``_per_example_reads``). Any
other read of the params that reaches the loss (``h @ embed.variables['params']
['embedding'].T`` written inline, a kernel reused by hand in another module, a
penalty on the weights inside the loss) carries a part of the gradient that
neither sees, so the norms would be silently wrong. One abstract run of the
loss finds such reads, as K-FAC does (``_param_reads``): every call of an owner
is a ``custom_vjp`` function named after it that takes its params explicitly,
and every nested ``apply`` one that takes its given params explicitly; reads
that only compute a nested apply's params are what that route accounts for.
It runs when the per-example function is traced, so a step costs nothing more.
"""
from typing import Any, Callable, Collection

import flax
import jax

from perturbkit.core._values import partition_values
from perturbkit.core._consumers import reads_outside, segment_function_name
from perturbkit.linen._interceptor import Call, in_map_variables, intercept, suspended
from perturbkit.core.filters import module_path
from perturbkit.linen._param_reads import named_call
from perturbkit.per_example._nested import nested_applies, replay
from perturbkit.core._segment_choice import direct_leaf_owners
from perturbkit.core._types import Path, Variables


def outside_reads(loss_fn: Callable[..., Any], variables: Variables, args: tuple,
                  kwargs: dict, owners: set[Path], holders: Collection[Path] = (), *,
                  whole_applies: bool = False) -> dict[str, set[str]]:
  """``{module path: {primitives}}`` reading an owner's params outside its calls.

  Reads that only compute the params of a nested ``apply``, and reads whose
  result does not reach the loss, are not counted. With ``whole_applies``, neither
  are the reads made inside the loss's top-level applies (each is one named call).
  The calls of ``holders`` (owners whose calls run a layer they were given) and
  those inside ``nn.map_variables`` are not replayed on their own: their reads
  count as reads outside their calls.
  """
  names = {path: '/'.join(path) for path in owners if path}
  if not names:
    return {}
  spared: dict[str, int] = {}

  def select(module, method_name):
    del method_name
    # Inside nn.map_variables a layer sees its params mapped (nn.WeightNorm): not a replay of
    # the layer with its own params, so its reads there are the mapping's.
    path = module_path(module)
    return path in names and path not in holders and not in_map_variables(module)

  def on_call(call: Call, run: Callable[[], Any]) -> Any:
    del run  # replayed as a named call instead
    return named_call(names[call.path], call.module, call.method_name, call.args,
                      call.kwargs, call.path, replay())

  def on_nested(index, module, method_name, a, kw, run):
    del run
    name = f'nested_apply_{index}'  # no spaces: the jaxpr keeps a function name's first word
    spared[segment_function_name(name)] = len(jax.tree.leaves(
        flax.core.unfreeze(module.variables.get('params', {}))))
    with suspended():  # its submodules' paths are its own, not the model's
      return named_call(name, module, method_name, a, kw, (), replay())

  def on_top(index, module, method_name, a, kw, run):
    del run
    name = f'apply_{index}'
    spared[segment_function_name(name)] = len(jax.tree.leaves(
        flax.core.unfreeze(module.variables.get('params', {}))))
    return named_call(name, module, method_name, a, kw, (), replay())

  kw_arrays, kw_of = partition_values(kwargs)

  def traced(params, others, kw_arrays, *args):
    kw = kw_of(kw_arrays)
    with (intercept(select, on_call),
          nested_applies(on_nested, on_top if whole_applies else None)):
      return loss_fn({**others, 'params': params}, *args, **kw)

  params = flax.core.unfreeze(variables['params'])
  others = {c: v for c, v in variables.items() if c != 'params'}
  jaxpr = jax.make_jaxpr(traced)(params, others, kw_arrays, *args)
  return reads_outside(jaxpr, direct_leaf_owners(params, names), spared=spared)


def reads_by_place(loss_fn: Callable[..., Any], variables: Variables, args: tuple,
                   kwargs: dict, owners: set[Path], holders: Collection[Path] = ()
                   ) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
  """Every read outside an owner's calls (:func:`outside_reads`), and those outside every ``apply``.

  A read inside the loss's ``apply`` (a tied embedding passed to another module as an
  argument) is covered by a per-example replay of that ``apply``; one outside it (a
  weight penalty in the loss) is not. The second trace runs only if the first finds reads.
  """
  reads = outside_reads(loss_fn, variables, args, kwargs, owners, holders)
  if not reads:
    return {}, {}
  return reads, outside_reads(loss_fn, variables, args, kwargs, owners, holders,
                              whole_applies=True)
