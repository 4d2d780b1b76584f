"""Variables in Flax's containers: metadata boxes (``nn.with_partitioning``) and ``FrozenDict``.

A model whose initializers are wrapped for sharding keeps each such param as an
``nn.Partitioned`` (an ``AxisMetadata`` box around the array) in its variables, and
``flax.core.freeze`` (older Flax, ``TrainState`` code) gives them as ``FrozenDict``.
``model.apply`` takes either, and ``jax.grad`` returns the gradient in the same
containers, so that ``nn.get_partition_spec`` reads the sharding of params, gradients
and optimizer states alike. The functions that look at the params one by one
(per-example norms, K-FAC) work on nested dicts of arrays (``plain``) and hand back
what mirrors the params (a gradient, an update) in the containers they came in
(``in_containers_of``).
"""
from typing import Any

import jax
from flax.core import meta, unfreeze


def plain(tree: Any) -> Any:
  """``tree`` as nested dicts of arrays: every box replaced by its array (a sharding
  constraint where the box names mesh axes and a mesh is active, as ``model.apply``
  does), every ``FrozenDict`` by a dict."""
  return unfreeze(meta.unbox(tree))


def in_containers_of(like: Any, values: Any) -> Any:
  """``values`` (``plain(like)``'s structure, other arrays) in ``like``'s boxes and dicts.

  ``values`` itself where ``like`` is already plain or the two hold different numbers of
  arrays (they are not the same params).
  """
  structure = jax.tree.structure(like)
  leaves, values_structure = jax.tree.flatten(values)
  if structure == values_structure or len(leaves) != structure.num_leaves:
    return values
  return jax.tree.unflatten(structure, leaves)
