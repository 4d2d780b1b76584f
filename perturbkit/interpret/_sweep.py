"""A sweep of one function over a stack of jobs: one ``vmap``, in batches, with a progress bar.

The bar is driven from inside the computation (``jax.debug.callback`` after each
batch, ordered), so it shows the progress of the compiled sweep as it runs, under
``jax.jit`` too, and starts afresh on every run of the compiled function.
"""
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from perturbkit.errors import InvalidOptionError


def check_batch_size(batch_size: int | None) -> None:
  """Raises ``InvalidOptionError`` unless ``batch_size`` is a positive int or ``None``."""
  if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
    raise InvalidOptionError('batch_size', batch_size, 'a positive int or None')


def check_progress(progress: Any) -> None:
  """Raises ``InvalidOptionError`` unless ``progress`` is a bool."""
  if not isinstance(progress, bool):
    raise InvalidOptionError('progress', progress, 'True or False')


class ProgressBar:
  """A tqdm bar of ``total`` jobs, advanced to the number done; a new bar when a run starts."""

  def __init__(self, total: int, description: str):
    self.total = total
    self.description = description
    self.bar = None

  def advance(self, done: np.ndarray, *dependencies: Any) -> None:
    """Moves the bar to ``done`` jobs (``dependencies``: the results it waits for)."""
    del dependencies
    done = int(done)
    if self.bar is None:
      self.bar = tqdm(total=self.total, desc=self.description, unit='run', leave=True)
    self.bar.update(done - self.bar.n)
    if done >= self.total:
      self.bar.close()
      self.bar = None


def sweep(job: Callable[[Any], jax.Array], jobs: Any, batch_size: int | None,
          progress: str | None = None) -> jax.Array:
  """``job`` over the leading axis of ``jobs``: one ``vmap``, or ``batch_size`` at a time.

  With ``progress`` (the bar's description), a progress bar counts the jobs
  done, moved after each batch.
  """
  if progress is None:
    if batch_size is None:
      return jax.vmap(job)(jobs)
    return jax.lax.map(job, jobs, batch_size=batch_size)
  total = jax.tree.leaves(jobs)[0].shape[0]
  size = total if batch_size is None else min(batch_size, total)
  full, rest = divmod(total, size)
  bar = ProgressBar(total, progress)
  head = jax.tree.map(lambda x: x[:full * size].reshape((full, size) + x.shape[1:]), jobs)

  def batch(done, chunk):
    out = jax.vmap(job)(chunk)
    done = done + size
    jax.debug.callback(bar.advance, done, out, ordered=True)
    return done, out

  done, outs = jax.lax.scan(batch, jnp.zeros((), jnp.int32), head)
  outs = jax.tree.map(lambda x: x.reshape((full * size,) + x.shape[2:]), outs)
  if rest:
    tail = jax.vmap(job)(jax.tree.map(lambda x: x[full * size:], jobs))
    jax.debug.callback(bar.advance, done + rest, tail, ordered=True)
    outs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), outs, tail)
  return outs
