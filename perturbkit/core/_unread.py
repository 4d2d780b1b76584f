"""Which modules own params that a loss never reads: none of its outputs is computed from them.

Hugging Face's Wav2Vec2 owns ``masked_spec_embed`` in the module around its whole encoder
and reads it only when the loss passes ``mask_time_indices``; without them the param is
in the variables but no equation of the loss takes it. Such params carry no gradient
(zero) and say nothing about which calls belong together.
"""
from typing import Any, Callable, Sequence

import jax

from perturbkit.core._dependence import needed_inputs

Path = tuple[str | int, ...]


def unread_owners(fn: Callable[..., Any], params: Any, others: Sequence[Any],
                  owner_of: Callable[[tuple[str, ...]], Path | None]) -> set[Path]:
  """The modules none of whose params an output of ``fn(params, *others)`` is computed from.

  Args:
    fn: The loss as a function of the params (a tree of arrays) and ``others``.
    params: The params.
    others: The other arguments of ``fn``, traced as they are.
    owner_of: Key path of a param leaf (every key a string) -> the module owning it
      directly, or ``None``.

  A param read only under ``stop_gradient`` or inside a nested jaxpr (``jit``,
  ``checkpoint``, loops) that takes it counts as read.
  """
  closed = jax.make_jaxpr(fn)(params, *others)
  keys = [tuple(str(getattr(k, 'key', k)) for k in path)
          for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  needed = needed_inputs(closed.jaxpr, [True] * len(closed.jaxpr.outvars))[:len(keys)]
  owners = [owner_of(k) for k in keys]
  read = {owner for owner, n in zip(owners, needed) if n}
  return {owner for owner in owners if owner is not None} - read
