"""``optax.lookahead``, refused by the trainers that hold the model's own params.

``optax.lookahead`` keeps its slow weights beside the fast ones in the params:
its update reads ``params.fast`` and ``params.slow`` of an
``optax.LookaheadParams``. The interleaved and DP-SGD trainers hold the model's
params tree and hand it to the optimizer as it is, so the update would fail
inside the traced step (``AttributeError: 'dict' object has no attribute
'fast'``). Its state (``optax.LookaheadState``) shows it in any optimizer state,
chained or nested.
"""
from typing import Any

import optax

from perturbkit.core._opt_states import holds
from perturbkit.errors import LookaheadParamsError


def refuse_lookahead(opt_state: Any, where: str) -> None:
  """Raises :class:`LookaheadParamsError` if ``opt_state`` holds ``optax.lookahead``'s state.

  Args:
    opt_state: The state ``optimizer.init`` returned.
    where: Who was given the optimizer (``'perturbkit.dp_sgd'``, ...).
  """
  if holds(opt_state, optax.LookaheadState):
    raise LookaheadParamsError(where)
