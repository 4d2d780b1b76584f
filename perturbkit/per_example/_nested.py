"""Nested ``apply`` calls inside a loss: found in execution order, and what they were given.

A nested ``apply`` (``self.lm_head.apply({'params': {'kernel': w.T}}, h)``) is not a
submodule call, so the interceptor of the model's calls does not see it; this
module finds the outermost ones by a Flax method interceptor of its own, counting
them in execution order (see ``_per_example_reads`` for what they are used for).
The loss's own top-level applies can be handed over too, in the same count: they
are how the params of modules called inside lifted transforms get their gradients.
"""
import contextlib
import threading
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
from flax.linen.module import TestScope as SetupCheckScope

from perturbkit.core._points import COLLECTION
from perturbkit.linen._interceptor import function_transform

# ``(index, module, method_name, args, kwargs, run) -> output`` for each outermost nested apply.
NestedHandler = Callable[[int, nn.Module, str, tuple, dict, Callable[[], Any]], Any]


class _Replays(threading.local):
  """Whether a replay (:func:`replay`) is about to start its ``apply`` in this thread."""

  def __init__(self):
    self.pending = False


_REPLAYS = _Replays()


@contextlib.contextmanager
def replay() -> Iterator[None]:
  """The ``apply`` started next in this block is a replay of one of the model's calls.

  perturbkit replays a call as an ``apply`` of its module; :func:`nested_applies`
  treats that ``apply`` as part of the running one, not as a nested apply of the model.
  """
  previous, _REPLAYS.pending = _REPLAYS.pending, True
  try:
    yield
  finally:
    _REPLAYS.pending = previous


@contextlib.contextmanager
def nested_applies(on_nested: NestedHandler,
                   on_top: NestedHandler | None = None) -> Iterator[None]:
  """Hands every outermost ``apply`` made inside another ``apply`` to ``on_nested``.

  With ``on_top``, every top-level ``apply`` (the loss's own ``model.apply``) is
  handed to it. The index counts both in execution order. ``apply`` calls nested
  inside a nested one run as they are (they are part of its replay), and so do
  the replays of calls started under :func:`replay`.
  """
  roots: list[Any] = []  # the scopes of the applies running now, outermost first
  replays: list[Any] = []  # those of them that are replays of the model's calls
  count = [0]

  def interceptor(next_fun, args, kwargs, context):
    module, method_name = context.module, context.method_name
    run = lambda: next_fun(*args, **kwargs)
    # Submodule calls, and a root calling its own methods, are part of the running apply;
    # so is a branch of nn.cond/nn.switch on the root (a copy of it, in a scope of its own);
    # a lifted module's check of its ``setup`` (run on a ``TestScope``) is no apply at all.
    if (module.scope is None or module.path or method_name == 'setup'
        or isinstance(module.scope, SetupCheckScope) or function_transform(module)
        or any(module.scope is scope for scope in roots)):
      return run()
    roots.append(module.scope)
    if _REPLAYS.pending:
      _REPLAYS.pending = False
      replays.append(module.scope)
    try:
      handler = {1: on_top, 2: on_nested}.get(len(roots) - len(replays))
      if handler is None or replays and replays[-1] is module.scope:
        return run()
      index = count[0]
      count[0] += 1
      return handler(index, module, method_name, args, kwargs, run)
    finally:
      done = roots.pop()
      if replays and replays[-1] is done:
        replays.pop()

  with nn.intercept_methods(interceptor):
    yield


def nested_params(module: nn.Module) -> Any:
  """The params a nested ``apply`` was given, as plain dicts."""
  return jax.tree.map(lambda x: x, dict(module.variables.get('params', {})))


def nested_others(module: nn.Module) -> dict:
  """The ``apply``'s collections other than params (and perturbkit's perturbations)."""
  return {c: v for c, v in module.variables.items() if c not in ('params', COLLECTION)}
