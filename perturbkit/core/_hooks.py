"""Backward hooks: observe or transform the gradient flowing back through a call.

A hook is an identity on the forward pass whose VJP applies ``fn`` to the
incoming cotangent (the activation gradient of the call's output). Everything
below the call, parameters included, is then differentiated with the
transformed gradient, as with PyTorch's ``register_full_backward_hook``.
"""
import functools
from typing import Any, Callable, NamedTuple

import jax

from perturbkit.core import filters as _filters
from perturbkit.errors import UnmatchedFilterError
from perturbkit.core._points import differentiable_part, has_differentiable_leaf, merge
from perturbkit.core._types import CallFilter
from perturbkit.errors import HookFunctionError


class Hook(NamedTuple):
  """A backward hook on the calls a filter selects.

  Attributes:
    filter: ``(module, method_name) -> bool``, the calls the hook applies to.
    fn: ``cotangent -> cotangent``, same structure, shapes and dtypes; it gets
      the floating-point leaves of the call's output gradient (other leaves are
      ``None``).
  """
  filter: CallFilter
  fn: Callable[[Any], Any]


def backward_hook(fn: Callable[[Any], Any], filter: CallFilter | bool | None = None) -> Hook:
  """A hook applying ``fn`` to the activation gradient of each selected call.

  The hook is an identity on the forward pass whose VJP applies ``fn`` to the
  activation gradient of every call the filter selects. ``with_hooks(fun,
  *hooks)`` turns hooks on for any differentiation of ``fun`` (``jax.grad``,
  ``jax.vjp``, ...), and ``value_and_grad(loss_fn, hooks=[...])`` /
  ``interleaved(..., hooks=[...])`` take them too. The layers below see the
  transformed gradient, and so their parameter gradients change. The activation
  gradient reported for a hooked call is the one arriving at it; the hook's
  output is what flows to the layers below. A filter that selects no call raises
  ``UnmatchedFilterError``, listing the calls seen.

  Inside ``interleaved``, hooks also apply to the calls a segment replays, with
  the segment's path in front (see "Threads and nesting" in
  ``help(perturbkit)``).

  In NNX, hooks from ``perturbkit.nnx.interleaved(..., hooks=...)`` or from
  ``perturbkit.nnx.with_hooks`` inside the loss act as in ``jax.grad`` of the
  hooked loss: on segment calls, and on the calls inside a segment in every
  replay of it (the one at the new weights too).

  Args:
    fn: Maps the incoming cotangent to the one passed further down, e.g.
      ``lambda g: jnp.clip(g, -1, 1)``. It must be a JAX-traceable function.
    filter: The calls it applies to (default: every submodule call).

  Returns:
    A :class:`Hook`, for :func:`with_hooks` or ``value_and_grad(hooks=...)``.

  Example:
    >>> import jax.numpy as jnp
    >>> import perturbkit
    >>> clip = perturbkit.backward_hook(lambda g: jnp.clip(g, -0.1, 0.1),
    ...                                 perturbkit.filters.by_path('Dense_0'))
  """
  if not callable(fn):
    raise HookFunctionError(f'A hook function must be callable, got {fn!r:.60}')
  return Hook(_filters.as_filter(filter), fn)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _identity_with_hook(fn, x):
  del fn
  return x


def _fwd(fn, x):
  del fn
  return x, None


def _bwd(fn, residual, g):
  del residual
  out = fn(g)
  if jax.tree.structure(out) != jax.tree.structure(g):
    raise HookFunctionError(
        f'A backward hook must return a cotangent of the structure it received '
        f'({jax.tree.structure(g)}), got {jax.tree.structure(out)}')
  return (out,)


_identity_with_hook.defvjp(_fwd, _bwd)


def apply_hooks(hooks: tuple[Hook, ...], module, method_name: str, output: Any) -> Any:
  """Inserts the hooks that select this call into its output, in order."""
  if not has_differentiable_leaf(output):
    return output
  part = differentiable_part(output)
  for hook in hooks:
    if hook.filter(module, method_name):
      part = _identity_with_hook(hook.fn, part)
  return merge(output, part)



def check_matched(hooks: tuple[Hook, ...], matched: set[int], seen: list[str]):
  """Raises :class:`UnmatchedFilterError` for a hook whose filter selected no call seen."""
  if not seen:
    return  # the function made no model call this time; nothing to check against
  for i, hook in enumerate(hooks):
    if i not in matched:
      raise UnmatchedFilterError(f'backward hook #{i} ({hook.fn!r})', sorted(set(seen)))
