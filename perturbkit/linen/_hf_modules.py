"""Hugging Face modules that are a Flax layer in all but name.

``FlaxConv1D`` (GPT-2's attention and MLP projections) is a Dense layer whose
kernel is stored transposed: ``inputs @ kernel.T + bias``, ``kernel`` of shape
``(features, in_features)``. The per-example and K-FAC rules treat it as such.
Llama's, Mistral's and Gemma's RMSNorms, and T5's (mT5's) and LongT5's
``LayerNorm`` (no mean subtracted, no bias), are an RMSNorm whose scale is named
``weight``: K-FAC gives them a norm's diagonal.
"""
import dataclasses

import flax.linen as nn


def is_hf_conv1d(module: nn.Module) -> bool:
  """Whether ``module`` is Hugging Face's ``FlaxConv1D`` as transformers 4.x defines it."""
  kind = type(module)
  fields = {f.name for f in dataclasses.fields(module)} - {'parent', 'name'}
  return (kind.__name__ == 'FlaxConv1D' and kind.__module__.startswith('transformers.')
          and fields == {'features', 'use_bias', 'dtype', 'precision'})


# Each class name with its fields (besides parent and name) as transformers 4.x defines it,
# and where its epsilon is: Llama's three take it from their config, T5's own field.
_FROM_CONFIG = ({'config', 'dtype'}, lambda module: module.config.rms_norm_eps)
_OWN_FIELD = ({'hidden_size', 'dtype', 'eps', 'weight_init'}, lambda module: module.eps)
_RMS_NORMS = {
    'FlaxLlamaRMSNorm': _FROM_CONFIG,
    'FlaxMistralRMSNorm': _FROM_CONFIG,
    'FlaxGemmaRMSNorm': _FROM_CONFIG,
    'FlaxT5LayerNorm': _OWN_FIELD,
    'FlaxLongT5LayerNorm': _OWN_FIELD,
}


def hf_rms_norm_epsilon(module: nn.Module) -> float | None:
  """The ``epsilon`` of a Hugging Face RMSNorm (Llama, Mistral, Gemma; T5's, mT5's and
  LongT5's ``LayerNorm``), else ``None``.

  Each is an RMSNorm over the last axis with a scale named ``weight`` and no bias:
  ``weight * x̂`` (Gemma: ``(1 + weight) * x̂``, whose gradient is the same),
  ``x̂ = x / sqrt(mean(x²) + eps)`` with ``eps`` the config's ``rms_norm_eps`` (T5: the
  module's ``eps``, the config's ``layer_norm_epsilon``).
  """
  kind = type(module)
  known = _RMS_NORMS.get(kind.__name__)
  fields = {f.name for f in dataclasses.fields(module)} - {'parent', 'name'}
  if known is not None and kind.__module__.startswith('transformers.') and fields == known[0]:
    return float(known[1](module))
  return None
