"""Learnable interventions: trainable perturbations of chosen calls, the model's params frozen.

An :class:`Intervention` is a pair of pure functions, like an optax
transformation: ``init() -> params`` and ``apply(params, output) -> output``,
and the path of the call it edits. The params of a dict of interventions form
one pytree, ``{name: params}``, that ``jax.grad`` differentiates and ``optax``
updates; the model's own variables are held constant (``jax.lax.stop_gradient``).
"""
import operator
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from perturbkit.core._callables import takes
from perturbkit.core._traced_points import PointEdit, point_name
from perturbkit.core._naming import named_after
from perturbkit.core._precision import accumulation_dtype
from perturbkit.core._validate import finite
from perturbkit.errors import (InterventionOutputError, InterventionParamsError,
                               InvalidOptionError, UnknownEditPathError)
from perturbkit.interpret._edits import Edit, add, apply_edit, scale
from perturbkit.interpret._leaves import checked_leaves, on_leaves
from perturbkit.interpret._points import Tracer, check_given, trace
from perturbkit.errors import NotInterventionsError


class Intervention(NamedTuple):
  """A trainable edit of one call's output.

  Attributes:
    path: The call's path and point key, ``'Dense_1/__call__'`` (as in
      ``run_with_edits``'s keys and ``PatchingResult.paths``).
    init: ``() -> params``, the initial trainable values.
    apply: ``(params, output) -> edited output``.
  """
  path: str
  init: Callable[[], Any]
  apply: Callable[[Any, Any], Any]


def _shape(shape: Any) -> tuple[int, ...]:
  """``shape`` as a tuple of ints, or ``InvalidOptionError`` if it is no shape."""
  try:
    sizes = tuple(operator.index(n) for n in shape)
  except TypeError:
    sizes = None
  if sizes is None or any(n < 0 for n in sizes) or any(
      isinstance(n, (bool, np.bool_)) for n in shape):
    raise InvalidOptionError('shape', shape, 'a tuple of sizes (ints >= 0) broadcasting to the '
                             "call's output, e.g. (features,)")
  return sizes


def _path(path: Any) -> str:
  """``path`` if it is a string (the call's path and point key)."""
  if not isinstance(path, str):
    raise InvalidOptionError('path', path, "the call's path and point key, a string such as "
                             "'Dense_1/__call__'")
  return path


def _floating(dtype: Any) -> Any:
  """``dtype`` if it is a floating dtype: the params are learned by gradient."""
  try:
    floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
  except TypeError:
    floating = False
  if not floating:
    raise InvalidOptionError('dtype', dtype, 'a floating dtype such as jnp.float32 (the vector '
                             'is learned by gradient)')
  return dtype


def _applied(path: str, leaves: Any, edit_of: Callable[[Any], Edit]) -> Callable[[Any, Any], Any]:
  """``(params, output) -> output`` with ``edit_of(params)`` applied to the output, or to the
  arrays of it that ``leaves`` names (in ``jax.tree.leaves`` order) alone, as the sweeps
  edit them (``on_leaves``)."""
  leaves = checked_leaves(leaves)

  def apply(params, output):
    count = len(jax.tree.leaves(output))
    if leaves is not None and leaves[-1] >= count:
      raise InvalidOptionError('leaves', leaves, f'indices of the arrays {path} returns, but it '
                               f'returns {count}')
    edit = on_leaves(lambda _, part: apply_edit(edit_of(params), part, path), leaves)
    return edit((), output)

  return apply


def steering_vector(path: str, shape: Sequence[int], *, positions: Any = None,
                    axis: int | None = None, dtype: Any = jnp.float32,
                    leaves: Any = None) -> Intervention:
  """A vector added to a call's output (at ``positions`` along ``axis``), zeros at init.

  Args:
    path: The call's path and point key, ``'Dense_1/__call__'``.
    shape: The vector's shape; it broadcasts to the output (``(features,)``
      adds the same vector at every example and token).
    positions: Integer indices along ``axis`` to steer (default: everywhere).
    axis: The axis the positions index (1 for tokens).
    dtype: The vector's dtype.
    leaves: Which arrays of the call's output to steer, by index in
      ``jax.tree.leaves`` order (``0``: an attention's output, not the weights
      it returns beside it); default: every one.

  Returns:
    The intervention; its params are the vector.

  Raises:
    InvalidOptionError: ``positions`` without ``axis`` or the other way round,
      or ``leaves`` not indices (while tracing: not indices of the call's
      arrays).

  Example:
    >>> import jax.numpy as jnp
    >>> from perturbkit import interpret
    >>> steer = interpret.steering_vector('Dense_0/__call__', (2,))
    >>> steer.apply(jnp.array([1.0, -1.0]), jnp.zeros((3, 2))).tolist()
    [[1.0, -1.0], [1.0, -1.0], [1.0, -1.0]]
  """
  path, shape, dtype = _path(path), _shape(shape), _floating(dtype)
  add(jnp.zeros(shape, dtype), positions=positions, axis=axis)  # checks the options now
  return Intervention(
      path, lambda: jnp.zeros(shape, dtype),
      _applied(path, leaves, lambda vector: add(vector, positions=positions, axis=axis)))


def gates(path: str, shape: Sequence[int], *, init_logit: float = 3.0, positions: Any = None,
          axis: int | None = None, leaves: Any = None) -> Intervention:
  """A gate per unit, ``output * sigmoid(logits)``: a differentiable mask of the output.

  Trained with a sparsity penalty on the gates (:func:`gate_penalty`, added to
  the loss by the user), the gates that stay open show which units the metric
  needs (Differentiable Masking). At large logits the gates are 1 and the run
  is the unedited one.

  Args:
    path: The call's path and point key.
    shape: The logits' shape; it broadcasts to the output (``(features,)``:
      one gate per hidden unit).
    init_logit: The logits' initial value (3.0: gates at 0.95).
    positions: Integer indices along ``axis`` to gate (default: everywhere).
    axis: The axis the positions index.
    leaves: Which arrays of the call's output to gate, as in
      :func:`steering_vector`; default: every one.

  Returns:
    The intervention; its params are the logits.

  Raises:
    InvalidOptionError: ``init_logit`` is not a finite number, the positions
      and axis are not those of :func:`perturbkit.interpret.replace`, or
      ``leaves`` not indices (while tracing: not indices of the call's arrays).

  Example:
    >>> import jax.numpy as jnp
    >>> from perturbkit import interpret
    >>> gate = interpret.gates('Dense_0/__call__', (2,))
    >>> gate.apply(jnp.array([30.0, -30.0]), jnp.ones((1, 2))).tolist()
    [[1.0, 0.0]]
  """
  finite('init_logit', init_logit)
  path, shape = _path(path), _shape(shape)
  scale(jnp.ones(shape), positions=positions, axis=axis)  # checks the options now
  return Intervention(
      path, lambda: jnp.full(shape, init_logit, jnp.float32),
      _applied(path, leaves,
               lambda logits: scale(jax.nn.sigmoid(logits), positions=positions, axis=axis)))


def gate_penalty(logits: Any) -> jax.Array:
  """The sum of the gates ``sigmoid(logits)``: their L1 norm, and the expected L0 norm.

  The expected number of open gates were each gate open with probability
  ``sigmoid(logit)``; add ``coefficient * gate_penalty(params[name])`` to the
  loss to close the gates the metric does not need. It is summed in float32 for
  logits in a narrower dtype (float64 stays float64).

  Example:
    >>> import jax.numpy as jnp
    >>> from perturbkit import interpret
    >>> float(interpret.gate_penalty(jnp.array([0.0, 0.0, 100.0])))
    2.0

  Raises:
    InvalidOptionError: ``logits`` holds no array, or a leaf that is not a real
      floating-point array or number (a string, integers, complex numbers).
  """
  leaves = jax.tree.leaves(logits)
  allowed = ("the gates' logits: a floating-point array, or a pytree of them (params[name] "
             'of an interpret.gates intervention)')
  if not leaves:
    raise InvalidOptionError('logits', logits, allowed)
  for leaf in leaves:
    try:
      floating = jnp.issubdtype(jnp.result_type(leaf), jnp.floating)
    except TypeError:  # a string, an object
      floating = False
    if not floating:
      shown = f'an array of {jnp.result_type(leaf)}' if hasattr(leaf, 'dtype') else leaf
      raise InvalidOptionError('logits', shown, allowed)
  # Summed in float32 at least: float16 gates add up past its largest value (65504).
  return sum(jnp.sum(jax.nn.sigmoid(leaf), dtype=accumulation_dtype(jnp.result_type(leaf)))
             for leaf in leaves)


def init_interventions(interventions: Mapping[str, Intervention]) -> dict[str, Any]:
  """The initial params of named interventions: ``{name: intervention.init()}``.

  Example:
    >>> from perturbkit import interpret
    >>> params = interpret.init_interventions(
    ...     {'steer': interpret.steering_vector('Dense_0/__call__', (3,))})
    >>> params['steer'].tolist()
    [0.0, 0.0, 0.0]
  """
  checked_interventions(interventions, 'perturbkit.interpret.init_interventions')
  return {name: intervention.init() for name, intervention in interventions.items()}


def checked_interventions(interventions: Any, function: str) -> None:
  """Raises :class:`NotInterventionsError` unless ``interventions`` is a dict of
  :class:`Intervention` s, each with a path, an ``init()`` and an ``apply(params, output)``."""
  if not isinstance(interventions, Mapping):
    raise NotInterventionsError(function, interventions)
  for name, item in interventions.items():
    if not isinstance(item, Intervention):
      raise NotInterventionsError(function, interventions)
    if not isinstance(item.path, str):
      raise NotInterventionsError(function, interventions, f'{name!r} has the path '
                                  f"{item.path!r}, not a string such as 'Dense_1/__call__'")
    for field, arguments, signature in (('init', 0, '()'), ('apply', 2, '(params, output)')):
      fn = getattr(item, field)
      if not callable(fn) or not takes(fn, arguments):
        raise NotInterventionsError(function, interventions, f'the {field} of {name!r} is '
                                    f'{fn!r:.60}, not a function {signature}')


def _layout(tree: Any) -> tuple:
  """The structure of ``tree`` with the shape and dtype of each leaf."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, [(jnp.shape(x), jnp.result_type(x)) for x in leaves]


def _described(tree: Any) -> str:
  """``tree`` with each leaf written as its dtype and shape, ``float32[2, 4]``."""
  if tree is None:
    return 'None'
  return str(jax.tree.map(lambda x: f'{jnp.result_type(x)}{list(jnp.shape(x))}', tree)
             ).replace("'", '')


def intervention_edit(interventions: Mapping[str, Intervention], params: Mapping[str, Any],
                      paths: tuple[tuple, ...]) -> PointEdit:
  """The ``(point path, output) -> output`` function applying each intervention with its params.

  Interventions at the same call apply in the order of ``interventions``.

  Raises:
    InterventionParamsError: ``params`` has other keys than ``interventions``.
    UnknownEditPathError: an intervention at a path no selected call has.
    InterventionOutputError: (when the edit runs) an intervention's ``apply``
      returned another structure, shape or dtype than the output it was given.
  """
  if not isinstance(params, Mapping) or set(params) != set(interventions):
    raise InterventionParamsError(list(interventions),
                                  list(params) if isinstance(params, Mapping) else [])
  known = {point_name(p): p for p in paths}
  by_path: dict[tuple, list[str]] = {}
  for name, intervention in interventions.items():
    if intervention.path not in known:
      raise UnknownEditPathError(intervention.path, list(known))
    by_path.setdefault(known[intervention.path], []).append(name)

  def edit(path: tuple, output: Any) -> Any:
    for name in by_path.get(path, ()):
      edited = interventions[name].apply(params[name], output)
      if _layout(edited) != _layout(output):  # shapes and dtypes: checked while tracing
        raise InterventionOutputError(name, point_name(path), _described(output),
                                      _described(edited))
      output = edited
    return output

  return edit


def run_with_interventions(tracer: Tracer, fn: Callable[..., Any],
                           interventions: Mapping[str, Intervention], *, filter: Any,
                           freeze: Callable[[Any], Any],
                           function: str) -> Callable[..., Any]:
  """The front-end-neutral :func:`perturbkit.run_with_interventions` (``freeze`` per API)."""
  check_given(fn, filter, function)
  checked_interventions(interventions, function)

  @named_after(fn)
  def run(model, params, *args, **kwargs):
    traced = trace(tracer, fn, freeze(model), args, kwargs, filter, function)
    edit = intervention_edit(interventions, params, traced.paths)
    out, _, _ = traced.run({}, args, kwargs, edit, reads=False)
    return out

  return run
