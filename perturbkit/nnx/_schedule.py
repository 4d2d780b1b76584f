"""``perturbkit.nnx.interleaved``: update-then-propagate training of an unmodified NNX model.

The same schedule as the Linen ``interleaved``, from the same core: each
segment call runs through ``_segment_vjp.segment_call`` (dw at the old
weights, ``pmean``, the optimizer step, the input cotangent at the new
weights), and ``_sweep`` keeps one optimizer state per segment, updates
``REST`` after the sweep and assembles the metrics. Only finding the calls is
NNX-specific (``_nnx_segmentation``, ``_nnx_segments``).

Two faces, as in NNX itself: a pure ``init``/``step`` pair over the model's
``nnx.State`` (like ``optax``), and :class:`InterleavedOptimizer`, which keeps
its state in ``nnx.OptState`` variables and updates the model in place (like
``nnx.Optimizer``), for use inside ``nnx.jit``.
"""
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import filterlib

from perturbkit.nnx import _segmentation as _nnx_segmentation
from perturbkit.core._examples import step_examples
from perturbkit.core._keywords import given, keywords_last, with_keywords
from perturbkit.core._loss import check_loss, check_loss_fn, describe
from perturbkit.errors import InvalidOptionError, SegmentationError, UninitializedStateError
from perturbkit.core._hooks import Hook, hooks_tuple
from perturbkit.core._input_types import TypesSeen
from perturbkit.nnx._driver import check_module, with_hooks
from perturbkit.nnx._segments import (params_tree, rng_objects, segmented_loss, variables_tree,
                                      with_values)
from perturbkit.core._sweep import (REST, Interleaved, Optimizer, Sweep, backward_for, carrier,
                                    check_opt_state, check_optimizer, clip_scale, device_mean,
                                    explaining_inputs, finish, group, init_opt_state,
                                    input_shapes, warn_whole_gradient)
from perturbkit.core._types import CallFilter
from perturbkit.core._validate import interleaved_options
from perturbkit.core._values import jax_arrays, partition_values
from perturbkit.core._varying import check_unchecked, explaining_unbound_axes

__all__ = ['InterleavedOptimizer', 'InterleavedState', 'interleaved']


def checked_wrt(wrt: Any) -> Any:
  """``wrt`` if Flax reads it as a filter of variables (Flax's own error for ``wrt=3`` is a
  ``ValueError`` from formatting its message)."""
  try:
    filterlib.to_predicate(wrt)
  except (TypeError, ValueError):
    raise InvalidOptionError('wrt', wrt, 'an NNX filter of the trained variables, e.g. '
                             'nnx.Param (a Variable type, a path pattern string, or a tuple '
                             'or list of them)') from None
  return wrt


class InterleavedState(NamedTuple):
  """The training state of an NNX model: a pytree (the graphdef has no leaves).

  Attributes:
    step: Number of steps taken.
    graphdef: The model's graphdef (``nnx.split(model)[0]``).
    variables: The model's whole state (params, batch statistics, RNG streams).
    opt_state: One optimizer state per segment name, and one for ``REST``.
    grad_norm: The previous step's global gradient norm (for clipping).
  """
  step: jax.Array
  graphdef: Any
  variables: nnx.State
  opt_state: dict
  grad_norm: jax.Array

  def model(self) -> nnx.Module:
    """The model with this state (a new object)."""
    return nnx.merge(self.graphdef, self.variables, copy=True)


class _Settings(NamedTuple):
  loss_fn: Callable[..., Any]
  optimizer: Optimizer
  wrt: Any
  segments: Any
  propagate: str
  axis_name: str | None
  has_aux: bool
  clip_global_norm: float | None
  skip_nonfinite: bool
  hooks: tuple = ()
  # (model, args, segment names) whose segments passed their checks, by type: one record
  # per trainer, given by its constructor.
  checked: TypesSeen | None = None
  # Segment names -> those that run inside nnx.scan and their number of iterations.
  scanned: dict | None = None


def _checked_key(settings: _Settings, model: nnx.Module, args: tuple, names) -> tuple:
  """What a segment check depends on: the model and inputs (by type) and the segments, in any
  order."""
  return nnx.split(model, settings.wrt, ...), args, tuple(sorted(names))


def _segmentation(settings: _Settings, model: nnx.Module, args: tuple, spec: Any
                  ) -> _nnx_segmentation.Segmentation:
  if not given(args):
    raise SegmentationError(
        'Segments are calls, which are only known by tracing the loss: pass example '
        'arguments, `init(model, *args)` / `segments(model, *args)`, the same arguments '
        'as the loss takes after the model.')
  with explaining_unbound_axes('perturbkit.nnx.InterleavedOptimizer(...)'):
    return _nnx_segmentation.choose(settings.loss_fn, model, args, settings.wrt, spec)


def _train(settings: _Settings, model: nnx.Module, opt_state: dict, grad_norm: jax.Array,
           args: tuple) -> tuple[nnx.State, nnx.State, dict, jax.Array, dict]:
  """One interleaved step: ``(new wrt state, new other state, opt_state, norm, metrics)``."""
  check_unchecked(settings.axis_name, 'perturbkit.nnx.interleaved')
  graphdef, template, others = nnx.split(model, settings.wrt, ...)
  params = params_tree(template)
  names = [n for n in opt_state if n != REST]
  # The state's segments must pass every check on this loss and batch: checked unless
  # they passed on inputs of these types (chosen at init, or a step before).
  key = _checked_key(settings, model, args, names)
  if key not in settings.checked:
    chosen = _nnx_segmentation.choose(settings.loss_fn, model, args, settings.wrt,
                                      _nnx_segmentation.exactly(names))
    settings.scanned[tuple(sorted(names))] = chosen.iterations
    settings.checked.add(key)
  iterations = settings.scanned[tuple(sorted(names))]
  check_opt_state(settings.optimizer, params, opt_state, iterations)
  paths = {name: path for name, path in _segment_paths(model, names)}
  # A state restored from a checkpoint holds NumPy arrays, a hyperparameter set by hand a
  # Python number: the sweep splits the optimizer state into its floating-point JAX arrays.
  sweep = Sweep(settings.optimizer, jax_arrays(opt_state),
                clip_scale(settings.clip_global_norm, grad_norm), settings.propagate,
                settings.skip_nonfinite, step_examples(args), iterations)
  swept: dict[str, dict] = {}
  groups = group(params, names)
  carriers = {name: carrier(sweep, name, groups[name]) for name in names}
  forward = segmented_loss(settings.loss_fn, graphdef, template, others, args, settings.wrt,
                           {paths[n]: n for n in names},
                           lambda name, opt: backward_for(sweep, name, swept, opt),
                           settings.axis_name, settings.hooks, iterations,
                           {n: opt_state[n] for n in iterations})

  def differentiable(params, carriers):
    out, (new_others, drawn) = forward(params, carriers)
    loss = check_loss(out, settings.has_aux)  # names a scalar given with has_aux first
    return loss, (out[1] if settings.has_aux else None, new_others, drawn)

  (loss, (aux, new_others, drawn)), (grads, carried) = jax.value_and_grad(
      differentiable, argnums=(0, 1), has_aux=True)(params, carriers)
  # An nnx.Rngs argument moves on as under nnx.value_and_grad: the next step draws anew.
  for obj, state in zip(rng_objects(args), drawn):
    nnx.update(obj, state)
  new_params, new_opt_state, metrics = finish(sweep, params, grads, carried, swept,
                                              settings.axis_name)
  loss = device_mean(loss, settings.axis_name)
  global_norm = metrics['global_grad_norm']
  kept_norm = jnp.where(jnp.isfinite(global_norm), global_norm, grad_norm)
  metrics = {'loss': loss, **metrics}
  if settings.has_aux:
    metrics['aux'] = aux
  return with_values(template, new_params), new_others, new_opt_state, kept_norm, metrics


def _segment_paths(model: nnx.Module, names) -> list[tuple[str, tuple]]:
  by_name = {'/'.join(map(str, path)): tuple(path) for path, _ in nnx.iter_modules(model)}
  return [(name, by_name[name]) for name in names]


def interleaved(loss_fn: Callable[..., Any], optimizer: Optimizer, *, wrt: Any = nnx.Param,
                segments: int | CallFilter | None = None, propagate: str = 'updated',
                axis_name: str | None = None, has_aux: bool = False,
                clip_global_norm: float | None = None, skip_nonfinite: bool = True,
                hooks: Sequence[Hook] = ()) -> Interleaved:
  """Interleaved update-then-propagate training for an unmodified NNX model.

  The schedule of :func:`perturbkit.interleaved`, for ``loss_fn(model, *args)``
  on an NNX model: segments (submodule calls) are processed in reverse order of
  execution; each one's gradient is taken at its old weights, ``pmean``-ed over
  ``axis_name``, applied by its own optimizer state at once, and the gradient
  for what the segment consumed is computed with its NEW weights
  (``propagate='updated'``; ``'original'`` equals ``nnx.value_and_grad`` +
  ``nnx.Optimizer.update``). Variables selected by ``wrt`` that no segment owns
  (``perturbkit.REST``) get their ordinary gradient and are updated at the end.
  Batch statistics and RNG counts change as in a plain call of the loss, and
  every replay of a segment draws the same random numbers.
  The rest of the conventions (choosing segments, per-segment optimizers,
  clipping, metrics, many devices and many hosts) are those of
  ``help(perturbkit.interleaved)``.

  By default every call of a module holding ``wrt`` variables directly
  (``nnx.Linear``, ``nnx.Conv``, ``nnx.Embed``, ``nnx.LayerNorm``, ...) is a
  segment; a module called twice, one whose variables are read outside its call
  (tied weights, loss terms on them), or one inside ``nnx.scan``/``nnx.vmap``/
  ``nnx.remat`` or the branches of ``nnx.cond``/``nnx.switch`` (then its
  nearest enclosing call takes it, if it can) goes to
  ``REST``, listed with the reason by ``segments(model, *args)`` (if none is
  left, ``NoSegmentError`` says what to change). A call a module makes inside
  its own call (a method calling another of its methods, or
  ``super().__call__(x)`` in a subclass of ``nnx.Linear``) is part of that call.
  A module holding variables directly around modules that hold some too is one
  segment with them, unless the loss does not read its own variables on the
  example arguments: those go to ``REST`` and the modules inside are segments.
  A Variable held by several modules (``self.head.w = self.embed.embedding``)
  belongs to the module where ``nnx.state(model, wrt)`` lists it; another
  module holding it reads that module's params (its owner goes to ``REST``,
  and it may still be a segment of its own variables).

  Blocks run by ``nnx.scan`` over modules made with ``nnx.vmap`` (params stacked
  ``(L, ...)``, sliced per iteration by the scan's ``in_axes=0``) are segments
  per iteration, as in Linen (see "Blocks in ``nn.scan``" in
  ``help(perturbkit.interleaved)``): each iteration's slice takes its step before
  the gradient goes on to the iteration below, with one optimizer state per
  iteration; ``segments(...).iterations`` gives their number. The scan must slice
  the module's whole state (``in_axes=0``, not a ``StateAxes`` that broadcasts
  other variables), since each iteration's step state rides on the module;
  otherwise the scanned module goes to its enclosing call or ``REST``
  (``tests/test_interleaved_scan.py``).

  Backward hooks, from ``hooks=`` or from ``perturbkit.nnx.with_hooks`` inside
  the loss, act as in ``jax.grad`` of the hooked loss: a hook on a segment call
  transforms the gradient its ``dw`` and its input cotangent see, and hooks on
  calls nested inside a segment act inside every replay of it, the one at the
  new weights included.

  Args:
    loss_fn: ``(model, *args, **kwargs) -> loss`` (or ``(loss, aux)`` with ``has_aux``);
      its arguments after the model, positional and keyword, are those given to
      ``init``/``step``, a leaf that is no array (a flag) reaching it as it is.
    optimizer: An ``optax.GradientTransformation`` for every segment, or a
      function ``segment_name -> GradientTransformation``.
    wrt: Filter of the trained variables (as ``nnx.Optimizer``'s ``wrt``),
      evaluated with the variables' paths in the model
      (``nnx.All(nnx.Param, nnx.PathContains('head'))`` trains the head only).
    segments: ``None`` (layer-wise), an ``int`` depth, or a call filter (e.g.
      ``perturbkit.nnx.filters.by_type(Block)``); for chosen segments a shared
      or outside-read segment raises :class:`perturbkit.SharedSegmentError`,
      one inside an NNX transform ``SegmentInTransformError``. The depth
      counts module levels as the Linen front end does: the items of an
      ``nnx.List``/``nnx.Dict`` attribute are one level below its owner
      (``segments=1`` makes each of ``self.blocks = nnx.List([...])`` a
      segment, as each layer of a root ``nnx.Sequential``), and each
      segment is the module at that depth holding (through its children)
      ``wrt`` variables.
    propagate: ``'updated'`` or ``'original'``.
    axis_name: Mapped axis to average gradients over (``shard_map``/``pmap``).
    has_aux: Whether ``loss_fn`` returns ``(loss, aux)``; aux goes to metrics.
    clip_global_norm: Optional global-norm clip using the previous step's norm.
    skip_nonfinite: A group whose gradient is not finite keeps its variables
      and optimizer state for the step (reported in ``metrics``).
    hooks: Backward hooks (:func:`perturbkit.backward_hook`, one or a list, filters
      from ``perturbkit.nnx.filters``) on the calls they select, segments and the
      calls inside them included; on a segment the hook transforms the
      gradient before the segment's own ``dw``, as in an ordinary backward pass.

  Returns:
    An ``Interleaved`` of pure functions: ``init(model, *example_args, **example_kwargs)
    -> InterleavedState``, ``step(state, *args, **kwargs) -> (state, metrics)`` (jittable)
    and ``segments(model, *example_args, **example_kwargs) -> Segmentation``.

  Raises:
    NotAHookError: ``hooks`` holds something else than hooks.
    UnmatchedFilterError: (``init``) a hook's filter selects no call of the loss.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Sequential(nnx.Linear(3, 8, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(8, 1, rngs=nnx.Rngs(1)))
    >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
    >>> loss_fn = lambda model, x, y: jnp.mean((model(x) - y) ** 2)
    >>> tx = perturbkit.nnx.interleaved(loss_fn, optax.sgd(0.1))
    >>> state = tx.init(model, x, y)
    >>> state, metrics = jax.jit(tx.step)(state, x, y)
    >>> sorted(metrics['grad_norm'])
    ['layers/0', 'layers/2']
    >>> nnx.update(model, state.variables)  # back into the model object
  """
  segments = interleaved_options(segments, clip_global_norm, propagate, has_aux,
                                 skip_nonfinite)
  check_loss_fn(loss_fn, 'perturbkit.nnx.interleaved', '(model, *args) -> loss')
  checked_wrt(wrt)
  check_optimizer(optimizer)
  warn_whole_gradient(optimizer, 'perturbkit.nnx.interleaved')
  # Every function below passes the loss's arguments as one tuple, the keywords last.
  settings = _Settings(keywords_last(loss_fn), optimizer, wrt, segments, propagate, axis_name, has_aux,
                       clip_global_norm, skip_nonfinite,
                       hooks_tuple(hooks, 'perturbkit.nnx.interleaved'), TypesSeen(), {})
  # What `init` was last given, only to word the error of a step that fails on other inputs.
  at_init: dict = {}

  def segmentation(model: nnx.Module, *args, **kwargs) -> _nnx_segmentation.Segmentation:
    _check_model(model)
    return _segmentation(settings, model, with_keywords(args, kwargs), segments)

  def init(model: nnx.Module, *args, **kwargs) -> InterleavedState:
    args = with_keywords(args, kwargs)
    opt_state = init_opt_state_of(settings, model, args)
    graphdef, variables = nnx.split(model)
    at_init['shapes'] = input_shapes(args)
    return InterleavedState(jnp.zeros((), jnp.int32), graphdef, variables, opt_state,
                            jnp.zeros((), jnp.float32))

  def step(state: InterleavedState, *args, **kwargs) -> tuple[InterleavedState, dict]:
    args = with_keywords(args, kwargs)
    if not isinstance(state, InterleavedState):
      raise UninitializedStateError(
          (f'an nnx.Module ({type(state).__name__}), the model itself'
           if isinstance(state, nnx.Module) else describe(state)),
          _INIT_CALL)
    model = state.model()
    with explaining_inputs(at_init.get('shapes'), args, _INIT_CALL):
      new_params, new_others, opt_state, norm, metrics = _train(
          settings, model, state.opt_state, state.grad_norm, args)
    nnx.update(model, new_params, new_others)
    graphdef, variables = nnx.split(model)
    return InterleavedState(state.step + 1, graphdef, variables, opt_state, norm), metrics

  return Interleaved(init, step, segmentation)


_INIT_CALL = 'trainer.init(model, *args)'
_OPTIMIZER_CALL = 'perturbkit.nnx.InterleavedOptimizer(model, tx, loss_fn, *args)'


def _check_model(model: Any):
  check_module(model, 'perturbkit.nnx.interleaved')


def _check_hooks(settings: _Settings, model: nnx.Module, args: tuple):
  """Raises :class:`UnmatchedFilterError` for a hook of ``hooks=`` that selects no call of the
  loss, found by an abstract run of the hooked loss (its paths are those of the segments'
  calls and of the calls inside them)."""
  if settings.hooks:
    hooked = with_hooks(settings.loss_fn, *settings.hooks)
    # Only the arrays are traced: a flag or a string reaches the loss as it is.
    arrays, rebuild = partition_values(args, keep=nnx.graph.is_graph_node)
    with explaining_unbound_axes('perturbkit.nnx.interleaved(...).init'):
      nnx.eval_shape(lambda model, arrays: hooked(model, *rebuild(arrays)), model, arrays)


def init_opt_state_of(settings: _Settings, model: nnx.Module, args: tuple,
                      of_variables: bool = False) -> dict:
  """One optimizer state per segment of ``model``'s loss, and one for ``REST``; made from the
  params' variables with ``of_variables`` (the states' arrays are then variables carrying
  their params' metadata, as ``nnx.Optimizer`` makes them), else from their values."""
  _check_model(model)
  _check_hooks(settings, model, args)
  chosen = _segmentation(settings, model, args, settings.segments)
  names = list(chosen.segments)
  settings.checked.add(_checked_key(settings, model, args, names))
  settings.scanned[tuple(sorted(names))] = chosen.iterations
  params = (variables_tree if of_variables else params_tree)(nnx.state(model, settings.wrt))
  return init_opt_state(settings.optimizer, params, names, chosen.iterations)


def _as_opt_state(leaf: Any) -> Any:
  """``leaf`` as an ``nnx.OptState``: with the metadata of the param it mirrors (its sharding;
  ``optimizer_sharding`` where the param names one), as ``nnx.Optimizer`` keeps it."""
  if isinstance(leaf, nnx.Variable):
    metadata = leaf.get_metadata()
    if 'optimizer_sharding' in metadata:
      metadata['out_sharding'] = metadata.pop('optimizer_sharding')
    return nnx.OptState(leaf.get_value(), **metadata)
  return nnx.OptState(leaf) if isinstance(leaf, jax.Array) else leaf


def _as_variables(tree: Any) -> Any:
  return jax.tree.map(_as_opt_state, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _values(tree: Any) -> Any:
  return jax.tree.map(lambda var: var.get_value(), tree,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


class InterleavedOptimizer(nnx.Pytree):
  """Interleaved training in the shape of ``nnx.Optimizer``: state in the object, updates in place.

  ``opt.step(model, *args)`` runs ``loss_fn(model, *args)`` forward and the
  interleaved backward sweep (see :func:`interleaved`), updating the model's
  variables (params, batch statistics, RNG counts) and the optimizer's state
  in place, as ``nnx.Optimizer.update`` does; use it inside ``nnx.jit``. To set a
  hyperparameter by hand with ``optax.inject_hyperparams``, set it in every segment's
  state: ``for s in opt.opt_state.values(): s.hyperparams['learning_rate'][...] = lr``.

  Attributes:
    step_count: ``nnx.OptState`` with the number of steps taken.
    opt_state: One optimizer state per segment (``nnx.OptState`` leaves with the metadata,
      the sharding too, of the params they mirror, as in ``nnx.Optimizer``).
    grad_norm: ``nnx.OptState``, the previous step's global gradient norm.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Sequential(nnx.Linear(3, 8, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(8, 1, rngs=nnx.Rngs(1)))
    >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
    >>> loss_fn = lambda model, x, y: jnp.mean((model(x) - y) ** 2)
    >>> opt = perturbkit.nnx.InterleavedOptimizer(model, optax.adam(1e-2), loss_fn, x, y)
    >>> @nnx.jit
    ... def train_step(model, opt, x, y):
    ...   return opt.step(model, x, y)
    >>> metrics = train_step(model, opt, x, y)
    >>> int(opt.step_count[...])
    1
  """

  def __init__(self, model: nnx.Module, tx: Optimizer, loss_fn: Callable[..., Any],
               *example_args, wrt: Any = nnx.Param, segments: int | CallFilter | None = None,
               propagate: str = 'updated', axis_name: str | None = None, has_aux: bool = False,
               clip_global_norm: float | None = None, skip_nonfinite: bool = True,
               hooks: Sequence[Hook] = (), **example_kwargs):
    """Builds the per-segment optimizer states.

    Args:
      model: The NNX model to train.
      tx: An ``optax.GradientTransformation``, or ``segment_name -> transformation``.
      loss_fn: ``(model, *args, **kwargs) -> loss`` (or ``(loss, aux)`` with
        ``has_aux``); its arguments after the model, positional and keyword, are those
        given here and to ``step``, a leaf that is no array (a flag) reaching it as it is.
      *example_args: Arguments of the loss after the model, to find its calls.
      wrt: Filter of the trained variables, on their paths in the model (as for ``interleaved``).
      segments: See :func:`interleaved`.
      propagate: ``'updated'`` or ``'original'``.
      axis_name: Mapped axis to average gradients over.
      has_aux: Whether ``loss_fn`` returns ``(loss, aux)``.
      clip_global_norm: Optional global-norm clip using the previous step's norm.
      skip_nonfinite: Keep a group's variables when its gradient is not finite.
      hooks: Backward hooks, see :func:`interleaved`.
      **example_kwargs: Keyword arguments of the loss, with ``example_args`` (other than
        the names above, which are this constructor's own).
    """
    example_args = with_keywords(example_args, example_kwargs)
    segments = interleaved_options(segments, clip_global_norm, propagate, has_aux,
                                   skip_nonfinite)
    check_loss_fn(loss_fn, 'perturbkit.nnx.InterleavedOptimizer', '(model, *args) -> loss')
    checked_wrt(wrt)
    check_optimizer(tx)
    warn_whole_gradient(tx, 'perturbkit.nnx.InterleavedOptimizer')
    self.settings = _Settings(keywords_last(loss_fn), tx, wrt, segments, propagate, axis_name, has_aux,
                              clip_global_norm, skip_nonfinite,
                              hooks_tuple(hooks, 'perturbkit.nnx.InterleavedOptimizer'),
                              TypesSeen(), {})
    # Static (hashable) shapes of the example arguments, only to word a failing step's error.
    self.example_shapes = tuple(input_shapes(example_args).items())
    self.step_count = nnx.OptState(jnp.zeros((), jnp.uint32))
    self.grad_norm = nnx.OptState(jnp.zeros((), jnp.float32))
    self.opt_state = nnx.data(_as_variables(init_opt_state_of(self.settings, model,
                                                              example_args, of_variables=True)))

  def segments(self, model: nnx.Module, *args, **kwargs) -> _nnx_segmentation.Segmentation:
    """The segments of the loss on ``model`` and the params left to ``REST`` with why.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import perturbkit
      >>> model = nnx.Sequential(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
      >>> loss_fn = lambda model, x: jnp.mean(model(x) ** 2)
      >>> x = jnp.ones((4, 3))
      >>> opt = perturbkit.nnx.InterleavedOptimizer(model, optax.sgd(0.1), loss_fn, x)
      >>> opt.segments(model, x)
      Segmentation(segments=('layers/0',), rest={})
    """
    return _segmentation(self.settings, model, with_keywords(args, kwargs),
                         self.settings.segments)

  def step(self, model: nnx.Module, *args, **kwargs) -> dict:
    """One interleaved step on ``loss_fn(model, *args, **kwargs)``; updates ``model`` and
    ``self``.

    Call it inside ``nnx.jit`` (see the class example); eagerly it works too,
    tracing the loss at every call.

    Returns:
      The metrics: ``loss``, ``grad_norm``, ``activation_grad_norm``,
      ``global_grad_norm``, ``nonfinite``, ``skipped``, ``segment_skipped``
      (and ``aux`` with ``has_aux``); with ``axis_name``, every one but
      ``aux`` is the whole batch's, as one device on it reports them (see
      "metrics" in ``help(perturbkit.interleaved)``).
    """
    _check_model(model)
    args = with_keywords(args, kwargs)
    with explaining_inputs(dict(self.example_shapes), args, _OPTIMIZER_CALL):
      new_params, new_others, opt_state, norm, metrics = _train(
          self.settings, model, _values(self.opt_state), self.grad_norm.get_value(), args)
    nnx.update(model, new_params, new_others)
    jax.tree.map(lambda var, value: var.set_value(value), self.opt_state, opt_state,
                 is_leaf=lambda x: isinstance(x, nnx.Variable))
    self.grad_norm.set_value(norm)
    self.step_count.set_value(self.step_count.get_value() + 1)
    return metrics
