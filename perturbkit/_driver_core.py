"""What the Linen and NNX ``value_and_grad``/``grad`` share, whichever API built the model.

The check of the loss's value, the reading of the ``filter``/``strict``
options, and ``grad`` as ``value_and_grad`` without the value.
"""
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from perturbkit import _filters
from perturbkit._errors import NonScalarLossError
from perturbkit._types import CallFilter


def check_loss(out: Any, has_aux: bool) -> jax.Array:
  """The loss of ``out`` (``(loss, aux)`` with ``has_aux``), checked to be a real scalar.

  Raises:
    TypeError: ``has_aux`` and ``out`` is not a pair.
    NonScalarLossError: the loss is not a real scalar.
  """
  if has_aux:
    if not (isinstance(out, tuple) and len(out) == 2):
      raise TypeError('With has_aux=True the loss function must return (loss, aux).')
    out = out[0]
  shape, dtype = jnp.shape(out), jnp.result_type(out)
  if shape != () or not jnp.issubdtype(dtype, jnp.floating):
    raise NonScalarLossError(shape, dtype)
  return out


def point_options(filter: CallFilter | bool | None, strict: bool | None
                  ) -> tuple[CallFilter, bool]:
  """The call filter, and whether a selected call without floating-point output is an error.

  ``strict`` defaults to whether a filter is given: selecting every call
  passes over calls with integer outputs, a filter naming one does not.
  """
  if strict is None:
    strict = filter is not None and filter is not True
  return _filters.as_filter(filter), strict


def grads_only(value_and_grad_fn: Callable[..., Any], loss_fn: Callable[..., Any],
               has_aux: bool) -> Callable[..., Any]:
  """``value_and_grad_fn`` returning ``grads`` (``(grads, aux)`` with ``has_aux``)."""
  @functools.wraps(loss_fn)
  def run(*args, **kwargs):
    value, grads = value_and_grad_fn(*args, **kwargs)
    return (grads, value[1]) if has_aux else grads

  return run
