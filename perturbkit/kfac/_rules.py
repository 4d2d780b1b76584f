"""Curvature rules of the layer kinds K-FAC knows: Dense, Conv, Embed, and LayerNorm/RMSNorm.

Each selected call gives rows ``a`` (the layer's input, as the weight matrix
sees it) and rows ``g`` (the gradient at its output, per example). With ``N``
examples (the batch's, from the model's output: a layer that runs on
``(examples * tokens, d)`` rows, as OPT's feed-forward layers do, has ``N``
examples, not one per row) and ``M`` rows in all:

* ``A = (1/N) Σ_rows ã ãᵀ`` where ``ã = [a, 1]`` when the layer has a bias, so
  that the kernel and the bias form one matrix ``Θ = [W; b]`` of shape
  ``(d_in + 1, d_out)``;
* ``G = (1/M) Σ_rows g gᵀ``.

For a Dense call on ``(N, d_in)`` inputs ``M = N`` and these are ``E[ã ãᵀ]`` and
``E[g gᵀ]``. Extra leading axes (a sequence, the spatial positions of a
convolution, several calls of one module) are treated as locations, as Grosse &
Martens (2016) do for convolutions: ``A`` SUMS over the ``T = M/N`` locations of
an example and ``G`` AVERAGES over them, so ``A ⊗ G`` approximates the Fisher
block ``E[Σ_t Σ_t' (ã_t ã_t'ᵀ) ⊗ (g_t g_t'ᵀ)]`` under their independence
assumptions. A Conv's rows are its input patches (``perturbkit.core._conv_patches``),
in the flattened kernel's ``(*kernel_size, in_features)`` order. An Embed's ``ã`` is a one-hot row, so
``A`` is diagonal: ``A = diag(token counts) / N``. Hugging Face's ``FlaxConv1D``
(GPT-2) is a Dense layer whose kernel is stored ``(d_out, d_in)``: its factors
are a Dense layer's, and its gradient is transposed around the preconditioning.

A LayerNorm's or RMSNorm's scale and bias (over the last axis; Hugging Face's
Llama, Mistral and Gemma RMSNorms and T5's LayerNorm too) get the exact diagonal of their Fisher
block instead, from the same pairs (``perturbkit.kfac._scale_shift``), as
kfac-jax's scale-and-shift blocks do.
"""
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.linear import canonicalize_padding

from perturbkit.core._conv_patches import conv_patches as patches_of
from perturbkit.core._precision import accumulation_dtype_of
from perturbkit.kfac._scale_shift import (NormGeometry, diagonal_factors, diagonal_shapes,
                                          precondition_diagonal)
from perturbkit.linen._hf_modules import hf_rms_norm_epsilon, is_hf_conv1d
from perturbkit.errors import KFACUnsupportedLayerError

KINDS = ('dense', 'conv', 'embed', 'norm')
_HIGHEST = jax.lax.Precision.HIGHEST


class ConvGeometry(NamedTuple):
  """The static attributes of an ``nn.Conv`` that decide its patches."""
  kernel_size: tuple[int, ...]
  strides: tuple[int, ...]
  padding: Any
  input_dilation: tuple[int, ...]
  kernel_dilation: tuple[int, ...]


class LayerInfo(NamedTuple):
  """One K-FAC layer: a module whose calls all have a rule.

  Attributes:
    kind: ``'dense'``, ``'conv'``, ``'embed'`` or ``'norm'`` (LayerNorm, RMSNorm).
    path: The module's path, as in the params tree.
    param: The preconditioned weight: ``'kernel'``, ``'embedding'``, or a norm's
      scale (``'scale'``; ``'weight'`` in Hugging Face's RMSNorms; ``'bias'`` for a
      norm without one).
    kernel_shape: Its shape.
    use_bias: Whether the ``'bias'`` is preconditioned with it (Dense, Conv, a
      norm with a scale).
    calls: The point keys of its calls (``'__call__'``, ``'__call__#1'``, ...).
    conv: The geometry of a Conv, else ``None``.
    transposed: A Dense kernel stored ``(d_out, d_in)`` (Hugging Face's ``FlaxConv1D``).
    norm: How a ``'norm'`` layer normalises, else ``None``.
    iterations: ``0``, or ``L`` for a layer run once per iteration of ``nn.scan``
      (``nn.vmap``, ``nnx.scan``) with its params stacked along axis 0
      (``kernel_shape`` is then ``(L, *one iteration's shape)``): each iteration
      has its own factors, stacked along axis 0 like the params (see
      :func:`one_iteration`).
  """
  kind: str
  path: tuple[str, ...]
  param: str
  kernel_shape: tuple[int, ...]
  use_bias: bool
  calls: tuple[str, ...]
  conv: ConvGeometry | None = None
  transposed: bool = False
  norm: NormGeometry | None = None
  iterations: int = 0


def one_iteration(info: LayerInfo) -> LayerInfo:
  """The layer of one iteration of a stacked layer (``info.iterations > 0``): its
  per-iteration weight shape, to which the rules apply under ``jax.vmap`` over the
  iterations."""
  return info._replace(kernel_shape=info.kernel_shape[1:], iterations=0)


class LayerFactors(NamedTuple):
  """The two Kronecker factors of a layer: ``a`` (``(d, d)``, or ``(vocab,)``, the
  diagonal, for an Embed) and ``g`` (``(d_out, d_out)``). For a ``'norm'`` layer, the
  diagonal Fisher of its first param (``a``) and of its bias (``g``, empty without one)."""
  a: jax.Array
  g: jax.Array


def _is_flax_norm(module: Any) -> bool:
  return type(module) in (nn.LayerNorm, nn.RMSNorm)


def _is_norm(module: Any) -> bool:
  return _is_flax_norm(module) or hf_rms_norm_epsilon(module) is not None


def last_axis_only(axes: Any) -> bool:
  """Whether a norm's ``reduction_axes``/``feature_axes`` name the last axis alone."""
  return axes == -1 or (isinstance(axes, (tuple, list)) and tuple(axes) == (-1,))


def norm_reason(name: str, reduction_axes: Any, feature_axes: Any, axis_name: Any) -> str | None:
  """Why a LayerNorm/RMSNorm has no rule (``None`` when it has one): the rule normalises
  over the last axis of each device's own input."""
  if not (last_axis_only(reduction_axes) and last_axis_only(feature_axes)):
    return (f'a {name} over reduction_axes={reduction_axes!r}, feature_axes={feature_axes!r} '
            'has no rule (only the last axis)')
  if axis_name is not None:
    return f'a {name} averaged over the devices (axis_name={axis_name!r}) has no rule'
  return None


def override_reason(cls: type, bases: tuple[tuple[type, str], ...], submodule: str
                    ) -> str | None:
  """Why a subclass of a layer with a rule does not get it, or ``None`` when it does.

  A rule is the math of the library class's own ``__call__``. A subclass that overrides
  it may compute anything around it (scale the input, add a LoRA adapter's
  ``x @ a @ b``, call ``super().__call__`` twice), so its calls' inputs and output
  gradients are not that layer's ``a`` and ``g``; one that only changes fields or
  adds other methods keeps the rule.

  Args:
    cls: The module's class, as the model defines it.
    bases: ``(class, 'nn.Dense')`` for each library class with a rule.
    submodule: How the fix creates a submodule of that class, with ``{base}`` for its
      name (Linen: under ``nn.compact``; NNX: in ``__init__``).
  """
  for base, base_name in bases:
    if issubclass(cls, base) and cls.__call__ is not base.__call__:
      fix = submodule.format(base=base_name)
      return (f'{cls.__name__} overrides {base_name}.__call__, so its calls need not compute '
              f'{base_name}\'s own math (an input transform, a LoRA adapter and a second '
              'super().__call__ all change the factors) and no K-FAC rule applies to it; to '
              f'precondition its kernel, make the {base_name} a submodule that your module '
              f'calls ({fix}) instead of subclassing it; left as it is, its params go to the '
              'fallback transform')
  return None


_LINEN_BASES = ((nn.Dense, 'nn.Dense'), (nn.Conv, 'nn.Conv'), (nn.Embed, 'nn.Embed'))


# A mask zeroes kernel taps: the layer's output is the patches times the masked kernel, so
# A formed from every tap preconditions the masked entries, whose gradient is exactly zero.
MASKED_CONV = ('a masked Conv (mask=...) has no rule: its factors would cover the kernel '
               'entries the mask zeroes, and its preconditioned update would move them')


def unsupported_reason(module: nn.Module, method_name: str) -> str | None:
  """Why a call has no K-FAC rule, or ``None`` when it has one."""
  name = type(module).__name__
  if not (isinstance(module, (nn.Dense, nn.Conv, nn.Embed)) or is_hf_conv1d(module)
          or _is_norm(module)):
    return f'{name} has no K-FAC rule'
  overridden = linen_override_reason(module)
  if overridden is not None:
    return overridden
  if method_name != '__call__':
    return f'{name}.{method_name} has no K-FAC rule (only __call__)'
  if isinstance(module, nn.Conv) and module.feature_group_count != 1:
    return f'a grouped Conv (feature_group_count={module.feature_group_count}) has no rule'
  if isinstance(module, nn.Conv) and module.mask is not None:
    return MASKED_CONV
  if _is_flax_norm(module):
    return norm_reason(name, module.reduction_axes, module.feature_axes, module.axis_name)
  return None


def linen_override_reason(module: nn.Module) -> str | None:
  """:func:`override_reason` for a Linen module (``nn.Dense``, ``nn.Conv``, ``nn.Embed``)."""
  return override_reason(type(module), _LINEN_BASES,
                         '`{base}(...)(x)` under `nn.compact`, or `self.layer = {base}(...)` '
                         'in `setup`')


def weight_name(module: nn.Module) -> str:
  """The param a supported module's :class:`LayerInfo` is keyed by (``LayerInfo.param``)."""
  if isinstance(module, nn.Embed):
    return 'embedding'
  if hf_rms_norm_epsilon(module) is not None:
    return 'weight'
  if _is_flax_norm(module):
    return flax_norm_weight(module)
  return 'kernel'


def as_tuple(value: Any, n: int) -> tuple[int, ...]:
  if value is None:
    value = 1
  return (value,) * n if isinstance(value, int) else tuple(value)


def hashable(padding: Any) -> Any:
  if isinstance(padding, (str, int)):
    return padding
  return tuple(p if isinstance(p, int) else tuple(p) for p in padding)


def describe(module: nn.Module, kernel_shape: tuple[int, ...], calls: tuple[str, ...]
             ) -> LayerInfo:
  """The :class:`LayerInfo` of a supported module (see :func:`unsupported_reason`)."""
  path = tuple(module.path)
  if isinstance(module, nn.Embed):
    return LayerInfo('embed', path, 'embedding', kernel_shape, False, calls)
  if isinstance(module, nn.Dense):
    return LayerInfo('dense', path, 'kernel', kernel_shape, module.use_bias, calls)
  if is_hf_conv1d(module):
    return LayerInfo('dense', path, 'kernel', kernel_shape, module.use_bias, calls,
                     transposed=True)
  epsilon = hf_rms_norm_epsilon(module)
  if epsilon is not None:
    return LayerInfo('norm', path, 'weight', kernel_shape, False, calls,
                     norm=NormGeometry(epsilon, centered=False))
  if _is_flax_norm(module):
    return flax_norm_layer(module, path, kernel_shape, calls,
                           centered=isinstance(module, nn.LayerNorm))
  size = (module.kernel_size,) if isinstance(module.kernel_size, int) else tuple(
      module.kernel_size)
  geometry = ConvGeometry(size, as_tuple(module.strides, len(size)), hashable(module.padding),
                          as_tuple(module.input_dilation, len(size)),
                          as_tuple(module.kernel_dilation, len(size)))
  return LayerInfo('conv', path, 'kernel', kernel_shape, module.use_bias, calls, geometry)


def flax_norm_weight(module: Any) -> str:
  """The param a Flax LayerNorm/RMSNorm (Linen or NNX) is keyed by: its scale, else its bias."""
  return 'scale' if module.use_scale else 'bias'


def flax_norm_layer(module: Any, path: tuple, shape: tuple[int, ...], calls: tuple[str, ...],
                    centered: bool) -> LayerInfo:
  """The :class:`LayerInfo` of a Flax LayerNorm (``centered``) or RMSNorm, Linen or NNX: both
  APIs name the attributes that decide it alike."""
  param = flax_norm_weight(module)
  use_bias = param == 'scale' and getattr(module, 'use_bias', False)  # RMSNorm has none
  geometry = NormGeometry(float(module.epsilon), centered, bool(module.use_fast_variance))
  return LayerInfo('norm', path, param, shape, use_bias, calls, norm=geometry)


def matrix_shape(info: LayerInfo) -> tuple[int, int]:
  """``(d_in, d_out)`` of a Dense/Conv layer's weight as a matrix (a Conv's rows are its
  flattened kernel's, a ``FlaxConv1D`` kernel is stored transposed)."""
  if info.transposed:
    d_out, d_in = info.kernel_shape
    return d_in, d_out
  return int(np.prod(info.kernel_shape[:-1])), info.kernel_shape[-1]


def factor_shapes(info: LayerInfo) -> LayerFactors:
  """The shapes of the layer's factors (as tuples in a :class:`LayerFactors`); a stacked
  layer's have its iterations in front."""
  if info.iterations:
    return LayerFactors(*((info.iterations,) + shape
                          for shape in factor_shapes(one_iteration(info))))
  if info.kind == 'norm':
    return LayerFactors(*diagonal_shapes(info.kernel_shape, info.use_bias))
  if info.kind == 'embed':
    vocab, features = info.kernel_shape
    return LayerFactors((vocab,), (features, features))
  d_in, d_out = matrix_shape(info)
  rows = d_in + int(info.use_bias)
  return LayerFactors((rows, rows), (d_out, d_out))


def params_dtype(info: LayerInfo, params: dict) -> jnp.dtype:
  """The dtype the factors of a layer with ``params`` (``{leaf: array}``, its leaves) are
  kept in: the accumulation dtype of its weight and bias, float32 for float32, bfloat16
  and float16 params, float64 for float64 ones."""
  return accumulation_dtype_of(params[info.param],
                               *([params['bias']] if info.use_bias else []))


def filled_factors(info: LayerInfo, value: float, dtype: Any) -> LayerFactors:
  """Factors of the layer's shapes (:func:`factor_shapes`) holding ``value``, in ``dtype``."""
  return LayerFactors(*(jnp.full(s, value, dtype) for s in factor_shapes(info)))


def conv_patches(geometry: ConvGeometry, x: jax.Array) -> jax.Array:
  """The input patches of a Conv call, ``(batch, *out_spatial, prod(kernel_size) * in)``.

  ``patches @ kernel.reshape(-1, features)`` is the convolution (without bias):
  the patch features are in the flattened kernel's ``(*kernel_size, in)`` order.
  Padding follows ``nn.Conv`` (``'CIRCULAR'``, ``'REFLECT'`` and ``'CAUSAL'``
  pad the input first); see ``perturbkit.core._conv_patches``.
  """
  size = geometry.kernel_size
  spatial = len(size)
  padding = canonicalize_padding(geometry.padding, spatial)
  if padding in ('CIRCULAR', 'REFLECT'):
    dilated = [(k - 1) * d + 1 for k, d in zip(size, geometry.kernel_dilation)]
    pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in dilated] + [(0, 0)]
    x = jnp.pad(x, pads, mode={'CIRCULAR': 'wrap', 'REFLECT': 'reflect'}[padding])
    padding = 'VALID'
  elif padding == 'CAUSAL':
    x = jnp.pad(x, [(0, 0), (geometry.kernel_dilation[0] * (size[0] - 1), 0), (0, 0)])
    padding = 'VALID'
  return patches_of(x, size, geometry.strides, padding, geometry.input_dilation,
                    geometry.kernel_dilation)


def _examples(x: jax.Array, batch_ndim: int) -> int:
  return x.shape[0] if batch_ndim > 0 else 1


def input_rows(info: LayerInfo, x: jax.Array, dtype: Any) -> tuple[jax.Array, int]:
  """``(rows, N)``: the call's input as weight-matrix rows in ``dtype`` (token ids for an
  Embed) and its number of examples (the size of the first axis)."""
  if info.kind == 'embed':
    return x.reshape(-1), _examples(x, x.ndim)
  if info.kind == 'dense':
    rows = x.reshape(-1, x.shape[-1])
    examples = _examples(x, x.ndim - 1)
  else:
    spatial = len(info.conv.kernel_size)
    batch_ndim = x.ndim - spatial - 1
    examples = _examples(x, batch_ndim)
    flat = x.reshape((-1,) + x.shape[batch_ndim:])
    patches = conv_patches(info.conv, flat)
    rows = patches.reshape(-1, patches.shape[-1])
  rows = rows.astype(dtype)
  if info.use_bias:
    rows = jnp.concatenate([rows, jnp.ones((rows.shape[0], 1), rows.dtype)], axis=1)
  return rows, examples


_INPUT_NAMES = ('inputs', 'x', 'hidden_states')


def call_input(args: tuple, kwargs: dict) -> jax.Array:
  """The array a layer's call received: positional, or by its name (``inputs=`` for
  Dense/Conv/Embed, ``x=`` for Flax's norms, ``hidden_states=`` for Hugging Face's)."""
  if args:
    return args[0]
  for name in _INPUT_NAMES:
    if name in kwargs:
      return kwargs[name]
  raise KFACUnsupportedLayerError(
      f'with the keywords {sorted(kwargs)} and no positional argument',
      f'its input is under none of the names {_INPUT_NAMES} its rule looks for (pass the '
      'input positionally)')


def batch_factors(info: LayerInfo, inputs: list[jax.Array], output_grads: list[jax.Array],
                  examples: int | None = None) -> LayerFactors:
  """The layer's factors on one batch, from every call's input and output gradients.

  Args:
    info: The layer.
    inputs: The input of each call.
    output_grads: For each call, per-example gradients at its output, stacked
      over ``L`` lanes: ``(L, *output_shape)``. ``G`` sums over the lanes (one
      sampled label, or the columns of an exact Fisher root).
    examples: The batch's number of examples ``N`` (default: the first call's
      input's first axis).

  For a stacked layer (``info.iterations``) each input is ``(iterations, *one
  iteration's input)`` and each gradient ``(L, iterations, ...)``, and the
  factors are each iteration's, stacked along axis 0.

  Returns:
    :class:`LayerFactors` ``A``, ``G`` as in the module docstring.
  """
  if info.iterations:
    one = one_iteration(info)
    if examples is None:
      raise ValueError(f'The stacked layer {"/".join(info.path)!r} needs the batch\'s examples.')
    return jax.vmap(lambda xs, gs: batch_factors(one, xs, gs, examples),
                    in_axes=(0, 1))(list(inputs), list(output_grads))
  if info.kind == 'norm':
    return LayerFactors(*diagonal_factors(info.param, info.use_bias, info.norm, inputs,
                                          output_grads, examples))
  # In the model's precision: float32 for a float32, bfloat16 or float16 model, float64
  # for a float64 one.
  dtype = accumulation_dtype_of(*inputs, *output_grads)
  a_sum = g_sum = None
  rows = 0
  for x, g in zip(inputs, output_grads):
    a, n = input_rows(info, x, dtype)
    examples = n if examples is None else examples
    if info.kind == 'embed':
      term = jnp.zeros((info.kernel_shape[0],), dtype).at[a].add(1.0)
    else:
      term = jnp.einsum('mi,mj->ij', a, a, precision=_HIGHEST)
    a_sum = term if a_sum is None else a_sum + term
    g = g.reshape(g.shape[0], -1, g.shape[-1]).astype(dtype)
    rows += g.shape[1]
    term = jnp.einsum('lmi,lmj->ij', g, g, precision=_HIGHEST)
    g_sum = term if g_sum is None else g_sum + term
  return LayerFactors(a_sum / examples, g_sum / rows)


def precondition(info: LayerInfo, grads: dict, inverses: LayerFactors) -> dict:
  """``A⁻¹ [∇W; ∇b] G⁻¹`` for one layer's gradient subtree (``inverses`` damped);
  ``∇θ / (F + λ)`` for a ``'norm'`` layer; each iteration's with its own inverses for a
  stacked layer."""
  if info.iterations:
    one = one_iteration(info)
    return jax.vmap(lambda g, inv: precondition(one, g, inv))(grads, inverses)
  if info.kind == 'norm':
    return precondition_diagonal(info.param, info.use_bias, grads, inverses.a, inverses.g)
  kernel = grads[info.param]
  if info.kind == 'embed':
    product = jnp.matmul(inverses.a[:, None] * kernel, inverses.g, precision=_HIGHEST)
    return {**grads, info.param: product.astype(kernel.dtype)}
  d_in, d_out = matrix_shape(info)
  theta = kernel.T if info.transposed else kernel.reshape(d_in, d_out)
  if info.use_bias:
    theta = jnp.concatenate([theta, grads['bias'][None, :]], axis=0)
  theta = jnp.matmul(jnp.matmul(inverses.a, theta, precision=_HIGHEST), inverses.g,
                     precision=_HIGHEST)
  weight = theta[:d_in].T if info.transposed else theta[:d_in].reshape(kernel.shape)
  out = {**grads, info.param: weight.astype(kernel.dtype)}
  if info.use_bias:
    out['bias'] = theta[-1].astype(grads['bias'].dtype)
  return out
