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
from typing import Any, Callable

from jax.extend import core as jex_core

from perturbkit.errors import CaptureInJaxTransformError


def trace_state() -> Any:
  """An opaque token of the JAX trace code runs under now, compared with ``==``."""
  return jex_core.get_opaque_trace_state()


def capture_check(reads: bool) -> Callable[[str], bool]:
  """``readable(call_name) -> bool`` for the captures of one run, begun now: whether a value
  captured now can be kept. Under a transform the loss began itself it cannot:
  :class:`CaptureInJaxTransformError` where the run ``reads`` its captures, else ``False``
  (a run that only edits leaves the capture out)."""
  began_under = trace_state()

  def readable(call_name: str) -> bool:
    if trace_state() == began_under:
      return True
    if reads:
      raise CaptureInJaxTransformError(call_name)
    return False

  return readable
