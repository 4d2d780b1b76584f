"""Which optax transformations an optimizer state shows it was made by.

A transformation's state (``optax.MultiStepsState``, ``optax.LookaheadState``, ...) sits
somewhere in the state ``optimizer.init`` returns, chained or nested; the trainers refuse
the transformations they cannot run by finding it there.
"""
from typing import Any

import jax


def holds(opt_state: Any, state_type: type) -> bool:
  """Whether ``opt_state`` holds a node of ``state_type`` anywhere in its tree."""
  is_state = lambda node: isinstance(node, state_type)
  return any(is_state(node) for node in jax.tree.leaves(opt_state, is_leaf=is_state))
