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
  (``jax.lax.conv_general_dilated_patches``), one token per output position: the
  ghost norm runs on the patches; the direct per-example gradient is the conv's
  own VJP per example (as the general path), which never forms the patches.
* ``embed``: row ``v`` of an example's embedding gradient is the sum of ``g_t``
  over its tokens with id ``v``: ``sum_{t,s} [id_t = id_s] (g_t·g_s)``.
* ``norm``: LayerNorm/RMSNorm scale and bias gradients (``sum_t g_t ⊙ x̂_t`` and
  ``sum_t g_t``) are formed per example directly; they are small.
* ``general``: anything else: each use's call replayed per example (a vmap of its
  own VJP), the uses' per-example gradients summed, then the norm.
"""
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.linear import canonicalize_padding

from perturbkit._per_example_errors import ExamplesAxisError
from perturbkit._per_example_replay import Pair, per_example_grads

DENSE_METHODS = ('auto', 'ghost', 'direct')


def _first_input(pair: Pair) -> jax.Array:
  return pair.args[0] if pair.args else next(iter(pair.kwargs.values()))


def _is_plain_call(pair: Pair) -> bool:
  return pair.use.method_name == '__call__' and len(pair.args) == 1 and not pair.kwargs


def _is_dense(pair: Pair) -> bool:
  m = pair.use.module
  return (type(m) is nn.Dense and _is_plain_call(pair)
          and getattr(m, 'dot_general', None) is None
          and getattr(m, 'dot_general_cls', None) is None)


def _is_conv(pair: Pair) -> bool:
  m = pair.use.module
  if not (type(m) is nn.Conv and _is_plain_call(pair)):
    return False
  kernel = (m.kernel_size,) if isinstance(m.kernel_size, int) else tuple(m.kernel_size)
  padding = canonicalize_padding(m.padding, len(kernel))
  return (m.shared_weights and m.feature_group_count == 1 and m.mask is None
          and m.conv_general_dilated is None and m.conv_general_dilated_cls is None
          and padding not in ('CIRCULAR', 'REFLECT', 'CAUSAL')
          and jnp.ndim(pair.args[0]) == len(kernel) + 2 and 1 <= len(kernel) <= 3)


def _is_embed(pair: Pair) -> bool:
  return type(pair.use.module) is nn.Embed and _is_plain_call(pair)


def _is_norm(pair: Pair) -> bool:
  m = pair.use.module
  if type(m) not in (nn.LayerNorm, nn.RMSNorm) or not _is_plain_call(pair):
    return False
  last = lambda axes: axes in (-1, (-1,)) or axes == jnp.ndim(pair.args[0]) - 1
  return last(m.reduction_axes) and last(m.feature_axes)


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


def linear_sq_norms(a: jax.Array, g: jax.Array, method: str) -> jax.Array:
  """``‖sum_t a_t g_tᵀ‖²`` per example for ``a`` (B, T, i) and ``g`` (B, T, o)."""
  tokens, d_in, d_out = a.shape[1], a.shape[2], g.shape[2]
  ghost = method == 'ghost' or (method == 'auto' and 2 * tokens * tokens < d_in * d_out)
  if ghost:
    aa = jnp.einsum('bti,bsi->bts', a, a)
    gg = jnp.einsum('bto,bso->bts', g, g)
    return jnp.sum(aa * gg, axis=(1, 2))
  per_example = jnp.einsum('bti,bto->bio', a, g)
  return jnp.sum(per_example * per_example, axis=(1, 2))


def _bias_sq_norms(g: jax.Array) -> jax.Array:
  return jnp.sum(jnp.sum(g, axis=1) ** 2, axis=-1)


def _linear_rule(pairs: list[Pair], params: dict, num_examples: int, method: str,
                 inputs: Callable[[Pair], jax.Array]) -> dict[str, jax.Array]:
  a = jnp.concatenate([_tokens(inputs(p), num_examples, _where(p)) for p in pairs], axis=1)
  g = jnp.concatenate([_tokens(p.grad, num_examples, _where(p)) for p in pairs], axis=1)
  out = {'kernel': linear_sq_norms(a, g, method)}
  if 'bias' in params:
    out['bias'] = _bias_sq_norms(g)
  return out


def dense_rule(pairs, params, num_examples, method):
  return _linear_rule(pairs, params, num_examples, method, _first_input)


def conv_patches(pair: Pair) -> jax.Array:
  """The conv's input patches, ``(examples, *out_spatial, in_features * prod(kernel))``."""
  m = pair.use.module
  x = pair.args[0]
  kernel = (m.kernel_size,) if isinstance(m.kernel_size, int) else tuple(m.kernel_size)
  spatial = len(kernel)
  broadcast = lambda v: (1,) * spatial if v is None else (
      (v,) * spatial if isinstance(v, int) else tuple(v))
  letters = 'DHW'[3 - spatial:]
  x = x.astype(jnp.promote_types(x.dtype, pair.grad.dtype))
  return jax.lax.conv_general_dilated_patches(
      x, kernel, broadcast(m.strides), canonicalize_padding(m.padding, spatial),
      lhs_dilation=broadcast(m.input_dilation), rhs_dilation=broadcast(m.kernel_dilation),
      dimension_numbers=(f'N{letters}C', f'{letters}IO', f'N{letters}C'))


def _conv_uses_ghost(pairs: list[Pair], params: dict, method: str) -> bool:
  """Ghost norms on patches when ``2T² < d_in·d_out``; else the direct path (see ``sq_norms``)."""
  if method != 'auto':
    return method == 'ghost'
  shapes = [jax.eval_shape(lambda p=p: conv_patches(p)).shape for p in pairs]
  tokens = sum(int(np.prod(shape[1:-1])) for shape in shapes)
  return 2 * tokens * tokens < shapes[0][-1] * params['kernel'].shape[-1]


def conv_rule(pairs, params, num_examples, method):
  return _linear_rule(pairs, params, num_examples, 'ghost', conv_patches)


def embed_rule(pairs, params, num_examples, method):
  del params, method
  ids = jnp.concatenate([_first_input(p).reshape(num_examples, -1) for p in pairs], axis=1)
  g = jnp.concatenate([_tokens(p.grad, num_examples, _where(p)) for p in pairs], axis=1)
  same = ids[:, :, None] == ids[:, None, :]
  gg = jnp.einsum('btd,bsd->bts', g, g)
  return {'embedding': jnp.sum(jnp.where(same, gg, 0), axis=(1, 2))}


def _normalized(pair: Pair, params: dict) -> jax.Array:
  """x̂ of a LayerNorm/RMSNorm call: the module itself with scale 1 and bias 0."""
  unit = {k: (jnp.ones_like(v) if k == 'scale' else jnp.zeros_like(v))
          for k, v in params.items()}
  return pair.use.module.apply({'params': unit}, pair.args[0])


def norm_rule(pairs, params, num_examples, method):
  del method
  sums: dict[str, jax.Array] = {}
  for p in pairs:
    g = _tokens(p.grad, num_examples, _where(p))
    parts = {'bias': jnp.sum(g, axis=1)}
    if 'scale' in params:
      x_hat = _tokens(_normalized(p, params), num_examples, _where(p))
      parts['scale'] = jnp.sum(g * x_hat, axis=1)
    for k in params:
      sums[k] = sums[k] + parts[k] if k in sums else parts[k]
  return {k: jnp.sum(v * v, axis=-1) for k, v in sums.items()}


def general_rule(pairs, params_subtree, num_examples, direct):
  """Squared norms of the ``direct`` params, from per-example VJPs of every use."""
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
  return {k: jnp.sum(v.reshape(num_examples, -1) ** 2, axis=1) for k, v in total.items()}


FAST_RULES = {'dense': dense_rule, 'conv': conv_rule, 'embed': embed_rule, 'norm': norm_rule}


def sq_norms(pairs: list[Pair], params_subtree: dict, direct: dict, num_examples: int,
             method: str) -> dict[str, jax.Array]:
  """``{param name: (examples,) squared norms}`` of one module's own params."""
  kind = kind_of(pairs)
  if kind == 'general' or set(direct) != set(params_subtree):
    return general_rule(pairs, params_subtree, num_examples, direct)
  if kind == 'conv' and not _conv_uses_ghost(pairs, direct, method):
    # The direct per-example kernel gradient is the conv's own VJP per example: patches
    # (prod(kernel) times the input) are never formed.
    return general_rule(pairs, params_subtree, num_examples, direct)
  return FAST_RULES[kind](pairs, direct, num_examples, method)
