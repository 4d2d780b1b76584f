"""optax's own DP-SGD transformation, refused where it would be given batch gradients.

``optax.contrib.differentially_private_aggregate`` (and ``optax.contrib.dpsgd``,
built on it) clips and noises PER-EXAMPLE gradients: every gradient leaf it
receives must have a leading examples axis. ``interleaved`` hands a segment's
optimizer the batch gradient, and ``dp_sgd`` its already clipped and noised
mean: the transformation would take the first axis of every param for the
examples and clip rows of the weight gradient, a wrong update with no error.
Its state (``DifferentiallyPrivateAggregateState``) shows it in any optimizer
state, chained or nested.
"""
from typing import Any

import optax.contrib

from perturbkit.core._opt_states import holds
from perturbkit.errors import OptaxPrivacyError

_STATE = getattr(optax.contrib, 'DifferentiallyPrivateAggregateState', None)


def refuse_optax_privacy(opt_state: Any, where: str, given: str) -> None:
  """Raises :class:`OptaxPrivacyError` if ``opt_state`` holds optax's DP aggregate state.

  Args:
    opt_state: The state ``optimizer.init`` returned.
    where: Who was given the optimizer (``'perturbkit.dp_sgd'``, ...).
    given: What its updates would receive instead of per-example gradients.
  """
  if _STATE is not None and holds(opt_state, _STATE):
    raise OptaxPrivacyError(where, given)
