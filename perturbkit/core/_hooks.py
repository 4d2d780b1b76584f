"""Backward hooks: observe or transform the gradient flowing back through a call.

A hook is an identity on the forward pass whose VJP applies ``fn`` to the
incoming cotangent (the activation gradient of the call's output). Everything
below the call, parameters included, is then differentiated with the
transformed gradient, as with PyTorch's ``register_full_backward_hook``.
"""
import functools
import inspect
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from perturbkit.core import filters as _filters
from perturbkit.core._callables import selects, takes
from perturbkit.core._points import differentiable_part, has_differentiable_leaf, merge
from perturbkit.core._types import CallFilter
from perturbkit.errors import (HookFunctionError, HookOutputError, NoHooksError, NotAHookError,
                               UnmatchedFilterError)


class Hook(NamedTuple):
  """A backward hook on the calls a filter selects.

  Attributes:
    filter: ``(module, method_name) -> bool``, the calls the hook applies to.
    fn: ``cotangent -> cotangent``, same structure and shapes (floating-point
      leaves in another precision are cast back to the cotangent's); it gets
      the floating-point leaves of the call's output gradient (other leaves are
      ``None``, see :func:`backward_hook`).
  """
  filter: CallFilter
  fn: Callable[[Any], Any]


def backward_hook(fn: Callable[[Any], Any], filter: CallFilter | bool | None = None) -> Hook:
  """A hook applying ``fn`` to the activation gradient of each selected call.

  The hook is an identity on the forward pass whose VJP applies ``fn`` to the
  activation gradient of every call the filter selects. ``with_hooks(fun,
  *hooks)`` turns hooks on for reverse-mode differentiation of ``fun``
  (``jax.grad``, ``jax.vjp``, ``jax.jacrev``, an optax training step) and for
  forward-over-reverse (``jax.jvp`` of ``jax.grad``, ``jax.hessian``), and
  ``value_and_grad(loss_fn, hooks=[...])`` / ``interleaved(..., hooks=[...])``
  take them too (one hook or a list). The layers below see the transformed
  gradient, and so their parameter gradients change. The activation gradient
  reported for a hooked call is the one arriving at it; the hook's output is
  what flows to the layers below. A filter that selects no call raises
  ``UnmatchedFilterError``, listing the calls seen.

  Once per module call, as a PyTorch module hook: a hook acts on the output of
  the outermost call of a module it selects. A call made while a call of the
  same module that the hook also selects runs (a helper method such as Hugging
  Face's ``_split_heads`` and ``_merge_heads`` inside its attention's
  ``__call__``) leaves the gradient to that enclosing call, whose output
  carries it already; otherwise ``by_path('attn')`` would transform the
  gradient at each of those calls on its way down. To hook a helper method's
  own output, select it alone: ``filters.all_of(filters.by_path('attn'),
  filters.by_method('_split_heads'))``. Calls of a module inside another
  module's call are separate calls (``by_path('attn/*')`` acts on each).

  Differentiation: each hook is a ``jax.custom_vjp``, so forward mode alone
  (``jax.jvp`` or ``jax.jacfwd`` of the hooked function) raises JAX's
  ``TypeError: can't apply forward-mode autodiff (jvp) to a custom_vjp
  function``; a hook only acts on a gradient, so differentiate in reverse mode
  (``jax.jacrev`` for a Jacobian), or forward over reverse.

  Inside ``interleaved``, hooks also apply to the calls a segment replays, with
  the segment's path in front (see "Threads and nesting" in
  ``help(perturbkit)``).

  In NNX, hooks from ``perturbkit.nnx.interleaved(..., hooks=...)`` or from
  ``perturbkit.nnx.with_hooks`` inside the loss act as in ``jax.grad`` of the
  hooked loss: on segment calls, and on the calls inside a segment in every
  replay of it (the one at the new weights too). NNX calls are those of
  ``__call__`` and the other public methods.

  The cotangent: ``fn`` gets the cotangent of the call's floating-point output
  leaves, laid out as ``value_and_grad`` reports the call's activation gradient
  and ``run_with_cache`` its output. Where ``jax.vjp`` takes a ``float0`` zero
  for a leaf that is not floating point (an ``argmax`` index beside the
  output), the hook gets ``None``, as a PyTorch hook does for an output with no
  gradient: a call returning ``(h, index)`` hands ``fn`` ``(g, None)``, a dict
  keeps its keys, and a pytree node of your own (a ``flax.struct`` dataclass,
  a Hugging Face ``ModelOutput``) with such a leaf comes as the tuple of its
  floating-point leaves' cotangents in ``jax.tree.leaves`` order (as it is, if
  every leaf is floating point). So ``lambda g: jax.tree.map(f, g)`` acts on the
  gradients alone; ``fn`` returns the same layout, ``None`` where it got ``None``.

  Args:
    fn: Maps the incoming cotangent to the one passed further down, e.g.
      ``lambda g: jnp.clip(g, -1, 1)``, with the same structure and shapes (see
      "The cotangent" above for a call with leaves that are not floating point).
      A floating-point leaf computed in another precision (float32 on a
      bfloat16 model) is cast back to the cotangent's dtype, so the params'
      gradients keep theirs. It must be a JAX-traceable function.
    filter: The calls it applies to (default: every submodule call).

  Returns:
    A :class:`Hook`, for :func:`with_hooks` or ``value_and_grad(hooks=...)``.

  Raises:
    HookFunctionError: ``fn`` is not callable.
    HookOutputError: (in the backward pass) ``fn`` returned a cotangent of
      another structure or shape than it was given, or a leaf that is not
      floating point.

  Example:
    >>> import jax.numpy as jnp
    >>> import perturbkit
    >>> clip = perturbkit.backward_hook(lambda g: jnp.clip(g, -0.1, 0.1),
    ...                                 perturbkit.filters.by_path('Dense_0'))
  """
  if not callable(fn):
    raise HookFunctionError(f'A hook function must be callable, got {fn!r:.60}')
  if not takes(fn, 1):
    raise HookFunctionError(f'A hook function takes one argument, the cotangent, but '
                            f'{fn!r:.60} takes {inspect.signature(fn)}')
  return Hook(_filters.as_filter(filter), fn)


def hooks_tuple(hooks: Any, function: str) -> tuple[Hook, ...]:
  """``hooks`` as a tuple of hooks: one :class:`Hook`, or a list or tuple of them.

  Args:
    hooks: What the user passed (``hooks=`` of an entry point).
    function: The public function, for the message.

  Returns:
    The hooks, in order.

  Raises:
    NotAHookError: ``hooks`` or one of its items is not a :class:`Hook`.
    FilterError, HookFunctionError: a :class:`Hook` built by hand holds no call filter or
      no function of the cotangent (the checks of :func:`backward_hook`).
  """
  if isinstance(hooks, Hook):
    hooks = (hooks,)
  if not isinstance(hooks, (list, tuple)):
    raise NotAHookError(function, hooks)
  for hook in hooks:
    if not isinstance(hook, Hook):
      raise NotAHookError(function, hook)
    backward_hook(hook.fn, hook.filter)  # its checks, for a Hook built by hand
  return tuple(hooks)


def hooks_of(given: tuple, function: str) -> tuple[Hook, ...]:
  """The hooks of ``with_hooks(fun, *given)``: each item a :class:`Hook` or a list or tuple
  of them.

  Raises:
    NoHooksError: there is none.
    NotAHookError: an item is neither a :class:`Hook` nor a list or tuple of them.
  """
  hooks = tuple(h for item in given for h in hooks_tuple(item, function))
  if not hooks:
    raise NoHooksError(function)
  return hooks


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _identity_with_hook(fn, where, x):
  del fn, where
  return x


def _fwd(fn, where, x):
  del fn, where
  return x, None


def _mismatch(received: Any, returned: Any) -> str | None:
  """How ``returned`` differs from the cotangent ``received`` (structure, shape, or a dtype
  that is not floating point where the cotangent's is)."""
  if jax.tree.structure(returned) != jax.tree.structure(received):
    return f'the structure {jax.tree.structure(returned)} for {jax.tree.structure(received)}'
  for index, (r, g) in enumerate(zip(jax.tree.leaves(returned), jax.tree.leaves(received))):
    shape, dtype = np.shape(r), jnp.result_type(r)
    if shape != g.shape or (dtype != g.dtype and not jnp.issubdtype(dtype, jnp.floating)):
      leaf = f' at leaf {index}' if len(jax.tree.leaves(received)) > 1 else ''
      return (f'{dtype.name}{list(shape)} for {g.dtype.name}{list(g.shape)}{leaf}')
  return None


def _bwd(fn, where, residual, g):
  del residual
  out = fn(g)
  mismatch = _mismatch(g, out)
  if mismatch is not None:
    raise HookOutputError(fn, where, mismatch)
  # A hook computing in another precision (float32 on a bfloat16 model, or the reverse)
  # hands back the gradient's own dtype: the params' gradients keep theirs.
  return (jax.tree.map(lambda r, g: r.astype(g.dtype), out, g),)


_identity_with_hook.defvjp(_fwd, _bwd)


def apply_hooks(hooks: Sequence[Hook], where: str, output: Any) -> Any:
  """Inserts ``hooks`` (already chosen for this call) into its output, in order.

  Args:
    hooks: The hooks to apply, whatever their filters say.
    where: The call's name, for errors (``'Block_0/Dense_1/__call__'``).
    output: The call's output.

  Returns:
    The output, its floating-point leaves passed through each hook's identity.
  """
  if not hooks or not has_differentiable_leaf(output):
    return output
  part = differentiable_part(output)
  for hook in hooks:
    part = _identity_with_hook(hook.fn, where, part)
  return merge(output, part)


def selecting(hooks: Sequence[Hook], module: Any, method_name: str) -> list[int]:
  """The indices of the hooks whose filters select the call."""
  return [i for i, hook in enumerate(hooks) if selects(hook.filter, module, method_name)]


def hook_runner(hooks: Sequence[Hook], matched: set[int] | None = None
                ) -> Callable[[Any, Callable[[], Any]], Any]:
  """A handler ``(call, run) -> output`` that runs a call and inserts its hooks.

  A hook acts once per call of a module it selects: not on a call made while a
  call of the same module (the same path) that it also selects runs (a helper
  method such as Hugging Face's ``_split_heads`` inside the attention's
  ``__call__``), whose output already carries the transformed gradient.

  Args:
    hooks: The hooks of one block.
    matched: Gets the indices of the hooks that selected a call (for
      :func:`check_matched`).

  Returns:
    The handler, for one run of the calls (it follows their nesting); ``call``
    has ``module``, ``method_name``, ``path`` and ``name``.
  """
  hooks = tuple(hooks)
  running: list[tuple[tuple, frozenset[int]]] = []  # (path, hooks selecting it), innermost last

  def on_call(call: Any, run: Callable[[], Any]) -> Any:
    selected = selecting(hooks, call.module, call.method_name)
    if matched is not None:
      matched.update(selected)
    path = tuple(call.path)
    enclosing = frozenset().union(*(s for p, s in running if p == path))
    running.append((path, frozenset(selected)))
    try:
      output = run()
    finally:
      running.pop()
    return apply_hooks([hooks[i] for i in selected if i not in enclosing], call.name, output)

  return on_call


def check_matched(hooks: tuple[Hook, ...], matched: set[int], seen: list[str]):
  """Raises :class:`UnmatchedFilterError` for a hook whose filter selected no call seen."""
  if not seen:
    return  # the function made no model call this time; nothing to check against
  for i, hook in enumerate(hooks):
    if i not in matched:
      raise UnmatchedFilterError(f'backward hook #{i} ({hook.fn!r})', sorted(set(seen)))
