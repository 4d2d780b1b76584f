"""Edits of a call's output: replace, add, scale, zero- and mean-ablate, at chosen positions.

An :class:`Edit` is data, a pytree of arrays: the edited output is
``scale * output + shift`` where the edit is active (and, with ``positions``,
only at those indices along ``axis``), the output itself elsewhere. So a stack of
edits runs under ``jax.vmap`` as many interventions at once, and ``jax.grad``
differentiates through ``scale`` and ``shift``. With ``view``, all of this
happens on the output reshaped to ``view`` (one attention head of a
``(batch, tokens, heads * head_dim)`` output is index ``h`` along axis 2 of
``view=(-1, tokens, heads, head_dim)``), and the result takes the output's
shape again. Each kind of edit is one choice
of ``scale`` and ``shift``; where an edit applies, the result is computed without
mixing in the old value (``jnp.where``), so replacing an output by itself, or
scaling it by 1, leaves it bit for bit unchanged.

Positions outside the axis raise ``PositionOutOfRangeError`` where they are
known while tracing. Traced positions (edits passed through ``jax.jit``, or a
stack of positions under ``jax.vmap``) cannot be checked then: an active edit
with one outside the axis turns the whole edited output into NaN (the fill
values of ``jnp.take(..., mode='fill')`` for other dtypes), so the model's
output and any metric show it rather than a dropped edit that looks like a
zero effect. Negative positions inside the axis count from its end.
"""
import dataclasses
import functools
import operator
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from perturbkit.core._traced_points import PointEdit, point_name
from perturbkit.core._validate import axes
from perturbkit.errors import (AmbiguousEditError, DuplicateEditError, EditShapeError,
                               EditStructureError, EditViewError, InvalidOptionError,
                               NotEditsError, PositionOutOfRangeError, UnknownEditPathError)


# How a slice or a boolean mask becomes positions, for the messages that refuse them.
AS_INDICES = 'a slice s as range(s.start, s.stop), a boolean mask m as np.flatnonzero(m)'


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=['scale', 'shift', 'positions', 'active'],
                   meta_fields=['axis', 'view'])
@dataclasses.dataclass(frozen=True)
class Edit:
  """``output -> scale * output + shift``, where active and at ``positions`` along ``axis``.

  Build one with :func:`replace`, :func:`add`, :func:`scale`,
  :func:`zero_ablate` or :func:`mean_ablate`. Every field but ``axis`` and
  ``view`` is an array (a pytree leaf); those two are static, so edits stacked
  for ``jax.vmap`` share them.

  Attributes:
    scale: Multiplies the output; broadcasts to it.
    shift: Added after scaling; broadcasts to the output. For a call whose
      output is a pytree, ``scale`` and ``shift`` are either arrays that apply
      to every floating-point leaf or pytrees of the output's structure.
    positions: Integer indices along ``axis`` (``None``: the whole output);
      negative ones count from the end. Traced ones outside the axis make
      the edited output NaN (see the module docstring).
    active: A boolean; ``False`` leaves the output as it is (activation
      patching switches the edits of a stack on one call at a time).
    axis: The axis ``positions`` index (``None`` without positions).
    view: A shape the output is reshaped to before the edit (``-1`` for one
      axis to infer), e.g. ``(-1, tokens, heads, head_dim)``; ``scale``,
      ``shift``, ``positions`` and ``axis`` then refer to it. ``None``: the
      output's own shape.
  """
  scale: Any
  shift: Any
  positions: Any = None
  active: Any = True
  axis: int | None = None
  view: tuple[int, ...] | None = None


def checked_view(view: Any) -> tuple[int, ...] | None:
  """``view`` as a tuple of ints, or ``InvalidOptionError`` if it is no shape (``None`` passes)."""
  if view is None:
    return None
  try:
    sizes = tuple(operator.index(n) for n in view)
  except TypeError:
    sizes = None
  if sizes is None or any(n < 1 and n != -1 for n in sizes) or sizes.count(-1) > 1:
    raise InvalidOptionError('view', view, 'a tuple of sizes (ints >= 1), at most one of them '
                             '-1, e.g. (-1, tokens, heads, head_dim)')
  return sizes


def _boolean_array(value: Any) -> bool:
  """Whether ``value`` is a boolean array (or nested lists of bools)."""
  try:
    return jnp.result_type(value) == jnp.bool_
  except TypeError:  # a string, an object
    return False


def _integer_indices(positions: Any) -> bool:
  """Whether ``positions`` are integer indices: not strings, floats, booleans, a slice or
  ragged lists (NumPy makes those arrays of another kind). A list of JAX scalars (traced
  ones too, ``[p]`` under ``jax.jit``) is read by ``jnp.asarray``."""
  if any(isinstance(p, jax.Array) for p in jax.tree.leaves(positions)):
    try:
      return jnp.issubdtype(jnp.asarray(positions).dtype, jnp.integer)
    except (TypeError, ValueError):  # ragged, or mixed with strings
      return False
  try:
    return np.asarray(positions).dtype.kind in 'iu'
  except ValueError:  # ragged
    return False


def _edit(scale_value, shift, positions, axis, view=None) -> Edit:
  view = checked_view(view)
  if (positions is None) != (axis is None):
    raise InvalidOptionError('axis', axis, 'given exactly when positions are (an int axis '
                             'such as 1 for tokens, with positions=[...])')
  if axis is not None:
    axes('axis', axis)
  if positions is not None:
    if not _integer_indices(positions):
      raise InvalidOptionError('positions', positions,
                               f'integer indices along the axis ({AS_INDICES})')
    positions = jnp.asarray(positions)
  return Edit(jax.tree.map(jnp.asarray, scale_value), jax.tree.map(jnp.asarray, shift),
              positions, jnp.asarray(True), axis, view)


def _numbers(value: Any, field: str, where: str) -> Any:
  """``value`` with every leaf an array, if it has leaves and each is a number or an array."""
  leaves = jax.tree.leaves(value)
  allowed = (f"a number or an array broadcasting to the output of {where}, or a pytree of "
             "them of the output's structure (a field of the Edit given for it)")
  if not leaves:
    raise InvalidOptionError(field, value, allowed)
  for leaf in leaves:
    try:
      jnp.asarray(leaf)
    except TypeError:
      raise InvalidOptionError(field, leaf, allowed) from None
  return jax.tree.map(jnp.asarray, value)


def checked_edit(edit: Edit, where: str) -> Edit:
  """``edit`` with its fields as :func:`replace` and the other constructors make them: the
  checks of their options, for an :class:`Edit` built by hand.

  Raises:
    InvalidOptionError: ``positions`` without ``axis`` or the other way round, an ``axis``
      that is not an int, positions that are not integers, ``scale`` or ``shift`` not
      numbers or arrays, ``active`` not one boolean, or a ``view`` that is no shape.
  """
  if (edit.positions is None) != (edit.axis is None):
    raise InvalidOptionError('axis', edit.axis, 'given exactly when positions are (an int '
                             'axis such as 1 for tokens, with positions=[...])')
  positions = edit.positions
  if positions is not None:
    axes('axis', edit.axis)
    if not _integer_indices(positions):
      raise InvalidOptionError('positions', positions,
                               f'integer indices along the axis ({AS_INDICES})')
    positions = jnp.asarray(positions)
  if not (_boolean_array(edit.active) and jnp.ndim(edit.active) == 0):
    raise InvalidOptionError('active', edit.active, 'one boolean, True or False (a stack of '
                             'edits for jax.vmap holds one per edit, and the map gives each '
                             'edit its own)')
  return Edit(_numbers(edit.scale, 'scale', where), _numbers(edit.shift, 'shift', where),
              positions, edit.active, edit.axis, checked_view(edit.view))


def replace(value: Any, *, positions: Any = None, axis: int | None = None,
            view: tuple[int, ...] | None = None) -> Edit:
  """Replaces the output (at ``positions`` along ``axis``) by ``value``.

  Args:
    value: An array that broadcasts to the output (a cached output, another
      run's activation), or a pytree of the structure the cache holds for the
      call (its floating-point arrays: a dataclass output with an integer
      field is the tuple of its floating-point arrays).
    positions: Integer indices along ``axis`` (negative ones count from its
      end); ``None`` for the whole output. The other edits take them too.
      Positions outside the axis raise ``PositionOutOfRangeError`` when the
      edit runs; traced positions (the edit passed through ``jax.jit``, or a
      stack of positions under ``jax.vmap``) cannot be checked while tracing,
      and one outside the axis turns the whole edited output into NaN.
    axis: The axis the positions index.
    view: Edit the output reshaped to this shape (see :class:`Edit`); the
      other edits take it too.

  Returns:
    The edit.

  Raises:
    InvalidOptionError: ``positions`` without ``axis`` or the other way round, an
      ``axis`` that is not an int, or positions that are not integers.

  Example:
    >>> import jax.numpy as jnp
    >>> from perturbkit import interpret
    >>> interpret.apply_edit(interpret.replace(jnp.zeros(3), positions=[1], axis=1),
    ...                      jnp.ones((2, 2, 3))).sum(axis=-1).tolist()
    [[3.0, 0.0], [3.0, 0.0]]
  """
  return _edit(0.0, value, positions, axis, view)


def add(delta: Any, *, positions: Any = None, axis: int | None = None,
        view: tuple[int, ...] | None = None) -> Edit:
  """Adds ``delta`` to the output (at ``positions`` along ``axis``), a steering vector.

  Positions as for :func:`replace`: out of range, an error, or NaN in the
  edited output where they are traced (under ``jax.jit`` or ``jax.vmap``).

  Example:
    >>> import jax.numpy as jnp
    >>> from perturbkit import interpret
    >>> interpret.apply_edit(interpret.add(jnp.array([1.0, 2.0])), jnp.ones((1, 2))).tolist()
    [[2.0, 3.0]]
  """
  return _edit(1.0, delta, positions, axis, view)


def scale(factor: Any, *, positions: Any = None, axis: int | None = None,
          view: tuple[int, ...] | None = None) -> Edit:
  """Multiplies the output (at ``positions`` along ``axis``) by ``factor``.

  Positions as for :func:`replace`: out of range, an error, or NaN in the
  edited output where they are traced (under ``jax.jit`` or ``jax.vmap``).

  Example:
    >>> import jax.numpy as jnp
    >>> from perturbkit import interpret
    >>> interpret.apply_edit(interpret.scale(2.0), jnp.ones((1, 2))).tolist()
    [[2.0, 2.0]]
  """
  return _edit(factor, 0.0, positions, axis, view)


def zero_ablate(*, positions: Any = None, axis: int | None = None,
                view: tuple[int, ...] | None = None) -> Edit:
  """Sets the output (at ``positions`` along ``axis``) to zero.

  Positions as for :func:`replace`: out of range, an error, or NaN in the
  edited output where they are traced (under ``jax.jit`` or ``jax.vmap``).

  Example:
    >>> import jax.numpy as jnp
    >>> from perturbkit import interpret
    >>> interpret.apply_edit(interpret.zero_ablate(positions=[0], axis=1),
    ...                      jnp.ones((1, 2))).tolist()
    [[0.0, 1.0]]
    >>> # head 1 of 2 (features 2 and 3) of a (batch, tokens, heads * head_dim) output
    >>> interpret.apply_edit(interpret.zero_ablate(positions=[1], axis=2, view=(-1, 1, 2, 2)),
    ...                      jnp.ones((1, 1, 4))).tolist()
    [[[1.0, 1.0, 0.0, 0.0]]]
  """
  return _edit(0.0, 0.0, positions, axis, view)


def mean_ablate(reference: Any, *, over: int | tuple[int, ...] = 0, where: Any = None,
                positions: Any = None, axis: int | None = None,
                view: tuple[int, ...] | None = None) -> Edit:
  """Replaces the output by the mean of ``reference`` over the axes ``over``.

  ``reference`` is the call's output on reference data, e.g.
  ``cache.outputs['Dense_0']['__call__']`` from :func:`perturbkit.run_with_cache`
  on a batch; its mean over the examples (``over=0``, kept as an axis of 1)
  broadcasts to the output for any batch size. With ``view``, the reference
  is viewed the same way before the mean (``over`` counts the view's axes).
  Positions as for :func:`replace`: out of range, an error, or NaN in the
  edited output where they are traced (under ``jax.jit`` or ``jax.vmap``).

  Args:
    reference: The call's output on reference data (an array, or a pytree
      like the output).
    over: The axes to average over.
    where: Which entries of ``reference`` enter the mean: a boolean array
      that broadcasts to each of its arrays (before ``view``), e.g.
      ``attention_mask[:, :, None]`` for a ``(batch, tokens, features)``
      reference of padded prompts, so that padding does not enter the mean of
      a token position. Where no entry enters, the mean is NaN. ``None``:
      every entry.
    positions: Integer indices along ``axis`` to ablate (default: the whole
      output).
    axis: The axis the positions index.
    view: Edit the output reshaped to this shape (see :class:`Edit`).

  Returns:
    The edit.

  Raises:
    InvalidOptionError: ``over`` is no int axis or tuple of them, or names an
      axis the reference (or its view) lacks, ``where``
      is not a boolean array that broadcasts to the reference, or the options
      of :func:`replace`.

  Example:
    >>> import jax.numpy as jnp
    >>> from perturbkit import interpret
    >>> reference = jnp.array([[0.0, 2.0], [2.0, 4.0]])
    >>> interpret.apply_edit(interpret.mean_ablate(reference), jnp.zeros((3, 2))).tolist()
    [[1.0, 3.0], [1.0, 3.0], [1.0, 3.0]]
    >>> kept = jnp.array([[True], [False]])   # the second example is padding
    >>> interpret.apply_edit(interpret.mean_ablate(reference, where=kept),
    ...                      jnp.zeros((1, 2))).tolist()
    [[0.0, 2.0]]
  """
  axes('over', over, tuples=True)
  view = checked_view(view)
  if where is not None and not _boolean_array(where):
    raise InvalidOptionError('where', where, 'a boolean array broadcasting to the reference '
                             '(True where an entry enters the mean), e.g. '
                             'attention_mask[:, :, None].astype(bool)')

  def mean(r):
    name = 'the mean-ablation reference'
    kept = where
    if where is not None:
      try:
        kept = viewed(jnp.broadcast_to(where, jnp.shape(r)), view, name)
      except ValueError:
        raise InvalidOptionError('where', f'an array of shape {jnp.shape(where)}',
                                 f'a boolean array broadcasting to the reference, of shape '
                                 f'{jnp.shape(r)}') from None
    r = viewed(r, view, name)
    rank = jnp.ndim(r)
    given = over if isinstance(over, tuple) else (over,)
    if not all(-rank <= a < rank for a in given) or len({a % rank for a in given}) < len(given):
      raise InvalidOptionError('over', over, f'distinct axes in [-{rank}, {rank}) of the '
                               f'reference{" as viewed" if view else ""}, which has {rank} axes '
                               f'(shape {jnp.shape(r)})')
    return jnp.mean(r, axis=over, keepdims=True, where=kept)

  return replace(jax.tree.map(mean, reference), positions=positions, axis=axis, view=view)


def _broadcast(value: jax.Array, shape: tuple, where: str, field: str) -> jax.Array:
  try:
    if jnp.broadcast_shapes(jnp.shape(value), shape) != tuple(shape):
      raise ValueError
  except ValueError:
    raise EditShapeError(where, field, jnp.shape(value), shape) from None
  return jnp.broadcast_to(value, shape)


def _position_mask(positions: jax.Array, axis: int, shape: tuple,
                   where: str) -> tuple[jax.Array, jax.Array | None]:
  """The positions as a mask broadcasting to ``shape``, and whether one is outside the axis.

  Known positions are checked now; traced ones (under ``jax.jit``, or a stack
  of them under ``jax.vmap``) cannot be, so the second value is a traced
  boolean, ``True`` where some position is out of range (``None``: checked).
  """
  if jnp.ndim(positions) > 1:
    raise InvalidOptionError('positions', _listed(positions), 'integer indices along the axis '
                             '(one flat list, e.g. [0, 1]; a stack of them for jax.vmap is '
                             'mapped, not nested)')
  if not -len(shape) <= axis < len(shape):
    raise PositionOutOfRangeError(where, _listed(positions), axis, shape)
  size = shape[axis]
  outside = None
  if isinstance(positions, jax.core.Tracer):
    outside = jnp.any((positions < -size) | (positions >= size))
  else:
    given = np.asarray(positions)
    if given.size and (given.min() < -size or given.max() >= size):
      raise PositionOutOfRangeError(where, _listed(positions), axis, shape)
  # In range, jnp's negative indices count from the end; out of range, the scatter drops them.
  selected = jnp.zeros(size, bool).at[positions].set(True)
  return (selected.reshape([size if i == axis % len(shape) else 1 for i in range(len(shape))]),
          outside)


def _poison(dtype) -> jax.Array:
  """What a traced out-of-range position turns an output of ``dtype`` into.

  NaN for floating-point outputs, as ``jnp.take(..., mode='fill')`` fills an
  out-of-range gather: it reaches the model's output and every metric after it,
  where a dropped edit would look like a real zero effect. Other dtypes take
  that mode's fill values too (their smallest value, ``True`` for booleans).
  """
  if jnp.issubdtype(dtype, jnp.inexact):
    return jnp.array(jnp.nan, dtype)
  if jnp.issubdtype(dtype, jnp.bool_):
    return jnp.array(True)
  if jnp.issubdtype(dtype, jnp.unsignedinteger):
    return jnp.array(jnp.iinfo(dtype).max, dtype)
  return jnp.array(jnp.iinfo(dtype).min, dtype)


def _listed(positions) -> Any:
  return positions if isinstance(positions, jax.core.Tracer) else np.asarray(positions).tolist()


def viewed_shape(shape: tuple, view: tuple[int, ...] | None, where: str) -> tuple[int, ...]:
  """``view`` with its ``-1`` filled in for an array of ``shape`` (``shape`` itself for ``None``).

  Raises:
    EditViewError: ``view`` does not hold the array's elements.
  """
  if view is None:
    return tuple(shape)
  size, known = int(np.prod(shape)), int(np.prod([n for n in view if n != -1]))
  if (size != known if -1 not in view else known == 0 or size % known):
    raise EditViewError(where, view, shape)
  return tuple(size // known if n == -1 else n for n in view)


def viewed(x: jax.Array, view: tuple[int, ...] | None, where: str) -> jax.Array:
  """``x`` reshaped to ``view`` (``x`` itself for ``None``); ``EditViewError`` if it does not fit."""
  return x if view is None else jnp.reshape(x, viewed_shape(jnp.shape(x), view, where))


def _leaf(edit: Edit, output: jax.Array, scale_value, shift, where: str) -> jax.Array:
  if edit.view is not None:
    shape = jnp.shape(output)
    return _leaf(dataclasses.replace(edit, view=None), viewed(output, edit.view, where),
                 scale_value, shift, where).reshape(shape)
  shape = jnp.shape(output)
  for field, value in (('scale', scale_value), ('shift', shift)):
    if jnp.iscomplexobj(value) and not jnp.iscomplexobj(output):
      raise InvalidOptionError(field, f'an array of {jnp.result_type(value)}',
                               f'real for the real output of {where} (cast to its dtype, a '
                               'complex value would lose its imaginary part)')
  scale_value = _broadcast(scale_value, shape, where, 'scale')
  # Where the scale is 0 (replace, zero- and mean-ablation), the old value does not enter:
  # 0 * inf would be nan at a masked -inf attention score.
  kept = jnp.where((scale_value != 0) | jnp.isfinite(output), output,
                   jnp.zeros((), jnp.result_type(output)))
  target = (scale_value * kept + _broadcast(shift, shape, where, 'shift')).astype(output.dtype)
  mask = jnp.asarray(edit.active, bool)
  outside = None
  if edit.positions is not None:
    selected, outside = _position_mask(edit.positions, edit.axis, shape, where)
    mask = mask & selected
  edited = jnp.where(mask, target, output)
  if outside is None:
    return edited
  # A traced position outside the axis poisons the whole output (of an active edit) loudly.
  return jnp.where(outside & jnp.asarray(edit.active, bool), _poison(output.dtype), edited)


def _like(value: Any, output: Any, field: str, where: str) -> list:
  """``value``'s leaves, one per leaf of ``output``: its own if it has that structure.

  One array for several leaves of different shapes is refused: it could broadcast to
  some by chance (a ``(T,)`` vector to ``(B, H, T, T)`` attention weights).

  Raises:
    EditStructureError: ``value`` is a pytree of another structure than ``output``.
    AmbiguousEditError: one array for leaves of different shapes.
  """
  leaves = jax.tree.leaves(output)
  if jax.tree.structure(value) == jax.tree.structure(output):
    return jax.tree.leaves(value)
  if not jax.tree_util.treedef_is_leaf(jax.tree.structure(value)):
    shapes = lambda tree: jax.tree.map(lambda x: tuple(jnp.shape(x)), tree)
    raise EditStructureError(where, field, shapes(value), shapes(output))
  if jnp.ndim(value) > 0 and len({jnp.shape(leaf) for leaf in leaves}) > 1:
    raise AmbiguousEditError(where, field, jnp.shape(value), [jnp.shape(x) for x in leaves])
  return [value] * len(leaves)


def apply_edit(edit: Edit, output: Any, where: str = 'the call') -> Any:
  """``output`` with ``edit`` applied: the pure function every intervention runs.

  Args:
    edit: The edit.
    output: A call's output (an array, or a pytree of floating-point arrays).
    where: The call's name, for messages.

  Returns:
    The edited output, of ``output``'s structure, shapes and dtypes.

  Raises:
    NotEditsError: ``edit`` is not an edit of ``perturbkit.interpret``.
    InvalidOptionError: a field of an :class:`Edit` built by hand is not what the edit
      constructors make (see :func:`checked_edit`), or a complex ``scale`` or ``shift``
      for a real output.
    EditShapeError: ``scale`` or ``shift`` does not broadcast to the output.
    EditStructureError: ``scale`` or ``shift`` is a pytree of another
      structure than the output.
    AmbiguousEditError: ``scale`` or ``shift`` is one array (not a scalar)
      while the output holds arrays of different shapes.
    EditViewError: the edit's ``view`` holds another number of elements than
      the output.
    PositionOutOfRangeError: a position (known while tracing) is outside the
      axis, or the output (or its view) has no such axis. A traced position
      outside the axis (under ``jax.jit``, or a stack of positions under
      ``jax.vmap``) cannot raise: it turns the whole edited output into NaN
      (floating point; other dtypes take ``jnp.take(..., mode='fill')``'s
      fill values).

  Example:
    >>> import jax.numpy as jnp
    >>> from perturbkit import interpret
    >>> output = jnp.arange(4.0).reshape(2, 2)
    >>> bool((interpret.apply_edit(interpret.replace(output), output) == output).all())
    True
  """
  if not isinstance(edit, Edit):
    raise NotEditsError(f'the edit of {where}', type(edit).__name__)
  edit = checked_edit(edit, where)
  leaves, treedef = jax.tree.flatten(output)
  edited = [_leaf(edit, leaf, s, b, where) for leaf, s, b in
            zip(leaves, _like(edit.scale, output, 'a scale', where),
                     _like(edit.shift, output, 'a shift', where))]
  return jax.tree.unflatten(treedef, edited)


def flat_edits(edits: Mapping[Any, Any], prefix: str = '') -> dict[str, Edit]:
  """``{'Dense_0': {'__call__': e}}`` or ``{'Dense_0/__call__': e}`` as ``{'Dense_0/__call__': e}``.

  Raises:
    NotEditsError: ``edits`` (or a value in it) is neither a dict nor an edit.
    DuplicateEditError: two keys (one joined, one nested) name the same call.
  """
  if not isinstance(edits, Mapping):
    raise NotEditsError('the edits' if not prefix else f'the edits at {prefix!r}',
                        type(edits).__name__)
  flat = {}
  for key, value in edits.items():
    name = f'{prefix}/{key}' if prefix else str(key)
    if isinstance(value, Edit):
      found = {name: value}
    elif isinstance(value, Mapping):
      found = flat_edits(value, name)
    else:
      raise NotEditsError(f'the edit at {name!r}', type(value).__name__)
    for path in found:
      if path in flat:
        raise DuplicateEditError(path)
    flat.update(found)
  return flat


def edit_function(edits: Mapping[Any, Any], paths: tuple[tuple, ...]) -> PointEdit:
  """The ``(point path, output) -> output`` function a front end runs at every point.

  Raises:
    NotEditsError: ``edits`` is not a dict of edits.
    DuplicateEditError: ``edits`` gives one call two edits.
    UnknownEditPathError: an edit's path is not among ``paths``.
  """
  by_name = flat_edits(edits)
  known = {point_name(p): p for p in paths}
  for name in by_name:
    if name not in known:
      raise UnknownEditPathError(name, list(known))
  by_path = {known[name]: edit for name, edit in by_name.items()}

  def edit(path: tuple, output: Any) -> Any:
    found = by_path.get(path)
    return output if found is None else apply_edit(found, output, point_name(path))

  return edit
