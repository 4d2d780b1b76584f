"""Hugging Face modules that are a Flax layer in all but name.

``FlaxConv1D`` (GPT-2's attention and MLP projections) is a Dense layer whose
kernel is stored transposed: ``inputs @ kernel.T + bias``, ``kernel`` of shape
``(features, in_features)``. The per-example and K-FAC rules treat it as such.
Llama's, Mistral's and Gemma's RMSNorms are an RMSNorm whose scale is named
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


_RMS_NORMS = ('FlaxLlamaRMSNorm', 'FlaxMistralRMSNorm', 'FlaxGemmaRMSNorm')


def hf_rms_norm_epsilon(module: nn.Module) -> float | None:
  """The ``epsilon`` of a Hugging Face Llama, Mistral or Gemma RMSNorm, else ``None``.

  Each is an RMSNorm over the last axis with a scale named ``weight`` and no bias:
  ``weight * x̂`` (Gemma: ``(1 + weight) * x̂``, whose gradient is the same),
  ``x̂ = x / sqrt(mean(x²) + config.rms_norm_eps)``.
  """
  kind = type(module)
  fields = {f.name for f in dataclasses.fields(module)} - {'parent', 'name'}
  if (kind.__name__ in _RMS_NORMS and kind.__module__.startswith('transformers.')
      and fields == {'config', 'dtype'}):
    return float(module.config.rms_norm_eps)
  return None
