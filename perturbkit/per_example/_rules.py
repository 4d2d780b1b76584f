"""Squared per-example gradient norms of one module's own params, from its uses.

Each rule takes every use of one module (a shared module has several) and
returns ``{param name: (examples,) squared norms}``. The per-example gradient of
a shared module is the sum over its uses, so the rules never add norms of uses:

* ``dense``: a Dense call on inputs with any leading axes is a sum over tokens
  ``t`` of ``a_t g_tᵀ``. The uses are concatenated along the token axis, so the
  ghost norm ``sum_{t,s} (a_t·a_s)(g_t·g_s)`` includes the cross terms between
  uses. Ghost (``T²`` per example) or the direct per-example outer product
  (``d_in·d_out`` per example) is chosen by size, as book-keeping does: ghost when
  ``2T² < d_in·d_out``.
* ``conv``: a convolution is a Dense layer on its patches
  (``perturbkit.core._conv_patches``), one token per output position: the ghost norm
  runs on the patches; the direct per-example kernel gradient is formed offset by
  offset (``conv_kernel_blocks``), which never forms the patches.
* ``embed``: row ``v`` of an example's embedding gradient is the sum of ``g_t``
  over its tokens with id ``v``: ``sum_{t,s} [id_t = id_s] (g_t·g_s)``. An output
  head tied to the embedding (``embed.attend(h)``, or a Dense layer given the
  embedding's transpose: ``logits = h @ embeddingᵀ``) adds ``Gᵀ H`` to it, whose
  ghost norm is that of a Dense layer (``T²`` per example instead of
  ``vocabulary × features``), plus the cross term
  ``2 sum_{t,s} G[s, id_t] (g_t·h_s)`` between the lookups and the head.
* ``norm``: LayerNorm/RMSNorm scale and bias gradients (``sum_t g_t ⊙ x̂_t`` and
  ``sum_t g_t``) are formed per example directly; they are small.
* ``general``: anything else: each use's call replayed per example (a vmap of its
  own VJP), the uses' per-example gradients summed, then the norm.

Where a rule forms per-example gradients (the general path, direct Conv kernels,
direct Dense kernels), it returns them too when they take no more memory than
the calls' inputs and output gradients: the clipped sum of DP-SGD is then a
weighted sum of them (``sum_i c_i G_i``) instead of one more VJP of each call.
"""
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from perturbkit.core._conv_patches import conv_patches as patches_of
from perturbkit.core._precision import accumulation_dtype, stored_dtype, widened
from perturbkit.errors import ExamplesAxisError
from perturbkit.per_example._replay import Pair, call_output, per_example_grads

DENSE_METHODS = ('auto', 'ghost', 'direct')


class LayerNorms(NamedTuple):
  """What a rule gives for one module.

  Attributes:
    squares: ``{param name: (examples,) squared norms}`` of its own params.
    per_example: ``{param name: (examples, *shape) gradients}`` where the rule
      formed them and they are worth keeping (see the module docstring), else ``None``.
  """
  squares: dict[str, jax.Array]
  per_example: dict[str, jax.Array] | None = None


def per_example_sq(per_example: jax.Array) -> jax.Array:
  """``(examples,)`` squared norms of ``(examples, *shape)`` gradients, in at least float32."""
  return jnp.sum(jnp.square(widened(per_example.reshape(per_example.shape[0], -1))), axis=1)


def _gram(layout: str, x: jax.Array, y: jax.Array) -> jax.Array:
  """``einsum(layout, x, y)`` accumulated and returned in at least float32."""
  return jnp.einsum(layout, x, y, preferred_element_type=accumulation_dtype(
      jnp.promote_types(x.dtype, y.dtype)))


def _size(tree) -> int:
  return sum(int(np.prod(jnp.shape(t))) for t in jax.tree.leaves(tree))


def _kept(pairs: list[Pair], per_example: dict[str, jax.Array],
          dtypes: dict[str, Any] | None = None) -> LayerNorms:
  """Norms of ``per_example``, which are kept when no larger than the calls' arrays.

  Without them, the clipped sum replays each call from its inputs and output
  gradient, which must then stay in memory until every example's norm is known.
  ``dtypes``: the dtype each kept array is stored in (the params', or the wider one the
  values are computed in where the params' range is narrower: float16), where the norms
  are taken from wider values.
  """
  squares = {k: per_example_sq(v) for k, v in per_example.items()}
  replay = sum(_size((p.args, p.kwargs)) + _size(p.grad) for p in pairs)
  if _size(per_example) > replay:
    return LayerNorms(squares)
  dtypes = dtypes or {}
  return LayerNorms(squares, {k: v.astype(stored_dtype(dtypes.get(k, v.dtype), v.dtype))
                              for k, v in per_example.items()})


def _first_input(pair: Pair) -> jax.Array:
  return pair.args[0] if pair.args else next(iter(pair.kwargs.values()))


def _is_plain_call(pair: Pair) -> bool:
  return pair.use.method_name == '__call__' and len(pair.args) == 1 and not pair.kwargs


def _is_dense(pair: Pair) -> bool:
  return pair.use.kind.name == 'dense' and _is_plain_call(pair)


def _is_conv(pair: Pair) -> bool:
  geometry = pair.use.kind.conv
  return (pair.use.kind.name == 'conv' and _is_plain_call(pair)
          and jnp.ndim(pair.args[0]) == len(geometry.kernel) + 2
          and 1 <= len(geometry.kernel) <= 3)


def _is_attend(pair: Pair) -> bool:
  """``embed.attend(h)``: ``h @ embeddingᵀ``, the output head of a tied embedding."""
  return (pair.use.method_name == 'attend' and len(pair.args) == 1 and not pair.kwargs
          and isinstance(pair.grad, jax.Array))


def _is_embed(pair: Pair) -> bool:
  return pair.use.kind.name == 'embed' and (_is_plain_call(pair) or _is_attend(pair))


def _is_norm(pair: Pair) -> bool:
  if pair.use.kind.name != 'norm' or not _is_plain_call(pair):
    return False
  reduction_axes, feature_axes = pair.use.kind.norm_axes
  last = lambda axes: axes in (-1, (-1,)) or axes == jnp.ndim(pair.args[0]) - 1
  return last(reduction_axes) and last(feature_axes)


KINDS: dict[str, Callable[[Pair], bool]] = {
    'dense': _is_dense, 'conv': _is_conv, 'embed': _is_embed, 'norm': _is_norm}


def kind_of(pairs: list[Pair]) -> str:
  """The fast path every use of a module fits, else ``'general'``."""
  for kind, fits in KINDS.items():
    if all(fits(p) for p in pairs):
      return kind
  return 'general'


def _tokens(x: jax.Array, num_examples: int, where: str) -> jax.Array:
  """``(examples, tokens, features)`` from an array with any leading axes after examples."""
  if jnp.ndim(x) < 2 or jnp.shape(x)[0] != num_examples:
    raise ExamplesAxisError(
        f'the call {where} has an input or output gradient of shape {jnp.shape(x)}, '
        f'whose axis 0 is not the {num_examples} examples')
  return x.reshape(num_examples, -1, x.shape[-1])


def _where(pair: Pair) -> str:
  return '/'.join(pair.use.path + (pair.use.key,))


def uses_ghost(tokens: int, d_in: int, d_out: int, method: str) -> bool:
  """Ghost norm (``T²`` per example) or direct outer product (``d_in·d_out``), by size."""
  return method == 'ghost' or (method == 'auto' and 2 * tokens * tokens < d_in * d_out)


def ghost_sq_norms(a: jax.Array, g: jax.Array) -> jax.Array:
  """``‖sum_t a_t g_tᵀ‖²`` per example for ``a`` (B, T, i) and ``g`` (B, T, o), by ghost norm.

  In at least float32: the Gram matrices accumulate in it from the model's dtype.
  """
  if a.shape[1] == 1:  # one token: ‖a‖²‖g‖²
    return per_example_sq(a) * per_example_sq(g)
  return jnp.sum(_gram('bti,bsi->bts', a, a) * _gram('bto,bso->bts', g, g), axis=(1, 2))


def _linear_rule(pairs: list[Pair], params: dict, num_examples: int, method: str,
                 inputs: Callable[[Pair], jax.Array]) -> LayerNorms:
  a = jnp.concatenate([_tokens(inputs(p), num_examples, _where(p)) for p in pairs], axis=1)
  g = jnp.concatenate([_tokens(p.grad, num_examples, _where(p)) for p in pairs], axis=1)
  bias = {'bias': jnp.sum(widened(g), axis=1)} if 'bias' in params else {}
  if not uses_ghost(a.shape[1], a.shape[2], g.shape[2], method):
    layout = 'bti,bto->boi' if pairs[0].use.kind.transposed else 'bti,bto->bio'
    kernel = _gram(layout, a, g).reshape((num_examples,) + params['kernel'].shape)
    return _kept(pairs, {'kernel': kernel, **bias},
                 {k: jnp.promote_types(a.dtype, g.dtype) for k in ('kernel', *bias)})
  squares = {'kernel': ghost_sq_norms(a, g)}
  squares.update({k: per_example_sq(v) for k, v in bias.items()})
  return LayerNorms(squares)


def dense_rule(pairs, params, num_examples, method):
  return _linear_rule(pairs, params, num_examples, method, _first_input)


def conv_patches(pair: Pair) -> jax.Array:
  """The conv's input patches, ``(examples, *out_spatial, prod(kernel) * in_features)``."""
  kernel, strides, dilation, input_dilation, padding = _conv_options(pair)
  x = pair.args[0]
  x = x.astype(jnp.promote_types(x.dtype, pair.grad.dtype))
  return patches_of(x, kernel, strides, padding, input_dilation, dilation)


def _conv_uses_ghost(pairs: list[Pair], params: dict, method: str) -> bool:
  """Ghost norms on patches when ``2T² < d_in·d_out``; else the direct path (see ``layer_norms``)."""
  if method != 'auto':
    return method == 'ghost'
  shapes = [jax.eval_shape(lambda p=p: conv_patches(p)).shape for p in pairs]
  tokens = sum(int(np.prod(shape[1:-1])) for shape in shapes)
  return uses_ghost(tokens, shapes[0][-1], params['kernel'].shape[-1], method)


def conv_rule(pairs, params, num_examples, method):
  return _linear_rule(pairs, params, num_examples, 'ghost', conv_patches)


def _conv_options(pair: Pair) -> tuple:
  """``(kernel, strides, dilation, input_dilation, padding)`` of a conv use."""
  return tuple(pair.use.kind.conv)


def conv_kernel_blocks(pair: Pair, reduce: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """``reduce`` of each example's conv kernel gradient at each kernel offset, without patches.

  Returns ``reduce(block)`` stacked over the kernel's offsets, where ``block`` is
  the ``(examples, in, out)`` gradient at one offset ``k``: ``sum_t x[t·stride +
  k·dilation]ᵀ g_t``, one batched matmul of a strided window of the padded input
  with ``g``. The window is gathered from the unpadded input (rows in the padding
  are zeroed), so no padded copy of the input is made, and the offsets run in a
  ``lax.scan``, so one window is in memory at a time, not ``prod(kernel)`` of
  them (the patches).
  """
  kernel, strides, dilation, _, padding = _conv_options(pair)
  x, g = pair.args[0], pair.grad
  x = x.astype(jnp.promote_types(x.dtype, g.dtype))
  extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilation)]
  if isinstance(padding, str):
    padding = jax.lax.padtype_to_pads(x.shape[1:-1], extent, strides, padding)
  out_spatial = g.shape[1:-1]
  # Contracted over its spatial axes as it is: the bias sum reads the same array, so XLA
  # materializes the output gradient once (a reshaped copy would be a second buffer).
  spatial = tuple(range(1, g.ndim - 1))
  starts = jnp.asarray([[o * d - lo for o, d, (lo, _) in zip(offset, dilation, padding)]
                        for offset in np.ndindex(*kernel)], jnp.int32)

  def block(_, start):
    # The window of the padded input, read from the unpadded one: out-of-range rows are zero.
    window = x
    for axis, (first, n, st) in enumerate(zip(start, out_spatial, strides), start=1):
      rows = first + st * jnp.arange(n)
      inside = (rows >= 0) & (rows < x.shape[axis])
      window = jnp.take(window, jnp.clip(rows, 0, x.shape[axis] - 1), axis=axis)
      shape = [1] * window.ndim
      shape[axis] = n
      window = window * inside.reshape(shape).astype(window.dtype)
    block = jax.lax.dot_general(window, g, ((spatial, spatial), ((0,), (0,))),  # (B, in, out)
                                preferred_element_type=accumulation_dtype(x.dtype))
    return None, reduce(block)

  return jax.lax.scan(block, None, starts)[1]


def conv_direct_rule(pairs, params, num_examples, method):
  """Direct per-example conv kernel gradients; kept only if smaller than the calls' arrays."""
  del method
  for p in pairs:
    _tokens(p.grad, num_examples, _where(p))  # the examples on axis 0
  bias = {}
  if 'bias' in params:
    bias = {'bias': sum(jnp.sum(widened(p.grad), axis=tuple(range(1, p.grad.ndim - 1)))
                        for p in pairs)}
  shape = params['kernel'].shape
  replay = sum(_size((p.args, p.kwargs)) + _size(p.grad) for p in pairs)
  keep = num_examples * int(np.prod(shape)) <= replay
  if len(pairs) == 1 and not keep:
    # Offsets are disjoint blocks of the kernel: the squares add up over them.
    squares = {'kernel': jnp.sum(conv_kernel_blocks(pairs[0], per_example_sq), axis=0)}
    return LayerNorms({**squares, **{k: per_example_sq(v) for k, v in bias.items()}})
  kernel = sum(conv_kernel_blocks(p, lambda b: b) for p in pairs)  # (offsets, B, in, out)
  kernel = jnp.moveaxis(kernel, 0, 1).reshape((num_examples,) + shape)
  squares = {'kernel': per_example_sq(kernel), **{k: per_example_sq(v) for k, v in bias.items()}}
  if not keep:
    return LayerNorms(squares)
  dtype = jnp.promote_types(pairs[0].args[0].dtype, pairs[0].grad.dtype)
  return LayerNorms(squares, {k: v.astype(stored_dtype(dtype, v.dtype))
                              for k, v in {'kernel': kernel, **bias}.items()})


class Head(NamedTuple):
  """An output head ``logits = inputs @ embeddingᵀ`` tied to an embedding, as arrays.

  Attributes:
    inputs: ``(examples, ..., features)``.
    grad: The per-example gradient at the logits, ``(examples, ..., vocabulary)``.
  """
  inputs: jax.Array
  grad: jax.Array


def heads_of(pairs: list[Pair]) -> list[Head]:
  """The ``attend`` uses among an embedding's ``pairs``, as :class:`Head` s."""
  return [Head(p.args[0], p.grad) for p in pairs if p.use.method_name == 'attend']


def heads_use_ghost(heads: list[Head], params: dict, method: str) -> bool:
  """Whether the heads' part of the norm is a ghost norm (else per-example gradients are formed)."""
  tokens = sum(int(np.prod(jnp.shape(h.inputs)[1:-1])) for h in heads)
  vocabulary, features = params['embedding'].shape
  return uses_ghost(tokens, features, vocabulary, method)


def embed_rule(pairs, params, num_examples, method, heads: tuple[Head, ...] = ()):
  """Lookups (``ids -> rows``), and heads tied to the embedding (module docstring)."""
  del params, method
  lookups = [p for p in pairs if p.use.method_name != 'attend']
  heads = heads_of(pairs) + list(heads)
  terms = []
  if lookups:
    ids = jnp.concatenate([_first_input(p).reshape(num_examples, -1) for p in lookups], axis=1)
    g = jnp.concatenate([_tokens(p.grad, num_examples, _where(p)) for p in lookups], axis=1)
    same = ids[:, :, None] == ids[:, None, :]
    gg = _gram('btd,bsd->bts', g, g)
    terms.append(jnp.sum(jnp.where(same, gg, 0), axis=(1, 2)))
  if heads:
    where = f'the output head tied to {_where(pairs[0]) if pairs else "an embedding"}'
    h = jnp.concatenate([_tokens(x.inputs, num_examples, where) for x in heads], axis=1)
    logits_grad = jnp.concatenate([_tokens(x.grad, num_examples, where) for x in heads], axis=1)
    terms.append(ghost_sq_norms(h, logits_grad))
    if lookups:
      # <Oᵀ g, Gᵀ h> = sum_{t,s} G[s, id_t] (g_t·h_s): the head's gradient at each looked-up row.
      at_ids = jnp.take_along_axis(
          logits_grad, jnp.broadcast_to(ids[:, None, :], ids.shape[:1] + (h.shape[1],)
                                        + ids.shape[1:]), axis=2)
      gh = _gram('btd,bsd->bst', g, h)
      terms.append(2 * jnp.sum(widened(at_ids) * gh, axis=(1, 2)))
  return LayerNorms({'embedding': sum(terms[1:], terms[0])})


def _normalized(pair: Pair, params: dict) -> jax.Array:
  """x̂ of a LayerNorm/RMSNorm call: the module itself with scale 1 and bias 0."""
  unit = {k: (jnp.ones_like(v) if k == 'scale' else jnp.zeros_like(v))
          for k, v in params.items()}
  return call_output(pair, unit)


def norm_rule(pairs, params, num_examples, method):
  del method
  sums: dict[str, jax.Array] = {}
  for p in pairs:
    g = widened(_tokens(p.grad, num_examples, _where(p)))
    parts = {'bias': jnp.sum(g, axis=1)}
    if 'scale' in params:
      x_hat = widened(_tokens(_normalized(p, params), num_examples, _where(p)))
      parts['scale'] = jnp.sum(g * x_hat, axis=1)
    for k in params:
      sums[k] = sums[k] + parts[k] if k in sums else parts[k]
  return LayerNorms({k: jnp.sum(v * v, axis=-1) for k, v in sums.items()})


def general_rule(pairs, params_subtree, num_examples, direct):
  """Norms of the ``direct`` params, from per-example VJPs of every use."""
  total = None
  for p in pairs:
    leading = jax.tree.leaves(p.grad)
    if not leading or any(jnp.shape(t)[:1] != (num_examples,) for t in leading):
      raise ExamplesAxisError(
          f'the call {_where(p)} has an output gradient whose axis 0 is not the '
          f'{num_examples} examples')
    grads = per_example_grads(p, params_subtree, num_examples)
    grads = {k: grads[k] for k in direct}
    total = grads if total is None else jax.tree.map(jnp.add, total, grads)
  return _kept(pairs, total)


FAST_RULES = {'dense': dense_rule, 'conv': conv_rule, 'embed': embed_rule, 'norm': norm_rule}


def layer_norms(pairs: list[Pair], params_subtree: dict, direct: dict, num_examples: int,
                method: str) -> LayerNorms:
  """Squared per-example norms of one module's own params (and, where kept, its per-example grads)."""
  kind = kind_of(pairs)
  if kind == 'general' or set(direct) != set(params_subtree):
    return general_rule(pairs, params_subtree, num_examples, direct)
  if kind == 'conv' and not _conv_uses_ghost(pairs, direct, method):
    # Patches (prod(kernel) times the input) are never formed for the direct path.
    if all(d == 1 for p in pairs for d in _conv_options(p)[3]):
      return conv_direct_rule(pairs, direct, num_examples, method)
    return general_rule(pairs, params_subtree, num_examples, direct)
  if (kind == 'embed' and heads_of(pairs)
      and not heads_use_ghost(heads_of(pairs), direct, method)):
    return general_rule(pairs, params_subtree, num_examples, direct)
  return FAST_RULES[kind](pairs, direct, num_examples, method)
