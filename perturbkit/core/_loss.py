"""What the Linen and NNX ``value_and_grad``/``grad`` share, whichever API built the model.

The checks of the loss function and its value, the reading of the ``filter``/``strict``
options, and ``grad`` as ``value_and_grad`` without the value.
"""
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from perturbkit.core import filters as _filters
from perturbkit.errors import (HasAuxOutputError, LossNotCallableError, MissingHasAuxError,
                                NonScalarLossError)
from perturbkit.core._types import CallFilter


def describe(value: Any) -> str:
  """What ``value`` is, for a message: ``'a tuple of 2'``, ``"a dict with keys ['a']"``."""
  if value is None:
    return 'None (is a `return` missing?)'
  if isinstance(value, Mapping):
    return f'a {type(value).__name__} with keys {sorted(map(str, value))[:8]}'
  if isinstance(value, (tuple, list)):
    return f'a {type(value).__name__} of {len(value)}'
  if hasattr(value, 'shape') and hasattr(value, 'dtype'):
    return f'an array of shape {tuple(value.shape)} and dtype {value.dtype}'
  cls = type(value)
  name = cls.__qualname__ if cls.__module__ == 'builtins' else f'{cls.__module__}.{cls.__qualname__}'
  return f'{"an" if name[0] in "aeiouAEIOU" else "a"} {name}'


def scalar_loss(out: Any, has_aux_option: bool = True) -> jax.Array:
  """``out`` checked to be a real scalar, before anything converts it to an array.

  Args:
    out: What the loss function returned (the loss of its ``(loss, aux)``).
    has_aux_option: Whether the caller takes ``has_aux``, so that a tuple
      returned without it is most likely a forgotten ``has_aux=True``.

  Raises:
    MissingHasAuxError: ``out`` is a container (tuple, list, dict) or ``None``.
    NonScalarLossError: ``out`` is an array other than a real scalar.
  """
  if out is None or not jax.tree_util.treedef_is_leaf(jax.tree.structure(out)):
    raise MissingHasAuxError(describe(out), has_aux_option)
  shape, dtype = jnp.shape(out), jnp.result_type(out)
  if shape != () or not jnp.issubdtype(dtype, jnp.floating):
    raise NonScalarLossError(shape, dtype)
  return out


def check_loss(out: Any, has_aux: bool) -> jax.Array:
  """The loss of ``out`` (``(loss, aux)`` with ``has_aux``), checked to be a real scalar.

  Raises:
    HasAuxOutputError: ``has_aux`` and ``out`` is not a pair.
    MissingHasAuxError: the loss is a tuple, list or dict (``has_aux`` forgotten).
    NonScalarLossError: the loss is not a real scalar.
  """
  if has_aux:
    if not (isinstance(out, tuple) and len(out) == 2):
      raise HasAuxOutputError(describe(out))
    out = out[0]
  return scalar_loss(out)


def check_loss_fn(loss_fn: Any, function: str, signature: str, what: str = 'loss function',
                  name: str = 'loss_fn'):
  """Raises :class:`LossNotCallableError` unless ``loss_fn`` (the ``what``, the argument
  ``name``) is callable."""
  if not callable(loss_fn):
    raise LossNotCallableError(function, f'{describe(loss_fn)} ({loss_fn!r:.60})', signature,
                               what, name)


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


def driver_result(loss: jax.Array, aux: Any, grads: dict, captured: Mapping[str, Any], *,
                  has_aux: bool, return_activations: bool, return_inputs: bool) -> tuple:
  """What ``value_and_grad`` returns on both front ends.

  ``(value, grads)``, then the captured activations and inputs (each a tree at
  the points' paths) when asked for; ``value`` is ``(loss, aux)`` with
  ``has_aux``.
  """
  value = (loss, aux) if has_aux else loss
  extras = ((captured['activations'],) if return_activations else ()) + (
      (captured['inputs'],) if return_inputs else ())
  return (value, grads, *extras)
