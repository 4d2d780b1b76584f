"""``with_hooks`` for Linen: backward hooks inserted into every model call of a function."""
import functools
from typing import Any, Callable

from perturbkit.core import filters as _filters
from perturbkit.core._hooks import Hook, check_matched, hook_runner, hooks_of
from perturbkit.core._loss import check_loss_fn
from perturbkit.linen._interceptor import intercept


def with_hooks(fun: Callable[..., Any], *hooks: Hook) -> Callable[..., Any]:
  """``fun`` with backward hooks inserted into every model call it makes.

  Works with reverse-mode differentiation of ``fun`` (``jax.grad``,
  ``perturbkit.grad``, an optax training step) and forward over reverse; not
  with forward mode alone (``jax.jvp``, ``jax.jacfwd``: see
  ``help(perturbkit.backward_hook)``). The hooks are part of ``fun`` itself, so a jitted
  ``fun`` keeps them, and nothing outlives the call. The layers below a hooked
  call see the transformed gradient, so their parameter gradients change; a
  filter that selects no call raises ``UnmatchedFilterError``, listing the calls
  seen (more in ``help(perturbkit.backward_hook)``).

  Hooks are transparent: they apply inside any perturbkit function, including to
  the calls an interleaved segment replays, with the segment's path in front
  (see "Threads and nesting" in ``help(perturbkit)``).

  Args:
    fun: Any function that calls ``model.apply``/``model.init`` inside.
    *hooks: Hooks from :func:`backward_hook` (or lists of them); several on one
      call apply in order on the forward pass, so the last one sees the
      gradient first.

  Returns:
    A function with the same signature and value as ``fun``.

  Raises:
    NoHooksError: no hook is given.
    NotAHookError: something else than a hook is given (a plain function).
    UnmatchedFilterError: (when the function runs) a hook's filter selects no
      call.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Dense(3), nn.Dense(1)])
    >>> x = jnp.ones((2, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> loss = lambda v: model.apply(v, x).sum()
    >>> zero_below = perturbkit.backward_hook(lambda g: 0 * g,
    ...                                       perturbkit.filters.by_path('layers_1'))
    >>> grads = jax.grad(perturbkit.with_hooks(loss, zero_below))(variables)
    >>> float(jnp.abs(grads['params']['layers_0']['kernel']).sum())
    0.0
  """
  check_loss_fn(fun, 'perturbkit.with_hooks', '(*args) -> value', 'function', 'fun')
  hooks = hooks_of(hooks, 'perturbkit.with_hooks')

  @functools.wraps(fun)
  def hooked(*args, **kwargs):
    seen: list[str] = []
    matched: set[int] = set()
    run_hooked = hook_runner(hooks, matched)

    def handler(call, run):
      seen.append(call.name)
      return run_hooked(call, run)

    with intercept(_filters.all_calls, handler, transparent=True, nested_applies=True):
      out = fun(*args, **kwargs)
    check_matched(hooks, matched, seen)
    return out

  return hooked
