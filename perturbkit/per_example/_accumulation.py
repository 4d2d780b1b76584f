"""Gradient accumulation (``optax.MultiSteps``) refused as the optimizer of DP-SGD.

Each ``dp_sgd`` step clips and noises its own batch's mean gradient. Under
``optax.MultiSteps`` the update applied every ``k`` steps is the mean of ``k``
such means, each with its own noise ``σC·ξ/B``: the noise on the applied
gradient is ``σC/(√k·B)``, ``√k`` times the ``σC/(k·B)`` of one DP-SGD step on
the ``k``-times larger batch that accumulation is meant to stand for. The
privacy accounting of the ``k`` steps is still that of ``k`` steps, so nothing
leaks, but the training is not the large-batch DP-SGD it looks like. Both
spellings are refused: the ``MultiSteps`` object (checked when the trainer is
made) and its ``gradient_transformation()`` (its state, when ``init`` runs).
"""
from typing import Any

import optax

from perturbkit.core._opt_states import holds
from perturbkit.errors import PrivateAccumulationError


def refuse_accumulation(optimizer: Any, where: str) -> None:
  """Raises :class:`PrivateAccumulationError` if ``optimizer`` is an ``optax.MultiSteps``."""
  if isinstance(optimizer, optax.MultiSteps):
    raise PrivateAccumulationError(where)


def refuse_accumulation_state(opt_state: Any, where: str) -> None:
  """Raises :class:`PrivateAccumulationError` if ``opt_state`` holds a ``MultiStepsState``
  (``optax.MultiSteps(...).gradient_transformation()``, chained or nested)."""
  if holds(opt_state, optax.MultiStepsState):
    raise PrivateAccumulationError(where)
