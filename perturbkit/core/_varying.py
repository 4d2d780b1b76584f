"""Device-varying types inside ``jax.shard_map``: zeros and loop carries typed like the values
they stand for.

Inside ``shard_map`` (with its default ``check_vma=True``) each value's type
says over which mesh axes it may differ from device to device, and JAX's
reverse mode sums over the devices the gradient with respect to a value that
does not vary (the same on every device). A zero perturbation added to a
call's output must therefore vary like that output: the gradient with respect
to it is then the device's own, and it is summed over the devices only where
the output itself is the same on every device, as the gradient of the params
is. Likewise a loop whose carry starts as a constant and whose body makes it
from the device's own data must start with the body's type. Outside
``shard_map`` (or with ``check_vma=False``) no value varies and these are the
identity.
"""
import contextlib
import warnings
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from perturbkit.errors import (CheckedShardMapError, DeviceLocalStepWarning, UnboundAxisError,
                               UnknownAxisError)


def manual_axes() -> frozenset[str]:
  """The mesh axes of the ``jax.shard_map`` this runs in (none outside one)."""
  mesh = jax.sharding.get_abstract_mesh()
  return frozenset(getattr(mesh, 'manual_axes', ()) or ())


def varying_axes(x: Any) -> frozenset[str]:
  """The mesh axes over which ``x`` (an array, a tracer or an abstract value) may differ per
  device, among those ``shard_map`` makes manual where this runs."""
  aval = jax.typeof(x) if isinstance(x, jax.Array) else x  # tracers are jax.Arrays too
  kind = getattr(aval, 'manual_axis_type', None)
  axes = kind.varying if kind is not None else getattr(aval, 'vma', ())
  return frozenset(axes or ()) & manual_axes()


def vary(x: jax.Array, axes: frozenset[str]) -> jax.Array:
  """``x``, typed to vary over ``axes`` too (the same values); ``axes`` outside the current
  ``shard_map`` are ignored."""
  missing = (frozenset(axes) & manual_axes()) - varying_axes(x)
  if not missing:
    return x
  return jax.lax.pcast(x, tuple(sorted(missing)), to='varying')


def summed_like(x: jax.Array, like: Any) -> jax.Array:
  """``x`` summed over the devices along the axes it varies over and ``like`` does not: what
  JAX's reverse mode does to the gradient of a value the same on every device (``like``), for
  a gradient made another way (from per-example gradients, which vary with the examples)."""
  axes = varying_axes(x) - varying_axes(like)
  return jax.lax.psum(x, tuple(sorted(axes))) if axes else x


def vary_like(x: jax.Array, *like: Any) -> jax.Array:
  """``x``, typed to vary over the axes each of ``like`` varies over."""
  return vary(x, frozenset().union(*map(varying_axes, like)))


def typed_shape(x: Any) -> jax.ShapeDtypeStruct:
  """``x``'s shape and dtype, with the mesh axes it varies over (for :func:`zeros_like_type`
  later in the same ``shard_map``)."""
  return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x),
                              manual_axis_type=getattr(jax.typeof(x), 'manual_axis_type', None))


def zeros_like_type(aval: Any) -> jax.Array:
  """Zeros of ``aval``'s shape and dtype, varying over the devices as it does."""
  return vary_like(jnp.zeros(aval.shape, aval.dtype), aval)


def check_unchecked(axis_name: Any, function: str) -> None:
  """Raises ``CheckedShardMapError`` if ``axis_name`` is an axis of a ``jax.shard_map`` with
  ``check_vma=True``, where the gradient of replicated params is already summed over it, and
  ``UnknownAxisError`` if no ``shard_map`` or ``pmap`` around the call binds it. Warns
  (``DeviceLocalStepWarning``) when there is no ``axis_name`` inside a ``shard_map`` with
  ``check_vma=False``, where each device would step on its own shard alone.

  With ``check_vma=False`` (and under ``pmap``) values carry no device-varying
  types, and the explicit all-reduce is what averages the devices' gradients.
  """
  manual = manual_axes()
  if axis_name is None:
    if manual and not any(name in varying_axes(jax.lax.axis_index(name)) for name in manual):
      # check_vma=False: nothing sums the devices' gradients unless axis_name is given.
      warnings.warn(DeviceLocalStepWarning(function, sorted(manual)), stacklevel=4)
    return
  for name in (axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)):
    try:
      index = jax.lax.axis_index(name)
    except NameError as error:  # bound by no shard_map or pmap around the call
      raise UnknownAxisError(function, name, manual) from error
    if name in manual and name in varying_axes(index):
      raise CheckedShardMapError(function, name)


@contextlib.contextmanager
def explaining_unbound_axes(where: str) -> Iterator[None]:
  """Turns JAX's error for a collective over an axis no ``shard_map`` binds here (the loss run
  outside the step's ``shard_map``) into an :class:`UnboundAxisError` saying where to run."""
  try:
    yield
  except NameError as error:
    if 'unbound axis name' not in str(error):
      raise
    raise UnboundAxisError(where, str(error).splitlines()[0]) from error


def typed_like(value: Any, make: Callable[[], Any]) -> Any:
  """``value`` typed to vary over the devices as ``make()``'s output (a tree of the same
  structure) does: for the other branch of a ``lax.cond``, or a loop's first carry, which
  must have the type of what the loop body makes. Traces ``make`` only inside
  ``shard_map``."""
  if not manual_axes():
    return value
  return jax.tree.map(vary_like, value, jax.eval_shape(make))
