"""A loss's keyword arguments, carried as one more positional argument.

Interleaved training hands a loss's arguments, as one tuple, to its segmentation,
its checks and its replays, which see every leaf of them (arrays traced, other
values kept as they are, see ``_values``). Keyword arguments ride along as the
tuple's last element, a dict, and the loss wrapped by :func:`keywords_last` gets
them back by name, as ``jax.grad`` hands them on.
"""
import functools
from typing import Any, Callable, Mapping


def with_keywords(args: tuple, kwargs: Mapping[str, Any]) -> tuple:
  """``args`` and, last, a dict of ``kwargs`` (empty when none are given)."""
  return (*args, dict(kwargs))


def given(arguments: tuple) -> bool:
  """Whether :func:`with_keywords`'s ``arguments`` hold any argument, positional or keyword."""
  return len(arguments) > 1 or bool(arguments[-1])


def keywords_last(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
  """``loss_fn`` taking its keyword arguments as a dict after its positional ones:
  ``keywords_last(f)(first, *with_keywords(args, kwargs)) == f(first, *args, **kwargs)``."""
  @functools.wraps(loss_fn)
  def loss(first, *arguments):
    *args, kwargs = arguments
    return loss_fn(first, *args, **kwargs)

  return loss
