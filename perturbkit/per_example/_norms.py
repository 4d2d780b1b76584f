"""Per-example gradient norms of an unmodified model, from one forward and one backward pass."""
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import traverse_util

from perturbkit.core._boxes import plain
from perturbkit.core._values import values_closed_over
from perturbkit.linen._driver import check_variables
from perturbkit.per_example._batch import BatchAxes, check_batch_axes
from perturbkit.per_example._check import reduction_checker
from perturbkit.per_example._pass import Pass, run_pass
from perturbkit.per_example._reads import grads_with_reads, tied_head
from perturbkit.per_example._rules import (DENSE_METHODS, LayerNorms, embed_rule, heads_of,
                                           heads_use_ghost, kind_of, layer_norms,
                                           per_example_sq)
from perturbkit.core._loss import check_loss_fn
from perturbkit.core._types import Path
from perturbkit.errors import InvalidOptionError


class PerExampleNorms(NamedTuple):
  """Per-example gradient norms, each an array with one entry per example.

  Attributes:
    total: The norm of each example's whole gradient, shape ``(examples,)``.
    by_layer: ``{'Block_0/Dense_1': (examples,)}``: the norm over each module's own params.
    by_param: A tree shaped like ``params`` with a ``(examples,)`` norm per param array.
  """
  total: jax.Array
  by_layer: dict[str, jax.Array]
  by_param: dict


def _scaled(norms: LayerNorms, scale: float) -> LayerNorms:
  """``norms`` of gradients ``scale`` times larger."""
  if scale == 1.0:
    return norms
  kept = norms.per_example
  return LayerNorms({k: v * (scale * scale) for k, v in norms.squares.items()},
                    None if kept is None else {k: v * scale for k, v in kept.items()})


def check_dense_method(dense_method: Any) -> None:
  """Raises :class:`InvalidOptionError` unless ``dense_method`` is one of ``DENSE_METHODS``."""
  if not isinstance(dense_method, str) or dense_method not in DENSE_METHODS:
    raise InvalidOptionError('dense_method', dense_method, f'one of {DENSE_METHODS}')


def all_layer_norms(result: Pass, dense_method: str) -> dict[Path, LayerNorms]:
  """Every layer's :class:`LayerNorms` (of each example's own term), by module path."""
  return {path: _scaled(norms, result.scale)
          for path, norms in _unscaled_layer_norms(result, dense_method).items()}


def _unscaled_layer_norms(result: Pass, dense_method: str) -> dict[Path, LayerNorms]:
  """Every layer's :class:`LayerNorms` from the pairs' gradients as they are."""
  check_dense_method(dense_method)
  out = {}
  for layer in result.layers:
    heads = [tied_head(r, layer.path, layer.direct) for r in layer.reads]
    if (layer.reads and all(h is not None for h in heads)
        and (not layer.pairs or kind_of(layer.pairs) == 'embed')
        and heads_use_ghost(heads + heads_of(layer.pairs), layer.direct, dense_method)):
      out[layer.path] = embed_rule(layer.pairs, layer.direct, result.num_examples,
                                   dense_method, tuple(heads))
    elif layer.reads:  # params also used by other nested applies: formed in full
      grads = grads_with_reads(layer.path, layer.pairs, layer.params, layer.direct,
                               list(layer.reads), result.num_examples)
      out[layer.path] = LayerNorms({k: per_example_sq(v) for k, v in grads.items()}, grads)
    elif not layer.pairs:
      zero = jnp.zeros((result.num_examples,), jnp.float32)
      out[layer.path] = LayerNorms({k: zero for k in layer.direct})
    else:
      out[layer.path] = layer_norms(layer.pairs, layer.params, layer.direct,
                                    result.num_examples, dense_method)
  return out


def flat_squares(layers: dict[Path, LayerNorms]) -> dict[tuple, jax.Array]:
  """``{param path: (examples,) squared norm}`` for every param of ``layers``."""
  return {path + (k,): v for path, norms in layers.items() for k, v in norms.squares.items()}


def norms_from_squares(squares: dict[tuple, jax.Array]) -> PerExampleNorms:
  """Per-layer, per-param and total norms from per-param squared norms."""
  layers: dict[str, jax.Array] = {}
  for path, sq in squares.items():
    name = '/'.join(path[:-1])
    layers[name] = layers[name] + sq if name in layers else sq
  total = functools.reduce(jnp.add, layers.values())
  return PerExampleNorms(jnp.sqrt(total), {k: jnp.sqrt(v) for k, v in layers.items()},
                         traverse_util.unflatten_dict({k: jnp.sqrt(v)
                                                       for k, v in squares.items()}))


def norms_of_pass(result: Pass, dense_method: str) -> PerExampleNorms:
  """The :class:`PerExampleNorms` of one pass (either front end's)."""
  return norms_from_squares(flat_squares(all_layer_norms(result, dense_method)))


def per_example_grad_norms(loss_fn: Callable[..., Any], *, reduction: str = 'mean',
                           batch_axes: BatchAxes = 0,
                           dense_method: str = 'auto') -> Callable[..., Any]:
  """Each example's gradient norm, per param, per layer and in total, without per-example gradients.

  The conventions (the loss and the examples axis, how each layer is computed,
  which models are refused and why, Hugging Face models, dropout) are in
  ``help(perturbkit.per_example)``.

  ``loss_fn(variables, *args, **kwargs)`` is the ordinary loss of an unmodified
  model and must be a sum or a mean over examples of one term per example
  (``reduction``). The examples are on axis 0 of every array argument unless
  ``batch_axes`` says otherwise, and on axis 0 of every layer's activations.
  One forward and one backward pass give each param-owning call's input and
  output gradient; the norms follow without forming per-example gradients
  where a layer has a fast path (Dense with any leading axes, Conv, Embed,
  LayerNorm/RMSNorm; see ``_per_example_rules``), and by a vmap over examples of
  that layer's own VJP otherwise (transient memory of one layer). A module used
  several times (shared weights, tied embeddings called through one module)
  contributes the norm of the SUM of its uses' gradients, as the loss sees it.

  With ``reduction='mean'`` the gradient at an example's activations is its own
  term's gradient divided by the number of examples ``B``; it is multiplied by
  ``B``, so the norms are those of each term's gradient, ``‖∇ term_i‖``. A
  ``reduction`` that does not match the loss would make every norm ``B`` times
  too large or too small, so the first call (or trace) checks it, once per loss
  function (a DP-SGD step built from the same loss does not check it again): the
  loss of one example given twice must be the loss of that example alone for a
  mean, twice it for a sum. The check is one small compiled call of the loss on one
  and on two examples, at trace time (under ``jax.jit`` on stand-in values of
  the traced arrays: the reduction is a property of the loss function), and
  costs nothing in the compiled step. A term ``term_i`` is the loss of example
  ``i`` alone; a weighted mean (a masked mean over tokens) is a mean. A loss
  that draws random numbers (dropout) can leave the check without an answer:
  then it passes.

  Args:
    loss_fn: ``(variables, *args, **kwargs) -> scalar loss``.
    reduction: ``'mean'`` or ``'sum'``: how the loss combines the examples' terms.
    batch_axes: The examples axis of each positional argument: an int, ``None``
      (shared by all examples) or a tuple of those, one per argument. Keyword
      arguments are shared.
    dense_method: ``'auto'`` (by size), ``'ghost'`` or ``'direct'`` for Dense and
      Conv kernels.

  Returns:
    A function ``(variables, *args, **kwargs) -> (loss, PerExampleNorms)``; jittable.

  Raises:
    ReductionMismatchError: the loss is a sum over the examples and ``reduction``
      is ``'mean'``, or the other way round (checked on the first call or trace).
    ExamplesMixedError: the model mixes examples (BatchNorm in training mode), or the
      loss does where gradients flow (a contrastive loss over the batch, a batch
      statistic of the activations, a nonlinear function of the batch's sum); found
      while tracing (``perturbkit.per_example._mixing``).
    ExamplesAxisError: the arguments disagree on the number of examples, or a call
      whose ``model.apply`` cannot be replayed per example sees them off axis 0.
    UncoveredParamsError: params no call or apply in the loss uses.
    ParamsReadOutsideError: params also read in the loss outside every ``model.apply``
      (a weight penalty, a weight used inline in the loss).
    AmbiguousInputError, SharedCallError: a call without per-example inputs (or with a
      constant of as many rows as examples) whose ``model.apply`` cannot be replayed per
      example either.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Dense(1)])
    >>> x = jnp.array([[1., 0.], [0., 2.]])
    >>> v = model.init(jax.random.key(0), x)
    >>> v = jax.tree.map(jnp.zeros_like, v)
    >>> loss_fn = lambda v, x: jnp.sum(model.apply(v, x) - 1.0)
    >>> loss, norms = perturbkit.per_example_grad_norms(loss_fn, reduction='sum')(v, x)
    >>> norms.total  # ‖(x_i, 1)‖
    Array([1.4142135, 2.236068 ], dtype=float32)
  """
  check_loss_fn(loss_fn, 'perturbkit.per_example_grad_norms', '(variables, *args) -> loss')
  check_dense_method(dense_method)
  batch_axes = check_batch_axes(batch_axes)
  check_reduction = reduction_checker(loss_fn, reduction, batch_axes)

  @functools.wraps(loss_fn)
  def run(variables, *args, **kwargs):
    check_variables(variables, 'perturbkit.per_example_grad_norms')
    variables = plain(variables)  # the norms are per example: no boxes, no FrozenDict
    on_arrays, array_args = values_closed_over(loss_fn, args)
    result = run_pass(on_arrays, variables, array_args, kwargs, reduction=reduction,
                      batch_axes=batch_axes)
    check_reduction(variables, args, kwargs, result.num_examples)
    return result.loss, norms_of_pass(result, dense_method)

  return run
