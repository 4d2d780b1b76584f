"""The model's predictive distribution, as K-FAC needs it: a loss, a sampler and a Fisher root.

The Fisher of a model with output ``z`` and per-example negative log-likelihood
``nll(z, y)`` is ``E_x E_{y ~ p(y|z)} [∇nll ∇nllᵀ]``. K-FAC needs the gradient of
``nll`` at labels ``y`` drawn from the model itself (``sample``); the exact
output-space Fisher ``H(z)`` is also available here through its square root
(``fisher_sqrt``), whose columns, pulled back through the network, give the exact
expectation over ``y`` instead of a one-sample estimate.
"""
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from perturbkit.core._precision import accumulation_dtype, widened
from perturbkit.core._validate import positive
from perturbkit.errors import (InvalidOptionError, KFACLossError, KFACLossShapeError,
                               KFACTargetsError)

FISHER_KINDS = ('sampled', 'empirical', 'exact')


class OutputLoss(NamedTuple):
  """A per-example negative log-likelihood with its predictive distribution.

  Attributes:
    name: A short name for messages.
    nll: ``(output, targets) -> (batch,)`` per-example losses (summed over every
      axis but the first).
    sample: ``(key, output) -> targets`` drawn from the model's predictive
      distribution, or ``None`` when there is none (only the empirical Fisher).
    fisher_sqrt: ``output -> (k, batch, k)`` columns ``B[:, j]`` of a square root
      ``B Bᵀ = H`` of the output-space Fisher of each example, for outputs shaped
      ``(batch, k)``; ``None`` when unknown.
  """
  name: str
  nll: Callable[[jax.Array, Any], jax.Array]
  sample: Callable[[jax.Array, jax.Array], Any] | None = None
  fisher_sqrt: Callable[[jax.Array], jax.Array] | None = None


def mean_loss(loss: OutputLoss, output: jax.Array, targets: Any) -> jax.Array:
  """The mean over the examples of ``loss.nll``'s per-example losses.

  Raises:
    KFACLossShapeError: ``loss.nll`` does not return one loss per example.
  """
  losses = loss.nll(output, targets)
  if jnp.shape(losses) != tuple(output.shape[:1]):
    raise KFACLossShapeError(loss.name, tuple(jnp.shape(losses)), tuple(output.shape))
  return jnp.mean(losses)


def _per_example(losses: jax.Array) -> jax.Array:
  return losses.reshape(losses.shape[0], -1).sum(axis=1)


def _check_labels(logits: jax.Array, labels: Any):
  """Raises :class:`KFACTargetsError` unless ``labels`` are class indices for ``logits``."""
  want_shape = tuple(logits.shape[:-1])
  shape, dtype = jnp.shape(labels), jnp.result_type(labels)
  if jnp.issubdtype(dtype, jnp.integer) and shape == want_shape:
    return
  if shape == tuple(logits.shape):
    fix = 'For one-hot labels pass the indices, `jnp.argmax(one_hot, axis=-1)`.'
  elif shape == want_shape:
    fix = 'Cast them to integers, e.g. `labels.astype(jnp.int32)`.'
  else:
    fix = (f'Give one class index per example (and position): labels of shape {want_shape} '
           f'for logits of shape {tuple(logits.shape)}.')
  raise KFACTargetsError('softmax_cross_entropy', f'integer class indices of shape {want_shape}',
                         f'{dtype} labels of shape {shape}', fix)


def _check_targets(output: jax.Array, targets: Any, name: str):
  """Raises :class:`KFACTargetsError` unless ``targets`` have the output's shape."""
  shape = jnp.shape(targets)
  if shape != tuple(output.shape):
    raise KFACTargetsError(
        name, f"of the output's shape {tuple(output.shape)}", f'targets of shape {shape}',
        'Reshape them to the output\'s shape (e.g. `y[:, None]` for one output feature); '
        'broadcasting would compare every example with every target.')


def categorical_output() -> OutputLoss:
  """Softmax cross-entropy on logits ``(batch, ..., classes)`` with integer labels.

  The predictive distribution is ``Categorical(softmax(logits))``; the
  per-example loss sums over any axes between the batch and the classes.

  Returns:
    An :class:`OutputLoss`, whose ``nll`` raises :class:`KFACTargetsError` for
    labels that are not integer class indices of the logits' shape without its
    last axis (one-hot labels, float labels).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import perturbkit
    >>> out = perturbkit.categorical_output()
    >>> out.nll(jnp.zeros((2, 4)), jnp.array([0, 3])).round(4).tolist()
    [1.3863, 1.3863]
    >>> out.sample(jax.random.key(0), jnp.zeros((2, 4))).shape
    (2,)
  """
  def nll(logits, labels):
    _check_labels(logits, labels)
    log_probs = jax.nn.log_softmax(widened(logits))
    picked = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    return -_per_example(picked)

  def sample(key, logits):
    return jax.random.categorical(key, widened(logits), axis=-1)

  def fisher_sqrt(logits):
    # H = diag(p) - p pᵀ = B Bᵀ with B[:, j] = sqrt(p_j) (e_j - p), since sum(p) = 1.
    p = jax.nn.softmax(widened(logits))
    k = p.shape[-1]
    return jnp.sqrt(p).T[:, :, None] * (jnp.eye(k, dtype=p.dtype)[:, None, :] - p[None])

  return OutputLoss('softmax_cross_entropy', nll, sample, fisher_sqrt)


def gaussian_output(variance: float = 1.0) -> OutputLoss:
  """Squared error, as the Gaussian ``N(output, variance·I)`` negative log-likelihood.

  The per-example loss is ``sum((output - targets)**2) / (2 * variance)``; with
  ``variance=1`` it is ``optax.l2_loss`` summed per example.

  Args:
    variance: The variance of the predictive Gaussian.

  Returns:
    An :class:`OutputLoss`, whose ``nll`` raises :class:`KFACTargetsError` for
    targets of another shape than the output.

  Raises:
    InvalidOptionError: ``variance`` is not a finite number > 0.

  Example:
    >>> import jax.numpy as jnp
    >>> import perturbkit
    >>> perturbkit.gaussian_output(0.5).nll(jnp.ones((1, 2)), jnp.zeros((1, 2))).tolist()
    [2.0]
  """
  positive('variance', variance)

  def nll(output, targets):
    _check_targets(output, targets, f'squared_error(variance={variance})')
    return _per_example(jnp.square(output - targets) / (2.0 * variance))

  def sample(key, output):
    noise = jax.random.normal(key, output.shape, accumulation_dtype(output.dtype))
    return output + (variance ** 0.5) * noise.astype(output.dtype)

  def fisher_sqrt(output):
    k = output.shape[-1]
    eye = jnp.eye(k, dtype=accumulation_dtype(output.dtype))[:, None, :] / variance ** 0.5
    return jnp.broadcast_to(eye, (k,) + output.shape)

  return OutputLoss(f'squared_error(variance={variance})', nll, sample, fisher_sqrt)


def _known() -> dict[Any, Callable[[], OutputLoss]]:
  return {
      'softmax_cross_entropy': categorical_output,
      'categorical': categorical_output,
      optax.softmax_cross_entropy_with_integer_labels: categorical_output,
      'gaussian': gaussian_output,
      optax.l2_loss: gaussian_output,
      # (y - t)**2 is the Gaussian negative log-likelihood with variance 1/2; the name means
      # what optax.squared_error computes (½(y - t)**2 is 'gaussian', optax.l2_loss).
      'squared_error': lambda: gaussian_output(0.5),
      optax.squared_error: lambda: gaussian_output(0.5),
  }


def as_output_loss(loss: Any, fisher: str) -> OutputLoss:
  """The :class:`OutputLoss` that ``loss`` names, checked against the Fisher kind.

  Raises:
    KFACLossError: ``loss`` names no predictive distribution and the Fisher
      needs one.
    InvalidOptionError: ``fisher`` is not one of ``FISHER_KINDS``.
  """
  if fisher not in FISHER_KINDS:
    raise InvalidOptionError('fisher', fisher, ' or '.join(map(repr, FISHER_KINDS)))
  if isinstance(loss, OutputLoss):
    resolved = loss
  else:
    try:
      make = _known().get(loss)
    except TypeError:  # unhashable
      make = None
    if make is not None:
      resolved = make()
    elif callable(loss) and fisher == 'empirical':
      resolved = OutputLoss(getattr(loss, '__name__', repr(loss)), loss)
    else:
      raise KFACLossError(loss, fisher)
  if fisher == 'sampled' and resolved.sample is None:
    raise KFACLossError(resolved.name, fisher)
  if fisher == 'exact' and resolved.fisher_sqrt is None:
    raise KFACLossError(resolved.name, fisher)
  return resolved
