"""One forward and one backward pass that yields every param-owning call's (inputs, output gradient).

The loss is run through ``value_and_grad(return_inputs=True)`` with a filter
selecting the calls of modules that own params; each call becomes a
:class:`Pair` whose output gradient is scaled to the gradient of its own
example's loss term (see ``reduction_scale``).
"""
from typing import Any, Callable, NamedTuple

import jax

from perturbkit._driver import value_and_grad
from perturbkit._per_example_batch import BatchAxes, count_examples, reduction_scale
from perturbkit._per_example_calls import (PERTURBATIONS, Use, direct_params, find_uses,
                                           merge_static, module_variables)
from perturbkit._per_example_errors import (AmbiguousInputError, ExamplesAxisError,
                                            SharedCallError)
from perturbkit._per_example_replay import Pair
from perturbkit._types import Path, Variables


class Layer(NamedTuple):
  """Every use of one param-owning module.

  Attributes:
    path: The module's path.
    pairs: Its uses with their arrays, in execution order.
    params: The module's whole params subtree (children included).
    direct: The params it owns itself, ``{name: array}``.
  """
  path: Path
  pairs: list[Pair]
  params: Any
  direct: dict[str, jax.Array]


class Pass(NamedTuple):
  """What one pass gives: the loss, the number of examples and every layer."""
  loss: jax.Array
  num_examples: int
  layers: list[Layer]


def _get_in(tree: Any, path: tuple) -> Any:
  for name in path:
    if not isinstance(tree, dict) or name not in tree:
      return None
    tree = tree[name]
  return tree


def check_sources(use: Use, arrays: list[Any], num_examples: int, where: str) -> None:
  """Every per-example input has the examples on axis 0; no input is ambiguous; one is per-example.

  Raises:
    ExamplesAxisError: an input computed from the batch has another axis 0.
    AmbiguousInputError: a constant input has as many rows as there are examples.
    SharedCallError: no input is computed from the batch.
  """
  for index, (array, kind) in enumerate(zip(arrays, use.sources)):
    rows = jax.numpy.shape(array)[:1]
    if kind == 'example' and rows != (num_examples,):
      raise ExamplesAxisError(
          f'input {index} of the call {where} is computed from the batched arguments but has '
          f'shape {jax.numpy.shape(array)}, whose axis 0 is not the {num_examples} examples')
    if kind == 'constant' and rows == (num_examples,):
      raise AmbiguousInputError(where, index, jax.numpy.shape(array))
  if 'example' not in use.sources:
    raise SharedCallError(where)


def _pair(use: Use, inputs: Any, grads: Any, variables: Variables, scale: float,
          num_examples: int) -> Pair | None:
  where = '/'.join(use.path + (use.key,))
  grad = _get_in(grads, use.path + (use.key,))
  if grad is None:
    return None  # no floating-point output: nothing flows back through this call
  args, kwargs = merge_static(_get_in(inputs, use.path + (use.key,)), use.template, where)
  check_sources(use, [x for x in jax.tree.leaves((args, kwargs)) if isinstance(x, jax.Array)],
                num_examples, where)
  grad = jax.tree.map(lambda g: g * jax.numpy.asarray(scale, g.dtype), grad)
  return Pair(use, tuple(args), dict(kwargs), grad, module_variables(variables, use.path))


def run_pass(loss_fn: Callable[..., Any], variables: Variables, args: tuple, kwargs: dict, *,
             reduction: str, batch_axes: BatchAxes) -> Pass:
  """The loss and every param-owning module's uses, from one forward and backward pass."""
  num_examples = count_examples(args, batch_axes)
  scale = reduction_scale(reduction, num_examples)
  uses = find_uses(loss_fn, variables, args, kwargs, batch_axes)
  selected = lambda module, method_name: tuple(module.path) in uses
  loss, grads, inputs = value_and_grad(loss_fn, filter=selected, return_inputs=True,
                                       strict=False)(variables, *args, **kwargs)
  layers = []
  for path, module_uses in uses.items():
    pairs = [_pair(u, inputs, grads[PERTURBATIONS], variables, scale, num_examples)
             for u in module_uses]
    pairs = [p for p in pairs if p is not None]
    params = _get_in(variables['params'], path)
    layers.append(Layer(path, pairs, params, direct_params(variables['params'], path)))
  return Pass(loss, num_examples, layers)
