"""NNX modules as the per-example rules see them: their :class:`LayerKind`, replay and mixing.

``nnx.Linear``, ``nnx.Conv``, ``nnx.Embed``, ``nnx.LayerNorm`` and ``nnx.RMSNorm``
with the default dot and convolution functions have the fast rules of their Linen
counterparts (the same param names and layouts); any other module that owns
``nnx.Param`` s (``nnx.LinearGeneral``, a module of your own) is replayed per
example: a copy of it merged from its graphdef with the given params, its method
called on one example's inputs.
"""
from typing import Any, Callable

import jax
from flax import nnx
from flax.nnx.nn.linear import canonicalize_padding

from perturbkit.core._dependence import depends_on
from perturbkit.core._values import is_typed_key
from perturbkit.errors import RandomCallError
from perturbkit.per_example._kinds import GENERAL, LayerKind, Replay, conv_kind
from perturbkit.per_example._nnx_draws import watched_draws
from perturbkit.nnx._segments import with_values


def _conv_kind(m: nnx.Conv) -> LayerKind:
  kernel = tuple(m.kernel_size)
  padding = canonicalize_padding(m.padding, len(kernel))
  if not isinstance(padding, str):
    padding = tuple(tuple(p) for p in padding)
  if not (m.feature_group_count == 1 and m.mask is None
          and m.conv_general_dilated is jax.lax.conv_general_dilated):
    return GENERAL
  return conv_kind(kernel, m.strides, m.kernel_dilation, m.input_dilation, padding)


def nnx_kind(module: nnx.Module) -> LayerKind:
  """The fast rule the plain calls of ``module`` (not instrumented) may use."""
  kind = type(module)
  if kind is nnx.Linear:
    return LayerKind('dense') if module.dot_general is jax.lax.dot_general else GENERAL
  if kind is nnx.Conv:
    return _conv_kind(module)
  if kind is nnx.Embed:
    return LayerKind('embed')
  if kind in (nnx.LayerNorm, nnx.RMSNorm):
    return LayerKind('norm', norm_axes=(module.reduction_axes, module.feature_axes))
  return GENERAL


def _rng_counts(module: nnx.Module) -> list[tuple[Any, Any]]:
  return [(path, var.get_value())
          for path, var in nnx.to_flat_state(nnx.state(module, nnx.RngCount))]


def _reads_keys(fn: Callable[[Any], Any], given: Any) -> bool:
  """Whether ``fn(given)`` is computed from the PRNG keys among ``given``'s leaves (one more
  trace of ``fn``, with the keys as its only inputs); ``True`` if ``given`` holds none."""
  leaves, tree = jax.tree.flatten(given)
  is_key = [is_typed_key(x) for x in leaves]
  if not any(is_key):
    return True

  def with_keys(keys):
    keys = iter(keys)
    return fn(jax.tree.unflatten(tree, [next(keys) if k else x
                                        for x, k in zip(leaves, is_key)]))

  closed = jax.make_jaxpr(with_keys)([x for x, k in zip(leaves, is_key) if k])
  return any(depends_on(closed.jaxpr, [True] * len(closed.jaxpr.invars)))


def nnx_replay(graphdef: Any, template: nnx.State, method_name: str, where: str,
               random_error: Callable[[str, str], RandomCallError] = RandomCallError) -> Replay:
  """The call of a module rebuilt from its plain ``graphdef``, given its params subtree.

  ``template`` is the module's ``nnx.Param`` state (for the variables' types);
  the params come as nested dicts with string keys (``_segments.params_tree``),
  the other variables as the module's ``nnx.State`` other than params.

  A draw whose keys the call's output is not computed from (``nnx.bridge.ToNNX``
  hands a key to every Linen call, used or not) changes nothing and is allowed.

  Raises (from the replay):
    RandomCallError: (``random_error``) the call draws from an ``nnx.Rngs`` stream of
      the model (seen at the draw: a count that an NNX transform hands back unchanged
      is no draw) and its output depends on the keys; a replay cannot draw the
      batched pass's numbers.
  """
  def call(params, others, args, kwargs):
    module = nnx.merge(graphdef, with_values(template, params), others, copy=True)
    return getattr(module, method_name)(*args, **kwargs)

  def replay(params, others, args, kwargs):
    module = nnx.merge(graphdef, with_values(template, params), others, copy=True)
    before = _rng_counts(module)
    with watched_draws(module) as draws:
      out = getattr(module, method_name)(*args, **kwargs)
    if draws and _reads_keys(lambda given: call(params, *given), (others, args, kwargs)):
      moved = ['.'.join(map(str, path[:-1])) for (path, a), (_, b)
               in zip(before, _rng_counts(module)) if a is not b]
      stream = f'the nnx.Rngs stream {moved[0]}' if moved else 'an nnx.Rngs stream'
      raise random_error(where, f'it draws from {stream} of the model: for dropout, or the '
                                'key nnx.RNN draws for its initial carry unless given '
                                '`initial_carry=`')
    return out

  return replay


def nnx_mixing_reason(module: nnx.Module, name: str, args: tuple, kwargs: dict) -> str | None:
  """Why a call makes one example's output depend on the others, if it does."""
  if isinstance(module, nnx.BatchNorm):
    given = kwargs.get('use_running_average', args[1] if len(args) > 1 else None)
    running = module.use_running_average if given is None else given
    if not running:
      return (f'{name} is an nnx.BatchNorm in training mode (batch statistics); call '
              '`model.eval()` or pass `use_running_average=True`')
  return None
