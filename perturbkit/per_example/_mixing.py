"""Whether a traced loss mixes examples where gradients flow: contrastive losses, batch statistics.

Per-example gradients exist when the loss is a sum of one term per example,
each term reaching the params through its own example's computation. The
jaxpr of the loss is walked once, following for every value:

* where its examples are: on one axis (``int``), summed over (:data:`SUMMED`),
  not at all (``None``), or no longer known (:data:`UNKNOWN`, after an
  operation the walk does not follow: while loops, conditionals, scatters,
  gathers it cannot read, ...); rows of the examples axis picked by
  per-example indices (``x[arange(B), ids]``) are taken to be each example's
  own. An axis that merges the examples with others (``(B, T, V) -> (B * T, V)``
  before a cross-entropy, or ``(T, B) -> T * B``) is followed as the examples
  axis whose rows are grouped by example (``State.blocks``): a sum over all its
  rows is a sum over the examples, and splitting it gives the examples back
  their axis. A ``lax.scan`` is followed into its body, the carry to a fixed
  point, unless it steps through the examples themselves;
* whether its examples axis holds them in their own order (``order`` 0), or
  rearranged: rows shifted, reversed or dropped along it (``x[1:]``, ``x[::-1]``,
  ``jnp.roll``), so that row ``i`` is no longer example ``i``; values picked from
  fixed rows of the examples axis (``x[0]``, ``x[perm]``) are :data:`ROWS`, no
  longer one per example;
* whether it depends on the params (``live``): only such values carry
  gradients, so mixing among values computed from the data alone (normalizing
  the inputs by their batch mean, dividing by the batch's token count) leaves
  each example a gradient of its own;
* the first mixing it is computed from (``mixed``, a sentence), if any;
* the first place it combines values of different examples at all, params or
  not (``coupled``, a sentence): DP-SGD needs each example's term computed from
  that example alone, since dividing by the batch's token count makes every
  example's gradient depend on the others' data.

Mixing is recorded only where it is certain and live: the examples of two live
arrays paired with each other (``a @ b.T`` between two embeddings of the batch,
the CLIP loss); a live sum over the examples combined with each example again
(a batch statistic), or put through a nonlinear function (the loss is then not
a sum of per-example terms); a maximum, sort or cumulative sum over the
examples of a live array; a live value of fixed rows (:data:`ROWS`) combined with
each example, or rearranged rows combined with rows in another order
(``z * jnp.roll(z, 1, 0)``, negatives taken from the next example); a scatter
that writes a live value of fixed rows or a sum into rows of the examples axis.
The same holds for the rows of merged examples, and rows merged in two
different ways (examples-major and examples-minor) are examples paired with
each other. The loss is refused when its value is computed from
such a mixing. Whatever the walk does not follow it leaves alone: it can miss
mixing there (``check_per_example`` checks values), never refuse a loss that
is a per-example sum.
"""
import math
from typing import Any, NamedTuple, Sequence

import numpy as np
import jax
from jax.extend import core as jex_core

from perturbkit.core._dependence import single_subjaxpr
from perturbkit.errors import (ExamplesAxisError, ExamplesCoupledError, ExamplesMixedError,
                               PerExampleError)

SUMMED = 'summed'
ROWS = 'rows'
UNKNOWN = 'unknown'
PLAIN = (1, 1)
AXIS_LESS = (SUMMED, ROWS)  # computed from the examples, with no axis of them


class State(NamedTuple):
  """What the walk knows of one value.

  Attributes:
    axis: The axis of its examples (``int``), :data:`SUMMED`, :data:`ROWS`,
      :data:`UNKNOWN` or ``None``.
    live: Whether it is computed from the params.
    mixed: The first mixing it is computed from, a sentence, or ``None``.
    blocks: ``(before, after)`` when ``axis`` merges the examples with other axes: it is
      the row-major merge of ``(before, examples, after)``, so row ``r`` is example
      ``(r // after) % examples``. :data:`PLAIN` (``(1, 1)``) for the examples' own axis.
    order: 0 when row ``i`` of ``axis`` is example ``i``; else the rearrangement's own
      tag (the value it was made as, and where), equal only for rows in the same order.
    coupled: The first combination of different examples' values it is computed
      from, params or not, a sentence, or ``None``.
  """
  axis: Any = None
  live: bool = False
  mixed: str | None = None
  blocks: tuple[int, int] = PLAIN
  order: Any = 0
  coupled: str | None = None

  @property
  def place(self) -> tuple:
    """Where its rows are: equal for two values whose row ``r`` is the same example."""
    return (self.axis, self.blocks, self.order)


UNARY = {'neg', 'exp', 'exp2', 'log', 'log1p', 'expm1', 'tanh', 'logistic', 'sin', 'cos',
         'tan', 'sqrt', 'rsqrt', 'cbrt', 'abs', 'sign', 'floor', 'ceil', 'round', 'erf',
         'erfc', 'erf_inv', 'lgamma', 'digamma', 'is_finite', 'convert_element_type',
         'integer_pow', 'square', 'reduce_precision', 'copy', 'copy_p', 'real', 'imag',
         'conj', 'not', 'asin', 'acos', 'atan', 'sinh', 'cosh', 'asinh', 'acosh', 'atanh'}
BINARY = {'add', 'sub', 'mul', 'div', 'max', 'min', 'pow', 'rem', 'atan2', 'nextafter',
          'eq', 'ne', 'lt', 'le', 'gt', 'ge', 'and', 'or', 'xor', 'select_n', 'clamp',
          'add_any'}
ELEMENTWISE = UNARY | BINARY
# Linear in each operand: a live sum over the examples stays a sum through them.
LINEAR = {'neg', 'convert_element_type', 'reduce_precision', 'copy', 'copy_p', 'add', 'sub',
          'add_any', 'real', 'imag', 'conj'}
ADDITIVE = {'add', 'sub', 'add_any'}
PASS_THROUGH = {'optimization_barrier', 'sharding_constraint'}
ORDER = {'reduce_max': 'a maximum', 'reduce_min': 'a minimum', 'argmax': 'an argmax',
         'argmin': 'an argmin', 'reduce_prod': 'a product', 'cumsum': 'a cumulative sum',
         'cumprod': 'a cumulative product', 'cummax': 'a cumulative maximum',
         'cummin': 'a cumulative minimum', 'cumlogsumexp': 'a cumulative logsumexp',
         'sort': 'a sort'}


def _where(eqn: jex_core.JaxprEqn) -> str:
  stack = str(eqn.source_info.name_stack)
  return f'`{eqn.primitive.name}`' + (f' in {stack}' if stack else '')


def _is_float(var: Any) -> bool:
  dtype = getattr(var.aval, 'dtype', None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, np.inexact)


def _ndim(var: Any) -> int:
  return len(getattr(var.aval, 'shape', ()))


def _batch_statistic(eqn) -> str:
  return (f'{_where(eqn)} combines each example with a sum over all examples computed from '
          'the params (a batch statistic)')


def _fixed_rows(eqn) -> str:
  return (f'{_where(eqn)} combines each example with values of fixed examples computed from '
          'the params (e.g. `h + h[0]`)')


def _over_examples(eqn) -> str:
  name = eqn.primitive.name
  return (f'{_where(eqn)} takes {ORDER.get(name, name)} over the examples of an array '
          'computed from the params')


def _paired(eqn) -> str:
  return f'{_where(eqn)} pairs the examples of two arrays computed from the params with each other'


def _couples(eqn) -> str:
  return f'{_where(eqn)} combines values of different examples'


def _with_batch_data(eqn) -> str:
  return (f'{_where(eqn)} combines values with a quantity computed from the whole batch (such as '
          "a sum over the examples of a mask: the batch's token count)")


def _combine(states: Sequence[State], axis: Any, mixed: str | None = None,
             blocks: tuple[int, int] = PLAIN, order: Any = 0,
             coupled: str | None = None) -> State:
  """``axis`` (with ``blocks`` and ``order``) for the output; live, mixing and coupling from the
  inputs."""
  first = mixed or next((s.mixed for s in states if s.mixed), None)
  joined = coupled or first or next((s.coupled for s in states if s.coupled), None)
  rows = isinstance(axis, int)
  return State(axis, any(s.live for s in states), first, blocks if rows else PLAIN,
               order if rows else 0, joined)


def _keep(states: Sequence[State], source: State, axis: Any = None) -> State:
  """``source``'s examples, moved to ``axis`` if given, for the output of ``states``."""
  return _combine(states, source.axis if axis is None else axis, blocks=source.blocks,
                  order=source.order)


def _rearranged(eqn, states: Sequence[State], source: State) -> State:
  """``source``'s examples axis with its rows in a new order (this operation's own)."""
  return _combine(states, source.axis, blocks=source.blocks,
                  order=(id(eqn.outvars[0]), _where(eqn)))


def _spread(eqn, index: int, state: State) -> State:
  """A size-1 examples axis broadcast by an elementwise operation is one row for every example."""
  if isinstance(state.axis, int):
    shape, out = eqn.invars[index].aval.shape, eqn.outvars[0].aval.shape
    if len(shape) == len(out) and shape[state.axis] == 1 and out[state.axis] != 1:
      return state._replace(axis=ROWS, blocks=PLAIN, order=0)
  return state


def _elementwise(eqn, states: list[State]) -> State:
  name = eqn.primitive.name
  states = [_spread(eqn, i, s) for i, s in enumerate(states)]
  if any(s.axis == UNKNOWN for s in states):
    return _combine(states, UNKNOWN)
  examples = [s for s in states if isinstance(s.axis, int)]
  summed = [s for s in states if s.axis in AXIS_LESS]
  # Rows merged differently (examples-major and -minor), or rearranged, line up different
  # examples.
  places = {s.place for s in examples}
  if len(places) > 1:
    live = {s.place for s in examples if s.live}
    if len(live) > 1:
      return _combine(states, UNKNOWN, _paired(eqn))
    axis, blocks, order = live.pop() if live else (UNKNOWN, PLAIN, 0)
    return _combine(states, axis, blocks=blocks, order=order, coupled=_couples(eqn))
  if examples:
    first = examples[0]
    mixed = None
    if any(s.live and s.axis == SUMMED for s in summed):
      mixed = _batch_statistic(eqn)
    elif any(s.live for s in summed):
      mixed = _fixed_rows(eqn)
    coupled = _with_batch_data(eqn) if summed else None
    return _combine(states, first.axis, mixed, first.blocks, first.order, coupled)
  if summed:
    live = [i for i, s in enumerate(states) if s.live]
    linear = (name in LINEAR
              or (name == 'mul' and len(live) == 1)
              or (name == 'div' and live == [0])
              or (name == 'select_n' and 0 not in live))
    axis = SUMMED if any(s.axis == SUMMED for s in summed) else ROWS
    if any(s.live and s.axis == SUMMED for s in summed) and not linear:
      return _combine(states, axis, f'{_where(eqn)} is applied to a sum over the examples, '
                                    'so the loss is not a sum of per-example terms')
    # A live value times or over the batch's data (`sum(loss * mask) / sum(mask)`): each
    # example's gradient depends on the other examples' data. Adding one does not.
    coupled = (_with_batch_data(eqn) if live and name not in ADDITIVE
               and any(not s.live for s in summed) else None)
    return _combine(states, axis, coupled=coupled)
  return _combine(states, None)


def _broadcast_in_dim(eqn, states):
  s = states[0]
  if not isinstance(s.axis, int):
    return _keep(states, s)
  axis = eqn.params['broadcast_dimensions'][s.axis]
  if eqn.invars[0].aval.shape[s.axis] == 1 and eqn.params['shape'][axis] != 1:
    return _combine(states, ROWS)  # one row for every example
  return _keep(states, s, axis)


def _reshape(eqn, states):
  """The new axis that holds the examples' factor of the flattened array whole, if one does.

  Merging the examples with the axes after them (``(B, T, V) -> (B * T, V)``) gives
  each example a block of rows; with those before them (``(T, B) -> (T * B)``), every
  ``B``-th row; splitting such an axis again gives the examples back their own axis.
  """
  s = states[0]
  if not isinstance(s.axis, int):
    return _combine(states, s.axis)
  old, new = eqn.invars[0].aval.shape, eqn.params['new_sizes']
  if eqn.params.get('dimensions') is not None or 0 in old:
    return _combine(states, UNKNOWN)
  before, after = s.blocks
  count = old[s.axis] // (before * after)
  stride = after * math.prod(old[s.axis + 1:])  # of the examples in the flattened array
  for j, size in enumerate(new):
    inner = math.prod(new[j + 1:])
    if stride % inner == 0 and (inner * size) % (stride * count) == 0:
      return _combine(states, j, blocks=(inner * size // (stride * count), stride // inner),
                      order=s.order)
  return _combine(states, UNKNOWN)


def _transpose(eqn, states):
  s = states[0]
  axis = list(eqn.params['permutation']).index(s.axis) if isinstance(s.axis, int) else s.axis
  return _keep(states, s, axis)


def _squeeze(eqn, states):
  s = states[0]
  if not isinstance(s.axis, int):
    return _combine(states, s.axis)
  dims = [d % _ndim(eqn.invars[0]) for d in eqn.params['dimensions']]
  if s.axis in dims:  # ``x[0]``: one example's values
    return _combine(states, ROWS)
  return _keep(states, s, s.axis - sum(d < s.axis for d in dims))


def _reduce(eqn, states):
  s = states[0]
  if not isinstance(s.axis, int):
    return _combine(states, s.axis)
  axes = tuple(eqn.params['axes'])
  if s.axis not in axes:
    return _keep(states, s, s.axis - sum(a < s.axis for a in axes))
  if eqn.primitive.name == 'reduce_sum':  # over all rows of merged examples too
    return _combine(states, SUMMED)
  return _combine(states, UNKNOWN, _over_examples(eqn) if s.live else None,
                  coupled=_couples(eqn))


def _along_axis(eqn, states):
  """Cumulative ops and sort: the examples' axis is kept unless it is the one they run along."""
  s = states[0]
  axis = eqn.params.get('axis', eqn.params.get('dimension'))
  if isinstance(s.axis, int) and s.axis == axis % _ndim(eqn.invars[0]):
    return _combine(states, UNKNOWN, _over_examples(eqn) if s.live else None,
                    coupled=_couples(eqn))
  return _keep(states, s)


def _position(a: int, contract, batch, ndim: int, offset: int):
  if a in batch:
    return 'batch', list(batch).index(a)
  if a in contract:
    return 'contract', list(contract).index(a)
  free = [d for d in range(ndim) if d not in contract and d not in batch]
  return 'free', offset + free.index(a)


def _dot_general(eqn, states):
  (lc, rc), (lb, rb) = eqn.params['dimension_numbers']
  left, right = states[:2]
  if UNKNOWN in (left.axis, right.axis):
    return _combine(states, UNKNOWN)
  n_left = _ndim(eqn.invars[0])
  free_left = n_left - len(lc) - len(lb)
  where = [None, None]
  if isinstance(left.axis, int):
    where[0] = _position(left.axis, lc, lb, n_left, len(lb))
  if isinstance(right.axis, int):
    where[1] = _position(right.axis, rc, rb, _ndim(eqn.invars[1]), len(lb) + free_left)
  if where[0] and where[1]:
    if (where[0] == where[1] and where[0][0] != 'free'
        and (left.blocks, left.order) == (right.blocks, right.order)):
      if where[0][0] == 'batch':
        return _keep(states, left, where[0][1])
      return _combine(states, SUMMED)
    if left.live and right.live:
      return _combine(states, UNKNOWN, f'{_paired(eqn)} (a contrastive loss over the batch, '
                                       '`a @ b.T`)')
    side = 0 if left.live else 1 if right.live else None
    if side is None or where[side][0] == 'contract':
      return _combine(states, UNKNOWN, coupled=_couples(eqn))
    return _combine(states, where[side][1], blocks=states[side].blocks,
                    order=states[side].order, coupled=_couples(eqn))
  if where[0] or where[1]:
    side = 0 if where[0] else 1
    kind, index = where[side]
    other = states[1 - side]
    mixed = None
    if other.live and other.axis == SUMMED:
      mixed = _batch_statistic(eqn)
    elif other.live and other.axis == ROWS:
      mixed = _fixed_rows(eqn)
    coupled = _with_batch_data(eqn) if other.axis in AXIS_LESS else None
    if kind == 'contract':
      return _combine(states, SUMMED, mixed, coupled=coupled)
    return _combine(states, index, mixed, states[side].blocks, states[side].order, coupled)
  if left.axis in AXIS_LESS or right.axis in AXIS_LESS:
    both = left.axis in AXIS_LESS and right.axis in AXIS_LESS
    mixed = (f'{_where(eqn)} multiplies two values computed from the examples (sums over them '
             'or fixed rows), so the loss is not a sum of per-example terms'
             if both and left.live and right.live else None)
    coupled = _with_batch_data(eqn) if both and (left.live or right.live) else None
    axis = SUMMED if SUMMED in (left.axis, right.axis) else ROWS
    return _combine(states, axis, mixed, coupled=coupled)
  return _combine(states, None)


def _conv(eqn, states):
  lhs, rhs = states[:2]
  dims = eqn.params['dimension_numbers']
  if (isinstance(lhs.axis, int) and rhs.axis is None and lhs.axis == dims.lhs_spec[0]
      and eqn.params.get('batch_group_count', 1) == 1):
    return _keep(states, lhs, dims.out_spec[0])
  return _combine(states, None if lhs.axis is None and rhs.axis is None else UNKNOWN)


def _window(eqn, states):
  s = states[0]
  if not isinstance(s.axis, int):
    return _combine(states, s.axis if s.axis is None else UNKNOWN)
  p = eqn.params
  untouched = (p['window_dimensions'][s.axis] == 1 and p['window_strides'][s.axis] == 1
               and tuple(p['padding'][s.axis]) == (0, 0)
               and p.get('base_dilation', (1,) * 64)[s.axis] == 1
               and p.get('window_dilation', (1,) * 64)[s.axis] == 1)
  return _keep(states, s) if untouched else _combine(states, UNKNOWN)


def _pad(eqn, states):
  s = states[0]
  if isinstance(s.axis, int) and tuple(eqn.params['padding_config'][s.axis]) != (0, 0, 0):
    return _combine(states, UNKNOWN)
  return _keep(states, s) if states[1].axis is None else _combine(states, UNKNOWN)


def _slice(eqn, states):
  """Leading rows of the examples axis are still those examples (``x[:k]``); other rows
  (``x[1:]``, ``x[::2]``) are rearranged."""
  s = states[0]
  if isinstance(s.axis, int):
    p = eqn.params
    start = p['start_indices'][s.axis]
    if p['strides'] is not None and p['strides'][s.axis] != 1:
      return _rearranged(eqn, states, s)
    before, after = s.blocks
    rows, size = eqn.invars[0].aval.shape[s.axis], eqn.outvars[0].aval.shape[s.axis]
    if after == 1 and s.order == 0 and rows == before * size and start % size == 0:
      # One whole batch of batches one after another (``jnp.tile``, ``jnp.concatenate``).
      return _combine(states, s.axis, order=0)
    return _combine(states, s.axis, blocks=s.blocks, order=_shifted(s.order, start, eqn))
  return _combine(states, s.axis)


def _offset(order: Any) -> tuple[Any, int]:
  """``(base, k)``: row ``r`` of a value in ``order`` is row ``r + k`` of one in order ``base``."""
  if isinstance(order, tuple) and order[0] == 'offset':
    return order[1], order[2]
  return order, 0


def _shifted(order: Any, by: int, eqn) -> Any:
  """The order of the rows from row ``by`` on of rows in ``order``: ``order`` itself for 0."""
  base, offset = _offset(order)
  return ('offset', base, offset + by, _where(eqn)) if offset + by else base


def _dynamic_slice(eqn, states):
  """``lax.dynamic_slice``: the whole examples axis is kept; part of it is rearranged."""
  s = states[0]
  if any(t.axis is not None for t in states[1:]):
    return _combine(states, UNKNOWN if s.axis is not None else None)
  if isinstance(s.axis, int):
    if eqn.params['slice_sizes'][s.axis] == eqn.invars[0].aval.shape[s.axis]:
      return _keep(states, s)
    return _rearranged(eqn, states, s)
  return _combine(states, s.axis)


def _split(eqn, states) -> list[State]:
  """``jnp.split``: pieces along another axis keep the examples; along theirs, each piece holds
  consecutive rows (as :func:`_slice` makes them)."""
  s = states[0]
  if not isinstance(s.axis, int) or eqn.params['axis'] != s.axis:
    return [_keep(states, s)] * len(eqn.outvars)
  starts = np.cumsum((0,) + tuple(eqn.params['sizes'][:-1]))
  return [_combine(states, s.axis, blocks=s.blocks, order=_shifted(s.order, int(start), eqn))
          for start in starts]


def _rev(eqn, states):
  s = states[0]
  if isinstance(s.axis, int) and s.axis in eqn.params['dimensions']:
    return _rearranged(eqn, states, s)
  return _keep(states, s)


def _concatenate(eqn, states):
  if any(s.axis == UNKNOWN for s in states):
    return _combine(states, UNKNOWN)
  places = {s.place for s in states if s.axis is not None}
  if not places:
    return _combine(states, None)
  if len(places) == 1:
    axis, blocks, order = places.pop()
    if isinstance(axis, int) and axis != eqn.params['dimension']:
      return _combine(states, axis, blocks=blocks, order=order)
  dimension = eqn.params['dimension']
  rows = [s for s in states if s.axis is not None]
  if (len(rows) == len(states) and len({v.aval.shape[dimension] for v in eqn.invars}) == 1
      and all(s.axis == dimension and s.blocks == PLAIN and s.order == 0 for s in rows)):
    # Whole batches one after another (``jnp.concatenate([x, f(x)])``): row ``r`` is example
    # ``r % examples``, as ``jnp.tile`` makes them.
    return _combine(states, dimension, blocks=(len(states), 1), order=0)
  if all(s.axis == dimension for s in rows) and len({s.blocks for s in rows}) == 1:
    # Consecutive rows put back in order (``jnp.concatenate([h[:k], h[k:]])``) are the rows
    # they were; others stacked along the examples axis (``jnp.roll``, two views of the batch)
    # are rearranged.
    offset, bases = 0, set()
    for var, s in zip(eqn.invars, states):
      base, start = _offset(s.order) if s.axis is not None else (None, -1)
      bases.add(base if start == offset else None)
      offset += var.aval.shape[dimension]
    if len(bases) == 1 and None not in bases:
      return _combine(states, dimension, blocks=rows[0].blocks, order=bases.pop())
    return _rearranged(eqn, states, rows[0])
  return _combine(states, UNKNOWN, coupled=_couples(eqn))


def _gather(eqn, states):
  operand, indices = states[:2]
  dims = eqn.params['dimension_numbers']
  n_out = _ndim(eqn.outvars[0])
  batch_out = [d for d in range(n_out) if d not in dims.offset_dims]
  index_axes = _ndim(eqn.invars[1]) - 1  # the last axis holds the index vectors
  if operand.axis is None and isinstance(indices.axis, int) and indices.axis < index_axes:
    return _keep(states, indices, batch_out[indices.axis])
  if isinstance(operand.axis, int) and operand.axis in dims.operand_batching_dims:
    # take_along_axis: each row of the operand is indexed by its own row of indices.
    k = list(dims.operand_batching_dims).index(operand.axis)
    b = dims.start_indices_batching_dims[k]
    lined_up = indices.axis is None or (indices.axis, indices.blocks) == (b, operand.blocks)
    if lined_up and b < index_axes:
      return _keep(states, operand, batch_out[b])
  if (isinstance(operand.axis, int) and isinstance(indices.axis, int)
      and indices.axis < index_axes and operand.axis in dims.collapsed_slice_dims
      and operand.axis in dims.start_index_map):
    # x[arange(B), ids] (CLIP's text pooling): rows of the examples axis picked by per-example
    # indices are taken to be each example's own. A permutation of the examples would pass
    # unnoticed here, but nothing is refused on this assumption.
    return _keep(states, indices, batch_out[indices.axis])
  if isinstance(operand.axis, int) and indices.axis is None:
    if operand.axis in dims.start_index_map:
      return _combine(states, ROWS)  # ``x[perm]``, ``jnp.take(x, 2, axis=0)``: fixed rows
    if (operand.axis not in dims.collapsed_slice_dims
        and operand.axis not in dims.operand_batching_dims
        and eqn.params['slice_sizes'][operand.axis] == eqn.invars[0].aval.shape[operand.axis]):
      # ``x[:, ids]``: the examples axis is a whole slice of every gathered window.
      kept = [d for d in range(_ndim(eqn.invars[0]))
              if d not in dims.collapsed_slice_dims and d not in dims.operand_batching_dims]
      return _keep(states, operand, dims.offset_dims[kept.index(operand.axis)])
  if operand.axis is None and indices.axis is None:
    return _combine(states, None)
  return _combine(states, UNKNOWN)


def _scatter(eqn, states):
  """Writing into the examples axis: constants or each row's own values keep the rows' examples;
  values of fixed examples or sums over them, written into rows, mix them."""
  operand, indices, updates = states[:3]
  dims = eqn.params['dimension_numbers']
  if not isinstance(operand.axis, int) or indices.axis is not None or updates.axis == UNKNOWN:
    carried = any(s.axis is not None for s in states)
    return _combine(states, UNKNOWN if carried else None)
  if updates.axis is None:
    return _keep(states, operand)
  if updates.axis in AXIS_LESS:
    mixed = (f'{_where(eqn)} writes values of fixed examples or sums over them, computed from '
             'the params, into the rows of the examples' if updates.live else None)
    return _combine(states, operand.axis, mixed, operand.blocks, operand.order, _couples(eqn))
  if operand.axis not in dims.scatter_dims_to_operand_dims:
    windows = [d for d in range(_ndim(eqn.invars[0]))
               if d not in dims.inserted_window_dims and d not in dims.operand_batching_dims]
    if (operand.axis in windows
        and updates.axis == dims.update_window_dims[windows.index(operand.axis)]
        and (updates.blocks, updates.order) == (operand.blocks, operand.order)):
      return _keep(states, operand)  # ``h.at[:, 0].set(g[:, 1])``: row by row
  return _rearranged(eqn, states, operand)


SCATTERS = ('scatter', 'scatter-add', 'scatter_add', 'scatter-mul', 'scatter_mul',
            'scatter-min', 'scatter_min', 'scatter-max', 'scatter_max', 'scatter-sub',
            'scatter_sub')

RULES = {
    'broadcast_in_dim': _broadcast_in_dim, 'reshape': _reshape, 'transpose': _transpose,
    'squeeze': _squeeze, 'dot_general': _dot_general, 'conv_general_dilated': _conv,
    'reduce_window_sum': _window, 'reduce_window_max': _window, 'reduce_window_min': _window,
    'pad': _pad, 'slice': _slice, 'concatenate': _concatenate, 'gather': _gather,
    'dynamic_slice': _dynamic_slice, 'rev': _rev, **{name: _scatter for name in SCATTERS},
    'cumsum': _along_axis, 'cumprod': _along_axis, 'cummax': _along_axis,
    'cummin': _along_axis, 'cumlogsumexp': _along_axis,
    **{name: _reduce for name in ('reduce_sum', 'reduce_max', 'reduce_min', 'reduce_prod',
                                  'argmax', 'argmin')},
}


def _join(a: State, b: State) -> State:
  """What is known of a value that is either ``a`` or ``b`` (a loop's carry)."""
  if a.axis is None or a.place == b.place:
    axis, blocks, order = b.place
  elif b.axis is None:
    axis, blocks, order = a.place
  else:
    axis, blocks, order = UNKNOWN, PLAIN, 0
  return State(axis, a.live or b.live, a.mixed or b.mixed, blocks, order,
               a.coupled or b.coupled)


def _shift(s: State, by: int) -> State:
  return s._replace(axis=s.axis + by) if isinstance(s.axis, int) else s


def _scan(eqn, states: list[State]) -> list[State]:
  """``lax.scan``: the body's carry followed to a fixed point, ``xs`` and ``ys`` one axis in.

  A scan along the examples themselves (one example per step, the carry running
  through them) is not followed.
  """
  p = eqn.params
  n_consts, n_carry = p['num_consts'], p['num_carry']
  consts, carry = states[:n_consts], states[n_consts:n_consts + n_carry]
  xs = states[n_consts + n_carry:]
  if any(s.axis == 0 for s in xs):
    return [_combine(states, UNKNOWN)] * len(eqn.outvars)
  xs = [_shift(s, -1) for s in xs]
  while True:  # the joins only move up a lattice of finite height
    outs = walk(p['jaxpr'].jaxpr, [*consts, *carry, *xs])
    joined = [_join(c, o) for c, o in zip(carry, outs[:n_carry])]
    if joined == carry:
      return [*carry, *(_shift(s, 1) for s in outs[n_carry:])]
    carry = joined


def _eqn_states(eqn, states: list[State]) -> list[State]:
  name = eqn.primitive.name
  if name == 'stop_gradient':  # no gradient, but the value still depends on the examples
    return [states[0]._replace(live=False, mixed=None)]
  if name in PASS_THROUGH:
    return list(states[:len(eqn.outvars)])
  if name == 'scan':
    return _scan(eqn, states)
  inner = single_subjaxpr(eqn)
  if inner is not None:
    return walk(inner, states)
  if name in ELEMENTWISE:
    return [_elementwise(eqn, states)] * len(eqn.outvars)
  if name == 'sort':
    return [_along_axis(eqn, [s]) for s in states]
  if name == 'split':
    return _split(eqn, states)
  if name in RULES and len(eqn.outvars) == 1:
    return [RULES[name](eqn, states)]
  # Not followed: loops, conditionals, scatters, ...
  carried = any(s.axis is not None for s in states)
  return [_combine(states, UNKNOWN if carried else None)] * len(eqn.outvars)


def walk(jaxpr: jex_core.Jaxpr, states: Sequence[State]) -> list[State]:
  """The :class:`State` of every output of ``jaxpr``, given those of its inputs."""
  known = dict(zip(jaxpr.invars, states))

  def read(var) -> State:
    return State() if isinstance(var, jex_core.Literal) else known.get(var, State())

  for eqn in jaxpr.eqns:
    outs = _eqn_states(eqn, [read(v) for v in eqn.invars])
    for var, s in zip(eqn.outvars, outs):
      # No gradient flows through integer or boolean values.
      known[var] = s if _is_float(var) else s._replace(live=False, mixed=None)
  return [read(v) for v in jaxpr.outvars]


def mixing(jaxpr: jex_core.Jaxpr, example_axes: Sequence[int | None], live: Sequence[bool],
           call_inputs: int = 0, private: bool = False
           ) -> tuple[PerExampleError | None, bool]:
  """How the loss, ``jaxpr``'s last output, mixes examples where gradients flow, if it does.

  Args:
    jaxpr: The traced loss; its first ``call_inputs`` outputs are the array inputs of
      the recorded layer calls, its last output is the loss.
    example_axes: For each input, the axis of its examples, or ``None``.
    live: For each input, whether it is a param.
    call_inputs: How many of the first outputs are layer-call inputs.
    private: Whether any combination of different examples' values counts (DP-SGD),
      not only mixing where gradients flow.

  Returns:
    ``(error, misplaced)``: the :class:`ExamplesMixedError` (for ``private``, an
    :class:`ExamplesCoupledError` where only data is combined; an
    :class:`ExamplesAxisError` where a layer sees the examples' rows rearranged) to
    raise, or ``None``,
    and whether a layer call sees the examples on an axis other than 0 (then the
    mixing may only be that axis's doing, and the examples-axis error is the one to give).
  """
  states = walk(jaxpr, [State(axis, p) for axis, p in zip(example_axes, live)])
  misplaced = any(isinstance(s.axis, int) and (s.axis != 0 or s.blocks != PLAIN)
                  for s in states[:call_inputs])
  sizes = {var.aval.shape[axis] for var, axis in zip(jaxpr.invars, example_axes)
           if axis is not None}
  if sizes <= {1}:  # one example: nothing to mix it with
    return None, misplaced
  rearranged = next((s.order[-1] for s in states[:call_inputs]
                     if isinstance(s.axis, int) and s.order != 0), None)
  if rearranged:
    return ExamplesAxisError(f'a layer sees the rows of its input rearranged along the examples '
                             f'axis by {rearranged} (`x[::-1]`, `jnp.roll`, `x[1:]`), so its '
                             'row i is not example i'), False
  loss = states[-1]
  if loss.mixed:
    return ExamplesMixedError(loss.mixed), misplaced
  if private and loss.coupled:
    return ExamplesCoupledError(loss.coupled), misplaced
  return None, misplaced
