"""Grad-CAM: where in the image a convolution's feature maps move the metric.

For a feature map ``A`` of shape ``(batch, height, width, channels)`` and the
metric's gradient ``G`` there, each channel's weight is the spatial mean of
``G``, and the map is ``relu(sum_c w_c A_c)`` per example, optionally resized
to the images' height and width (axes 1 and 2 of channels-last images) or a given size. One forward and one backward pass.
"""
import functools
import operator
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from perturbkit.core._precision import widened
from perturbkit.core._traced_points import TracedPoints, point_name
from perturbkit.errors import FeatureMapShapeError, ImageLayoutError, InvalidOptionError
from perturbkit.interpret._cache import metric_and_grads
from perturbkit.interpret._compiled import compiled_when_eager
from perturbkit.interpret._points import Tracer, check_given, trace


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


def checked_upsample(upsample: Any) -> bool | tuple[int, int]:
  """``upsample`` checked where it is given: a bool or a ``(height, width)`` of positive ints.

  Raises:
    InvalidOptionError: anything else.
  """
  if isinstance(upsample, (bool, np.bool_)):
    return bool(upsample)
  try:
    size = tuple(operator.index(n) for n in upsample if not isinstance(n, (bool, np.bool_)))
  except TypeError:
    size = ()
  if len(size) != 2 or len(upsample) != 2 or min(size) < 1:
    raise InvalidOptionError('upsample', upsample, 'True (resize each map to the height and '
                             'width of (batch, height, width, channels) images), False, or '
                             'the (height, width) to resize to')
  return size


def resized(cam: jax.Array, inputs: Any, upsample: bool | tuple[int, int], where: str,
            function: str) -> jax.Array:
  """``cam`` resized (bilinear) to ``upsample``'s size, or (``True``) that of image ``inputs``.

  Raises:
    InvalidOptionError: ``upsample=True`` and ``inputs`` is not one ``(batch,
      height, width, channels)`` array.
    ImageLayoutError: ``upsample=True`` and the map is larger than the
      inputs' axes 1 and 2: those axes are not the images' height and width
      (channels-first pixel values).
  """
  if upsample is True:
    if not isinstance(inputs, (jax.Array, np.ndarray)) or inputs.ndim != 4:
      given = (f'shape {inputs.shape}' if isinstance(inputs, (jax.Array, np.ndarray)) else
               f'the structure {jax.tree.map(jnp.shape, inputs)}')
      raise InvalidOptionError(
          'upsample', True, f'False or a (height, width) in {function} unless the inputs are '
          f'one (batch, height, width, channels) array (they have {given})')
    (height, width), (rows, columns) = jnp.shape(inputs)[1:3], cam.shape[1:]
    # A convolution's map is no larger than the image it comes from (strides and pooling only
    # shrink it); axes 1 and 2 of channels-first pixels are (channels, height), and the
    # channels (1, 3 or 4) are fewer than the rows of almost any map. The ratio of the two
    # axes is no test: strides may differ per axis (spectrograms).
    if rows > height or columns > width:
      raise ImageLayoutError(function, where, jnp.shape(inputs), cam.shape[1:])
    upsample = (height, width)
  return jax.image.resize(cam, (cam.shape[0], *upsample), 'bilinear')


def grad_cam(tracer: Tracer, fn: Callable[..., Any], *, filter: Any,
             upsample: bool | tuple[int, int],
             function: str) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
  """The front-end-neutral :func:`perturbkit.grad_cam` (``tracer`` picks the API)."""
  check_given(fn, filter, function)
  upsample = checked_upsample(upsample)

  @functools.wraps(fn)
  def cams(model, inputs) -> tuple[jax.Array, dict[str, jax.Array]]:
    traced = trace(tracer, fn, model, (inputs,), {}, filter, function)
    check_feature_maps(traced, function)
    metric, outputs, _, grads = metric_and_grads(traced, (inputs,), {}, function)
    maps = {}
    for path in traced.paths:
      (feature_map,), (grad,) = jax.tree.leaves(outputs[path]), jax.tree.leaves(grads[path])
      cam = class_activation_map(feature_map, grad)
      maps[point_name(path)] = (resized(cam, inputs, upsample, point_name(path), function)
                                if upsample else cam)
    return metric, maps

  return compiled_when_eager(cams)
