"""Whether each K-FAC layer's calls see the examples one by one.

``G`` is an average over examples of ``g gᵀ``, ``g`` the gradient of ONE
example's loss at the layer's output. A call whose input is not computed from
the batch and has no examples axis (Whisper's encoder looks its positions up
with ``jnp.arange(max_source_positions)``) gives an output every example
shares: the gradient at it is already summed over the examples, and factors
formed from it would be ``(Σ g)(Σ g)ᵀ`` instead of ``Σ g gᵀ``. Such a layer is
skipped (refused when a filter selects it).

Whether an input is computed from the batch is read off the jaxpr of one
abstract run (``core._dependence.depends_on``), never guessed from its shape.
An input that is not is skipped whatever its shape: one whose first axis
happens to have the batch's size (a ``(length, d)`` table where the batch has
``length`` examples, or positions broadcast to ``(batch, length)`` inside the
model, as Hugging Face models make them when none are passed) cannot be told
apart from rows of one example each, as for per-example gradients
(``AmbiguousInputError``). To have such a layer covered, make its input part of
the batch: pass the positions in ``inputs`` (Hugging Face:
``position_ids=jnp.broadcast_to(jnp.arange(length), ids.shape)``, built outside
``predict_fn``).

A layer run once per iteration of ``nn.scan`` (its params stacked per iteration)
is called inside the transform, whose values do not leave it in that run: its
input is checked by its shape alone, the batch's examples on the first axis of
each iteration's input.

The examples are counted on the first axis of the arrays of ``inputs``, which
must all have them there (``batch_examples``): an array every example shares (a
``(length, length)`` mask) is passed through ``predict_fn``, not in ``inputs``.

A LayerNorm's diagonal Fisher squares each example's gradient, summed over its
locations (``_scale_shift``), so its calls' inputs must have the examples on
their first axis; one that does not is skipped with that reason. Its rule normalises
over every feature, so a call given a ``mask`` (``nn.LayerNorm()(x, mask=m)``) is
skipped too.
"""
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from perturbkit.core._dependence import depends_on
from perturbkit.core._examples import num_examples
from perturbkit.errors import KFACInputsError


def batch_examples(inputs: Any, function: str) -> int | None:
  """The batch's number of examples: the first axis every array of ``inputs`` has.

  Counting them on the first array alone would take a shared array (a ``(length,
  length)`` mask sorted before the tokens) for the batch, and every factor would be
  averaged over the wrong count, silently.

  Raises:
    KFACInputsError: array leaves of ``inputs`` (with at least one axis) have
      different first axes.
  """
  leaves = jax.tree_util.tree_flatten_with_path(inputs)[0]
  first_axes = {jax.tree_util.keystr(path) or 'inputs': jnp.shape(leaf)[0]
                for path, leaf in leaves if jnp.ndim(leaf) >= 1}
  if len(set(first_axes.values())) > 1:
    raise KFACInputsError(function, ', '.join(f'{name}: {size}'
                                              for name, size in first_axes.items()))
  return num_examples(inputs)


def grouping_reason(shape: tuple[int, ...], examples: int | None) -> str | None:
  """Why a norm's call on an input of ``shape`` has no diagonal rule, or ``None``: its
  rule needs the batch's ``examples`` on the input's first axis."""
  if examples is not None and len(shape) >= 2 and shape[0] == examples:
    return None
  return (f'its input (shape {tuple(shape)}) does not have the batch\'s {examples} examples '
          'on its first axis, and the diagonal Fisher of its scale and bias squares each '
          'example\'s gradient')


def mask_reason(kwargs: dict) -> str | None:
  """Why a norm's call with keyword arguments ``kwargs`` has no diagonal rule, or ``None``:
  the rule normalises over every feature, which a ``mask`` would restrict."""
  if kwargs.get('mask') is not None:
    return 'it is called with a mask, and its rule normalises over every feature'
  return None


def input_reason(shape: tuple[int, ...], examples: int | None, grouped: bool,
                 from_batch: bool | None, stacked: bool = False) -> str | None:
  """Why a call on an input of ``shape`` does not see the batch's ``examples`` one by one,
  or ``None``. ``grouped``: the layer's rule groups the rows by example (a norm);
  ``from_batch``: whether the input is computed from the batch (``None``: not known, for
  a call inside a transform); ``stacked``: the call is one iteration of a stacked layer,
  whose ``shape`` is one iteration's input and must have the examples first."""
  if grouped:
    reason = grouping_reason(shape, examples)
    if reason is not None:
      return reason
  if from_batch is False:
    return _not_from_batch(shape)
  if (from_batch is None or stacked) and not (
      examples is not None and len(shape) >= 1 and shape[0] == examples):
    unknown = (', and inside its transform K-FAC cannot tell whether it carries them'
               if from_batch is None else '')
    return (f'each iteration\'s input (shape {tuple(shape)}) does not have the batch\'s '
            f'{examples} examples on its first axis{unknown}')
  return None


def _not_from_batch(shape: tuple[int, ...]) -> str:
  return (f'its input (shape {tuple(shape)}) is not computed from the batch `inputs` '
          '(e.g. positions built inside the model with `jnp.arange`): every example may '
          'share it, and then the gradient at its output is summed over the examples where '
          'K-FAC needs each example\'s; whatever its shape, K-FAC cannot tell its rows '
          'from the examples and does not guess. To cover the layer, pass that array as '
          'part of the batch `inputs`, with the examples on its first axis, and from there '
          'to the model (Hugging Face: `position_ids=jnp.broadcast_to(jnp.arange(length), '
          'ids.shape)` built outside predict_fn); where the model takes no such argument '
          '(T5\'s relative position buckets, made inside its attention), leave the layer '
          'to the plain gradient of the fallback')


def shared_input_reasons(jaxpr: Any, shared: Any, inputs: Any,
                         recorded: list[tuple[str, tuple]],
                         grouped: set[str] = frozenset(),
                         per_iteration: list[tuple[str, tuple]] = (),
                         stacked: set[str] = frozenset(),
                         masked: Mapping[str, str] | None = None) -> dict[str, str]:
  """``{layer: reason}`` for the layers with a call that does not see the examples, or a
  norm's call given a mask.

  Args:
    jaxpr: A closed jaxpr of ``(shared, inputs)`` whose outputs are the recorded
      calls' inputs, in order.
    shared: Its first argument, the same for every example (the model's variables).
    inputs: Its second argument, the batch.
    recorded: ``(layer name, input shape)`` of each output of ``jaxpr`` (one
      iteration's shape for a layer in ``stacked``).
    grouped: The layers whose rule groups the rows by example (the norms): their
      inputs must have the examples on the first axis.
    per_iteration: ``(layer name, shape of one iteration's input)`` of the calls of
      stacked layers, inside their transform (not outputs of ``jaxpr``): checked by
      their shape alone.
    stacked: The layers of ``recorded`` stacked per iteration: each iteration's
      input must also have the examples on its first axis.
    masked: ``{layer: mask_reason}`` of the norms with a call given a mask.
  """
  examples = num_examples(inputs)  # checked by batch_examples where the inputs were given
  batched = [False] * len(jax.tree.leaves(shared)) + [True] * len(jax.tree.leaves(inputs))
  from_batch = depends_on(jaxpr.jaxpr, batched)
  reasons: dict[str, str] = dict(masked or {})
  calls = [*zip(recorded, from_batch), *((call, None) for call in per_iteration)]
  for (name, shape), dependent in calls:
    reason = input_reason(shape, examples, name in grouped, dependent, name in stacked)
    if reason is not None:
      reasons.setdefault(name, reason)
  return reasons
