"""K-FAC as the optimizer of one segment of the interleaved schedule.

A segment that is one Dense or Conv call knows both of its Kronecker factors
when its backward pass runs: its input ``a`` is the segment's input and ``g``
is the cotangent at its output. A LayerNorm's or RMSNorm's diagonal Fisher
comes from the same two. The sweep (``_sweep``) gives both to a segment
optimizer as the extra arguments ``segment_inputs`` and ``segment_output_grad``;
:func:`kfac_segment` forms the factors from them and preconditions the
segment's gradient with :func:`kfac_preconditioner`'s machinery. With
``propagate='updated'`` the cotangent of segment ``k`` is the one sent back by
the already-updated later segments, so its factors are those of the
update-then-propagate sweep; with ``'original'`` they are the ordinary
backpropagated ones (the empirical Fisher of :func:`kfac_estimator`).
"""
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax

from perturbkit.errors import KFACExamplesError, KFACUnsupportedLayerError, KFACUpdateArgsError
from perturbkit.kfac._checks import check_layer_given, check_layer_info
from perturbkit.kfac._layers import KFACLayers
from perturbkit.kfac._preconditioner import kfac_preconditioner
from perturbkit.kfac._rules import LayerFactors, LayerInfo, batch_factors, one_iteration

_NAME = 'segment'


def segment_factors(info: LayerInfo, segment_inputs: Any, segment_output_grad: jax.Array,
                    examples: int | None = None, name: str | None = None) -> LayerFactors:
  """The layer's factors from its call's input and the cotangent at its output.

  The cotangent is that of the MEAN loss over the batch's ``examples``, so it is
  scaled by their number to give per-example gradients (as the estimator's
  ``fisher='empirical'`` does). The sweep gives ``examples``; without it, the
  input's first axis is taken (wrong for a call on ``(examples * tokens, d)``
  rows). ``name`` is the layer's, for errors (default: its path).

  Raises:
    KFACExamplesError: the input does not have the ``examples`` on its first axis
      (:func:`check_examples`).
  """
  name = name or '/'.join(map(str, info.path)) or _NAME
  leaves = jax.tree.leaves(segment_inputs)
  if len(leaves) != 1 or not isinstance(segment_output_grad, jax.Array):
    raise KFACUnsupportedLayerError(
        name,
        f'the segment has {len(leaves)} floating-point inputs and an output of type '
        f'{type(segment_output_grad).__name__}; a K-FAC segment is one call with one input '
        'array and one output array')
  x = leaves[0]
  if examples is None:
    examples = x.shape[0] if x.ndim > 1 else 1
  check_examples(info.kind, name, x.shape, examples)
  return batch_factors(info, [x], [segment_output_grad[None] * examples], examples)


def check_examples(kind: str, name: str, shape: tuple[int, ...], examples: int) -> None:
  """Raises :class:`KFACExamplesError` unless the input of segment ``name`` (a layer of
  ``kind``), of ``shape``, has the batch's ``examples`` on its first axis: exactly for a
  norm (its diagonal groups the rows by example), a multiple of them for a Dense or Conv
  (its rows may be ``(examples * tokens, d)``).

  The examples come from the first axis of the step's first array argument that holds no
  PRNG keys (a dropout key passed first, typed or a raw ``uint32[2]``, is not counted);
  when that argument is not the batch (class weights passed first), the factors would be
  scaled by the wrong count: refused here unless the rows happen to be a multiple of it.
  """
  if len(shape) < 2:
    return  # one example, with no batch axis
  rows = shape[0]
  if rows == examples or (kind != 'norm' and examples > 0 and rows % examples == 0):
    return
  want = 'the' if kind == 'norm' else 'the (or a multiple of the)'
  raise KFACExamplesError(
      name,
      f'its segment\'s input has shape {tuple(shape)}, whose first axis is not {want} '
      f'{examples} examples interleaved counts, the first axis of the step\'s first array '
      'argument (PRNG keys not counted)',
      'Pass the batch first: the loss function takes `(variables, x, y, ...)` with the '
      'examples on axis 0 of `x`, and arguments shared by every example (class weights, '
      'a mask over the classes) after it.')


def kfac_segment(layer: LayerInfo, *, damping: float = 1e-3, decay: float = 0.95,
                 inverse_every: int = 10, stats_every: int | None = None,
                 axis_name: str | None = None) -> optax.GradientTransformationExtraArgs:
  """K-FAC preconditioning of one segment of :func:`interleaved`, from its own backward pass.

  For the conventions (the loss, skipped layers, amortised statistics, per-segment
  K-FAC, how the factors relate to kfac-jax's) see ``help(perturbkit.kfac)``.

  For a segment that is exactly one Dense, Conv, LayerNorm or RMSNorm call (the
  default layer-wise segments), ``update(grads, state, params, *, segment_inputs,
  segment_output_grad, segment_examples)`` forms ``A`` from the call's input and
  ``G`` from the per-example cotangent at its output (the loss is taken to be a
  mean over the batch's ``segment_examples`` examples, the first axis of the
  step's first array argument, so the loss function must take the batch first:
  ``(variables, x, y, class_weights)``; a PRNG key before it, ``(variables, rng, x, y)``,
  typed or a raw ``jax.random.PRNGKey``, is not counted), and then acts as
  :func:`kfac_preconditioner` on
  this one layer: EMA of the factors taken every ``stats_every`` updates,
  damped inverses every ``inverse_every``, ``(A + λI)⁻¹ [∇W; ∇b] (G + λI)⁻¹``
  (``∇θ / (F + λ)`` for a norm's diagonal).
  The sweep passes the two extra arguments; chain it with the step:
  ``optax.chain(kfac_segment(layers.layers[name]), optax.sgd(lr))``.

  Args:
    layer: The segment's layer, ``kfac_layers(...).layers[segment_name]``.
    damping: Tikhonov damping ``λ`` added to both factors.
    decay: EMA decay of the factors.
    inverse_every: Refresh the inverses every this many updates.
    stats_every: Take the factors every this many updates (default
      ``inverse_every``); the other updates skip their computation.
    axis_name: The mapped axis of :func:`interleaved`'s ``axis_name``: the
      factors of the devices' batches are averaged over it.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`KFACState`.

  Raises:
    InvalidOptionError: ``damping``, ``decay``, ``inverse_every`` or
      ``stats_every`` is out of range (as for :func:`kfac_preconditioner`).
    KFACLayerInfoError: a ``LayerInfo`` built by hand without what its rule needs (a
      known ``kind``, a Conv's or a norm's geometry).
    KFACLayersTypeError: ``layer`` is not one ``LayerInfo`` (e.g. the whole
      ``KFACLayers``: pass ``layers.layers[name]``).
    KFACExamplesError: the segment's input does not have the ``segment_examples``
      on its first axis (a multiple of them for a Dense or Conv on ``(examples *
      tokens, d)`` rows): the step's first array argument is not the batch.
    KFACUpdateArgsError: ``update`` is called without the sweep's extra arguments
      (outside :func:`interleaved`).
    KFACUnsupportedLayerError: the layer is an Embed (its integer input is not
      one of the segment's floating-point inputs), or the segment is not one
      call with one input and one output array holding exactly the layer's
      params. A layer stacked in ``nn.scan``/``nnx.scan`` (``layer.iterations``)
      is a segment per iteration, each with its own state.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, optax
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(3)])
    >>> x, y = jnp.ones((4, 5)), jnp.zeros((4,), jnp.int32)
    >>> variables = model.init(jax.random.key(0), x)
    >>> layers = perturbkit.kfac_layers(lambda v, x: model.apply(v, x), variables, x)
    >>> def optimizer(name):   # a K-FAC layer's segment, or perturbkit.REST
    ...   if name not in layers.layers:
    ...     return optax.sgd(0.1)
    ...   return optax.chain(perturbkit.kfac_segment(layers.layers[name], damping=0.1),
    ...                      optax.sgd(0.1))
    >>> loss_fn = lambda v, x, y: optax.softmax_cross_entropy_with_integer_labels(
    ...     model.apply(v, x), y).mean()
    >>> tx = perturbkit.interleaved(loss_fn, optimizer)
    >>> state = tx.init(variables, x, y)
    >>> state, metrics = jax.jit(tx.step)(state, x, y)
    >>> state.opt_state['layers_2'][0].factors['segment'].g.shape
    (3, 3)
  """
  check_layer_given(layer, 'perturbkit.kfac_segment')
  check_layer_info('/'.join(map(str, layer.path)), layer)
  if layer.kind not in ('dense', 'conv', 'norm'):
    raise KFACUnsupportedLayerError(
        '/'.join(map(str, layer.path)), f'a K-FAC segment needs a Dense, Conv or norm call, not '
        f'{layer.kind!r} (an Embed takes integer inputs, which do not reach the segment '
        'optimizer); give this segment another optimizer, or precondition it with '
        'kfac_preconditioner')
  # A layer stacked in a scan is a segment per iteration: interleaved makes one state per
  # iteration and hands each its iteration's params, inputs and output cotangent.
  info = (one_iteration(layer) if layer.iterations else layer)._replace(path=())
  leaves = {info.param, 'bias'} if info.use_bias else {info.param}

  def check_segment(params: Any) -> None:
    if not isinstance(params, Mapping) or set(params) != leaves:
      got = sorted(params) if isinstance(params, Mapping) else type(params).__name__
      raise KFACUnsupportedLayerError(
          '/'.join(map(str, layer.path)), f'its segment holds the params {got}, not exactly the layer\'s '
          f'{sorted(leaves)}; a K-FAC segment is one Dense, Conv or norm call (the default '
          'layer-wise segments of interleaved, segments=None)')

  inner = kfac_preconditioner(KFACLayers({_NAME: info}, {}), damping=damping, decay=decay,
                              inverse_every=inverse_every, stats_every=stats_every,
                              axis_name=axis_name)

  def update(updates: Any, state: Any, params: Any = None, *, segment_inputs: Any = None,
             segment_output_grad: Any = None, segment_examples: int | None = None,
             **extra_args: Any) -> tuple[Any, Any]:
    del extra_args
    if segment_inputs is None or segment_output_grad is None:
      raise KFACUpdateArgsError(
          'kfac_segment is the optimizer of a segment of perturbkit.interleaved, whose sweep '
          'passes segment_inputs= and segment_output_grad=. For a whole model use '
          'kfac_preconditioner with kfac_estimator.')
    check_segment(updates)
    taken = lambda: segment_factors(info, segment_inputs, segment_output_grad,
                                    segment_examples, '/'.join(map(str, layer.path)))
    # Zeros of the factors' shapes and dtype (float64 for a float64 segment).
    stats = jax.lax.cond(state.stats_due, taken,
                         lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                              jax.eval_shape(taken)))
    return inner.update(updates, state, params, kfac_stats={_NAME: stats})

  def init(params: Any) -> Any:
    check_segment(params)
    return inner.init(params)

  return optax.GradientTransformationExtraArgs(init, update)
