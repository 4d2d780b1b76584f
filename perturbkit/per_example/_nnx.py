"""Per-example gradient norms and DP-SGD for Flax NNX models.

The same functions as for Linen, with the model in place of the variables:
``loss_fn(model, *args, **kwargs)`` as for ``nnx.value_and_grad``, gradients as the
``nnx.State`` that ``nnx.grad(loss_fn)`` gives for ``nnx.Param``. Only the pass
differs (``_nnx_pass``); the rules, the norms, the clipping and the noise are
Linen's (``_norms``, ``_dp``), and so are the conventions (``help(perturbkit.per_example)``).
"""
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx, traverse_util

from perturbkit.core._values import values_closed_over
from perturbkit.core._lookahead import refuse_lookahead
from perturbkit.core._optax_privacy import refuse_optax_privacy
from perturbkit.per_example._accumulation import refuse_accumulation_state
from perturbkit.core._validate import non_negative, positive
from perturbkit.core._naming import named_after
from perturbkit.core._loss import check_loss_fn, describe
from perturbkit.errors import UninitializedStateError
from perturbkit.nnx._driver import check_module
from perturbkit.nnx._segments import params_tree, with_values
from perturbkit.per_example._batch import BatchAxes, check_batch_axes
from perturbkit.per_example._check import check_per_example as check_functional
from perturbkit.per_example._check import reduction_checker
from perturbkit.core._keys import check_key
from perturbkit.per_example._dp import (PrivateTraining, check_optimizer, finite_step,
                                        privatize)
from perturbkit.per_example._nnx_pass import run_nnx_pass
from perturbkit.per_example._norms import PerExampleNorms, check_dense_method, norms_of_pass


def keyed_like_state(norms: PerExampleNorms, model: nnx.Module) -> PerExampleNorms:
  """``norms`` with ``by_param`` keyed as ``nnx.state(model, nnx.Param)`` (list items by int)."""
  keys = {tuple(map(str, path)): tuple(path)
          for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  flat = traverse_util.flatten_dict(norms.by_param)
  return norms._replace(by_param=traverse_util.unflatten_dict(
      {keys.get(path, path): value for path, value in flat.items()}))


def _functional(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
  """``loss_fn`` as a function of ``(graphdef, state)`` (a pytree: the graphdef has no leaves)."""
  def loss(parts, *args, **kwargs):
    return loss_fn(nnx.merge(*parts, copy=True), *args, **kwargs)
  return loss


def _reduction_check(loss_fn: Callable[..., Any], reduction: str,
                     batch_axes: BatchAxes) -> Callable[..., None]:
  check = reduction_checker(_functional(loss_fn), reduction, batch_axes, loss=loss_fn)

  def run(model: nnx.Module, args: tuple, kwargs: dict, num_examples: int) -> None:
    check(nnx.split(model), args, kwargs, num_examples)

  return run


def per_example_grad_norms(loss_fn: Callable[..., Any], *, reduction: str = 'mean',
                           batch_axes: BatchAxes = 0,
                           dense_method: str = 'auto') -> Callable[..., Any]:
  """Each example's gradient norm of an NNX model, per param, per layer and in total.

  ``perturbkit.per_example_grad_norms`` for NNX: the same options, conventions and
  refusals (``help(perturbkit.per_example)``), from one forward and one backward
  pass. ``nnx.Linear``, ``nnx.Conv``, ``nnx.Embed``, ``nnx.LayerNorm`` and
  ``nnx.RMSNorm`` have the fast rules; any other submodule owning ``nnx.Param`` s
  (``nnx.LinearGeneral``, ``nnx.BatchNorm`` in eval mode, a module of your own) is
  replayed per example. Modules called inside ``nnx.scan`` or ``nnx.remat``, the
  root module's own params, weights read inline inside the model and calls on
  inputs made inside the model with no examples axis 0 (a position embedding
  looked up at ``jnp.arange(length)[None, :]``) get theirs
  from a per-example replay of the whole model call in the loss (``model(x)``),
  at the cost of ``jax.vmap(nnx.grad)`` of that call (the scanned layers' stacked
  params: each iteration's gradient in its slice). Layers are named by their path (``'layers/0'``), and
  ``by_param`` is keyed like ``nnx.state(model, nnx.Param)``
  (``norms.by_param['layers'][0]['kernel']``).

  Args:
    loss_fn: ``(model, *args, **kwargs) -> scalar loss``, a sum or mean over examples.
    reduction: ``'mean'`` or ``'sum'``.
    batch_axes: The examples axis of each positional argument.
    dense_method: ``'auto'``, ``'ghost'`` or ``'direct'`` for Linear and Conv kernels.

  Returns:
    A function ``(model, *args, **kwargs) -> (loss, PerExampleNorms)``; jittable
    (``nnx.jit``, or ``jax.jit`` with the model as an argument). The model's state
    moves as under ``nnx.grad`` (RNG counts).

  Raises:
    WrongFrontEndError: the model is Linen variables or a Linen module.
    ReductionMismatchError: the loss's reduction is not ``reduction``.
    ExamplesMixedError: an ``nnx.BatchNorm`` in training mode, or the loss mixes examples.
    ExamplesAxisError, AmbiguousInputError, SharedCallError: see
      ``help(perturbkit.per_example)``.
    ParamsReadOutsideError: params read outside their module's calls and outside
      every call of the whole model (a penalty in the loss, a weight used inline in
      the loss).
    UncoveredParamsError: a module owning params is never called.
    PerExampleError: a module owning params is called inside an NNX transform
      outside any call of the whole model.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Sequential(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    >>> model.layers[0].kernel[...] = jnp.zeros((2, 1))
    >>> x = jnp.array([[1., 0.], [0., 2.]])
    >>> loss_fn = lambda model, x: jnp.sum(model(x) - 1.0)
    >>> loss, norms = perturbkit.nnx.per_example_grad_norms(loss_fn, reduction='sum')(model, x)
    >>> norms.total  # ‖(x_i, 1)‖
    Array([1.4142135, 2.236068 ], dtype=float32)
    >>> norms.by_param['layers'][0]['kernel']  # keyed as nnx.state(model, nnx.Param)
    Array([1., 2.], dtype=float32)
  """
  check_loss_fn(loss_fn, 'perturbkit.nnx.per_example_grad_norms', '(model, *args) -> loss')
  check_dense_method(dense_method)
  batch_axes = check_batch_axes(batch_axes)
  check_reduction = _reduction_check(loss_fn, reduction, batch_axes)

  @functools.wraps(loss_fn)
  def run(model, *args, **kwargs):
    check_module(model, 'perturbkit.nnx.per_example_grad_norms')
    on_arrays, array_args = values_closed_over(loss_fn, args)
    result = run_nnx_pass(on_arrays, model, array_args, kwargs, reduction=reduction,
                          batch_axes=batch_axes)
    check_reduction(model, args, kwargs, result.num_examples)
    return result.loss, keyed_like_state(norms_of_pass(result, dense_method), model)

  return run


def private_grad(loss_fn: Callable[..., Any], *, clip_norm: float, noise_multiplier: float,
                 reduction: str = 'mean', batch_axes: BatchAxes = 0,
                 axis_name: str | None = None,
                 dense_method: str = 'auto') -> Callable[..., Any]:
  """The DP-SGD gradient of an unmodified NNX model, to feed any optax optimizer.

  ``perturbkit.private_grad`` for NNX: the same maths, options and metrics (see
  its docstring and ``help(perturbkit.per_example)``). The noise's keys follow the
  leaves of the returned ``nnx.State``.

  Args:
    loss_fn: ``(model, *args, **kwargs) -> scalar loss``, a sum or mean over examples.
    clip_norm: ``C``, the largest norm an example's gradient may have.
    noise_multiplier: ``σ``; the noise's standard deviation is ``σC``.
    reduction: ``'mean'`` or ``'sum'``.
    batch_axes: The examples axis of each positional argument.
    axis_name: The data-parallel axis under ``shard_map``; the first device's
      ``key`` then draws the noise for every device.
    dense_method: ``'auto'``, ``'ghost'`` or ``'direct'``.

  Returns:
    A function ``(model, key, *args, **kwargs) -> (grads, metrics)``: ``grads`` the
    ``nnx.State`` of ``nnx.Param`` that ``nnx.grad`` gives, ``metrics`` with
    ``'loss'``, ``'per_example_norms'``, ``'fraction_clipped'`` and ``'dropped'``.

  Raises:
    InvalidOptionError: ``clip_norm`` or ``noise_multiplier`` is out of range.
    WrongFrontEndError: (from the returned function) the model is Linen variables.
    PRNGKeyError: (from the returned function) ``key`` is not a JAX random key.
    ReductionMismatchError: the loss's reduction is not ``reduction``.
    ExamplesCoupledError: an example's term is computed from other examples' data.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(3, 1, rngs=nnx.Rngs(1)))
    >>> loss_fn = lambda model, x: jnp.mean(model(x) ** 2)
    >>> dp = perturbkit.nnx.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=0.0)
    >>> grads, metrics = dp(model, jax.random.key(1), jnp.ones((4, 2)))
    >>> grads['layers'][0]['kernel'].shape, metrics['per_example_norms'].shape
    ((2, 3), (4,))
  """
  check_loss_fn(loss_fn, 'perturbkit.nnx.private_grad', '(model, *args) -> loss')
  positive('clip_norm', clip_norm)
  non_negative('noise_multiplier', noise_multiplier)
  check_dense_method(dense_method)
  batch_axes = check_batch_axes(batch_axes)
  check_reduction = _reduction_check(loss_fn, reduction, batch_axes)

  @named_after(loss_fn)
  def run(model, key, *args, **kwargs):
    check_module(model, 'perturbkit.nnx.private_grad')
    check_key(key, 'The DP-SGD step (its `key` argument)')
    on_arrays, array_args = values_closed_over(loss_fn, args)
    result = run_nnx_pass(on_arrays, model, array_args, kwargs, reduction=reduction,
                          batch_axes=batch_axes, private=True)
    check_reduction(model, args, kwargs, result.num_examples)
    template = nnx.state(model, nnx.Param)
    return privatize(result, params_tree(template), key, clip_norm=clip_norm,
                     noise_multiplier=noise_multiplier, axis_name=axis_name,
                     dense_method=dense_method, reduction=reduction,
                     as_grads=lambda tree: with_values(template, tree))

  return run


class NNXPrivateState(NamedTuple):
  """DP-SGD training state of an NNX model, a pytree (the graphdef has no leaves).

  Attributes:
    step: Number of steps taken.
    graphdef: The model's graphdef (``nnx.split(model)[0]``).
    variables: The model's whole state (params, batch statistics, RNG streams).
    opt_state: The optimizer's state, over the ``nnx.Param`` state.
  """
  step: jax.Array
  graphdef: Any
  variables: nnx.State
  opt_state: Any

  def model(self) -> nnx.Module:
    """The model with this state (a new object)."""
    return nnx.merge(self.graphdef, self.variables, copy=True)


def dp_sgd(loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation, *,
           clip_norm: float, noise_multiplier: float, reduction: str = 'mean',
           batch_axes: BatchAxes = 0, axis_name: str | None = None,
           dense_method: str = 'auto') -> PrivateTraining:
  """DP-SGD training of an NNX model (any optax optimizer) as an ``init``/``step`` pair.

  ``perturbkit.dp_sgd`` for NNX: ``init(model)`` gives an :class:`NNXPrivateState`,
  ``step(state, key, *args, **kwargs) -> (state, metrics)`` applies ``optimizer`` to
  :func:`private_grad`'s gradient (a non-finite one skips the step,
  ``metrics['skipped']``); ``state.model()`` is the trained model.

  Args:
    loss_fn: ``(model, *args, **kwargs) -> scalar loss``, a sum or mean over examples.
    optimizer: Any optax gradient transformation.
    clip_norm: ``C``.
    noise_multiplier: ``σ``.
    reduction: ``'mean'`` or ``'sum'``.
    batch_axes: The examples axis of each positional argument.
    axis_name: The data-parallel axis under ``shard_map``.
    dense_method: ``'auto'``, ``'ghost'`` or ``'direct'``.

  Returns:
    A ``PrivateTraining``.

  Raises:
    InvalidOptionError: ``clip_norm`` or ``noise_multiplier`` is out of range.
    InterleavedClippingError: ``optimizer`` is a trainer such as
      ``perturbkit.nnx.interleaved(...)``.
    WrongFrontEndError: (from ``init``) the model is Linen variables.
    OptaxPrivacyError: (from ``init``) ``optimizer`` contains optax's own DP aggregate.
    PrivateAccumulationError: ``optimizer`` is (or, from ``init``, contains)
      ``optax.MultiSteps``.
    LookaheadParamsError: (from ``init``) ``optimizer`` contains ``optax.lookahead``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(3, 1, rngs=nnx.Rngs(1)))
    >>> loss_fn = lambda model, x: jnp.mean(model(x) ** 2)
    >>> tx = perturbkit.nnx.dp_sgd(loss_fn, optax.sgd(0.1), clip_norm=1.0,
    ...                            noise_multiplier=1.0)
    >>> state = tx.init(model)
    >>> state, metrics = jax.jit(tx.step)(state, jax.random.key(1), jnp.ones((4, 2)))
    >>> int(state.step), metrics['per_example_norms'].shape, bool(metrics['skipped'])
    (1, (4,), False)
  """
  check_loss_fn(loss_fn, 'perturbkit.nnx.dp_sgd', '(model, *args) -> loss')
  check_optimizer(optimizer, 'perturbkit.nnx.dp_sgd')
  grad_fn = private_grad(loss_fn, clip_norm=clip_norm, noise_multiplier=noise_multiplier,
                         reduction=reduction, batch_axes=batch_axes, axis_name=axis_name,
                         dense_method=dense_method)

  def init(model: nnx.Module) -> NNXPrivateState:
    check_module(model, 'perturbkit.nnx.dp_sgd')
    opt_state = optimizer.init(nnx.state(model, nnx.Param))
    refuse_optax_privacy(opt_state, '`perturbkit.nnx.dp_sgd`',
                         'the mean gradient dp_sgd has already clipped and noised')
    refuse_accumulation_state(opt_state, 'perturbkit.nnx.dp_sgd')
    refuse_lookahead(opt_state, '`perturbkit.nnx.dp_sgd`')
    graphdef, variables = nnx.split(model)
    return NNXPrivateState(jnp.zeros((), jnp.int32), graphdef, variables, opt_state)

  def step(state: NNXPrivateState, key: jax.Array, *args, **kwargs):
    if not isinstance(state, NNXPrivateState):
      raise UninitializedStateError(
          (f'an nnx.Module ({type(state).__name__}), the model itself'
           if isinstance(state, nnx.Module) else describe(state)), 'trainer.init(model)')
    model = state.model()
    grads, metrics = grad_fn(model, key, *args, **kwargs)
    params, opt_state, finite = finite_step(optimizer, grads, state.opt_state,
                                            nnx.state(model, nnx.Param))
    nnx.update(model, params)
    graphdef, variables = nnx.split(model)
    metrics = {**metrics, 'skipped': jnp.logical_not(finite)}
    return NNXPrivateState(state.step + 1, graphdef, variables, opt_state), metrics

  return PrivateTraining(init, step)


def check_per_example(loss_fn: Callable[..., Any], model: nnx.Module, *args: Any,
                      reduction: str = 'mean', batch_axes: BatchAxes = 0,
                      rtol: float = 1e-4, atol: float = 1e-6) -> None:
  """Raises unless the loss of the batch equals the ``reduction`` of each example's loss alone.

  ``perturbkit.check_per_example`` for NNX (one extra forward pass, compiled); the
  model's state is not changed.

  Args:
    loss_fn: ``(model, *args) -> scalar loss``.
    model: The ``nnx.Module``.
    *args: The loss's positional arguments, examples on ``batch_axes``.
    reduction: ``'mean'`` or ``'sum'``.
    batch_axes: The examples axis of each positional argument.
    rtol: Relative tolerance of the comparison.
    atol: Absolute tolerance of the comparison.

  Raises:
    ExamplesMixedError: the two values differ.
    WrongFrontEndError: the model is Linen variables or a Linen module.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> x = jnp.array([[1., 2.], [3., 1.], [0., 5.]])
    >>> perturbkit.nnx.check_per_example(lambda m, x: jnp.mean(m(x) ** 2), model, x)
    >>> perturbkit.nnx.check_per_example(lambda m, x: jnp.var(m(x)), model, x)
    Traceback (most recent call last):
    ...
    perturbkit.errors.ExamplesMixedError: Per-example ...
  """
  check_loss_fn(loss_fn, 'perturbkit.nnx.check_per_example', '(model, *args) -> loss')
  check_module(model, 'perturbkit.nnx.check_per_example')
  check_functional(_functional(loss_fn), nnx.split(model), *args, reduction=reduction,
                   batch_axes=batch_axes, rtol=rtol, atol=atol)


