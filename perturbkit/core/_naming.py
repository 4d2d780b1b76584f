"""Naming a function made from a user's function, without claiming the user's signature."""
from typing import Callable, TypeVar

F = TypeVar('F', bound=Callable)


def named_after(fn: Callable) -> Callable[[F], F]:
  """``functools.wraps(fn)`` for a wrapper whose arguments are not ``fn``'s.

  The wrapper takes ``fn``'s name (what ``jax.jit`` and tracebacks show) and
  keeps its own signature and docstring. ``functools.wraps`` would also set
  ``__wrapped__``, from which ``inspect.signature`` (``help``, argument binding
  in ``flax.nnx.vmap``) reads ``fn``'s parameters instead of the wrapper's:
  ``(model, x)`` for a function called as ``(model, clean, corrupted)``.
  """

  def name(wrapper: F) -> F:
    for attribute in ('__module__', '__name__', '__qualname__'):
      if hasattr(fn, attribute):
        setattr(wrapper, attribute, getattr(fn, attribute))
    return wrapper

  return name
