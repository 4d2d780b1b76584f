"""Grad-CAM: where in the image a convolution's feature maps move the metric.

For a feature map ``A`` of shape ``(batch, height, width, channels)`` and the
metric's gradient ``G`` there, each channel's weight is the spatial mean of
``G``, and the map is ``relu(sum_c w_c A_c)`` per example, optionally resized
to the input's height and width. One forward and one backward pass.
"""
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from perturbkit.core._precision import widened
from perturbkit.core._traced_points import TracedPoints, point_name
from perturbkit.errors import FeatureMapShapeError, InvalidOptionError
from perturbkit.interpret._cache import metric_and_grads
from perturbkit.interpret._points import Tracer, trace


def check_feature_maps(traced: TracedPoints, function: str) -> None:
  """Raises a named error unless every selected call returns one rank-4 floating array.

  Raises:
    FeatureMapShapeError: a call returning anything else.
  """
  for path in traced.paths:
    leaves = traced.shapes[path].leaves
    if len(leaves) != 1 or len(leaves[0].shape) != 4:
      shapes = [tuple(leaf.shape) for leaf in leaves]
      raise FeatureMapShapeError(function, point_name(path),
                                 shapes[0] if len(shapes) == 1 else shapes)


def class_activation_map(feature_map: jax.Array, grad: jax.Array) -> jax.Array:
  """``relu(sum_c mean_hw(grad)_c * feature_map_c)``: ``(batch, height, width)``.

  In at least float32, whatever the model's dtype.

  Example:
    >>> import jax.numpy as jnp
    >>> a = jnp.ones((1, 2, 2, 3))
    >>> g = jnp.array([1.0, -1.0, 2.0]).reshape(1, 1, 1, 3) * jnp.ones((1, 2, 2, 3))
    >>> class_activation_map(a, g).tolist()
    [[[2.0, 2.0], [2.0, 2.0]]]
  """
  weights = jnp.mean(widened(grad), axis=(1, 2))
  return jax.nn.relu(jnp.einsum('bhwc,bc->bhw', widened(feature_map), weights))


def resized(cam: jax.Array, inputs: Any, function: str) -> jax.Array:
  """``cam`` resized (bilinear) to the height and width of image ``inputs``.

  Raises:
    InvalidOptionError: ``inputs`` is not one ``(batch, height, width, channels)`` array.
  """
  if jnp.ndim(inputs) != 4:
    raise InvalidOptionError(
        'upsample', True, f'False in {function} unless the inputs are one '
        f'(batch, height, width, channels) array (they have shape {jnp.shape(inputs)})')
  return jax.image.resize(cam, (cam.shape[0], *jnp.shape(inputs)[1:3]), 'bilinear')


def grad_cam(tracer: Tracer, fn: Callable[..., Any], *, filter: Any, upsample: bool,
             function: str) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
  """The front-end-neutral :func:`perturbkit.grad_cam` (``tracer`` picks the API)."""

  @functools.wraps(fn)
  def cams(model, inputs) -> tuple[jax.Array, dict[str, jax.Array]]:
    traced = trace(tracer, fn, model, (inputs,), {}, filter, function)
    check_feature_maps(traced, function)
    metric, outputs, _, grads = metric_and_grads(traced, (inputs,), {}, function)
    maps = {}
    for path in traced.paths:
      (feature_map,), (grad,) = jax.tree.leaves(outputs[path]), jax.tree.leaves(grads[path])
      cam = class_activation_map(feature_map, grad)
      maps[point_name(path)] = resized(cam, inputs, function) if upsample else cam
    return metric, maps

  return cams
