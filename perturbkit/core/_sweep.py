"""The optimizer side of the interleaved schedule, independent of the Flax API.

The params are split into *groups*: one per segment, plus ``REST`` (params
owned by no segment). Each group has its own optimizer state. During the
backward sweep a segment's group takes its step inside the segment's custom
VJP (``backward_for``); after the sweep, ``finish`` updates ``REST``, keeps the
steps the sweep took, and assembles the new params, optimizer state and
metrics. A front end (Linen or NNX) decides which calls are segments and runs
them through ``_segment_vjp.segment_call``.
"""
import contextlib
import inspect
import warnings
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from perturbkit.errors import (InputMismatchError, NotAnOptimizerError, OptimizerStateError,
                               PerSegmentTransformWarning, PerturbkitError,
                               SegmentOptimizerError)
from perturbkit.core._callables import takes, takes_keywords
from perturbkit.core._lookahead import refuse_lookahead
from perturbkit.core._optax_privacy import refuse_optax_privacy
from perturbkit.core._precision import global_norm
from perturbkit.core._segment_choice import Segmentation
from perturbkit.core._segment_vjp import Backward, split_floats
from perturbkit.core._types import PyTree
from perturbkit.core._varying import manual_axes, vary
from perturbkit.core._whole_gradient import whole_gradient_transforms

REST = '<rest>'
"""The group of params owned by no segment (e.g. created directly in the root)."""

Optimizer = optax.GradientTransformation | Callable[[str], optax.GradientTransformation]


class InterleavedState(NamedTuple):
  """The training state: a pytree, so it passes through ``jax.jit`` and sharding.

  Attributes:
    step: Number of steps taken.
    variables: All model collections (``params``, ``batch_stats``, ...).
    opt_state: One optimizer state per segment name, and one for ``REST``.
    grad_norm: The previous step's global gradient norm (for clipping).
  """
  step: jax.Array
  variables: dict
  opt_state: dict
  grad_norm: jax.Array

  @property
  def params(self) -> PyTree:
    """The current parameters."""
    return self.variables['params']


def _wrapper_hint(optimizer: Any) -> str:
  """How to get the transformation out of a wrapper object such as ``optax.MultiSteps``."""
  if not callable(getattr(optimizer, 'gradient_transformation', None)):
    return ''
  example = (' (`optax.MultiSteps(optax.adam(1e-3), every_k_schedule=4)'
             '.gradient_transformation()`)' if isinstance(optimizer, optax.MultiSteps) else '')
  return (f'A {type(optimizer).__name__} is not a GradientTransformation itself: pass its '
          f'`.gradient_transformation()`{example}.')


def check_optimizer(optimizer: Any):
  """Raises :class:`NotAnOptimizerError` unless ``optimizer`` can be an :data:`Optimizer`.

  A function from optax itself (``optax.adam`` rather than ``optax.adam(1e-3)``)
  is refused too: called with a segment name it would take the name as its
  learning rate. A wrapper holding a transformation (``optax.MultiSteps``) is
  refused with the way to get its transformation.
  """
  if isinstance(optimizer, optax.GradientTransformation):
    return
  if not callable(optimizer):
    raise NotAnOptimizerError(f'it is {optimizer!r:.60} ({type(optimizer).__name__})',
                              _wrapper_hint(optimizer))
  if inspect.isfunction(optimizer) and optimizer.__module__.split('.')[0] == 'optax':
    raise NotAnOptimizerError(
        f'it is the function optax.{optimizer.__name__}',
        f'Call it to make the transformation, e.g. `optax.{optimizer.__name__}(1e-3)`.')
  if not takes(optimizer, 1):
    raise NotAnOptimizerError(f'it is a function taking {inspect.signature(optimizer)}',
                              'A function of the segment: `name -> transformation`, one argument.')


def warn_whole_gradient(optimizer: Optimizer, function: str) -> None:
  """Warns (:class:`PerSegmentTransformWarning`) where one optimizer for every segment
  contains a transformation of the whole gradient, which acts per segment in the sweep.
  A function ``segment_name -> GradientTransformation`` builds per-segment chains on purpose."""
  if isinstance(optimizer, optax.GradientTransformation):
    names = whole_gradient_transforms(optimizer)
    if names:
      warnings.warn(PerSegmentTransformWarning(function, names), stacklevel=3)


def optimizer_for(optimizer: Optimizer, name: str) -> optax.GradientTransformation:
  """The optax transformation of group ``name``."""
  if isinstance(optimizer, optax.GradientTransformation):
    return optimizer
  tx = optimizer(name)
  if not isinstance(tx, optax.GradientTransformation):
    raise NotAnOptimizerError(f'the function returned {tx!r:.60} for segment {name!r}',
                              _wrapper_hint(tx))
  return tx


def _path(name: str) -> tuple:
  return tuple(name.split('/'))


def group(params: Mapping, names: list[str]) -> dict[str, PyTree]:
  """``{segment name: its params subtree, REST: everything else}``."""
  flat = traverse_util.flatten_dict(params)
  groups: dict[str, dict] = {name: {} for name in names}
  groups[REST] = {}
  owner = {}
  for key in flat:
    owner[key] = next((n for n in names if key[:len(_path(n))] == _path(n)), REST)
  for key, value in flat.items():
    name = owner[key]
    local = key if name == REST else key[len(_path(name)):]
    groups[name][local] = value
  return {name: traverse_util.unflatten_dict(g) if g else {} for name, g in groups.items()}


def ungroup(groups: Mapping[str, PyTree]) -> dict:
  """The params tree back from ``group``'s result."""
  flat = {}
  for name, tree in groups.items():
    prefix = () if name == REST else _path(name)
    for key, value in traverse_util.flatten_dict(tree).items():
      flat[prefix + key] = value
  return traverse_util.unflatten_dict(flat)


def _init(tx: optax.GradientTransformation, w: PyTree, iterations: int) -> PyTree:
  """``tx``'s state for ``w``; for a scanned segment, one per iteration, stacked."""
  return jax.vmap(tx.init)(w) if iterations else tx.init(w)


def _init_group(tx: optax.GradientTransformation, name: str, w: PyTree,
                iterations: int) -> PyTree:
  """``_init`` for one group; a transformation built for another tree (a mask or labels
  for the whole params) raises :class:`SegmentOptimizerError` naming the group."""
  try:
    return _init(tx, w, iterations)
  except (ValueError, TypeError) as error:
    if isinstance(error, PerturbkitError):
      raise
    raise SegmentOptimizerError(name, error) from error


def init_opt_state(optimizer: Optimizer, params: Mapping, names: list[str],
                   iterations: Mapping[str, int] | None = None) -> dict:
  """One optimizer state per group (per iteration of a scanned segment, stacked).

  Raises:
    OptaxPrivacyError: a group's optimizer contains optax's per-example DP
      transformation, which the sweep would hand batch gradients.
    LookaheadParamsError: a group's optimizer contains ``optax.lookahead``.
  """
  iterations = iterations or {}
  states = {name: _init_group(optimizer_for(optimizer, name), name, w, iterations.get(name, 0))
            for name, w in group(params, names).items()}
  refuse_optax_privacy(states, 'The interleaved schedule',
                       "each segment's batch gradient (summed over the examples)")
  refuse_lookahead(states, 'The interleaved schedule')
  return states


def check_opt_state(optimizer: Optimizer, params: Mapping, opt_state: Mapping,
                    iterations: Mapping[str, int] | None = None):
  """Raises :class:`OptimizerStateError` naming the first leaf that does not fit."""
  iterations = iterations or {}
  names = [n for n in opt_state if n != REST]
  for name, w in group(params, names).items():
    if name != REST and not jax.tree.leaves(w):
      raise OptimizerStateError(
          f'The optimizer state has a segment {name!r} that the params do not have; '
          'build the state with `init` on these variables.')
    want = jax.eval_shape(lambda w: _init(optimizer_for(optimizer, name), w,
                                          iterations.get(name, 0)), w)
    got = opt_state.get(name)
    want_leaves = jax.tree_util.tree_flatten_with_path(want)[0]
    got_leaves = jax.tree_util.tree_flatten_with_path(got)[0] if got is not None else []
    for (want_path, want_leaf), got_item in zip(want_leaves, got_leaves + [None] * len(
        want_leaves)):
      if got_item is None or got_item[0] != want_path or (
          jnp.shape(got_item[1]) != want_leaf.shape):
        where = jax.tree_util.keystr(want_path)
        got_text = 'nothing' if got_item is None else (
            f'{jax.tree_util.keystr(got_item[0])} of shape {jnp.shape(got_item[1])}')
        raise OptimizerStateError(
            f'The optimizer state of {name!r} does not match its params: at {where} it '
            f'should have shape {want_leaf.shape}, it has {got_text}. Build the state with '
            '`init` for the same params and optimizer.')
    if len(got_leaves) != len(want_leaves):
      raise OptimizerStateError(
          f'The optimizer state of {name!r} does not match its params: it has '
          f'{len(got_leaves)} leaves, the optimizer makes {len(want_leaves)}. Build the state '
          'with `init` for the same params and optimizer.')


def _argument_name(path: tuple, keywords: int) -> str:
  if path[0].idx == keywords:
    return f'keyword argument {path[1].key!r}{jax.tree_util.keystr(path[2:])}'
  return f'argument {path[0].idx}{jax.tree_util.keystr(path[1:])}'


def input_shapes(args: tuple) -> dict[str, jax.ShapeDtypeStruct]:
  """The shape and dtype of every array in ``args`` (the positional arguments and, last, the
  keyword arguments, ``_keywords.with_keywords``), by ``'argument 0'``-style names."""
  return {_argument_name(path, len(args) - 1):
          jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf))
          for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]
          if hasattr(leaf, 'shape') and hasattr(leaf, 'dtype')}


def _shown(leaf: jax.ShapeDtypeStruct | None) -> str:
  return 'absent' if leaf is None else f'shape {leaf.shape} ({leaf.dtype})'


def input_mismatch(at_init: Mapping[str, jax.ShapeDtypeStruct] | None, args: tuple,
                   init_call: str) -> InputMismatchError | None:
  """The error for ``step`` inputs that differ from ``init``'s beyond the batch size, if any.

  Only a failing step asks this, to tell inputs of the wrong shape from a
  state of another model; the leading axis (the batch size) may differ.

  Args:
    at_init: ``input_shapes`` of the arguments ``init`` was given (``None``:
      unknown, e.g. for a state from another process).
    args: The arguments ``step`` was given.
    init_call: How to call ``init``, for the message.
  """
  if at_init is None:
    return None
  now = input_shapes(args)
  changes = []
  for name in [*at_init, *(n for n in now if n not in at_init)]:
    before, after = at_init.get(name), now.get(name)
    if before is None or after is None or len(before.shape) != len(after.shape) or (
        before.shape[1:] != after.shape[1:]):
      changes.append(f'{name} had {_shown(before)} at init, now {_shown(after)}')
  return InputMismatchError(changes, init_call) if changes else None


@contextlib.contextmanager
def explaining_inputs(at_init: Mapping[str, jax.ShapeDtypeStruct] | None, args: tuple,
                      init_call: str) -> Iterator[None]:
  """Turns a raw ``TypeError``/``ValueError`` of a step on other inputs into ``InputMismatchError``.

  A perturbkit error, or a failure on inputs shaped as at init, passes unchanged.
  """
  try:
    yield
  except (TypeError, ValueError) as error:
    if isinstance(error, PerturbkitError):
      raise
    mismatch = input_mismatch(at_init, args, init_call)
    if mismatch is not None:
      raise mismatch from error
    raise


def clip_scale(max_norm: float | None, previous_norm: jax.Array) -> jax.Array:
  """``min(1, max_norm / previous_norm)`` (1 without a maximum)."""
  if max_norm is None:
    return jnp.ones(())
  return jnp.where(previous_norm > max_norm, max_norm / jnp.maximum(previous_norm, 1e-30), 1.0)


def scaled(grads: PyTree, scale: jax.Array) -> PyTree:
  """``grads * scale`` in the gradients' own dtype (a bfloat16 model's stay bfloat16, so its
  optimizer state keeps its dtype from step to step)."""
  return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)


def takes_extra_args(tx: optax.GradientTransformation) -> bool:
  """Whether ``tx``'s update is given the sweep's extra arguments: a
  ``GradientTransformationExtraArgs``, or an update taking ``**extra_args`` (a wrapper such
  as ``optax.MultiSteps(...).gradient_transformation()``, which hands them on)."""
  return isinstance(tx, optax.GradientTransformationExtraArgs) or takes_keywords(tx.update)


def _update(tx: optax.GradientTransformation, grads: PyTree, opt_state: PyTree, params: PyTree,
            extra_args: dict | None):
  if extra_args and takes_extra_args(tx):
    return tx.update(grads, opt_state, params, **extra_args)
  return tx.update(grads, opt_state, params)


def always_true_after(values: PyTree) -> jax.Array:
  """``True``, computed from one entry of each array in ``values``.

  XLA updates a donated buffer in place only after every read of its old
  value that the update depends on; a step gated by this waits for
  ``values`` (e.g. the input cotangent at the old weights) at the cost of
  reading a scalar per array.
  """
  # Indexed, not raveled: a ravel of an array sharded across devices is an all-gather.
  firsts = [leaf[(0,) * jnp.ndim(leaf)] for leaf in jax.tree.leaves(values) if jnp.size(leaf)]
  # Equal or unequal to itself (NaN included): true, and not folded away by XLA.
  return jnp.all(jnp.stack([(x == x) | (x != x) for x in firsts] or [jnp.ones((), bool)]))


def guarded_step(tx: optax.GradientTransformation, grads: PyTree, opt_state: PyTree,
                 params: PyTree, scale: jax.Array, guard: bool, extra_args: dict | None = None,
                 after: PyTree = None):
  """One optimizer step on one group: ``(params, opt_state, finite)``.

  With ``guard``, a gradient whose norm is not finite keeps the old params and
  state. A conditional (not an elementwise select) skips the work, so the
  finite path makes no extra pass over the state and can update it in place.
  ``extra_args`` go to an update that takes them (``takes_extra_args``). With
  ``guard`` and ``after``, the conditional also waits for ``after`` (the old
  params' last reads), so that XLA updates the params in place without first
  copying them.
  """
  finite = jnp.isfinite(global_norm(grads))
  if guard and after is not None:
    finite = jnp.logical_and(finite, always_true_after(after))

  def take():
    updates, new_opt = _update(tx, scaled(grads, scale), opt_state, params,
                               extra_args)
    return optax.apply_updates(params, updates), new_opt

  if not guard:
    return *take(), finite
  new_params, new_opt = jax.lax.cond(finite, take, lambda: (params, opt_state))
  return new_params, new_opt, finite


class Sweep(NamedTuple):
  """What one step's sweep needs: its settings and the state it starts from.

  ``examples`` is the batch's number of examples (the first axis of the step's
  first array argument that is not one raw PRNG key, ``_examples.step_examples``),
  given to the segment optimizers as ``segment_examples``.
  ``iterations`` names the segments inside a scan, with their number of
  iterations: their optimizer states are stacked, one per iteration.
  """
  optimizer: Optimizer
  opt_state: dict
  scale: jax.Array
  propagate: str
  skip_nonfinite: bool
  examples: int | None = None
  iterations: Mapping[str, int] = {}


def backward_for(sweep: Sweep, name: str, swept: dict, opt_state: PyTree = None) -> Backward:
  """The backward step of segment ``name``: its optimizer step, inside the sweep.

  The step is taken here with either ``propagate`` (the old weights' input
  cotangent for ``'original'``), so that the segment's inputs and output
  cotangent reach its optimizer as extra arguments. ``swept`` records the
  segment with those arguments' shapes, for ``finish``. ``opt_state`` is the
  state of one iteration of a scanned segment (default: the segment's state).
  """
  tx = optimizer_for(sweep.optimizer, name)

  def step(g, dw, w, dyn, after, state):
    opt_state, scale = state
    # Typed to vary like its carrier (``carrier``), whether or not ``g`` varies.
    carried = {'activation_grad_norm': vary(global_norm(g).astype(jnp.float32),
                                            manual_axes())}
    extra_args = {'segment_inputs': dyn, 'segment_output_grad': g}
    swept[name] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), extra_args)
    extra_args['segment_examples'] = sweep.examples
    new_w, new_opt, _ = guarded_step(tx, dw, opt_state, w, scale, sweep.skip_nonfinite,
                                     extra_args, after)
    carried['step'] = (new_w, split_floats(new_opt)[0])
    return new_w, carried

  return Backward(step, propagate_updated=sweep.propagate == 'updated',
                  state=(sweep.opt_state[name] if opt_state is None else opt_state, sweep.scale))


def carrier(sweep: Sweep, name: str, w: PyTree) -> dict:
  """Zeros shaped like what segment ``name``'s backward step carries out (stacked per
  iteration for a scanned segment, as its ``w`` and optimizer state are).

  Inside ``jax.shard_map`` (with ``check_vma=True``) the activation gradient's norm
  is each device's own, so its zeros vary over every mesh axis; the step is typed
  as ``w`` and the optimizer state are."""
  floats = split_floats(sweep.opt_state[name])[0]
  norm_shape = (sweep.iterations[name],) if name in sweep.iterations else ()
  return {'activation_grad_norm': vary(jnp.zeros(norm_shape, jnp.float32), manual_axes()),
          'step': (jax.tree.map(jnp.zeros_like, w), [jnp.zeros_like(leaf) for leaf in floats])}


def whole_batch_norms(local_norms: PyTree, axis_name: str) -> PyTree:
  """The norms of the whole batch's activation gradients, from each device's own.

  A data-parallel step minimises the mean of the devices' losses,
  ``L = (1/D) sum_d L_d`` (``pmean`` of the gradients). A device's activations
  reach only its own ``L_d``, so their gradient is ``g_d / D``, with ``g_d`` the
  device's own cotangent; the whole batch's activation gradient is the
  concatenation of these, of norm ``sqrt(sum_d |g_d|^2) / D``. For a mean loss
  over equal shards this is the norm one device sees on the whole batch.
  Norms of a scanned segment (one per iteration) are combined entrywise.
  """
  devices = jax.lax.psum(1, axis_name)
  return jax.tree.map(lambda n: jnp.sqrt(jax.lax.psum(jnp.square(n), axis_name)) / devices,
                      local_norms)


def device_mean(loss: jax.Array, axis_name: str | None) -> jax.Array:
  """The loss averaged over ``axis_name`` (``pmean``), as the gradients are: a data-parallel
  step minimises the mean of the devices' losses. Unchanged without an axis."""
  return loss if axis_name is None else jax.lax.pmean(loss, axis_name)


def finish(sweep: Sweep, params: Mapping, grads: Mapping, carried: Mapping, swept: Mapping,
           axis_name: str | None) -> tuple[dict, dict, dict]:
  """The step after the sweep: ``(new params, new opt_state, metrics)``.

  ``REST`` gets its ordinary (``pmean``-ed) gradient and its step now; the
  segments keep the step the sweep took, and only their optimizers' non-float
  state (a step count) is taken here, so XLA drops the rest of that update.
  That update sees zeros for the segment's extra arguments (their shapes are
  in ``swept``): only its non-float state is kept, which
  must not depend on their values.
  """
  names = [n for n in sweep.opt_state if n != REST]
  grad_groups, param_groups = group(grads, names), group(params, names)
  if axis_name is not None:
    grad_groups[REST] = jax.lax.pmean(grad_groups[REST], axis_name)
  new_groups, new_opt_state, grad_norms, skipped = {}, {}, {}, {}
  for name, g in grad_groups.items():
    tx, w, opt = optimizer_for(sweep.optimizer, name), param_groups[name], sweep.opt_state[name]
    grad_norms[name] = global_norm(g)
    # A scanned segment steps each iteration on its own: its update is mapped over them.
    mapped = jax.vmap if name in sweep.iterations else lambda f: f
    finite = mapped(lambda g: jnp.isfinite(global_norm(g)))(g)
    skipped[name] = (jnp.logical_not(jnp.all(finite)) if sweep.skip_nonfinite
                     else jnp.zeros((), bool))
    if name in swept:
      new_w, floats = carried[name]['step']
      extra_args = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), swept[name])
      extra_args['segment_examples'] = sweep.examples

      def fresh_state(g, opt, w, finite, extra_args=extra_args, tx=tx):
        _, fresh = _update(tx, scaled(g, sweep.scale), opt, w, extra_args)
        if sweep.skip_nonfinite:
          fresh = jax.tree.map(lambda a, b: jnp.where(finite, a, b), fresh, opt)
        return fresh

      new_opt_state[name] = split_floats(mapped(fresh_state)(g, opt, w, finite))[1](floats)
    else:
      new_w, new_opt_state[name], _ = mapped(
          lambda g, opt, w, tx=tx: guarded_step(tx, g, opt, w, sweep.scale,
                                                sweep.skip_nonfinite))(g, opt, w)
    new_groups[name] = new_w
  act_norms = {name: c['activation_grad_norm'] for name, c in carried.items()}
  if axis_name is not None:
    act_norms = whole_batch_norms(act_norms, axis_name)
  whole_norm = jnp.sqrt(sum(n ** 2 for n in grad_norms.values()))
  metrics = {'grad_norm': {n: v for n, v in grad_norms.items() if n != REST},
             'activation_grad_norm': act_norms, 'global_grad_norm': whole_norm,
             'nonfinite': {n: jnp.logical_not(jnp.isfinite(v)) for n, v in grad_norms.items()},
             'skipped': jnp.any(jnp.stack(list(skipped.values()))),
             'segment_skipped': skipped}
  return ungroup(new_groups), new_opt_state, metrics

class Interleaved(NamedTuple):
  """A pair of pure functions, like ``optax.GradientTransformation``.

  Attributes:
    init: ``(variables, *example_args, **example_kwargs) -> InterleavedState``.
    step: ``(state, *args, **kwargs) -> (state, metrics)``; jittable.
    segments: ``(variables, *example_args, **example_kwargs) -> Segmentation``: the segment names
      in execution order, and which params went to ``REST`` and why.
  """
  init: Callable[..., InterleavedState]
  step: Callable[..., tuple[InterleavedState, dict]]
  segments: Callable[..., Segmentation]
