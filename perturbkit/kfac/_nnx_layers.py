"""Which calls of an NNX model K-FAC preconditions, found by one abstract run.

The NNX counterpart of ``_kfac_layers``: every submodule call of
``predict(model, inputs)`` is recorded (``_nnx_calls.instrument`` under
``nnx.eval_shape``: no FLOPs, the model untouched), and every module that owns
``nnx.Param``s becomes a :class:`LayerInfo` when all its calls have a rule:
``nnx.Linear`` is ``'dense'``, ``nnx.Conv`` ``'conv'``, ``nnx.Embed``
``'embed'``, ``nnx.LayerNorm`` and ``nnx.RMSNorm`` ``'norm'``, with the same
param names (``kernel``/``bias``/``embedding``/``scale``) and the same factors
as their Linen twins (``_rules``); a subclass of ``nnx.Linear``, ``nnx.Conv`` or
``nnx.Embed`` only where it keeps the layer's ``__call__``. Others are listed in
``KFACLayers.skipped`` with the reason.

So is a layer whose params the model also reads outside its own calls (a tied
LM head ``h @ self.embed.embedding[...].T``, a kernel reused by hand, a loss
term on it): its calls' factors would not cover that part of the gradient.
The reads are found as for the interleaved schedule's segments: one more
abstract run in which every call of a layer is replayed as a ``custom_vjp``
function named after it (``_nnx_segments.run_segment``), then
``_consumers.reads_outside`` on the jaxpr. A layer with a call whose input
is not computed from the batch (a position table looked up with ``jnp.arange``
inside the model), whatever its shape, is skipped as in Linen (``_examples``).
"""
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from perturbkit.core._callables import selects
from perturbkit.core import filters as _filters
from perturbkit.core._consumers import reads_outside
from perturbkit.core._loss import check_loss_fn
from perturbkit.core._segment_vjp import FORWARD_ONLY
from perturbkit.errors import KFACUnsupportedLayerError
from perturbkit.kfac._examples import batch_examples, mask_reason, shared_input_reasons
from perturbkit.kfac._layers import (KFACLayers, outside_reason, root_reason, skip_layers,
                                    stacked_iterations)
from perturbkit.kfac._rules import (MASKED_CONV, ConvGeometry, LayerInfo, as_tuple, call_input,
                                    flax_norm_layer, flax_norm_weight, hashable, norm_reason,
                                    override_reason)
from perturbkit.nnx._calls import Call, NNXPath, instrument, own_class, submodules
from perturbkit.nnx._driver import check_module, discover, flat_state
from perturbkit.nnx._ownership import ownership
from perturbkit.nnx._segments import params_tree, run_segment, segment_name, with_values
from perturbkit.core._segment_choice import flat_leaf_owners
from perturbkit.core._types import CallFilter

_IN_TRANSFORM = ('it runs inside an NNX transform (nnx.scan, nnx.vmap) where its gradient '
                 'cannot be read, or without its params and its calls stacked per iteration '
                 'along axis 0 (one transform deep), as K-FAC needs for factors per iteration')


class _Input(nnx.Variable):
  """A layer call's input, recorded inside an NNX transform."""


def call_model(model: nnx.Module, inputs: Any) -> Any:
  """The default ``predict``: ``model(inputs)``."""
  return model(inputs)


def layer_name(path: NNXPath) -> str:
  """``'layers/0'``: the name of a layer in ``KFACLayers.layers`` and in the stats."""
  return '/'.join(map(str, path)) or '<root>'


def _is_norm(module: Any) -> bool:
  return own_class(module) in (nnx.LayerNorm, nnx.RMSNorm)


_NNX_BASES = ((nnx.Linear, 'nnx.Linear'), (nnx.Conv, 'nnx.Conv'), (nnx.Embed, 'nnx.Embed'))


def nnx_override_reason(module: nnx.Module) -> str | None:
  """:func:`override_reason` for an NNX module (``nnx.Linear``, ``nnx.Conv``, ``nnx.Embed``),
  instrumented or not."""
  return override_reason(own_class(module), _NNX_BASES,
                         '`self.layer = {base}(...)` in `__init__`')


def unsupported_reason(call: Call) -> str | None:
  """Why an NNX call has no K-FAC rule, or ``None`` when it has one."""
  module, name = call.module, type(call.module).__name__
  if not isinstance(module, (nnx.Linear, nnx.Conv, nnx.Embed)) and not _is_norm(module):
    return f'{name} has no K-FAC rule'
  overridden = nnx_override_reason(module)
  if overridden is not None:
    return overridden
  if call.method_name != '__call__':
    return f'{name}.{call.method_name} has no K-FAC rule (only __call__)'
  if isinstance(module, nnx.Conv) and module.feature_group_count != 1:
    return f'a grouped Conv (feature_group_count={module.feature_group_count}) has no rule'
  if isinstance(module, nnx.Conv) and module.mask is not None:
    return MASKED_CONV
  if _is_norm(module):
    return norm_reason(name, module.reduction_axes, module.feature_axes, module.axis_name)
  return None


def weight_name(module: nnx.Module) -> str:
  """The param a supported module's :class:`LayerInfo` is keyed by (``LayerInfo.param``)."""
  if isinstance(module, nnx.Embed):
    return 'embedding'
  if _is_norm(module):
    return flax_norm_weight(module)
  return 'kernel'


def transformed_layers(model: nnx.Module, inputs: Any,
                       predict: Callable[[nnx.Module, Any], Any],
                       weights: Mapping[NNXPath, tuple[tuple, tuple]]
                       ) -> tuple[dict[NNXPath, int], set[NNXPath]]:
  """``({layer: iterations}, {layers refused})`` for the layers in ``weights`` (called
  inside NNX transforms; ``(shape as their calls see it, shape as the model holds it)``
  of their weight).

  Inside ``nnx.remat`` and ``nnx.jit`` a call's point has the call's shape, and its
  inputs and gradient come out of the transform: such a layer is in neither result.
  Under ``nnx.scan`` (``nnx.vmap``) over stacked modules every call's point, and the
  weight, are stacked along axis 0 per iteration: the layer gets factors per iteration.
  Any other layer (no point, params broadcast to every iteration, scans nested) is
  refused."""
  if not weights:
    return {}, set()
  names = {layer_name(p) for p in weights}
  found = discover(predict, model, (inputs,), {}, strict=False, scalar=False,
                   points=lambda module, _: _filters.path_string(module) in names)
  counts: dict[NNXPath, set] = {path: set() for path in weights}
  for point in found.points:
    if point.path not in counts:
      continue
    outside = [found.shapes.get(leaf) for leaf in point.leaf_paths()]
    if any(o is None for o in outside):
      counts[point.path].add(None)
      continue
    outside = [tuple(o.shape) for o in outside]
    inside = [tuple(i) for i in point.shapes]
    counts[point.path].add(0 if outside == inside else stacked_iterations(
        inside, outside, *weights[point.path]))
  stacked = {path: found_counts.pop() for path, found_counts in counts.items()
             if len(found_counts) == 1 and None not in found_counts}
  refused = {path for path, found_counts in counts.items() if path not in stacked}
  return {path: count for path, count in stacked.items() if count}, refused


def describe(module: nnx.Module, path: NNXPath, kernel_shape: tuple[int, ...],
             calls: tuple[str, ...]) -> LayerInfo:
  """The :class:`LayerInfo` of a supported NNX module (see :func:`unsupported_reason`)."""
  if isinstance(module, nnx.Embed):
    return LayerInfo('embed', path, 'embedding', kernel_shape, False, calls)
  if isinstance(module, nnx.Linear):
    return LayerInfo('dense', path, 'kernel', kernel_shape, module.use_bias, calls)
  if _is_norm(module):
    return flax_norm_layer(module, path, kernel_shape, calls,
                           centered=isinstance(module, nnx.LayerNorm))
  size = tuple(module.kernel_size)
  geometry = ConvGeometry(size, as_tuple(module.strides, len(size)), hashable(module.padding),
                          as_tuple(module.input_dilation, len(size)),
                          as_tuple(module.kernel_dilation, len(size)))
  return LayerInfo('conv', path, 'kernel', kernel_shape, module.use_bias, calls, geometry)


def _recorded_calls(model: nnx.Module, inputs: Any, predict: Callable[[nnx.Module, Any], Any],
                    user: CallFilter | None) -> list[tuple[Call, bool]]:
  """Every submodule call, and whether ``user`` selects it (asked during the call, while
  the module knows its path, so that path filters work)."""
  calls: list[tuple[Call, bool]] = []

  def record(call: Call, run: Callable[[], Any]) -> Any:
    calls.append((call, user is None or selects(user, call.module, call.method_name)))
    return run()

  def traced(model, inputs):
    with instrument([model], record, transparent=True):
      return predict(model, inputs)

  nnx.eval_shape(traced, model, inputs)
  return calls


def outside_reads(model: nnx.Module, inputs: Any, predict: Callable[[nnx.Module, Any], Any],
                  paths: Mapping[NNXPath, str]) -> dict[str, set[str]]:
  """``{layer name: {primitives}}`` reading a layer's params outside its own calls.

  Args:
    model: The ``nnx.Module`` (left untouched: a copy is traced).
    inputs: An example batch.
    predict: ``(model, inputs) -> output``.
    paths: ``{module path: layer name}`` of the layers to check; every
      ``__call__`` of these modules is one named call (the same name as its
      segment in the interleaved schedule).

  Returns:
    The layers whose params something else reads (another method such as
    ``attend``, an inline ``kernel[...].T``, another module's call), with what
    reads them; a layer absent from the result is used through its calls only.
  """
  if not paths:
    return {}
  graphdef, template, others = nnx.split(model, nnx.Param, ...)

  def traced(params):
    copy = nnx.merge(graphdef, with_values(template, params), others, copy=True)
    owners = ownership(copy, nnx.Param)
    modules = dict(submodules(copy))
    plain = {path: nnx.graphdef(modules[path]) for path in paths if path in modules}

    def on_call(call: Call, run: Callable[[], Any]) -> Any:
      if call.method_name != '__call__' or call.path not in plain:
        return run()
      return run_segment(call, plain[call.path], owners, FORWARD_ONLY, ())

    with instrument([copy], on_call):
      return predict(copy, inputs)

  params = params_tree(template)
  jaxpr = jax.make_jaxpr(traced)(params)
  # Liveness followed into nested jaxprs: nnx.remat hands the module's params back out of
  # its body, which is no read unless the model uses what comes out.
  return reads_outside(jaxpr, flat_leaf_owners(params, [segment_name(p) for p in paths]),
                       spared={})


def shared_inputs(model: nnx.Module, inputs: Any, predict: Callable[[nnx.Module, Any], Any],
                  layers: Mapping[str, LayerInfo]) -> dict[str, str]:
  """``{layer: reason}`` for the layers with a call whose input does not carry the
  examples (``_examples``), from one abstract trace of a copy of the model."""
  names = {info.path: name for name, info in layers.items()}
  stacked = {info.path for info in layers.values() if info.iterations}
  graphdef, template, others = nnx.split(model, nnx.Param, ...)
  norms = {info.path for info in layers.values() if info.kind == 'norm'}
  recorded: list[tuple[str, tuple]] = []
  per_iteration: list[tuple[str, tuple]] = []
  masked: dict[str, str] = {}

  def traced(params, inputs):
    copy = nnx.merge(graphdef, with_values(template, params), others, copy=True)
    captured = []

    def on_call(call: Call, run: Callable[[], Any]) -> Any:
      reason = mask_reason(call.kwargs) if call.path in norms else None
      if call.method_name == '__call__' and reason is not None:
        masked.setdefault(names[call.path], reason)
      if call.method_name == '__call__' and call.path in stacked:
        # Checked by its shape alone (_examples).
        per_iteration.append((names[call.path], tuple(jnp.shape(call_input(call.args,
                                                                           call.kwargs)))))
      elif call.method_name == '__call__' and call.path in names:
        x = call_input(call.args, call.kwargs)
        recorded.append((names[call.path], tuple(jnp.shape(x))))
        if call.copied:
          # Traced inside an NNX transform (nnx.remat): it leaves as the transform's output.
          name = f'input_{len(recorded)}'
          call.module.sow(_Input, name, x, reduce_fn=lambda _, v: v, init_fn=lambda: None)
          x = call.path + (name,)
        captured.append(x)
      return run()

    with instrument([copy], on_call, transparent=True):
      _, sown = nnx.capture(predict, _Input)(copy, inputs)
    flat = flat_state(sown)
    return [flat[x] if isinstance(x, tuple) else x for x in captured]

  params = params_tree(template)
  jaxpr = jax.make_jaxpr(traced)(params, inputs)
  return shared_input_reasons(jaxpr, params, inputs, recorded,
                              {name for name, info in layers.items() if info.kind == 'norm'},
                              per_iteration, masked=masked)


# nnx.state(model, nnx.Param) lists a Variable held by two modules once, under one of them.
_HELD_WEIGHT = ('its {} is the nnx.Variable of another module (tied weights), the one where '
                'nnx.state(model, nnx.Param) lists it: factors of these calls would '
                "precondition that module's param")


def _held(module: nnx.Module, path: NNXPath, params: dict) -> str | None:
  """The name of a param of ``module`` (at ``path``) that the model lists under another
  module's path (a Variable it holds from that module), or ``None``."""
  own = [key[0] for key, _ in nnx.to_flat_state(nnx.state(module, nnx.Param)) if len(key) == 1]
  return next((name for name in own if path + (name,) not in params), None)


def kfac_layers(model: nnx.Module, inputs: Any, *,
                predict: Callable[[nnx.Module, Any], Any] | None = None,
                filter: CallFilter | None = None) -> KFACLayers:
  """The Linear, Conv, Embed and LayerNorm calls of an unmodified NNX model, for K-FAC.

  Runs ``predict(model, inputs)`` abstractly (``nnx.eval_shape``: no FLOPs, the
  model's state unchanged) and records every submodule call, then traces it
  once more to check that each layer's params are read by its own calls only
  (an embedding that an LM head also multiplies by, ``h @ embed.embedding[...].T``
  or ``embed.attend(h)``, is skipped with the reads named).

  Args:
    model: The ``nnx.Module``.
    inputs: An example batch, as ``predict`` takes it.
    predict: ``(model, inputs) -> output`` (default ``model(inputs)``), e.g.
      ``lambda m, x: m(x, train=True)``.
    filter: Which calls to precondition (default: every Linear, Conv, Embed,
      LayerNorm and RMSNorm call, and those of a subclass of ``nnx.Linear``,
      ``nnx.Conv`` or ``nnx.Embed`` that keeps the layer's ``__call__``; see
      ``perturbkit.nnx.filters``). A call it selects that has no rule is an
      error.

  Returns:
    A :class:`perturbkit.KFACLayers` keyed by the module path joined with
    ``/`` (``'layers/0'``); each ``LayerInfo.path`` is the path in
    ``nnx.state(model, nnx.Param)`` (integers for ``nnx.List`` items).

  Raises:
    KFACUnsupportedLayerError: ``filter`` selects a call without a rule on a
      module that owns params, a layer whose params are also read outside
      its calls, or one with a call whose input is not computed from ``inputs``.
    KFACInputsError: the arrays of ``inputs`` have different first axes (pass an
      array every example shares through ``predict`` instead).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Sequential(nnx.Linear(5, 4, rngs=nnx.Rngs(0)), nnx.LayerNorm(4, rngs=nnx.Rngs(0)),
    ...                        nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
    >>> layers = perturbkit.nnx.kfac_layers(model, jnp.ones((3, 5)))
    >>> {name: info.kind for name, info in layers.layers.items()}, layers.skipped
    ({'layers/0': 'dense', 'layers/1': 'norm', 'layers/2': 'dense'}, {})
  """
  check_module(model, 'perturbkit.nnx.kfac_layers')
  batch_examples(inputs, 'perturbkit.nnx.kfac_layers')
  predict = call_model if predict is None else predict
  check_loss_fn(predict, 'perturbkit.nnx.kfac_layers', '(model, inputs) -> output',
                'prediction function', 'predict')
  user = None if filter is None else _filters.as_filter(filter)
  supported: dict[NNXPath, tuple[nnx.Module, list[str]]] = {}
  unsupported: dict[NNXPath, str] = {}
  selected_unsupported: dict[NNXPath, str] = {}
  unselected: set[NNXPath] = set()
  in_transform: set[NNXPath] = set()
  for call, selected in _recorded_calls(model, inputs, predict, user):
    if not selected:
      unselected.add(call.path)
      continue
    reason = unsupported_reason(call)
    if reason is not None:
      unsupported.setdefault(call.path, reason)
      if user is not None:
        selected_unsupported.setdefault(call.path, f'{reason} ({call.method_name})')
      continue
    supported.setdefault(call.path, (call.module, []))[1].append(call.key)
    if call.copied:
      in_transform.add(call.path)
  params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))

  def weight_shapes(path: NNXPath) -> tuple[tuple, tuple]:
    # as the call inside its transform saw the weight, and as the model holds it
    module = supported[path][0]
    param = weight_name(module)
    return (tuple(jnp.shape(getattr(module, param).get_value())),
            tuple(jnp.shape(params[path + (param,)].get_value())))

  iterations, refused = transformed_layers(
      model, inputs, predict, {path: weight_shapes(path) for path in in_transform})
  for path in refused:
    del supported[path]
    unsupported.setdefault(path, _IN_TRANSFORM)
    if user is not None:
      selected_unsupported.setdefault(path, f'{_IN_TRANSFORM} (__call__)')

  owners = sorted({path[:-1] for path in params}, key=lambda p: tuple(map(str, p)))
  layers: dict[str, LayerInfo] = {}
  skipped: dict[str, str] = {}
  for owner in owners:
    name = layer_name(owner)
    if owner in selected_unsupported:
      raise KFACUnsupportedLayerError(
          name, selected_unsupported[owner],
          exclude='`perturbkit.nnx.filters.by_type(nnx.Linear, nnx.Conv, nnx.Embed, '
                  'nnx.LayerNorm, nnx.RMSNorm)`')
    if owner in unsupported:
      skipped[name] = unsupported[owner]
    elif owner in supported and _held(supported[owner][0], owner, params) is not None:
      reason = _HELD_WEIGHT.format(_held(supported[owner][0], owner, params))
      if user is not None:
        raise KFACUnsupportedLayerError(
            name, reason, exclude='`perturbkit.nnx.filters.all_of(your_filter, perturbkit.nnx.'
                                  f'filters.negate(perturbkit.nnx.filters.by_path({name!r})))`')
      skipped[name] = reason
    elif owner in supported:
      module, keys = supported[owner]
      param = weight_name(module)
      shape = tuple(jnp.shape(params[owner + (param,)].get_value()))
      layers[name] = describe(module, owner, shape, tuple(keys))._replace(
          iterations=iterations.get(owner, 0))
    elif owner in unselected:
      skipped[name] = 'not selected by the filter'
    elif not owner:
      skipped[name] = root_reason('nnx.Linear(5, 3, rngs=rngs)',
                                  'nnx.Sequential(nnx.Linear(5, 3, rngs=rngs))')
    else:
      skipped[name] = 'its params are not used through a call of its own'
  reads = outside_reads(model, inputs, predict, {info.path: segment_name(info.path)
                                                 for info in layers.values() if info.path})
  skip_layers(layers, skipped, {name: outside_reason(what) for name, what in reads.items()},
              user is not None, 'perturbkit.nnx.filters')
  skip_layers(layers, skipped, shared_inputs(model, inputs, predict, layers),
              user is not None, 'perturbkit.nnx.filters')
  return KFACLayers(layers, {layer_name(o): skipped[layer_name(o)] for o in owners
                             if layer_name(o) in skipped})
