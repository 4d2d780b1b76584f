"""A sweep over calls and a stack of jobs: one ``vmap`` per group of calls, in batches, with a bar.

The bar is driven from inside the computation (``jax.debug.callback`` after each
batch), so it shows the progress of the compiled sweep as it runs, under
``jax.jit`` too, and starts afresh on every run of the compiled function. The
callback is unordered, as JAX allows on many devices (a sweep of a batch sharded
over them): the groups of calls may run in any order, and each batch adds its runs.
Inside ``jax.shard_map``, where each device runs the whole sweep on its shard, the
bar counts the first device's runs.
Under ``jax.vmap`` (one sweep per example, run in lockstep) the bar counts the
runs of one sweep: each batch reports once (:func:`_report`), not once per example.
"""
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from perturbkit.core._varying import manual_axes, typed_like
from perturbkit.errors import InvalidOptionError
from perturbkit.core._validate import count

# The most groups of calls a sweep is cut into (see ``sweep``).
GROUPS = 8


def check_batch_size(batch_size: int | None) -> None:
  """Raises ``InvalidOptionError`` unless ``batch_size`` is a positive int (not a bool, a float
  or a JAX array) or ``None``."""
  if batch_size is not None:
    count('batch_size', batch_size)


def check_progress(progress: Any) -> None:
  """Raises ``InvalidOptionError`` unless ``progress`` is a bool."""
  if not isinstance(progress, bool):
    raise InvalidOptionError('progress', progress, 'True or False')


class ProgressBar:
  """A tqdm bar of ``total`` jobs, advanced by each batch done; a new bar when a run starts."""

  def __init__(self, total: int, description: str):
    self.total = total
    self.description = description
    self.bar = None

  def advance(self, count: np.ndarray, *dependencies: Any) -> None:
    """Adds ``count`` jobs done (``dependencies``: the results it waits for)."""
    del dependencies
    if int(count) == 0:
      return
    if self.bar is None:
      self.bar = tqdm(total=self.total, desc=self.description, unit='run', leave=True)
    self.bar.update(int(count))
    if self.bar.n >= self.total:
      self.bar.close()
      self.bar = None


def _report(advance: Callable[..., None], count: jax.Array, dependencies: Any,
            combine: Callable[[jax.Array], jax.Array]) -> None:
  """``advance(count)`` once ``dependencies`` are computed; once, not per example, under ``vmap``.

  ``jax.debug.callback`` under ``jax.vmap`` runs once per example, each with
  that example's slice of every argument: a bar would count each batch once per
  example. Here a vmapped report (a ``custom_vmap``, so under nested ``vmap``
  too) is one callback with ``combine`` of the examples' counts: the sweeps run
  in lockstep, so a batch counts once if any example ran it (``jnp.max``), and
  the jobs skipped by every example once (``jnp.min``). The dependencies only
  order the callback after them; no derivative flows into it.
  """

  @jax.custom_batching.custom_vmap
  def report(count, dependencies):
    jax.debug.callback(advance, count, dependencies)
    return ()

  @report.def_vmap
  def report_once(axis_size, in_batched, count, dependencies):
    del axis_size
    report(combine(count) if in_batched[0] else count, dependencies)
    return (), ()

  report(_first_device_only(count), jax.lax.stop_gradient(dependencies))


def _first_device_only(count: jax.Array) -> jax.Array:
  """``count`` on the first device of the ``jax.shard_map`` it runs in, 0 on the others.

  Inside ``shard_map`` every device runs the whole sweep on its own shard of
  the batch, and a callback runs once per device: the bar follows the first
  device's sweep (each reaches every job), not the sum over devices.
  """
  axes = sorted(manual_axes())
  if not axes:
    return count
  first = jnp.all(jnp.stack([jax.lax.axis_index(axis) == 0 for axis in axes]))
  return jnp.where(first, count, jnp.zeros_like(count))


def _batched(job: Callable[[Any], jax.Array], jobs: Any, batch_size: int | None,
             bar: ProgressBar | None, skip: tuple[jax.Array, Any] | None = None) -> jax.Array:
  """``job`` over the leading axis of ``jobs``, ``batch_size`` at a time; ``bar`` after each batch.

  With ``skip = (needed, skipped)``, the jobs where ``needed`` is false give
  ``skipped`` instead of running: the needed jobs go first, and the loop over
  batches stops after the last batch holding one (a ``jax.lax.while_loop``,
  whose invariant part, the model before the edited calls, XLA computes once;
  differentiated, every job runs: see :func:`_skipping`).
  In one batch (no ``batch_size``, or no fewer jobs) every job runs, and those
  not needed still give ``skipped`` (:func:`_as_skipped`).
  """
  total = jax.tree.leaves(jobs)[0].shape[0]
  size = total if batch_size is None else min(batch_size, total)
  if size == total:
    if skip is not None:
      return _as_skipped(_batched(job, jobs, batch_size, bar), *skip)
    if bar is None:
      return jax.vmap(job)(jobs)
  batches = -(-total // size)
  if skip is not None:
    needed, skipped = skip
    order = jnp.argsort(~needed, stable=True)
    jobs = jax.tree.map(lambda x: x[order], jobs)
    needed = needed[order]
  # Padded with copies of the last job to whole batches; their results are dropped.
  pad = batches * size - total
  jobs = jax.tree.map(lambda x: jnp.concatenate([x, jnp.repeat(x[-1:], pad, axis=0)]), jobs)

  def run(start: jax.Array) -> Any:
    chunk = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, size), jobs)
    return jax.vmap(job)(chunk)

  def advance(start: jax.Array, ran: jax.Array, out: Any) -> Any:
    if bar is not None:
      _report(bar.advance, jnp.where(ran, jnp.minimum(size, total - start), 0), out, jnp.max)
    return out

  if skip is None:
    return _every_batch(run, advance, batches, size, total, batches)

  count = (jnp.sum(needed) + size - 1) // size
  outs = _skipping(run, advance, needed, count, batches, size, skipped)
  if bar is not None:
    _report(bar.advance, total - jnp.minimum(count * size, total), outs, jnp.min)
  return jax.tree.map(lambda x: x[jnp.argsort(order)], outs)


@jax.custom_jvp
def _as_skipped(outs: Any, needed: jax.Array, skipped: Any) -> Any:
  """``outs`` where ``needed``, ``skipped`` exactly elsewhere; the derivatives are ``outs``'.

  A job that need not run (a patch of a value the corrupted run already has)
  gives exactly ``skipped`` also where it ran, in one batch with the others:
  the batched program may round the unchanged run otherwise than the run it
  is compared with. Its derivatives are still those of the run, as
  :func:`_skipping`'s are.
  """
  return jax.tree.map(
      lambda x, s: jnp.where(needed.reshape((-1,) + (1,) * (x.ndim - 1)), x, s), outs, skipped)


@_as_skipped.defjvp
def _as_skipped_jvp(primals, tangents):
  return _as_skipped(*primals), tangents[0]


def _every_batch(run: Callable[[jax.Array], Any],
                 advance: Callable[[jax.Array, jax.Array, Any], Any], batches: int, size: int,
                 total: int, count: jax.Array | int) -> Any:
  """``run(i * size)`` of every batch ``i`` (a ``jax.lax.map``), the first ``total`` results.

  Each batch is recomputed in the backward pass (``jax.checkpoint``), so that
  reverse mode keeps one batch's intermediates at a time, as the forward does,
  not every batch's. ``advance(start, ran, out)`` follows each batch, outside
  the recomputed part (so it runs once per batch), with ``ran`` for ``i < count``.
  """
  batch = jax.checkpoint(run)
  outs = jax.lax.map(lambda i: advance(i * size, i < count, batch(i * size)), jnp.arange(batches))
  return jax.tree.map(lambda x: x.reshape((batches * size,) + x.shape[2:])[:total], outs)


def _skipping(run: Callable[[jax.Array], Any], advance: Callable[[jax.Array, jax.Array, Any], Any],
              needed: jax.Array, count: jax.Array, batches: int, size: int, skipped: Any) -> Any:
  """``run`` of each batch of jobs, the needed ones first; ``skipped`` for the others' results.

  The values: the first ``count`` batches run (a ``jax.lax.while_loop``, whose
  trip count is traced), which hold every job where ``needed``; the others'
  results are ``skipped`` exactly. Their derivatives (a custom JVP) are those
  of running every batch: a skipped job's result equals ``skipped`` at this
  point, but not its derivatives (a patch that changes nothing here changes the
  metric when the clean input moves), so they are never taken as zero. And
  :func:`_every_batch` is differentiable in reverse mode, which a loop with a
  traced trip count is not. The values ``run`` closes over that carry
  derivatives (the model's variables, the clean outputs) are made explicit
  arguments (``jax.closure_convert``) so that the custom JVP sees them.
  ``advance(start, ran, out)`` (the progress bar) counts the batches
  ``i < count``, once each.
  """
  total = needed.shape[0]
  converted, consts = jax.closure_convert(run, jnp.zeros((), jnp.int32))

  def chosen(outs, skipped):
    outs = jax.tree.map(lambda x: x[:total], outs)
    return jax.tree.map(
        lambda x, s: jnp.where(needed.reshape((-1,) + (1,) * (x.ndim - 1)), x, s), outs, skipped)

  def first_batches(consts, skipped):
    def batch(i, outs):
      out = advance(i * size, True, converted(i * size, *consts))
      return jax.tree.map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, i * size, 0),
                          outs, out)

    outs = jax.tree.map(lambda s: jnp.broadcast_to(s, (batches * size,) + jnp.shape(s)), skipped)
    # Inside shard_map, the results start typed as what a batch makes (varying per device).
    outs = typed_like(outs, lambda: converted(jnp.zeros((), jnp.int32), *consts))
    return chosen(jax.lax.fori_loop(0, count, batch, outs), skipped)

  def every_batch(consts):
    return _every_batch(lambda start: converted(start, *consts), advance, batches, size, total,
                        count)

  def derivatives(primals, tangents):
    consts, skipped = primals
    outs, tangent = jax.jvp(every_batch, (consts,), (tangents[0],))
    return chosen(outs, skipped), tangent

  looped = jax.custom_jvp(first_batches)
  looped.defjvp(derivatives)
  return looped(consts, skipped)


def call_groups(calls: int, groups: int | None = None) -> list[tuple[int, ...]]:
  """The call numbers ``0 .. calls - 1`` cut into at most ``groups`` (default ``GROUPS``) runs
  of neighbours."""
  most = GROUPS if groups is None else groups
  return [tuple(int(c) for c in group)
          for group in np.array_split(np.arange(calls), min(calls, most))]


def sweep(job: Callable[[tuple[int, ...], jax.Array, Any], jax.Array], calls: int, jobs: Any,
          batch_size: int | None, progress: str | None = None,
          skip: tuple[jax.Array, Any] | None = None, groups: int | None = None) -> jax.Array:
  """``job(group, call, j)`` for every call number and every ``j`` along ``jobs``' leading axis.

  The calls are cut into :func:`call_groups` (neighbours in call order), a
  Python loop; each group's (call, ``j``) pairs are one ``vmap``, or
  ``batch_size`` at a time. A job edits its ``call`` among the ``group``'s
  calls (a traced number), so what the model computes before the group's first
  call does not depend on the batched jobs and runs once per group (at most
  once per batch of ``batch_size``), not once per job; only the rest runs
  batched. Groups trade compiled size (the model after a group's first call
  is in the program once per group) for time (the model before it is not
  repeated per job). With ``progress`` (the bar's description), a progress
  bar counts the jobs done, moved after each batch. With ``skip = (needed,
  skipped)``, ``needed`` a ``(calls, jobs)`` boolean array, the jobs where it is
  false give ``skipped`` without running: within a group the needed jobs go
  first, and a batch with none is not run. ``groups``: at most that many
  groups instead of ``GROUPS`` (1: the whole model compiled once, the model
  before the first call run once).

  Returns:
    The results stacked as ``(calls, jobs, ...)``.
  """
  per_call = jax.tree.leaves(jobs)[0].shape[0]
  bar = None if progress is None else ProgressBar(calls * per_call, progress)
  results = []
  for group in call_groups(calls, groups):
    pairs = (jnp.repeat(jnp.asarray(group), per_call),
             jax.tree.map(lambda x: jnp.tile(x, (len(group),) + (1,) * (x.ndim - 1)), jobs))
    group_skip = None if skip is None else (skip[0][jnp.asarray(group)].reshape(-1), skip[1])
    out = _batched(lambda pair: job(group, *pair), pairs, batch_size, bar, group_skip)
    results.append(out.reshape((len(group), per_call) + out.shape[1:]))
  return jnp.concatenate(results)
