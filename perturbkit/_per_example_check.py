"""A value check that a loss is a sum or mean of per-example terms."""
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from perturbkit._per_example_batch import BatchAxes, per_argument, reduce
from perturbkit._per_example_errors import ExamplesMixedError


def check_per_example(loss_fn: Callable[..., Any], variables: Any, *args: Any,
                      reduction: str = 'mean', batch_axes: BatchAxes = 0,
                      rtol: float = 1e-4, atol: float = 1e-6) -> None:
  """Raises unless the loss of the batch equals the ``reduction`` of each example's loss alone.

  A loss that is a sum or mean of per-example terms passes (up to float
  rounding); a model that normalizes over the batch (BatchNorm in training
  mode) or a loss over batch statistics almost never does, because each
  example's loss changes when it is alone. Passing does not prove the loss is
  separable; failing proves it is not. It costs one extra forward pass (a vmap
  over examples, each a batch of one) and runs eagerly, outside ``jax.jit``.

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

  Example:
    >>> import jax.numpy as jnp
    >>> import perturbkit
    >>> x = jnp.array([1., 2., 6.])
    >>> perturbkit.check_per_example(lambda v, x: jnp.mean(v * x ** 2), 2.0, x)
    >>> perturbkit.check_per_example(lambda v, x: jnp.var(v * x), 2.0, x)
    Traceback (most recent call last):
    ...
    perturbkit._per_example_errors.ExamplesMixedError: Per-example ...
  """
  axes = per_argument(batch_axes, len(args))
  whole = float(loss_fn(variables, *args))

  def alone(*example):
    batch = [x if a is None else jax.tree.map(lambda t, a=a: jnp.expand_dims(t, a), x)
             for x, a in zip(example, axes)]
    return loss_fn(variables, *batch)

  terms = jax.vmap(alone, in_axes=axes)(*args)
  combined = float(reduce(terms, reduction))
  if not np.isclose(whole, combined, rtol=rtol, atol=atol):
    raise ExamplesMixedError(
        f'the loss of the batch is {whole:.6g}, but the {reduction} of each example\'s loss '
        f'alone is {combined:.6g}')
