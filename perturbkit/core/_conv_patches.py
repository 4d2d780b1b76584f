"""A convolution's input patches, gathered by strided slices of the padded input.

``patches @ kernel.reshape(-1, features)`` is the convolution (without bias):
row ``t`` of an example holds the input window that output location ``t``
sees, its features in the flattened kernel's ``(*kernel_size, in)`` order.
K-FAC's input factor of a conv and the ghost norms of per-example gradients
are formed from them.

Each kernel offset contributes one strided slice of the padded input; no
arithmetic is done, so the patches are exact in any dtype.
``lax.conv_general_dilated_patches`` gives the same numbers (channel-major) as a
convolution with an identity kernel, which on XLA:CPU took longer than the
layer's own convolution; it is used here only for an input dilation.
"""
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def _pads(x: jax.Array, extent: Sequence[int], strides: Sequence[int], padding: Any
          ) -> list[tuple[int, int]]:
  if isinstance(padding, str):
    return list(jax.lax.padtype_to_pads(x.shape[1:-1], extent, strides, padding))
  return [tuple(p) for p in padding]


def _dilated_patches(x: jax.Array, kernel_size: Sequence[int], strides: Sequence[int],
                     padding: Any, input_dilation: Sequence[int],
                     kernel_dilation: Sequence[int]) -> jax.Array:
  ndim = x.ndim
  channels_last = (0, ndim - 1) + tuple(range(1, ndim - 1))
  numbers = jax.lax.ConvDimensionNumbers(
      channels_last, (ndim - 1, ndim - 2) + tuple(range(ndim - 2)), channels_last)
  patches = jax.lax.conv_general_dilated_patches(
      x, tuple(kernel_size), tuple(strides), padding, lhs_dilation=tuple(input_dilation),
      rhs_dilation=tuple(kernel_dilation), dimension_numbers=numbers,
      precision=jax.lax.Precision.HIGHEST)
  # Channel-major (in, *kernel_size) features, reordered to (*kernel_size, in).
  taps, channels = int(np.prod(kernel_size)), x.shape[-1]
  out = patches.shape[:-1]
  return jax.numpy.swapaxes(patches.reshape(out + (channels, taps)), -1, -2).reshape(
      out + (taps * channels,))


def conv_patches(x: jax.Array, kernel_size: Sequence[int], strides: Sequence[int],
                 padding: Any, input_dilation: Sequence[int],
                 kernel_dilation: Sequence[int]) -> jax.Array:
  """The patches of ``x`` (``(batch, *spatial, in)``), ``(batch, *out_spatial, taps * in)``.

  Args:
    x: The convolution's input, channels last, one batch axis.
    kernel_size, strides, input_dilation, kernel_dilation: One int per spatial axis.
    padding: ``'SAME'``, ``'VALID'`` (as in ``lax.conv_general_dilated``) or one
      ``(low, high)`` pair per spatial axis.
  """
  if any(d != 1 for d in input_dilation):
    return _dilated_patches(x, kernel_size, strides, padding, input_dilation, kernel_dilation)
  extent = [(k - 1) * d + 1 for k, d in zip(kernel_size, kernel_dilation)]
  pads = _pads(x, extent, strides, padding)
  x = jax.lax.pad(x, jax.numpy.zeros((), x.dtype),
                  [(0, 0, 0)] + [(lo, hi, 0) for lo, hi in pads] + [(0, 0, 0)])
  spatial = x.shape[1:-1]
  out = [(n - e) // s + 1 for n, e, s in zip(spatial, extent, strides)]
  taps = []
  for offset in np.ndindex(*kernel_size):
    start = [o * d for o, d in zip(offset, kernel_dilation)]
    limit = [b + (n - 1) * s + 1 for b, n, s in zip(start, out, strides)]
    taps.append(jax.lax.slice(x, [0, *start, 0], [x.shape[0], *limit, x.shape[-1]],
                              [1, *strides, 1]))
  stacked = jax.numpy.stack(taps, axis=-2)
  return stacked.reshape(stacked.shape[:-2] + (len(taps) * x.shape[-1],))
