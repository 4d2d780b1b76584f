"""What the per-layer rules need to know of a module, in a form neither Flax API owns.

A front end describes each recorded call's module by a :class:`LayerKind` (which
fast rule its calls may use, and that rule's options) and a :data:`Replay` (its
call run again as a function of its params). The rules in ``_rules`` and the
replays in ``_replay`` read only these, so the maths is written once for Linen
(``_linen_kinds``) and NNX (``_nnx_kinds``) modules.
"""
from typing import Any, Callable, NamedTuple


class ConvGeometry(NamedTuple):
  """The options of a convolution a per-example rule reads.

  Attributes:
    kernel: The kernel's spatial size, one int per spatial axis.
    strides: One int per spatial axis.
    dilation: The kernel dilation, one int per spatial axis.
    input_dilation: One int per spatial axis.
    padding: ``'SAME'``, ``'VALID'`` or ``((low, high), ...)``, as
      ``flax.linen.linear.canonicalize_padding`` gives it.
  """
  kernel: tuple[int, ...]
  strides: tuple[int, ...]
  dilation: tuple[int, ...]
  input_dilation: tuple[int, ...]
  padding: Any


class LayerKind(NamedTuple):
  """Which fast rule a module's plain calls may use.

  Attributes:
    name: ``'dense'``, ``'conv'``, ``'embed'``, ``'norm'`` or ``'general'`` (a
      per-example replay of the call).
    conv: The geometry of a ``'conv'`` module.
    norm_axes: ``(reduction_axes, feature_axes)`` of a ``'norm'`` module.
    transposed: A ``'dense'`` module whose kernel is stored ``(out, in)`` and used
      transposed (Hugging Face's ``FlaxConv1D`` in GPT-2).
  """
  name: str
  conv: ConvGeometry | None = None
  norm_axes: tuple | None = None
  transposed: bool = False


GENERAL = LayerKind('general')

# ``(params, other variables, args, kwargs) -> output``: the call run again with
# ``params`` (the module's params subtree, children included).
Replay = Callable[[Any, Any, tuple, dict], Any]


def spatial(value: Any, dims: int, default: int = 1) -> tuple[int, ...]:
  """A per-axis option (``None``, an int or a sequence) as one int per spatial axis."""
  if value is None:
    return (default,) * dims
  if isinstance(value, int):
    return (value,) * dims
  return tuple(value)


def conv_kind(kernel: tuple[int, ...], strides: Any, dilation: Any, input_dilation: Any,
              padding: Any) -> LayerKind:
  """The ``'conv'`` kind of a plain convolution, options as its module holds them.

  ``padding`` is canonical (``canonicalize_padding``); circular, reflect and
  causal padding have no fast rule (``GENERAL``).
  """
  if padding in ('CIRCULAR', 'REFLECT', 'CAUSAL'):
    return GENERAL
  dims = len(kernel)
  return LayerKind('conv', ConvGeometry(kernel, spatial(strides, dims), spatial(dilation, dims),
                                        spatial(input_dilation, dims), padding))
