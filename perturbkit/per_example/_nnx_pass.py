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

Owners no call of theirs can give per-example gradients to (called inside an NNX
transform: ``nnx.scan``, ``nnx.remat``; the root module's own params; params read
outside their module's calls inside the model, an inline tied head; calls inside the
model whose inputs do not hold the examples on axis 0, a position embedding looked
up at ``jnp.arange`` made inside the model) get them from
a per-example replay of the whole model's calls in the loss (``model(x)``), as
Linen's do from the top-level ``apply`` (``_fallback``): the cost of
``jax.vmap(nnx.grad)`` of that call, only for models that have such owners.

Refused, with the error named: an ``nnx.BatchNorm`` in training mode and any mixing
of examples where gradients flow (:class:`ExamplesMixedError`); an owner called
inside an NNX transform outside any model call (:class:`PerExampleError`); params
read outside every model call, a penalty in the loss (:class:`ParamsReadOutsideError`);
an owner never called (:class:`UncoveredParamsError`); calls without per-example
inputs (:class:`SharedCallError`, :class:`AmbiguousInputError`).
"""
import functools
from typing import Any, Callable, NamedTuple

import jax
from flax import nnx

from perturbkit.core._values import is_array, partition_values
from perturbkit.core._dependence import source_kinds
from perturbkit.core._loss import scalar_loss
from perturbkit.core._points import array_part
from perturbkit.core._trees import find_in
from perturbkit.core._types import Path
from perturbkit.core._varying import typed_shape, zeros_like_type
from perturbkit.core.filters import module_path
from perturbkit.errors import (ExamplesMixedError, ParamsReadOutsideError, PerExampleError,
                               RandomApplyReplayError, UncoveredParamsError)
from perturbkit.nnx._calls import Call, NNXPath, instrument, submodules
from perturbkit.nnx._driver import value_and_grad
from perturbkit.nnx._ownership import ownership, owned_state, reads_foreign, unowned_state
from perturbkit.nnx._segments import params_tree, with_values
from perturbkit.per_example._batch import (BatchAxes, count_examples, per_argument,
                                           reduction_scale)
from perturbkit.per_example._kinds import GENERAL
from perturbkit.per_example._calls import (Use, add_to_floats, float_part, merge_static,
                                           static_part)
from perturbkit.per_example._fallback import array_shapes, check_sources, source_error
from perturbkit.per_example._mixing import mixing
from perturbkit.per_example._nnx_kinds import nnx_kind, nnx_mixing_reason, nnx_replay
from perturbkit.per_example._nnx_reads import nnx_outside_reads
from perturbkit.per_example._pass import Layer, Pass
from perturbkit.per_example._reads import Read, read_of
from perturbkit.per_example._replay import Pair


def _array_leaves(tree: Any) -> list[Any]:
  return [leaf for leaf in jax.tree.leaves(tree) if is_array(leaf)]


def _names(path: NNXPath) -> Path:
  return tuple(map(str, path))


def owner_names(model: nnx.Module) -> dict[NNXPath, str]:
  """``{module path: 'layers/0'}`` of every module owning an ``nnx.Param`` directly."""
  return {tuple(path[:-1]): '/'.join(map(str, path[:-1])) or '<root>'
          for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}


class ModelCall(NamedTuple):
  """A call of the whole model in the loss (``model(x)``), as recorded while tracing.

  Attributes:
    method_name: The method called.
    template: ``(args, kwargs)`` with every array replaced by ``None``.
    sources: What each array input is computed from (``Use.sources``).
    outputs: The shapes of its floating-point outputs.
    out_tree: Their tree structure (``float_part`` of the output).
  """
  method_name: str
  template: Any
  sources: tuple[str, ...] = ()
  outputs: tuple[jax.ShapeDtypeStruct, ...] = ()
  out_tree: Any = None


class NNXUses(NamedTuple):
  """What the abstract run found.

  Attributes:
    uses: ``{string path: [Use]}`` of each owner, in execution order (without
      those inside the model calls that cover it).
    paths: ``{string path: NNX path}`` (integer keys of ``nnx.List`` items kept).
    mixed: The error for how the loss mixes examples, when a call also sees them off
      axis 0 (raised after the examples-axis checks, which name the axis problem), else
      ``None``.
    model_calls: The calls of the whole model, when some owners need their replay.
    covered: The owners (string paths) whose per-example gradients come from the
      per-example replay of the model calls (``_per_example_fallback``).
  """
  uses: dict[Path, list[Use]]
  paths: dict[Path, NNXPath]
  mixed: PerExampleError | None
  model_calls: tuple[ModelCall, ...] = ()
  covered: frozenset = frozenset()


def find_nnx_uses(loss_fn: Callable[..., Any], model: nnx.Module, args: tuple, kwargs: dict,
                  batch_axes: BatchAxes = 0, private: bool = False) -> NNXUses:
  """Every outermost call of each param-owning submodule, with what its inputs come from.

  Owners no call of theirs can give per-example gradients to (called inside an
  NNX transform such as ``nnx.scan`` or ``nnx.remat``, the root's own params,
  params read outside their module's calls but inside the model, calls inside the
  model that ``_fallback.source_error`` finds fault with) are covered by
  a per-example replay of the whole model's calls in the loss (``model(x)``), as
  Linen's are by the top-level ``apply``; their uses inside those calls are
  dropped (the replay carries them).

  Raises:
    ExamplesMixedError: an ``nnx.BatchNorm`` in training mode, or the loss mixes examples
      where gradients flow (``_mixing``).
    PerExampleError: an owner is called inside an NNX transform outside any call of
      the whole model.
    ParamsReadOutsideError: params read outside their module's calls and outside the
      model's calls (a penalty in the loss; ``_nnx_reads``).
    UncoveredParamsError: a module owns params but is never called.
  """
  owners = owner_names(model)
  modules = dict(submodules(model))
  owned_by = ownership(model, nnx.Param)
  # Taken from the model as given (plain classes): replays dispatch nothing. A module
  # replays with the params it owns; another module's Variable it holds (tied weights)
  # is a read of that module's params, a constant of the replay.
  plain = {path: (nnx.graphdef(modules[path]), owned_state(modules[path], path, owned_by))
           for path in owners if path in modules}
  # The fast rules give a gradient to every param the layer type has: one held from
  # another module is not this module's to report, so its own are found by replay.
  kinds = {path: GENERAL if reads_foreign(modules[path], path, owned_by)
           else nnx_kind(modules[path]) for path in plain}
  graphdef, template, others = nnx.split(model, nnx.Param, ...)
  uses: dict[Path, list[Use]] = {}
  paths: dict[Path, NNXPath] = {}
  inputs: list[tuple[Path, int, list[Any]]] = []
  active: list[NNXPath] = []
  model_calls: list[ModelCall] = []
  model_inputs: list[list[Any]] = []
  in_model_call: set[tuple[Path, int]] = set()  # the uses made inside a model call
  lifted: set[Path] = set()  # owners called inside an NNX transform in a model call

  def on_model_call(call: Call, run: Callable[[], Any]) -> Any:
    position = len(model_calls)
    model_calls.append(ModelCall(call.method_name, static_part((call.args, call.kwargs))))
    model_inputs.append(_array_leaves((call.args, call.kwargs)))
    active.append(())
    try:
      out = run()
    finally:
      active.pop()
    floats, out_tree = jax.tree.flatten(float_part(out))
    model_calls[position] = model_calls[position]._replace(
        outputs=tuple(map(typed_shape, floats)),
        out_tree=out_tree)
    return out

  def handler(call: Call, run: Callable[[], Any]) -> Any:
    if call.path == ():  # the whole model
      return run() if () in active else on_model_call(call, run)
    reason = nnx_mixing_reason(call.module, call.name, call.args, call.kwargs)
    if reason:
      raise ExamplesMixedError(reason)
    if call.path not in plain or call.path in active:
      return run()
    if call.copied:
      if () in active:  # covered by the model call's replay
        lifted.add(_names(call.path))
        paths[_names(call.path)] = call.path
        return run()
      raise PerExampleError(
          f'The call {call.name} runs inside an NNX transform (nnx.scan, nnx.remat, '
          'nnx.vmap, ...) outside any call of the whole model, where its inputs and '
          "output gradient are values of the transform's own trace; call the model "
          '(model(x)) in the loss, or the param-owning modules directly.')
    name = _names(call.path)
    paths[name] = call.path
    module_graphdef, module_params = plain[call.path]
    uses.setdefault(name, []).append(Use(
        name, call.key, call.method_name, module_graphdef,
        static_part((call.args, call.kwargs)), kind=kinds[call.path],
        replay=nnx_replay(module_graphdef, module_params, call.method_name, call.name)))
    inputs.append((name, len(uses[name]) - 1, _array_leaves((call.args, call.kwargs))))
    if () in active:
      in_model_call.add((name, len(uses[name]) - 1))
    active.append(call.path)
    try:
      return run()
    finally:
      active.pop()

  kw_arrays, kw_of = partition_values(kwargs)

  def traced(params, other_values, kw_arrays, *args):
    kw = kw_of(kw_arrays)
    copy = nnx.merge(graphdef, with_values(template, params),
                     with_values(others, other_values), copy=True)
    with instrument([copy], handler, include_roots=True):
      loss = loss_fn(copy, *args, **kw)
    return ([leaf for _, _, leaves in inputs for leaf in leaves]
            + [leaf for leaves in model_inputs for leaf in leaves]
            + [jax.numpy.asarray(scalar_loss(loss, has_aux_option=False))])

  params, other_values = params_tree(template), params_tree(others)
  jaxpr = jax.make_jaxpr(traced)(params, other_values, kw_arrays, *args).jaxpr
  shared = len(jax.tree.leaves((params, other_values, kw_arrays)))
  example_axes: list[int | None] = [None] * shared
  for arg, axis in zip(args, per_argument(batch_axes, len(args))):
    example_axes += [axis % jax.numpy.ndim(leaf) if axis is not None and is_array(leaf)
                     else None for leaf in jax.tree.leaves(arg)]
  live = [True] * len(jax.tree.leaves(params))
  mixed, misplaced = mixing(jaxpr, example_axes, live + [False] * (len(example_axes) - len(live)),
                            sum(len(leaves) for _, _, leaves in inputs)
                            + sum(len(leaves) for leaves in model_inputs), private)
  if mixed and not misplaced:
    raise mixed
  sources = iter(source_kinds(jaxpr, [axis is not None for axis in example_axes]))
  for name, index, leaves in inputs:
    uses[name][index] = uses[name][index]._replace(sources=tuple(next(sources) for _ in leaves))
  model_calls = [c._replace(sources=tuple(next(sources) for _ in leaves))
                 for c, leaves in zip(model_calls, model_inputs)]
  refused = nnx_outside_reads(loss_fn, model, args, kwargs, owners)
  by_name = {name: _names(path) for path, name in owners.items()}
  num_examples = count_examples(args, batch_axes)
  # Calls inside a model call whose inputs cannot be replayed on their own (a position
  # embedding looked up at `jnp.arange` made inside the model): the model call can.
  misfits = {name for name, index, leaves in inputs if (name, index) in in_model_call
             and source_error(uses[name][index].sources, [x.shape for x in leaves],
                              num_examples, '') is not None}
  wanted = lifted | misfits | {by_name[name] for name in refused}
  covered: frozenset = frozenset()
  if wanted and model_calls:
    outside = nnx_outside_reads(loss_fn, model, args, kwargs, owners,
                                outside_model_calls=True)
    replayable = all(source_error(c.sources, [x.shape for x in leaves], num_examples, '')
                     is None for c, leaves in zip(model_calls, model_inputs))
    if replayable:
      covered = frozenset(wanted - {by_name[name] for name in outside})
      refused = {name: what for name, what in refused.items()
                 if by_name[name] not in covered or name in outside}
      uses = {name: [u for i, u in enumerate(module_uses)
                     if name not in covered or (name, i) not in in_model_call]
              for name, module_uses in uses.items()}
  missing = sorted(owners[path] for path in owners
                   if _names(path) not in uses and _names(path) not in covered
                   and owners[path] not in refused)
  if missing:
    raise UncoveredParamsError(missing, nnx=True)
  if refused:
    raise ParamsReadOutsideError(refused, nnx=True)
  lifted_left = sorted('/'.join(name) for name in lifted - covered)
  if lifted_left:
    raise PerExampleError(
        f'{lifted_left[0]} is called inside an NNX transform (nnx.scan, nnx.remat, '
        'nnx.vmap, ...), where its inputs and output gradient are values of the '
        "transform's own trace, and the model's calls in the loss cannot be replayed "
        'per example instead (their inputs do not hold the examples on axis 0, or its '
        'params are also read outside them).')
  for name in covered:
    paths.setdefault(name, next(p for p in owners if _names(p) == name))
  return NNXUses(uses, paths, mixed if misplaced else None,
                 tuple(model_calls) if covered else (), covered)


def _model_call_reads(loss_fn: Callable[..., Any], model: nnx.Module, args: tuple,
                      kwargs: dict, calls: tuple[ModelCall, ...], num_examples: int,
                      covered: frozenset = frozenset()) -> tuple[jax.Array, list[Read]]:
  """The loss, and each call of the whole model as a :class:`Read` of every param.

  One forward and backward pass of the loss on a copy of the model gives each
  model call's inputs and output gradient; the read's per-example gradients are
  its call replayed per example (``_reads``), the cost of ``jax.vmap(nnx.grad)``.
  ``covered`` (the owners it is replayed for) is named if the replay draws random numbers.
  """
  graphdef, template, others = nnx.split(model, nnx.Param, ...)
  plain_graphdef, other_state = nnx.graphdef(model), nnx.state(model, nnx.Not(nnx.Param))

  def run(deltas):
    copy = nnx.merge(graphdef, template, others, copy=True)
    seen: list[Any] = []
    running = [False]

    def handler(call: Call, go: Callable[[], Any]) -> Any:
      if call.path != () or running[0]:
        return go()
      position = len(seen)
      seen.append(array_part((call.args, call.kwargs)))
      running[0] = True
      try:
        out = go()
      finally:
        running[0] = False
      return add_to_floats(out, jax.tree.unflatten(calls[position].out_tree, deltas[position]))

    with instrument([copy], handler, include_roots=True):
      loss = loss_fn(copy, *args, **kwargs)
    return jax.numpy.asarray(scalar_loss(loss, has_aux_option=False)), seen

  zeros = [[zeros_like_type(s) for s in c.outputs] for c in calls]
  loss, vjp, seen = jax.vjp(run, zeros, has_aux=True)
  (cotangents,) = vjp(jax.numpy.ones_like(loss))
  params = params_tree(template)
  owners = ', '.join(sorted('/'.join(name) or '<root>' for name in covered))
  reads = []
  for position, (call, arrays, cotangent) in enumerate(zip(calls, seen, cotangents)):
    where = f'the model call #{position} ({type(model).__name__}.{call.method_name})'
    call_args, call_kwargs = merge_static(arrays, call.template, where)
    check_sources(call.sources, array_shapes((call_args, call_kwargs)), num_examples, where,
                  nnx=True)
    grad = jax.tree.unflatten(call.out_tree, list(cotangent))
    replayed = f'{where.removeprefix("the ")}, replayed per example for the params of {owners},'
    use = Use((), where, call.method_name, plain_graphdef, call.template, call.sources,
              replay=nnx_replay(plain_graphdef, template, call.method_name, replayed,
                                functools.partial(RandomApplyReplayError, nnx=True)))
    reads.append(read_of(Pair(use, tuple(call_args), dict(call_kwargs), grad, other_state),
                         params, lambda cotangent: cotangent, num_examples))
  return loss, reads


def run_nnx_pass(loss_fn: Callable[..., Any], model: nnx.Module, args: tuple, kwargs: dict, *,
                 reduction: str, batch_axes: BatchAxes, private: bool = False) -> Pass:
  """The loss and every param-owning module's uses, from one forward and backward pass.

  With owners covered by the model's calls (``find_nnx_uses``), one more forward
  and backward pass gives those calls' inputs and output gradients.
  """
  num_examples = count_examples(args, batch_axes)
  scale = reduction_scale(reduction, num_examples)
  found = find_nnx_uses(loss_fn, model, args, kwargs, batch_axes, private)
  called = {found.paths[name] for name, module_uses in found.uses.items() if module_uses}
  selected = lambda module, method_name: module_path(module) in called
  modules = dict(submodules(model))
  # The other variables as they are before the loss runs (it may move RNG counts), and
  # the params of other modules that a module holds.
  owned_by = ownership(model, nnx.Param)
  others = {path: unowned_state(modules[path], path, owned_by) for path in called}
  model_reads: list[Read] = []
  if found.covered:
    loss, model_reads = _model_call_reads(loss_fn, model, args, kwargs, found.model_calls,
                                          num_examples, found.covered)
  grads, inputs = {'perturbations': {}}, {}
  if called or not found.covered:
    loss, grads, inputs = value_and_grad(loss_fn, filter=selected, return_inputs=True,
                                         strict=False)(model, *args, **kwargs)
  params = params_tree(nnx.state(model, nnx.Param))
  layers = []
  for name in list(found.uses) + sorted(found.covered - set(found.uses)):
    module_uses = found.uses.get(name, [])
    path = found.paths[name]
    pairs = []
    for use in module_uses:
      grad = find_in(grads['perturbations'], path + (use.key,))
      if grad is None:
        continue  # no floating-point output: nothing flows back through this call
      where = '/'.join(name + (use.key,))
      call_args, call_kwargs = merge_static(find_in(inputs, path + (use.key,)), use.template,
                                            where)
      check_sources(use.sources, array_shapes((call_args, call_kwargs)), num_examples, where,
                    nnx=True)
      pairs.append(Pair(use, tuple(call_args), dict(call_kwargs), grad, others[path]))
    subtree = find_in(params, name)
    layers.append(Layer(name, pairs, subtree,
                        {k: v for k, v in subtree.items() if not isinstance(v, dict)},
                        tuple(model_reads) if name in found.covered else ()))
  if found.mixed:  # after the pairs: an examples axis in the wrong place is named as such first
    raise found.mixed
  return Pass(loss, num_examples, layers, scale)
