"""Value checks of a loss: that it is a sum or mean of per-example terms, and which of the two.

``check_per_example`` compares the loss of a batch with each example's loss alone
(eagerly, on the user's values). ``check_reduction`` is the cheap check the
per-example functions run on their first trace: it tells a mean from a sum by
the loss of one example against the loss of that example given twice, and of two
examples together against their losses alone.
"""
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from perturbkit.core._values import is_array
from perturbkit.errors import PerturbkitError, ReductionCheckError, ReductionMismatchError
from perturbkit.linen._driver import check_variables
from perturbkit.per_example._batch import (BatchAxes, check_batch_axes, check_reduction_option,
                                           count_examples, per_argument, reduce)
from perturbkit.errors import ExamplesMixedError
from perturbkit.core._loss import check_loss_fn
from perturbkit.core._validate import non_negative


def check_per_example(loss_fn: Callable[..., Any], variables: Any, *args: Any,
                      reduction: str = 'mean', batch_axes: BatchAxes = 0,
                      rtol: float = 1e-4, atol: float = 1e-6) -> None:
  """Raises unless the loss of the batch equals the ``reduction`` of each example's loss alone.

  A loss that is a sum or mean of per-example terms passes (up to float
  rounding); a model that normalizes over the batch (BatchNorm in training
  mode) or a loss over batch statistics almost never does, because each
  example's loss changes when it is alone. Passing does not prove the loss is
  separable; failing proves it is not. It costs one extra forward pass (a vmap
  over examples, each a batch of one), compiled, and is called outside ``jax.jit``
  (it compares values).

  Args:
    loss_fn: ``(variables, *args) -> scalar loss``.
    variables: The model variables.
    *args: The loss's positional arguments, examples on ``batch_axes``.
    reduction: ``'mean'`` or ``'sum'``.
    batch_axes: The examples axis of each positional argument.
    rtol: Relative tolerance of the comparison.
    atol: Absolute tolerance of the comparison.

  Raises:
    ExamplesMixedError: the two values differ.
    ReductionMismatchError: the loss of the batch is the other reduction (a sum while
      ``reduction='mean'``, or the other way round).
    ExamplesAxisError: an argument has no axis ``batch_axes`` says, or the arguments
      disagree on the number of examples.
    WrongFrontEndError: ``variables`` is an NNX model (use
      ``perturbkit.nnx.check_per_example``).

  Example:
    >>> import jax.numpy as jnp
    >>> import perturbkit
    >>> x = jnp.array([1., 2., 6.])
    >>> perturbkit.check_per_example(lambda v, x: jnp.mean(v * x ** 2), 2.0, x)
    >>> perturbkit.check_per_example(lambda v, x: jnp.var(v * x), 2.0, x)
    Traceback (most recent call last):
    ...
    perturbkit.errors.ExamplesMixedError: Per-example ...
  """
  if isinstance(variables, nnx.Module):
    check_variables(variables, 'perturbkit.check_per_example')
  check_loss_fn(loss_fn, 'perturbkit.check_per_example', '(variables, *args) -> loss')
  non_negative('rtol', rtol)
  non_negative('atol', atol)
  check_reduction_option(reduction)
  batch_axes = check_batch_axes(batch_axes)
  axes = per_argument(batch_axes, len(args))
  count_examples(args, batch_axes)  # each batched argument has its examples axis
  whole = float(_compiled(loss_fn, variables, *args))

  def alone(variables, *example):
    batch = [x if a is None else jax.tree.map(lambda t, a=a: jnp.expand_dims(t, a), x)
             for x, a in zip(example, axes)]
    return loss_fn(variables, *batch)

  terms = _compiled(lambda v, *a: jax.vmap(alone, in_axes=(None, *axes))(v, *a),
                    variables, *args)
  combined = float(reduce(terms, reduction))
  other = 'sum' if reduction == 'mean' else 'mean'
  if (not np.isclose(whole, combined, rtol=rtol, atol=atol)
      and np.isclose(whole, float(reduce(terms, other)), rtol=rtol, atol=atol)):
    raise ReductionMismatchError(
        reduction, other, f'the loss of the batch, {whole:.6g}, is the {other} of each '
        f"example's loss alone (their {reduction} is {combined:.6g})")
  if not np.isclose(whole, combined, rtol=rtol, atol=atol):
    raise ExamplesMixedError(
        f'the loss of the batch is {whole:.6g}, but the {reduction} of each example\'s loss '
        f'alone is {combined:.6g}')


def over_arrays(fn: Callable[..., Any], leaves: list[Any],
                treedef: Any) -> tuple[Callable[[list[Any]], Any], list[Any]]:
  """``fn`` of the tree ``leaves`` make, as a function of its array leaves alone, and those.

  The other leaves (Python numbers, strings, ``None``) stay as they are, closed over.
  """
  where = [i for i, leaf in enumerate(leaves) if is_array(leaf)]

  def on_arrays(arrays):
    full = list(leaves)
    for i, x in zip(where, arrays):
      full[i] = x
    return fn(*jax.tree.unflatten(treedef, full))

  return on_arrays, [leaves[i] for i in where]


def _compiled(fn: Callable[..., Any], *tree: Any) -> Any:
  """``fn(*tree)`` as one compiled call over the array leaves (the others stay as given)."""
  on_arrays, arrays = over_arrays(fn, *jax.tree.flatten(tree))
  return jax.jit(on_arrays)(arrays)


def stand_in(leaf: Any, index: int) -> Any:
  """``leaf`` if it has a value, else a concrete array of its shape and dtype.

  The reduction is a property of the loss function, not of the numbers it is
  given, so a traced argument (under ``jax.jit``) is replaced by fixed numbers:
  small normal floats (a stand-in for params and features), ones for integers
  (valid ids, labels and masks), fixed keys for PRNG keys. Floats and integers
  are made with NumPy, so that no stand-in costs a compile.
  """
  if not isinstance(leaf, jax.core.Tracer):
    return leaf
  shape, dtype = leaf.shape, leaf.dtype
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    with jax.ensure_compile_time_eval():
      keys = jax.random.split(jax.random.key(index, impl=jax.random.key_impl(leaf)),
                              int(np.prod(shape)))
      return keys.reshape(shape)
  if jnp.issubdtype(dtype, jnp.inexact):
    normal = np.random.default_rng(index).standard_normal(shape)
    return (0.5 * normal).astype(dtype)
  return np.ones(shape, dtype)


def _examples(arg: Any, axis: int | None, rows: tuple[int, ...]) -> Any:
  """The examples ``rows`` of ``arg`` along ``axis`` (``arg`` itself if shared)."""
  if axis is None:
    return arg
  take = lambda x: jnp.take(x, jnp.asarray(rows), axis=axis)
  return jax.tree.map(lambda x: take(x) if is_array(x) else x, arg)


# The check's program runs once, on one or two examples: its compile time is what counts, not
# its speed. On CPU, XLA's optimization level 0 without the expensive LLVM passes, the older
# fusion emitters and one LLVM module compile it in about a fifth of the time (0.32 s instead
# of 1.66 s for a 2-layer GPT-2's loss), with the same HLO.
_CHECK_COMPILE_OPTIONS = {'cpu': {'xla_backend_optimization_level': 0,
                                  'xla_llvm_disable_expensive_passes': True,
                                  'xla_cpu_use_fusion_emitters': False,
                                  'xla_cpu_parallel_codegen_split_count': 1}}


def batch_losses(loss_fn: Callable[..., Any], variables: Any, args: tuple, kwargs: dict,
                 batch_axes: BatchAxes, batches: list[tuple[int, ...]]
                 ) -> tuple[list[float], Any] | None:
  """The loss of each batch of ``batches`` (rows of the batch), at trace time, in one call,
  and the dtype the loss is computed in.

  Runs on concrete values (``stand_in``), as one compiled call of the loss, also
  while a caller's ``jax.jit`` traces (the call is compiled ahead of time and run
  on its own, not staged into the caller's computation). ``None`` if the loss
  closes over a traced value, which has no value to run on.
  """
  axes = per_argument(batch_axes, len(args))
  leaves, tree = jax.tree.flatten((variables, args, kwargs))
  leaves = [stand_in(leaf, i) for i, leaf in enumerate(leaves)]
  dtypes = []

  def losses(variables, args, kwargs):
    given = [[_examples(x, a, rows) for x, a in zip(args, axes)] for rows in batches]
    values = [loss_fn(variables, *a, **kwargs) for a in given]
    dtypes.append(jnp.result_type(values[0]))
    return [jnp.asarray(v, jnp.float32) for v in values]

  on_arrays, arrays = over_arrays(losses, leaves, tree)
  traced = jax.jit(on_arrays).trace(arrays)
  if len(traced.jaxpr.jaxpr.invars) != len(arrays):
    return None  # the traced values the loss closes over became inputs of their own
  compiled = traced.lower().compile(_CHECK_COMPILE_OPTIONS.get(jax.default_backend()))
  return [float(v) for v in compiled(arrays)], dtypes[0]


def _close(a: float, b: float, dtype: Any) -> bool:
  """Whether two losses computed in ``dtype`` are equal up to its rounding (a bfloat16 loss
  is rounded to 3 digits, so the loss of two examples is their sum only to about 1%)."""
  rounding = 4 * float(jnp.finfo(dtype).eps) if jnp.issubdtype(dtype, jnp.floating) else 0.0
  return bool(np.isclose(a, b, rtol=max(1e-3, rounding), atol=1e-6))


def found_reduction(loss_fn: Callable[..., Any], variables: Any, args: tuple, kwargs: dict,
                    batch_axes: BatchAxes, num_examples: int) -> tuple[str | None, float]:
  """``('mean' | 'sum' | None, ratio)`` from the losses of a few examples alone and together.

  ``ratio`` is the loss of the first example given twice over its loss alone:
  exactly 1 for a mean of per-example terms (also a weighted one, such as a
  masked mean over tokens: the weights double with the example) and 2 for a
  sum. A sum must also be additive: the loss of the first two examples is the
  sum of their losses alone; a loss pairing each example with the whole batch
  (through ``stop_gradient``) doubles too, but is not additive, and is left
  unjudged (``None``), as is a loss whose values are zero or not finite, or
  a loss that draws random numbers (dropout) and so gives each copy other draws.
  The two examples' losses are compiled only for a loss that doubles.
  """
  losses = lambda batches: batch_losses(loss_fn, variables, args, kwargs, batch_axes, batches)
  usable = lambda result: result is not None and np.all(np.isfinite(result[0]))
  result = losses([(0,), (0, 0)])
  if not usable(result) or abs(result[0][0]) < 1e-20:
    return None, float('nan')
  (alone, twice), dtype = result
  ratio = twice / alone
  if abs(ratio - 1) <= 0.25:
    return 'mean', ratio
  if abs(ratio - 2) > 0.5:
    return None, ratio
  if num_examples == 1:
    return 'sum', ratio
  # Only a sum-like loss pays for the second compile (the common mean needs one).
  result = losses([(1,), (0, 1)])
  if usable(result) and _close(result[0][1], alone + result[0][0], dtype):
    return 'sum', ratio
  return None, ratio


def check_reduction(loss_fn: Callable[..., Any], variables: Any, args: tuple, kwargs: dict, *,
                    reduction: str, batch_axes: BatchAxes, num_examples: int) -> None:
  """Raises unless ``loss_fn`` combines the examples as ``reduction`` says (``found_reduction``).

  Raises:
    ReductionMismatchError: the loss is found to be a sum and ``reduction`` is
      ``'mean'``, or the other way round.
    ReductionCheckError: the loss fails on the one or two examples the check
      runs it on (e.g. a model that hard-codes the batch size).
  """
  try:
    found, ratio = found_reduction(loss_fn, variables, args, kwargs, batch_axes, num_examples)
  except (TypeError, ValueError, IndexError) as error:
    if isinstance(error, PerturbkitError):
      raise
    raise ReductionCheckError(reduction, error) from error
  if found is not None and found != reduction:
    raise ReductionMismatchError(
        reduction, found, f'the loss of one example given twice (a batch of two copies) is '
        f'{ratio:.4g} times the loss of that example alone; a mean gives 1, a sum 2')


# The losses whose check passed, with the (reduction, batch_axes) it passed with: the
# functions built from one loss (its norms, then a DP-SGD step) check it once.
_PASSED: 'weakref.WeakKeyDictionary[Any, set[tuple[str, str]]]' = weakref.WeakKeyDictionary()


def _passed_settings(loss: Any, unshared: set[tuple[str, str]]) -> set[tuple[str, str]]:
  """The settings ``loss`` passed with; ``unshared`` (one function's own) if ``loss`` cannot be
  weakly referenced."""
  try:
    return _PASSED.setdefault(loss, set())
  except TypeError:
    return unshared


def reduction_checker(loss_fn: Callable[..., Any], reduction: str, batch_axes: BatchAxes,
                      loss: Any = None) -> Callable[..., None]:
  """``check_reduction`` for ``loss_fn``, run on the first call (or trace) that passes it.

  The check runs once per user loss (``loss``, default ``loss_fn``), ``reduction`` and
  ``batch_axes``: another function built from the same loss skips it.
  """
  check_reduction_option(reduction)
  check_batch_axes(batch_axes)
  setting = (reduction, repr(batch_axes))
  owner = loss_fn if loss is None else loss
  unshared: set[tuple[str, str]] = set()

  def check(variables: Any, args: tuple, kwargs: dict, num_examples: int) -> None:
    done = _passed_settings(owner, unshared)
    if setting not in done:
      check_reduction(loss_fn, variables, args, kwargs, reduction=reduction,
                      batch_axes=batch_axes, num_examples=num_examples)
      done.add(setting)

  return check
