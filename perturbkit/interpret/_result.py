"""The labelled result of activation patching, attribution patching and gradient x activation."""
import dataclasses
import functools

import jax


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=['effects', 'clean_metric', 'corrupted_metric'],
                   meta_fields=['paths', 'positions'])
@dataclasses.dataclass(frozen=True)
class PatchingResult:
  """One effect per selected call (row) and position (column), labelled, ready to plot.

  The labels are static, the numbers arrays, so the functions that return it
  work under ``jax.jit``.

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
  """
  paths: tuple[str, ...]
  positions: tuple[int, ...] | None
  effects: jax.Array
  clean_metric: jax.Array
  corrupted_metric: jax.Array
