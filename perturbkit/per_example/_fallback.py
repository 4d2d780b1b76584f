"""Which calls can be replayed per example on their own, and which owners need the whole ``apply``.

Per-example gradients are built call by call: each call of a param-owning module is
replayed on one example's inputs with that example's output gradient. That needs
the call's per-example inputs to hold the examples on axis 0, and at least one of
them. Some params of models whose examples do not mix cannot be reached that way:

* the root module's own params, read by the root's own code (BART's
  ``final_logits_bias``, Wav2Vec2's ``masked_spec_embed``): no call of theirs is seen;
* params read outside their module's calls inside the model (DistilBERT passes its
  word embedding to the vocabulary projector as an argument);
* calls that see the examples merged with another axis (OPT's feed-forward layers on
  ``(examples * positions, features)``) or on another axis than 0;
* calls with no per-example input (Whisper's encoder looks its position embedding up
  at ``jnp.arange`` inside the model), whose output gradient is already summed over
  the examples, and calls given a constant with as many rows as there are examples
  (DistilBERT broadcasts ``jnp.arange`` to the batch for its position embedding), which
  could be the examples or shared.

These owners get their per-example gradients from the top-level ``apply`` they run in,
replayed per example (``_per_example_reads``): the cost of ``jax.vmap(jax.grad)`` of that
``apply``, computed once for all of them, and only for models that have such owners. The
whole ``apply`` rebuilds inside the model whatever it builds there, so the replay is right
either way; ids the model accepts as arguments (``position_ids``), passed batched to the
loss, keep the calls' own fast paths. A call whose inputs do not allow its ``apply`` to be
replayed per example either (an ``apply`` given a constant made in the loss) keeps its error;
params no call of theirs is seen for (the root's own) get that ``apply``'s error
(:func:`unreplayed_error`).
"""
from typing import Any, Iterable, Sequence

import jax

from perturbkit.core._types import Path
from perturbkit.core._values import is_array
from perturbkit.errors import (AmbiguousInputError, ExamplesAxisError, PerExampleError,
                               SharedCallError)

Shape = tuple[int, ...]


def source_error(sources: Sequence[str], shapes: Sequence[Shape], num_examples: int,
                 where: str, nnx: bool = False) -> PerExampleError | None:
  """Why a call cannot be replayed per example from its inputs, if it cannot.

  Args:
    sources: What each array input is computed from (``Use.sources``).
    shapes: The array inputs' shapes, in the same order.
    num_examples: The number of examples.
    where: The call's name, for the message.
    nnx: Whether the model is an NNX one (the message speaks of its model calls, not of
      ``model.apply``).

  Returns:
    :class:`ExamplesAxisError` if a per-example input has another axis 0,
    :class:`AmbiguousInputError` if a constant input has as many rows as there are
    examples, :class:`SharedCallError` if no input is per-example, else ``None``.
  """
  for index, (shape, kind) in enumerate(zip(shapes, sources)):
    rows = tuple(shape[:1])
    if kind == 'example' and rows != (num_examples,):
      return ExamplesAxisError(
          f'input {index} of the call {where} is computed from the batched arguments but has '
          f'shape {tuple(shape)}, whose axis 0 is not the {num_examples} examples')
    if kind == 'constant' and rows == (num_examples,):
      return AmbiguousInputError(where, index, tuple(shape))
  if 'example' not in sources:
    return SharedCallError(where, nnx)
  return None


def array_shapes(tree: Any) -> list[Shape]:
  """The shapes of ``tree``'s array leaves (JAX and NumPy, as a trace takes them), in the
  order of a call's ``sources``."""
  return [jax.numpy.shape(x) for x in jax.tree.leaves(tree) if is_array(x)]


def check_sources(sources: Sequence[str], shapes: Sequence[Shape], num_examples: int,
                  where: str, nnx: bool = False) -> None:
  """Raises :func:`source_error`'s error, if there is one."""
  error = source_error(sources, shapes, num_examples, where, nnx)
  if error is not None:
    raise error


def replayed_owners(owners: set[Path], calls: Iterable[tuple[Path, Sequence[str], list[Shape]]],
                    read_inside: set[Path], num_examples: int) -> frozenset[Path]:
  """The owners whose per-example gradients must come from a replay of the whole ``apply``.

  Args:
    owners: Every param-owning module's path.
    calls: ``(path, sources, shapes)`` of each recorded call of an owner.
    read_inside: The owners whose params are read outside their calls, inside an ``apply``.
    num_examples: The number of examples.

  Returns:
    The root (if it owns params), ``read_inside``, and the owners of calls that
    :func:`source_error` finds fault with.
  """
  misfits = {path for path, sources, shapes in calls
             if source_error(sources, shapes, num_examples, '') is not None}
  return frozenset((owners & {()}) | read_inside | misfits)


def unreplayed_error(uncovered: set[Path],
                     applies: Iterable[tuple[str, frozenset, Sequence[str], list[Shape]]],
                     num_examples: int) -> PerExampleError | None:
  """Why params no call covers were left out: the ``apply`` reading them cannot be replayed.

  Args:
    uncovered: The owners no call and no replay gives per-example gradients.
    applies: ``(name, owners its output depends on, sources, shapes)`` of each top-level
      ``apply`` that cannot be replayed per example.
    num_examples: The number of examples.

  Returns:
    :func:`source_error`'s error for the first such ``apply`` whose output depends on
    an uncovered owner (BART's root ``final_logits_bias`` read by an ``apply`` given
    positions made in the loss: not unused params, an input to pass), else ``None``.
  """
  for where, needed, sources, shapes in applies:
    if needed & uncovered:
      error = source_error(sources, shapes, num_examples, where)
      if error is not None:
        return error
  return None
