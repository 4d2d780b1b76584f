"""The per-example pass of an NNX loss: every param-owning call's (inputs, output gradient).

The NNX counterpart of ``_calls.find_uses`` and ``_pass.run_pass``, giving the same
:class:`Pass` the rules, the norms and DP-SGD consume. An abstract run of the loss
on a copy of the model, with every submodule call instrumented (``nnx._calls``),
records each outermost call of a module owning ``nnx.Param`` s directly (a
:class:`Use` with its :class:`LayerKind` and replay, ``_nnx_kinds``); the traced
loss says which inputs carry the examples and whether the loss mixes them, as for
Linen. Then ``perturbkit.nnx.value_and_grad(return_inputs=True)`` gives each
call's inputs and output gradient in one backward pass.

Paths are the module paths as strings (``('layers', '0')``), the params nested
dicts with string keys (``_segments.params_tree``), so that the rules and the norms
(``'layers/0'``) read them as they read Linen's.

Refused, with the error named: an ``nnx.BatchNorm`` in training mode and any mixing
of examples where gradients flow (:class:`ExamplesMixedError`); an owner called
inside an NNX transform (``nnx.scan``, ``nnx.remat``, ``nnx.vmap``), whose inputs
live inside the transform (:class:`PerExampleError`); params read outside their
module's calls, the root module's own included (:class:`ParamsReadOutsideError`);
an owner never called (:class:`UncoveredParamsError`); calls without per-example
inputs (:class:`SharedCallError`, :class:`AmbiguousInputError`). There is no replay
of a whole model call for these, as Linen's ``apply`` has.
"""
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from flax import nnx

from perturbkit.core._dependence import source_kinds
from perturbkit.core._loss import scalar_loss
from perturbkit.core._trees import find_in
from perturbkit.core._types import Path
from perturbkit.core.filters import module_path
from perturbkit.errors import (ExamplesMixedError, ParamsReadOutsideError, PerExampleError,
                               UncoveredParamsError)
from perturbkit.nnx._calls import Call, NNXPath, instrument, submodules
from perturbkit.nnx._driver import value_and_grad
from perturbkit.nnx._segments import params_tree, with_values
from perturbkit.per_example._batch import (BatchAxes, count_examples, per_argument,
                                           reduction_scale)
from perturbkit.per_example._calls import Use, merge_static, static_part
from perturbkit.per_example._fallback import check_sources
from perturbkit.per_example._mixing import mixing
from perturbkit.per_example._nnx_kinds import nnx_kind, nnx_mixing_reason, nnx_replay
from perturbkit.per_example._nnx_reads import nnx_outside_reads
from perturbkit.per_example._pass import Layer, Pass
from perturbkit.per_example._replay import Pair


def _is_array(leaf: Any) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray))


def _array_leaves(tree: Any) -> list[Any]:
  return [leaf for leaf in jax.tree.leaves(tree) if _is_array(leaf)]


def _names(path: NNXPath) -> Path:
  return tuple(map(str, path))


def owner_names(model: nnx.Module) -> dict[NNXPath, str]:
  """``{module path: 'layers/0'}`` of every module owning an ``nnx.Param`` directly."""
  return {tuple(path[:-1]): '/'.join(map(str, path[:-1])) or '<root>'
          for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}


class NNXUses(NamedTuple):
  """What the abstract run found.

  Attributes:
    uses: ``{string path: [Use]}`` of each owner, in execution order.
    paths: ``{string path: NNX path}`` (integer keys of ``nnx.List`` items kept).
    mixed: How the loss mixes examples, when a call also sees them off axis 0 (raised
      after the examples-axis checks, which name the axis problem), else ``None``.
  """
  uses: dict[Path, list[Use]]
  paths: dict[Path, NNXPath]
  mixed: str | None


def find_nnx_uses(loss_fn: Callable[..., Any], model: nnx.Module, args: tuple, kwargs: dict,
                  batch_axes: BatchAxes = 0) -> NNXUses:
  """Every outermost call of each param-owning submodule, with what its inputs come from.

  Raises:
    ExamplesMixedError: an ``nnx.BatchNorm`` in training mode, or the loss mixes examples
      where gradients flow (``_mixing``).
    PerExampleError: an owner is called inside an NNX transform.
    ParamsReadOutsideError: params read outside their module's calls (``_nnx_reads``).
    UncoveredParamsError: a module owns params but is never called.
  """
  owners = owner_names(model)
  modules = dict(submodules(model))
  # Taken from the model as given (plain classes): replays dispatch nothing.
  plain = {path: (nnx.graphdef(modules[path]), nnx.state(modules[path], nnx.Param))
           for path in owners if path in modules}
  kinds = {path: nnx_kind(modules[path]) for path in plain}
  graphdef, template, others = nnx.split(model, nnx.Param, ...)
  uses: dict[Path, list[Use]] = {}
  paths: dict[Path, NNXPath] = {}
  inputs: list[tuple[Path, int, list[Any]]] = []
  active: list[NNXPath] = []

  def handler(call: Call, run: Callable[[], Any]) -> Any:
    reason = nnx_mixing_reason(call.module, call.name, call.args, call.kwargs)
    if reason:
      raise ExamplesMixedError(reason)
    if call.path not in plain or call.path in active:
      return run()
    if call.copied:
      raise PerExampleError(
          f'The call {call.name} runs inside an NNX transform (nnx.scan, nnx.remat, '
          'nnx.vmap, ...), where its inputs and output gradient are values of the '
          "transform's own trace; per-example gradients of NNX models need the "
          'param-owning modules called directly (unroll the scan, drop the remat).')
    name = _names(call.path)
    paths[name] = call.path
    module_graphdef, module_params = plain[call.path]
    uses.setdefault(name, []).append(Use(
        name, call.key, call.method_name, module_graphdef,
        static_part((call.args, call.kwargs)), kind=kinds[call.path],
        replay=nnx_replay(module_graphdef, module_params, call.method_name, call.name)))
    inputs.append((name, len(uses[name]) - 1, _array_leaves((call.args, call.kwargs))))
    active.append(call.path)
    try:
      return run()
    finally:
      active.pop()

  kw_leaves, kw_tree = jax.tree.flatten(kwargs)
  kw_arrays = [leaf for leaf in kw_leaves if _is_array(leaf)]

  def traced(params, other_values, kw_arrays, *args):
    given = iter(kw_arrays)
    kw = jax.tree.unflatten(kw_tree, [next(given) if _is_array(leaf) else leaf
                                      for leaf in kw_leaves])
    copy = nnx.merge(graphdef, with_values(template, params),
                     with_values(others, other_values), copy=True)
    with instrument([copy], handler):
      loss = loss_fn(copy, *args, **kw)
    return ([leaf for _, _, leaves in inputs for leaf in leaves]
            + [jax.numpy.asarray(scalar_loss(loss, has_aux_option=False))])

  params, other_values = params_tree(template), params_tree(others)
  jaxpr = jax.make_jaxpr(traced)(params, other_values, kw_arrays, *args).jaxpr
  shared = len(jax.tree.leaves((params, other_values, kw_arrays)))
  example_axes: list[int | None] = [None] * shared
  for arg, axis in zip(args, per_argument(batch_axes, len(args))):
    example_axes += [axis % jax.numpy.ndim(leaf) if axis is not None and _is_array(leaf)
                     else None for leaf in jax.tree.leaves(arg)]
  live = [True] * len(jax.tree.leaves(params))
  mixed, misplaced = mixing(jaxpr, example_axes, live + [False] * (len(example_axes) - len(live)),
                            sum(len(leaves) for _, _, leaves in inputs))
  if mixed and not misplaced:
    raise ExamplesMixedError(mixed)
  sources = iter(source_kinds(jaxpr, [axis is not None for axis in example_axes]))
  for name, index, leaves in inputs:
    uses[name][index] = uses[name][index]._replace(sources=tuple(next(sources) for _ in leaves))
  refused = nnx_outside_reads(loss_fn, model, args, kwargs, owners)
  missing = sorted(owners[path] for path in owners
                   if _names(path) not in uses and owners[path] not in refused)
  if missing:
    raise UncoveredParamsError(missing, nnx=True)
  if refused:
    raise ParamsReadOutsideError(refused, nnx=True)
  return NNXUses(uses, paths, mixed if misplaced else None)


def _shapes(tree: Any) -> list[tuple[int, ...]]:
  return [jax.numpy.shape(x) for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


def run_nnx_pass(loss_fn: Callable[..., Any], model: nnx.Module, args: tuple, kwargs: dict, *,
                 reduction: str, batch_axes: BatchAxes) -> Pass:
  """The loss and every param-owning module's uses, from one forward and backward pass."""
  num_examples = count_examples(args, batch_axes)
  scale = reduction_scale(reduction, num_examples)
  found = find_nnx_uses(loss_fn, model, args, kwargs, batch_axes)
  called = set(found.paths.values())
  selected = lambda module, method_name: module_path(module) in called
  modules = dict(submodules(model))
  # The other variables as they are before the loss runs (it may move RNG counts).
  others = {path: nnx.state(modules[path], nnx.Not(nnx.Param)) for path in called}
  loss, grads, inputs = value_and_grad(loss_fn, filter=selected, return_inputs=True,
                                       strict=False)(model, *args, **kwargs)
  params = params_tree(nnx.state(model, nnx.Param))
  layers = []
  for name, module_uses in found.uses.items():
    path = found.paths[name]
    pairs = []
    for use in module_uses:
      grad = find_in(grads['perturbations'], path + (use.key,))
      if grad is None:
        continue  # no floating-point output: nothing flows back through this call
      where = '/'.join(name + (use.key,))
      call_args, call_kwargs = merge_static(find_in(inputs, path + (use.key,)), use.template,
                                            where)
      check_sources(use.sources, _shapes((call_args, call_kwargs)), num_examples, where)
      grad = jax.tree.map(lambda g: g * jax.numpy.asarray(scale, g.dtype), grad)
      pairs.append(Pair(use, tuple(call_args), dict(call_kwargs), grad, others[path]))
    subtree = find_in(params, name)
    layers.append(Layer(name, pairs, subtree,
                        {k: v for k, v in subtree.items() if not isinstance(v, dict)}))
  if found.mixed:  # after the pairs: an examples axis in the wrong place is named as such first
    raise ExamplesMixedError(found.mixed)
  return Pass(loss, num_examples, layers)
