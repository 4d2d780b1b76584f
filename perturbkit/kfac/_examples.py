"""Whether each K-FAC layer's calls see the examples one by one.

``G`` is an average over examples of ``g gᵀ``, ``g`` the gradient of ONE
example's loss at the layer's output. A call whose input is not computed from
the batch and has no examples axis (Whisper's encoder looks its positions up
with ``jnp.arange(max_source_positions)``) gives an output every example
shares: the gradient at it is already summed over the examples, and factors
formed from it would be ``(Σ g)(Σ g)ᵀ`` instead of ``Σ g gᵀ``. Such a layer is
skipped (refused when a filter selects it).

Whether an input is computed from the batch is read off the jaxpr of one
abstract run (``_per_example_inputs.depends_on``), never guessed. An input
that is not, but whose first axis has the batch's size, is taken as built for
the batch (positions broadcast to ``(batch, length)``, as Hugging Face models
make them when none are passed).

A layer run once per iteration of ``nn.scan`` (its params stacked per iteration)
is called inside the transform, whose values do not leave it in that run: its
input is checked by its shape alone, the batch's examples on the first axis of
each iteration's input.

A LayerNorm's diagonal Fisher squares each example's gradient, summed over its
locations (``_scale_shift``), so its calls' inputs must have the examples on
their first axis; one that does not is skipped with that reason.
"""
from typing import Any

import jax

from perturbkit.core._dependence import depends_on
from perturbkit.core._examples import num_examples


def grouping_reason(shape: tuple[int, ...], examples: int | None) -> str | None:
  """Why a norm's call on an input of ``shape`` has no diagonal rule, or ``None``: its
  rule needs the batch's ``examples`` on the input's first axis."""
  if examples is not None and len(shape) >= 2 and shape[0] == examples:
    return None
  return (f'its input (shape {tuple(shape)}) does not have the batch\'s {examples} examples '
          'on its first axis, and the diagonal Fisher of its scale and bias squares each '
          'example\'s gradient')


def input_reason(shape: tuple[int, ...], examples: int | None, grouped: bool,
                 from_batch: bool | None) -> str | None:
  """Why a call on an input of ``shape`` does not see the batch's ``examples`` one by one,
  or ``None``. ``grouped``: the layer's rule groups the rows by example (a norm);
  ``from_batch``: whether the input is computed from the batch (``None``: not known, for
  a call inside a transform)."""
  if grouped:
    reason = grouping_reason(shape, examples)
    if reason is not None:
      return reason
  if from_batch or (examples is not None and len(shape) >= 1 and shape[0] == examples):
    return None
  if from_batch is None:
    return (f'each iteration\'s input (shape {tuple(shape)}) does not have the batch\'s '
            f'{examples} examples on its first axis, and inside its transform K-FAC '
            'cannot tell whether it carries them')
  return (f'its input (shape {tuple(shape)}) is neither computed from the batch nor has '
          f'the batch\'s {examples} examples on its first axis (e.g. positions built '
          'inside the model): the gradient at its output is summed over the examples, '
          'and K-FAC needs each example\'s')


def shared_input_reasons(jaxpr: Any, shared: Any, inputs: Any,
                         recorded: list[tuple[str, tuple]],
                         grouped: set[str] = frozenset(),
                         per_iteration: list[tuple[str, tuple]] = ()) -> dict[str, str]:
  """``{layer: reason}`` for the layers with a call that does not see the examples.

  Args:
    jaxpr: A closed jaxpr of ``(shared, inputs)`` whose outputs are the recorded
      calls' inputs, in order.
    shared: Its first argument, the same for every example (the model's variables).
    inputs: Its second argument, the batch.
    recorded: ``(layer name, input shape)`` of each output of ``jaxpr``.
    grouped: The layers whose rule groups the rows by example (the norms): their
      inputs must have the examples on the first axis.
    per_iteration: ``(layer name, shape of one iteration's input)`` of the calls of
      stacked layers, inside their transform (not outputs of ``jaxpr``): checked by
      their shape alone.
  """
  examples = num_examples(inputs)
  batched = [False] * len(jax.tree.leaves(shared)) + [True] * len(jax.tree.leaves(inputs))
  from_batch = depends_on(jaxpr.jaxpr, batched)
  reasons: dict[str, str] = {}
  calls = [*zip(recorded, from_batch), *((call, None) for call in per_iteration)]
  for (name, shape), dependent in calls:
    reason = input_reason(shape, examples, name in grouped, dependent)
    if reason is not None:
      reasons.setdefault(name, reason)
  return reasons
