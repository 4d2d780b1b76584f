"""Hugging Face modules that are a Flax layer in all but name.

``FlaxConv1D`` (GPT-2's attention and MLP projections) is a Dense layer whose
kernel is stored transposed: ``inputs @ kernel.T + bias``, ``kernel`` of shape
``(features, in_features)``. The per-example and K-FAC rules treat it as such.
"""
import dataclasses

import flax.linen as nn


def is_hf_conv1d(module: nn.Module) -> bool:
  """Whether ``module`` is Hugging Face's ``FlaxConv1D`` as transformers 4.x defines it."""
  kind = type(module)
  fields = {f.name for f in dataclasses.fields(module)} - {'parent', 'name'}
  return (kind.__name__ == 'FlaxConv1D' and kind.__module__.startswith('transformers.')
          and fields == {'features', 'use_bias', 'dtype', 'precision'})
