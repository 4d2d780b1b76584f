"""Whether the layers given to a K-FAC estimator describe the model it runs.

:class:`KFACLayers` normally come from ``kfac_layers`` on the same model and
the same predict function. Layers built by hand, for another model or for
another predict function may name a layer the model no longer has, with
another kernel shape or another number of calls, or a layer whose params the
model also reads outside its calls (a tied head): its factors would then
precondition a gradient they do not describe. The estimators check each new
input signature once, while tracing (one more abstract trace of the model).
"""
from typing import Any

import jax

from perturbkit.errors import (KFACLayerInfoError, KFACLayersTypeError, KFACShapeError,
                               KFACUnsupportedLayerError)
from perturbkit.kfac._examples import grouping_reason, mask_reason
from perturbkit.kfac._layers import KFACLayers, outside_reason
from perturbkit.kfac._rules import KINDS, LayerInfo


def signature(tree: Any) -> tuple:
  """A hashable key of a tree's structure, shapes and dtypes (arrays or tracers)."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((getattr(x, 'shape', None), str(getattr(x, 'dtype', type(x))))
                        for x in leaves)


def abstract(tree: Any) -> Any:
  """The tree with every array replaced by its ``ShapeDtypeStruct``."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
                      if hasattr(x, 'shape') and hasattr(x, 'dtype') else x, tree)


def check_layers_given(layers: Any, function: str) -> None:
  """Raises :class:`KFACLayersTypeError` unless ``layers`` is a :class:`KFACLayers`."""
  if isinstance(layers, KFACLayers):
    return
  fix = ('Pass what kfac_layers returned, `layers`, not its dict `layers.layers`.'
         if isinstance(layers, dict) else
         'Pass `layers = perturbkit.kfac_layers(...)` (perturbkit.nnx.kfac_layers for NNX).')
  raise KFACLayersTypeError(function, 'the KFACLayers that kfac_layers returns',
                            f'{type(layers).__name__}', fix)


def check_layer_given(layer: Any, function: str) -> None:
  """Raises :class:`KFACLayersTypeError` unless ``layer`` is one :class:`LayerInfo`."""
  if isinstance(layer, LayerInfo):
    return
  fix = ('Pass one layer of it, `layers.layers[name]`, to each segment\'s optimizer.'
         if isinstance(layer, KFACLayers) else
         'Pass one layer of kfac_layers\' result, `layers.layers[name]`.')
  raise KFACLayersTypeError(function, 'one LayerInfo (the segment\'s layer)',
                            f'{type(layer).__name__}', fix)


def check_layer_info(name: str, info: LayerInfo) -> None:
  """Raises :class:`KFACLayerInfoError` where a (hand-built) ``LayerInfo`` lacks what its
  rule needs: a known ``kind``, a Conv's geometry, a norm's geometry (a norm with a scale)."""
  if info.kind not in KINDS:
    raise KFACLayerInfoError(name, f'LayerInfo.kind is {info.kind!r}, not one of {KINDS}')
  if info.kind == 'conv' and info.conv is None:
    raise KFACLayerInfoError(name, "a 'conv' LayerInfo needs LayerInfo.conv, the "
                                   "convolution's geometry (strides, padding, dilation)")
  if info.kind == 'norm' and info.param != 'bias' and info.norm is None:
    raise KFACLayerInfoError(name, "a 'norm' LayerInfo with a scale needs LayerInfo.norm, how "
                                   'the layer normalises (LayerNorm or RMSNorm, its epsilon)')


def check_kernel_shapes(layers: KFACLayers, shapes: dict[str, tuple | None]) -> None:
  """Raises :class:`KFACShapeError` where a layer's weight is missing or has another shape.

  ``shapes`` maps each layer name to its weight's shape in the model, or ``None``.
  """
  for name, info in layers.layers.items():
    shape = shapes.get(name)
    if shape is None:
      raise KFACShapeError(name, f'the model has no {info.param!r} param at this path')
    if tuple(shape) != tuple(info.kernel_shape):
      raise KFACShapeError(name, f'its {info.param!r} has shape {tuple(shape)} in the model, '
                                 f'{tuple(info.kernel_shape)} in the layers')


def check_calls(name: str, expected: tuple[str, ...], made: Any) -> None:
  """Raises :class:`KFACShapeError` unless the model made exactly the layer's recorded calls."""
  made = () if made is None else tuple(k for k in made if k.startswith('__call__'))
  if tuple(sorted(made)) != tuple(sorted(expected)):
    raise KFACShapeError(name, f'the model calls it as {list(made)}, the layers record '
                               f'{list(expected)} (a call left out would be missing from the '
                               'factors)')


def refuse_outside_reads(reads: dict[str, set[str]], builder: str) -> None:
  """Raises :class:`KFACUnsupportedLayerError` for a layer whose params are read outside its
  calls; ``builder`` names the ``kfac_layers`` that would have skipped it."""
  for name, what in sorted(reads.items()):
    raise KFACUnsupportedLayerError(
        name, outside_reason(what),
        exclude=f'by building the layers with `{builder}` on this model and predict '
                'function, which leaves such a layer to the fallback')


def refuse_override(name: str, reason: str | None, builder: str) -> None:
  """Raises :class:`KFACUnsupportedLayerError` for a layer whose class overrides the library
  layer's ``__call__`` (``reason`` from ``_rules.override_reason``; ``None`` passes);
  ``builder`` names the ``kfac_layers`` that would have skipped it."""
  if reason is not None:
    raise KFACUnsupportedLayerError(
        name, reason, exclude=f'by building the layers with `{builder}` on this model, which '
                              'leaves such a layer to the fallback')


def check_norm_call(name: str, kwargs: dict, shape: tuple[int, ...], examples: int) -> None:
  """Raises :class:`KFACUnsupportedLayerError` for a LayerNorm/RMSNorm call its rule does not
  cover: called with a ``mask`` (the rule normalises over every feature), or on an input of
  ``shape`` without the batch's ``examples`` on its first axis (``kfac_layers`` skips such a
  layer; layers built by hand or for another model may not)."""
  exclude = 'by leaving it out of the filter given to kfac_layers'
  reason = mask_reason(kwargs) or grouping_reason(shape, examples)
  if reason is not None:
    raise KFACUnsupportedLayerError(name, reason, exclude)
