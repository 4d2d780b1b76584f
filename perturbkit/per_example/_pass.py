"""One forward and one backward pass that yields every param-owning call's (inputs, output gradient).

The loss is run through ``value_and_grad(return_inputs=True)`` with a filter
selecting the calls of modules that own params; each call becomes a
:class:`Pair` with the loss's gradient at its output, which ``Pass.scale``
turns into the gradient of each example's own loss term (``reduction_scale``):
the norms and the weights of a weighted sum are scaled instead of every output
gradient, which would be one more copy of each.
"""
from typing import Any, Callable, NamedTuple

import jax

from perturbkit.linen._driver import value_and_grad
from perturbkit.per_example._batch import BatchAxes, count_examples, reduction_scale
from perturbkit.per_example._calls import (PERTURBATIONS, ReadUse, Use, add_to_floats,
                                           direct_params, find_uses, merge_static,
                                           module_variables)
from perturbkit.per_example._fallback import array_shapes, check_sources
from perturbkit.per_example._linen_kinds import linen_kind, linen_replay
from perturbkit.per_example._nested import nested_applies, nested_others, nested_params
from perturbkit.per_example._reads import READS, Read, read_of
from perturbkit.per_example._replay import Pair
from perturbkit.core._points import array_part
from perturbkit.core._trees import find_in
from perturbkit.core._types import Path, Variables
from perturbkit.core._varying import zeros_like_type
from perturbkit.errors import RandomApplyReplayError


class Layer(NamedTuple):
  """Every use of one param-owning module.

  Attributes:
    path: The module's path.
    pairs: Its uses with their arrays, in execution order.
    params: The module's whole params subtree (children included).
    direct: The params it owns itself, ``{name: array}``.
    reads: The nested applies whose params are computed from its own (a tied head).
  """
  path: Path
  pairs: list[Pair]
  params: Any
  direct: dict[str, jax.Array]
  reads: tuple[Read, ...] = ()


class Pass(NamedTuple):
  """What one pass gives.

  Attributes:
    loss: The loss.
    num_examples: The number of examples.
    layers: Every param-owning module's uses.
    scale: The factor from the loss's gradients in the pairs to each example's
      own term's gradient (``reduction_scale``: the number of examples for a mean).
  """
  loss: jax.Array
  num_examples: int
  layers: list[Layer]
  scale: float = 1.0


def _pair(use: Use, inputs: Any, grads: Any, variables: Variables,
          num_examples: int) -> Pair | None:
  where = '/'.join(use.path + (use.key,))
  grad = find_in(grads, use.path + (use.key,))
  if grad is None:
    return None  # no floating-point output: nothing flows back through this call
  args, kwargs = merge_static(find_in(inputs, use.path + (use.key,)), use.template, where)
  check_sources(use.sources, array_shapes((args, kwargs)), num_examples, where)
  return Pair(use, tuple(args), dict(kwargs), grad, module_variables(variables, use.path))


def _with_reads(loss_fn: Callable[..., Any], reads: list[ReadUse]) -> Callable[..., Any]:
  """The loss with a zero perturbation on each read's outputs, taken from ``params[READS]``.

  A read is a nested ``apply`` or a top-level one (``find_uses``), counted together.

  Returns ``(loss, [(array part of (args, kwargs), params, other collections) by read])``.
  """
  by_index = {r.index: i for i, r in enumerate(reads)}

  def run(variables, *args, **kwargs):
    params = dict(variables['params'])
    deltas = params.pop(READS)
    found: list[Any] = [None] * len(reads)

    def on_nested(index, module, method_name, a, kw, call):
      del method_name
      out = call()
      if index not in by_index:
        return out
      i = by_index[index]
      found[i] = (array_part((a, kw)), nested_params(module), nested_others(module))
      return add_to_floats(out, jax.tree.unflatten(reads[i].out_tree, deltas[i]))

    with nested_applies(on_nested, on_nested):
      loss = loss_fn({**variables, 'params': params}, *args, **kwargs)
    return loss, found

  return run


def _read(read: ReadUse, found: Any, grads: list[Any], num_examples: int,
          pullback: Callable[[Any], Any]) -> Read:
  """One nested or top-level apply as a :class:`Read`: its call's pair and the pullback."""
  arrays, params, others = found
  where = f'apply #{read.index} ({type(read.module).__name__}.{read.method_name})'
  args, kwargs = merge_static(arrays, read.template, where)
  use = Use((), where, read.method_name, read.module, read.template, read.sources,
            kind=linen_kind(read.module),
            replay=linen_replay(read.module, read.method_name, where,
                                random_error=RandomApplyReplayError))
  check_sources(use.sources, array_shapes((args, kwargs)), num_examples, where)
  # The cotangent of the replayed call's floating-point outputs (``call_output``).
  grad = jax.tree.unflatten(read.out_tree, list(grads))
  return read_of(Pair(use, tuple(args), dict(kwargs), grad, others), params, pullback,
                 num_examples)


def _grads_and_inputs(loss_fn: Callable[..., Any], reads: list[ReadUse],
                      uses: dict[Path, list[Use]], variables: Variables, args: tuple,
                      kwargs: dict) -> tuple[Any, Any, Any, Any]:
  """``(loss, what each read saw, gradients, the selected calls' inputs)`` from one pass."""
  selected = lambda module, method_name: bool(uses.get(tuple(module.path)))
  zeros = [[zeros_like_type(s) for s in r.outputs] for r in reads]
  variables = {**variables, 'params': {**variables['params'], READS: zeros}}
  if any(uses.values()):
    (loss, found), grads, inputs = value_and_grad(
        _with_reads(loss_fn, reads), filter=selected, return_inputs=True, strict=False,
        has_aux=True)(variables, *args, **kwargs)
    return loss, found, grads, inputs
  # Every module is called inside lifted transforms: the reads alone give the gradients.
  (loss, found), grads = jax.value_and_grad(
      lambda p: _with_reads(loss_fn, reads)({**variables, 'params': p}, *args, **kwargs),
      has_aux=True)(variables['params'])
  return loss, found, {'params': grads, PERTURBATIONS: {}}, {}


def run_pass(loss_fn: Callable[..., Any], variables: Variables, args: tuple, kwargs: dict, *,
             reduction: str, batch_axes: BatchAxes, private: bool = False) -> Pass:
  """The loss and every param-owning module's uses, from one forward and backward pass.

  ``private`` (DP-SGD) also refuses a loss that combines different examples' data
  (:class:`ExamplesCoupledError`).
  """
  num_examples = count_examples(args, batch_axes)
  scale = reduction_scale(reduction, num_examples)
  uses, reads, mixed, given_params = find_uses(loss_fn, variables, args, kwargs, batch_axes,
                                                private)
  loss, found, grads, inputs = _grads_and_inputs(loss_fn, reads, uses, variables, args,
                                                 kwargs)
  read_grads = grads['params'][READS]
  pulled = []
  if reads:
    given, pullback = jax.vjp(given_params, variables['params'])

    def pull(position, cotangent):
      # The VJP of every read's params at once, zero but for the one at ``position``.
      full = [cotangent if j == position else jax.tree.map(jax.numpy.zeros_like, p)
              for j, p in enumerate(given)]
      return pullback(full)[0]

    pulled = [_read(r, f, g, num_examples, lambda c, i=i: pull(i, c))
              for i, (r, f, g) in enumerate(zip(reads, found, read_grads))]
  layers = []
  for path, module_uses in uses.items():
    pairs = [_pair(u, inputs, grads[PERTURBATIONS], variables, num_examples)
             for u in module_uses]
    pairs = [p for p in pairs if p is not None]
    params = find_in(variables['params'], path)
    layer_reads = tuple(p for p, r in zip(pulled, reads) if path in r.owners)
    layers.append(Layer(path, pairs, params, direct_params(variables['params'], path),
                        layer_reads))
  if mixed:  # after the pairs: an examples axis in the wrong place is named as such first
    raise mixed
  return Pass(loss, num_examples, layers, scale)
