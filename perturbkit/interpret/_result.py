"""The labelled results of activation and attribution patching, gradient x activation and layer IG."""
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from perturbkit.core._validate import positive, positive_int
from perturbkit.errors import MetricGapError, ResultValuesError

_MOST_TICKS = 32
"""At most this many labelled columns; wider maps label every n-th."""


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=['effects', 'clean_metric', 'corrupted_metric'],
                   meta_fields=['paths', 'positions'])
@dataclasses.dataclass(frozen=True)
class PatchingResult:
  """One effect per selected call (row) and position (column), labelled, ready to plot.

  The labels are static, the numbers arrays, so the functions that return it
  work under ``jax.jit``; ``jax.vmap`` over them gives a result whose arrays
  have a leading batch axis.

  Attributes:
    paths: Each call's path and point key, ``'Dense_0/__call__'``, in call order
      (the rows of ``effects``).
    positions: The indices along the patched axis (the columns), or ``None``
      when whole outputs are patched (one column).
    effects: ``(len(paths), len(positions) or 1)``: how much the metric moves
      from the corrupted run's value when that call's output (at that position)
      takes its clean value, measured (activation patching) or estimated to
      first order (attribution patching, gradient x activation).
    clean_metric: The metric on the clean inputs.
    corrupted_metric: The metric on the corrupted inputs (for gradient x
      activation, both are the metric on the inputs).

  Example:
    >>> import jax.numpy as jnp
    >>> from perturbkit import PatchingResult
    >>> result = PatchingResult(('h/0/__call__', 'h/1/__call__'), (0, 1),
    ...                         jnp.array([[0.5, 0.0], [1.5, -2.0]]), jnp.array(3.0),
    ...                         jnp.array(1.0))
    >>> result.normalized().effects.tolist()
    [[0.25, 0.0], [0.75, -1.0]]
    >>> result.top(2)
    [('h/1/__call__', 1, -2.0), ('h/1/__call__', 0, 1.5)]
  """
  paths: tuple[str, ...]
  positions: tuple[int, ...] | None
  effects: jax.Array
  clean_metric: jax.Array
  corrupted_metric: jax.Array

  def normalized(self) -> 'PatchingResult':
    """The same result with each effect a fraction of ``clean_metric - corrupted_metric``.

    1 where patching that call (at that position) brings the metric all the way
    to its clean value, 0 where it changes nothing, negative where it moves
    the metric away: the usual scale of patching heat maps ("the fraction of
    the logit difference recovered"). For layer integrated gradients
    (``clean_metric`` on the inputs, ``corrupted_metric`` on the baseline) the
    effects become fractions of the whole change. Jittable; a batched result
    (from ``jax.vmap``) is normalized per example, and under ``jax.jit`` an
    example whose two metrics are equal gets ``nan`` effects.

    Raises:
      MetricGapError: the two metrics are equal (gradient x activation has one
        metric for both), so there is nothing to take a fraction of.
    """
    gap = jnp.asarray(self.clean_metric - self.corrupted_metric)
    if not isinstance(gap, jax.core.Tracer) and np.any(np.asarray(gap) == 0):
      first = np.argwhere(np.asarray(gap) == 0)[0]
      raise MetricGapError(float(np.asarray(self.clean_metric)[tuple(first)]),
                           float(np.asarray(self.corrupted_metric)[tuple(first)]))
    gap = gap[..., None, None]
    nonzero = gap != 0
    effects = jnp.where(nonzero, self.effects / jnp.where(nonzero, gap, 1), jnp.nan)
    return dataclasses.replace(self, effects=effects)

  def _values(self, method: str) -> np.ndarray:
    """The effects as a ``(calls, positions)`` NumPy array, or ``ResultValuesError``."""
    if isinstance(self.effects, jax.core.Tracer):
      raise ResultValuesError(method, 'its effects are traced (inside jax.jit or jax.vmap)')
    effects = np.asarray(self.effects)
    if effects.ndim != 2:
      raise ResultValuesError(
          method, f'its effects have shape {effects.shape}, with a leading batch axis '
          '(a result from jax.vmap)')
    return effects

  def _column_labels(self, columns: int) -> list:
    return list(self.positions) if self.positions is not None else [None] * columns

  def top(self, k: int = 10) -> list[tuple[str, int | None, float]]:
    """The ``k`` effects largest in magnitude, largest first, as ``(path, position, effect)``.

    ``position`` is ``None`` when whole outputs were patched. Ties keep call
    order, then position order.

    Raises:
      InvalidOptionError: ``k`` is not an integer >= 1.
      ResultValuesError: the result is traced (inside ``jax.jit``) or batched.
    """
    positive_int('k', k)
    effects = self._values('top')
    columns = self._column_labels(effects.shape[1])
    order = np.argsort(-np.abs(effects), axis=None, kind='stable')[:k]
    rows, cols = np.unravel_index(order, effects.shape)
    return [(self.paths[r], columns[c], float(effects[r, c])) for r, c in zip(rows, cols)]

  def plot(self, ax: Any = None, *, limit: float | None = None, cmap: str = 'RdBu',
           colorbar: bool = True, **imshow_kwargs) -> Any:
    """A heat map of the effects with matplotlib: calls down, positions across.

    Rows are labelled with the call paths (``'/__call__'`` left out), columns
    with the positions (every n-th where there are more than 32). The colour
    scale is symmetric around 0, up to ``limit`` (default: the largest
    magnitude), so that red and blue mean the same amount either way; pass the
    same ``limit`` to put two maps on one scale.

    Args:
      ax: The matplotlib axes to draw in (default: the current axes).
      limit: The magnitude at the ends of the colour scale (> 0).
      cmap: A diverging colormap.
      colorbar: Whether to add a colour bar beside the axes.
      **imshow_kwargs: Passed on to ``ax.imshow``.

    Returns:
      The ``AxesImage``.

    Raises:
      InvalidOptionError: ``limit`` is not a finite number > 0.
      ResultValuesError: the result is traced (inside ``jax.jit``) or batched.
    """
    import matplotlib.pyplot as plt

    effects = self._values('plot')
    if limit is None:
      largest = float(np.nanmax(np.abs(effects))) if effects.size else 0.0
      limit = largest if np.isfinite(largest) and largest > 0 else 1.0
    positive('limit', limit)
    ax = plt.gca() if ax is None else ax
    image = ax.imshow(effects, cmap=cmap, vmin=-limit, vmax=limit, aspect='auto',
                      interpolation='nearest', **imshow_kwargs)
    ax.set_yticks(range(len(self.paths)),
                  [path.removesuffix('/__call__') for path in self.paths])
    columns = effects.shape[1]
    every = -(-columns // _MOST_TICKS)
    labels = self._column_labels(columns)
    ax.set_xticks(range(0, columns, every),
                  ['whole output' if labels[c] is None else str(labels[c])
                   for c in range(0, columns, every)])
    ax.set(xlabel='position' if self.positions is not None else '', ylabel='call')
    if colorbar:
      ax.figure.colorbar(image, ax=ax, label='change of the metric')
    return image


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=['effects', 'clean_metric', 'corrupted_metric', 'endpoint_metrics',
                                'gaps'],
                   meta_fields=['paths', 'positions'])
@dataclasses.dataclass(frozen=True)
class IntegratedGradientsResult(PatchingResult):
  """Layer integrated gradients' :class:`PatchingResult`, with each call's completeness gap.

  Completeness says a call's effects, summed over the positions, equal
  ``clean_metric - endpoint_metrics[i]``: the metric's change when that call's
  output goes from its baseline to its value. The quadrature only approximates
  the integral along the path; ``gaps`` is how far it is from complete.

  Attributes:
    endpoint_metrics: ``(len(paths),)``: the metric on the inputs with that
      call's output (its swept arrays, with ``leaves=``) replaced by its
      baseline, a forward run each, as an activation patch runs; ``None``
      unless asked for (``gaps=True``).
    gaps: ``(len(paths),)``: ``effects.sum(positions) - (clean_metric -
      endpoint_metrics)``, in at least float32; 0 for a complete attribution.
      A large gap (relative to ``clean_metric - endpoint_metrics``) means the
      integrand varies faster than ``steps`` nodes follow: take more steps,
      or a baseline nearer the inputs. ``None`` unless asked for.
  """
  endpoint_metrics: jax.Array | None = None
  gaps: jax.Array | None = None
