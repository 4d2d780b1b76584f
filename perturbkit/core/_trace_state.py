"""Whether code runs under a JAX transform begun since a given moment (one the loss applies).

A capture is a Python side effect: a call's output kept in a dict while the
loss runs. Where the loss itself wraps ``model.apply`` in ``jax.jit``,
``jax.checkpoint``, ``jax.vmap`` or ``lax.map``, the value kept is a tracer of
that transform, which is dead once the transform returns (its first use raises
``UnexpectedTracerError``). JAX's trace state at the capture then differs from
the one the perturbkit function began under; perturbkit's own transforms are
all begun before that moment, or are Flax lifted transforms, whose captures
leave through a collection instead.
"""
from typing import Any

from jax.extend import core as jex_core


def trace_state() -> Any:
  """An opaque token of the JAX trace code runs under now, compared with ``==``."""
  return jex_core.get_opaque_trace_state()
