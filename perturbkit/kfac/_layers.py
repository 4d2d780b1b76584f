"""Which calls of a model K-FAC preconditions, found by one abstract run.

A K-FAC layer is a module that owns params and whose every call has a
curvature rule (``_rules``: Dense, Conv, Embed, Hugging Face's ``FlaxConv1D``,
LayerNorm and RMSNorm). A module that owns params but has no rule (BatchNorm, a
grouped or masked Conv, ``Embed.attend``, a subclass of a layer that overrides its ``__call__``, a layer inside a lifted transform that does not
stack its params and its calls per iteration, the root's own ``self.param``) is
listed in ``KFACLayers.skipped`` with the reason; its params go to the fallback
transform. A layer of blocks stacked in ``nn.scan`` (params and points stacked
along axis 0) is one layer with ``iterations`` set: factors per iteration.
So is a Dense/Conv/Embed whose params the model also reads outside its calls
(a tied LM head on the transposed embedding): its calls' factors would not
cover that part of the gradient (``_reads``); and one with a call whose input
is not computed from the batch (a position table the model looks up with
``jnp.arange``): the gradient at it may be summed over the examples, whatever
the input's shape (``_examples``).
"""
from typing import Any, Callable, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from perturbkit.core._boxes import plain
from perturbkit.core._callables import selects
from perturbkit.core import filters as _filters
from perturbkit.core._iterations import leaf_shapes_of
from perturbkit.core._loss import check_loss_fn
from perturbkit.core._points import stacked_axis, with_stacked_axis
from perturbkit.core._trees import find_in
from perturbkit.linen._driver import check_variables, discover, value_and_grad
from perturbkit.linen._interceptor import suspended
from perturbkit.errors import KFACUnsupportedLayerError
from perturbkit.kfac._examples import batch_examples, mask_reason, shared_input_reasons
from perturbkit.kfac._reads import outside_reads
from perturbkit.kfac._rules import (LayerInfo, call_input, describe, unsupported_reason,
                                    weight_name)
from perturbkit.core._types import CallFilter, Variables

_LIFTED = ('it runs once per iteration of a lifted transform (nn.scan, nn.vmap), where K-FAC '
           'needs its params and its calls stacked per iteration along axis 0 (variable_axes '
           '{"params": 0, "perturbations": 0}, one transform deep), and they are not')
_UNREACHED = ('its calls run inside a lifted transform that does not map the "perturbations" '
              'collection (nn.scan, nn.vmap without it in variable_axes) or inside '
              'nn.map_variables (nn.WeightNorm, nn.SpectralNorm: the layer sees its weights '
              'normalized, not its params), so their gradients cannot be read')


def root_reason(layer: str, wrapped: str) -> str:
  """Why the root module's own params have no factors; ``layer`` is a one-layer model in the
  front end's words (``'nn.Dense(3)'``) and ``wrapped`` the same wrapped in a module."""
  return ('they are the root module\'s own params (a model that is one layer, such as '
          f'`{layer}`, or a param of the top module itself), and K-FAC finds its layers among '
          'the calls of submodules; to precondition a one-layer model, wrap it in a module, '
          f'e.g. `{wrapped}`')


def outside_reason(what: set[str]) -> str:
  return ('its params are also read outside its calls (by ' + ', '.join(sorted(what)) +
          '), e.g. tied weights such as an LM head on the transposed embedding: K-FAC '
          'has no factors for that part of their gradient')


def stacked_iterations(inside: list[tuple], outside: list[tuple], weight_inside: tuple,
                       weight: tuple | None) -> int | None:
  """``L`` where a call's point leaves (shapes ``inside`` its transform, ``outside`` it)
  and the layer's weight (as its call sees it, as the params hold it) are all stacked
  along one leading axis of ``L`` iterations (``nn.scan`` over layers with
  ``variable_axes={'params': 0, 'perturbations': 0}``); else ``None`` (params
  broadcast to every iteration, another axis, scans nested)."""
  if not inside or weight is None:
    return None
  stacking = stacked_axis(inside[0], outside[0])
  if stacking is None or stacking[0] != 0 or len(stacking[1]) != 1:
    return None
  if with_stacked_axis(inside, stacking) != outside or tuple(weight) != stacking[1] + weight_inside:
    return None
  return stacking[1][0]


def skip_layers(layers: dict, skipped: dict, reasons: dict[str, str], user_filter: bool,
                filters: str) -> None:
  """Moves the layers in ``reasons`` from ``layers`` to ``skipped``, with their reasons.

  With a filter of the user's (``user_filter``) such a layer was asked for by
  name or kind, so it is refused instead, with the exclusion written in the
  ``filters`` module the user's front end has (``'perturbkit.filters'`` or
  ``'perturbkit.nnx.filters'``).
  """
  for name, reason in reasons.items():
    if user_filter:
      raise KFACUnsupportedLayerError(
          name, reason, exclude=f'`{filters}.all_of(your_filter, {filters}.negate('
                                f'{filters}.by_path({name!r})))`')
    del layers[name]
    skipped[name] = reason


class KFACLayers(NamedTuple):
  """The layers K-FAC preconditions and the param owners it leaves out.

  Attributes:
    layers: ``{'Dense_0': LayerInfo, 'Block_0/Conv_1': LayerInfo, ...}``, keyed
      by the module path joined with ``/``.
    skipped: ``{path: reason}`` for every other module that owns params.
  """
  layers: dict[str, LayerInfo]
  skipped: dict[str, str]


def _float_sum(tree: Any) -> jax.Array:
  leaves = [jnp.sum(leaf) for leaf in jax.tree.leaves(tree)
            if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
  return sum(leaves, jnp.zeros((), jnp.float32))


def kfac_layers(predict_fn: Callable[[Variables, Any], Any], variables: Variables,
                inputs: Any, *, filter: CallFilter | None = None) -> KFACLayers:
  """The Dense, Conv, Embed and LayerNorm calls of an unmodified model, for K-FAC.

  For the conventions (the loss, skipped layers, amortised statistics, per-segment
  K-FAC, how the factors relate to kfac-jax's) see ``help(perturbkit.kfac)``.

  Runs ``predict_fn`` abstractly (``jax.eval_shape``: no FLOPs) and records
  every submodule call, then traces it twice more: to check that each layer's
  params are read by its own calls only (a tied embedding that an LM head
  also multiplies by is skipped, with the reads named), and that each call's
  input is computed from ``inputs`` (a position table looked up with positions
  the model builds itself is skipped, whatever their shape: pass the positions
  in ``inputs`` to have it preconditioned).

  Args:
    predict_fn: ``(variables, inputs) -> output``, e.g.
      ``lambda v, x: model.apply(v, x)``.
    variables: The model variables (``'params'`` and any other collection).
    inputs: An example batch, as ``predict_fn`` takes it.
    filter: Which calls to precondition (default: every call with a rule:
      Dense, Conv, Embed, Hugging Face's ``FlaxConv1D``, LayerNorm and RMSNorm
      over the last axis; a subclass of ``nn.Dense``, ``nn.Conv`` or ``nn.Embed``
      only where it keeps the layer's ``__call__``). A call it selects that has
      no rule is an error.

  Returns:
    A :class:`KFACLayers`.

  Raises:
    KFACUnsupportedLayerError: ``filter`` selects a call without a rule on a
      module that owns params, a layer whose params are also read outside
      its calls, or one with a call whose input is not computed from ``inputs``.
    KFACInputsError: the arrays of ``inputs`` have different first axes (pass an
      array every example shares through ``predict_fn`` instead).
    NotVariablesError: ``variables`` is not the variables dict (e.g.
      ``variables['params']``).
    WrongFrontEndError: ``variables`` is an NNX model (use
      ``perturbkit.nnx.kfac_layers``).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Dense(4), nn.LayerNorm(), nn.Dense(2)])
    >>> x = jnp.ones((3, 5))
    >>> variables = model.init(jax.random.key(0), x)
    >>> layers = perturbkit.kfac_layers(lambda v, x: model.apply(v, x), variables, x)
    >>> {name: info.kind for name, info in layers.layers.items()}, layers.skipped
    ({'layers_0': 'dense', 'layers_1': 'norm', 'layers_2': 'dense'}, {})
  """
  check_loss_fn(predict_fn, 'perturbkit.kfac_layers', '(variables, inputs) -> output',
                'prediction function', 'predict_fn')
  check_variables(variables, 'perturbkit.kfac_layers')
  variables = plain(variables)
  batch_examples(inputs, 'perturbkit.kfac_layers')
  user = None if filter is None else _filters.as_filter(filter)
  supported: dict[tuple, nn.Module] = {}
  unsupported: dict[tuple, str] = {}
  selected_unsupported: dict[tuple, str] = {}
  unselected: set[tuple] = set()
  weights_inside: dict[tuple, tuple] = {}  # a supported module's weight shape as it sees it

  def recorder(module: nn.Module, method_name: str) -> bool:
    path = tuple(module.path)
    if user is not None and not selects(user, module, method_name):
      unselected.add(path)
      return False
    reason = unsupported_reason(module, method_name)
    if reason is not None:
      unsupported.setdefault(path, reason)
      if user is not None:
        selected_unsupported.setdefault(path, f'{reason} ({method_name})')
      return False
    supported[path] = module
    weights_inside[path] = tuple(jnp.shape(module.get_variable('params', weight_name(module))))
    return True

  loss_fn = lambda v, x: _float_sum(predict_fn(v, x))
  lifted: set[tuple] = set()
  inside: dict[tuple, Any] = {}
  with suspended():
    points, _ = discover(loss_fn, variables, (inputs,), {}, filter=recorder, strict=False,
                         unreachable=[], lifted=lifted, inside=inside)
  flat = traverse_util.flatten_dict(flax.core.unfreeze(variables['params']))
  owners = sorted({key[:-1] for key in flat})
  iterations: dict[tuple, int] = {}
  for path in lifted:
    # Inside nn.remat and nn.jit (a Hugging Face model with gradient checkpointing) a call
    # is the call it would be outside, and its inputs and gradient come out; nn.scan and
    # nn.vmap run it once per iteration, with a point stacked per iteration.
    if leaf_shapes_of(inside[path]) == leaf_shapes_of(points[path]):
      continue
    owner = path[:-1]
    module = supported.get(owner)
    count = None if module is None else stacked_iterations(
        leaf_shapes_of(inside[path]), leaf_shapes_of(points[path]), weights_inside[owner],
        getattr(flat.get(owner + (weight_name(module),)), 'shape', None))
    if count is None or iterations.setdefault(owner, count) != count:
      unsupported.setdefault(owner, _LIFTED)
      if user is not None:
        selected_unsupported.setdefault(owner, f'{_LIFTED} ({path[-1]})')
      supported.pop(owner, None)

  layers: dict[str, LayerInfo] = {}
  skipped: dict[str, str] = {}
  for owner in owners:
    name = '/'.join(owner) or '<root>'
    if owner in selected_unsupported:
      raise KFACUnsupportedLayerError(name, selected_unsupported[owner])
    if owner in unsupported:
      skipped[name] = unsupported[owner]
    elif owner in supported:
      module = supported[owner]
      param = weight_name(module)
      calls = tuple(p[-1] for p in points if p[:-1] == owner and p[-1].startswith('__call__'))
      if not calls:
        if user is not None:
          raise KFACUnsupportedLayerError(name, _UNREACHED)
        skipped[name] = _UNREACHED
        continue
      layers[name] = describe(module, tuple(flat[owner + (param,)].shape), calls)._replace(
          iterations=iterations.get(owner, 0))
    elif owner in unselected:
      skipped[name] = 'not selected by the filter'
    elif not owner:
      skipped[name] = root_reason('nn.Dense(3)', 'nn.Sequential([nn.Dense(3)])')
    else:
      skipped[name] = 'its params are not used through a call of its own'
  reads = outside_reads(predict_fn, variables, inputs,
                        {info.path: name for name, info in layers.items() if info.path})
  skip_layers(layers, skipped, {name: outside_reason(what) for name, what in reads.items()},
              user is not None, 'perturbkit.filters')
  skip_layers(layers, skipped, _shared_inputs(predict_fn, variables, inputs, layers),
              user is not None, 'perturbkit.filters')
  return KFACLayers(layers, dict(sorted(skipped.items())))


def _shared_inputs(predict_fn: Callable[[Variables, Any], Any], variables: Variables,
                   inputs: Any, layers: dict[str, LayerInfo]) -> dict[str, str]:
  """``{layer: reason}`` for the layers with a call whose input is not computed from the
  batch (``_examples``), from one abstract trace.

  The calls' inputs are taken as the estimator takes them (``value_and_grad`` with
  ``return_inputs``): a call inside ``nn.remat``, ``nn.jit`` or ``nn.scan`` hands its
  input out of the transform through a collection, so the jaxpr follows what it is
  computed from there too. A stacked layer's input has the iterations in front; its
  rule sees one iteration's.
  """
  if not layers:
    return {}
  names = {info.path: name for name, info in layers.items()}
  select = lambda module, method_name: (method_name == '__call__'
                                        and tuple(module.path) in names)
  grad_fn = value_and_grad(lambda v, x: _float_sum(predict_fn(v, x)), filter=select,
                           return_inputs=True)
  recorded: list[tuple[str, tuple]] = []
  masked: dict[str, str] = {}

  def traced(variables, inputs):
    _, _, captured = grad_fn(variables, inputs)
    recorded.clear()
    calls_inputs = []
    for name, info in layers.items():
      calls = find_in(captured, info.path)
      for call in info.calls:
        reason = mask_reason(calls[call][1]) if info.kind == 'norm' else None
        if reason is not None:
          masked.setdefault(name, reason)
        x = call_input(*calls[call])
        recorded.append((name, tuple(jnp.shape(x))[bool(info.iterations):]))
        calls_inputs.append(x)
    return calls_inputs

  jaxpr = jax.make_jaxpr(traced)(variables, inputs)
  return shared_input_reasons(jaxpr, variables, inputs, recorded,
                              {name for name, info in layers.items() if info.kind == 'norm'},
                              stacked={name for name, info in layers.items() if info.iterations},
                              masked=masked)
