"""Linen modules as the per-example rules see them: their :class:`LayerKind` and replay.

``nn.Dense``, ``nn.Conv``, ``nn.Embed``, ``nn.LayerNorm`` and ``nn.RMSNorm`` with
the default dot and convolution functions, and Hugging Face's ``FlaxConv1D`` (GPT-2's
dense layers, kernel stored transposed), have fast rules; any other module is
replayed per example as its own ``module.apply``.
"""
import flax.errors
import flax.linen as nn
from flax.linen.linear import canonicalize_padding

from perturbkit.errors import RandomCallError
from perturbkit.linen._hf_modules import is_hf_conv1d
from perturbkit.per_example._kinds import GENERAL, LayerKind, Replay, conv_kind


def _conv_kind(m: nn.Conv) -> LayerKind:
  kernel = (m.kernel_size,) if isinstance(m.kernel_size, int) else tuple(m.kernel_size)
  if not (m.shared_weights and m.feature_group_count == 1 and m.mask is None
          and m.conv_general_dilated is None and m.conv_general_dilated_cls is None):
    return GENERAL
  return conv_kind(kernel, m.strides, m.kernel_dilation, m.input_dilation,
                   canonicalize_padding(m.padding, len(kernel)))


def linen_kind(module: nn.Module) -> LayerKind:
  """The fast rule ``module``'s plain calls may use (``GENERAL`` if none)."""
  kind = type(module)
  if is_hf_conv1d(module):
    return LayerKind('dense', transposed=True)
  if kind is nn.Dense:
    custom = (getattr(module, 'dot_general', None) is not None
              or getattr(module, 'dot_general_cls', None) is not None)
    return GENERAL if custom else LayerKind('dense')
  if kind is nn.Conv:
    return _conv_kind(module)
  if kind is nn.Embed:
    return LayerKind('embed')
  if kind in (nn.LayerNorm, nn.RMSNorm):
    return LayerKind('norm', norm_axes=(module.reduction_axes, module.feature_axes))
  return GENERAL


def linen_replay(module: nn.Module, method_name: str, where: str,
                 random_error: type[RandomCallError] = RandomCallError) -> Replay:
  """The call of the unbound ``module`` as ``module.apply``, given its params subtree.

  Args:
    module: The unbound module.
    method_name: The method the replay calls.
    where: The call's name in errors.
    random_error: What a draw from a Flax RNG stream raises (a whole apply's replay names
      why the apply is replayed).

  Raises (from the replay):
    RandomCallError: the call draws from a Flax RNG stream; the replay is given none.
  """
  def replay(params, variables, args, kwargs):
    try:
      return module.apply({**variables, 'params': params}, *args, method=method_name,
                          **kwargs)
    except flax.errors.InvalidRngError as err:
      raise random_error(where, str(err).split(' (https://')[0]) from err

  return replay
