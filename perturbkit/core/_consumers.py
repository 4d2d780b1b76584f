"""Who reads a parameter: the equations of a jaxpr that consume each input.

The interleaved schedule updates a segment's params inside the backward pass,
with the gradient that flows back through the segment's own call. A param read
anywhere else (a tied LM head reading the embedding matrix, an L2 term on the
weights) would be missing from that step, so every such read must be found.
Each segment call is one named ``custom_vjp_call`` equation; any other
equation that takes the param as an operand, and whose result carries gradient
to the outputs (not only through ``stop_gradient``), is a read outside the
segment.
Calls to nested jaxprs (``jit``, ``remat``, ``scan``, ``cond``, ...) are
followed into their bodies. With liveness (``spared`` given), a param a nested
jaxpr hands back unchanged (``nnx.remat`` returns the module's state) is the
same param outside it, not a read.
"""
from typing import Any, Callable, Mapping

from jax.extend import core as jex_core

SEGMENT_PREFIX = 'perturbkit_segment:'
# Equations whose outputs carry no gradient to their operands: a param read only
# through them adds nothing to its gradient, so it is not a read outside.
NO_GRADIENT = frozenset({'stop_gradient'})


def segment_function_name(name: str) -> str:
  """The name a segment's ``custom_vjp`` function carries into the jaxpr."""
  return SEGMENT_PREFIX + name


def _sub_jaxprs(eqn) -> list[tuple[Any, list]] | None:
  """``(body, operands)`` for each nested jaxpr of ``eqn``; ``None`` if one of
  them does not take the operands one to one (then its reads are not followed)."""
  found = []
  for value in eqn.params.values():
    for body in (value if isinstance(value, (tuple, list)) else (value,)):
      jaxpr = getattr(body, 'jaxpr', body)
      if not isinstance(jaxpr, jex_core.Jaxpr):
        continue
      n = len(jaxpr.invars)
      if n == len(eqn.invars):
        found.append((jaxpr, list(eqn.invars)))
      elif n == len(eqn.invars) - 1:  # cond: the first operand is the branch index
        found.append((jaxpr, list(eqn.invars[1:])))
      else:
        return None
  return found


def _custom_vjp_name(eqn) -> str:
  """The name of the function a ``custom_vjp_call`` equation calls."""
  body = eqn.params.get('call_jaxpr')
  info = getattr(getattr(body, 'jaxpr', body), 'debug_info', None)
  return str(getattr(info, 'func_name', '') or eqn.params.get('name', ''))


def reads_outside(jaxpr: Any, owner_of: dict[int, str], *,
                  spared: Mapping[str, int] | None = None) -> dict[str, set[str]]:
  """The equations reading each segment's params outside its own call.

  Args:
    jaxpr: A (closed) jaxpr whose inputs include the params.
    owner_of: Maps an input position of ``jaxpr`` to the name of the segment
      owning that param leaf.
    spared: The reads it accounts for are not reads: ``{custom_vjp function name: n}``
      names calls whose first ``n`` operands (after their constants) are
      params computed from the model's (a nested ``apply`` on a tied weight,
      handled by the caller); what only flows into those operands is not a
      read. A named call of one segment that is given another's params (a
      module calling its child) is followed into, so that only what it does
      with them counts.

  A read that reaches the outputs only through ``stop_gradient`` (or not at
  all) is not a read: it adds nothing to the gradient.

  Returns:
    ``{segment name: {primitive names}}`` for each segment read elsewhere; a
    param returned directly as an output counts as a read (``'output'``).
  """
  jaxpr = getattr(jaxpr, 'jaxpr', jaxpr)
  found: dict[str, set[str]] = {}
  owners = {jaxpr.invars[i]: name for i, name in owner_of.items()}
  report = lambda name, what: found.setdefault(name, set()).add(what)
  if spared is None:
    _walk(jaxpr, owners, report)
  else:
    _walk_live(jaxpr, owners, [True] * len(jaxpr.outvars), spared, report)
  return found


def _walk(jaxpr, owners: dict, report: Callable[[str, str], None]):
  live = _live_vars(jaxpr, [True] * len(jaxpr.outvars), {})
  for eqn in jaxpr.eqns:
    read = {owners[v] for v in eqn.invars if isinstance(v, jex_core.Var) and v in owners}
    if (not read or eqn.primitive.name in NO_GRADIENT
        or not any(v in live for v in eqn.outvars)):
      continue  # reads nothing, or carries no gradient to the outputs (stop_gradient)
    if eqn.primitive.name == 'custom_vjp_call':
      own = _custom_vjp_name(eqn)
      for name in read:
        if own != segment_function_name(name):
          report(name, f'custom_vjp_call {own.removeprefix(SEGMENT_PREFIX)}')
      continue
    bodies = _sub_jaxprs(eqn)
    if not bodies:
      for name in read:
        report(name, eqn.primitive.name)
      continue
    for body, operands in bodies:
      inner = {b: owners[o] for b, o in zip(body.invars, operands)
               if isinstance(o, jex_core.Var) and o in owners}
      _walk(body, inner, report)
  for v in jaxpr.outvars:
    if isinstance(v, jex_core.Var) and v in owners:
      report(owners[v], 'output')


def _spared_operands(eqn, spared: Mapping[str, int]) -> range:
  """The operand positions of ``eqn`` that ``spared`` accounts for."""
  if eqn.primitive.name != 'custom_vjp_call':
    return range(0)
  n = spared.get(_custom_vjp_name(eqn))
  if n is None:
    return range(0)
  start = eqn.params.get('num_consts', 0)
  return range(start, start + n)


def _carried(eqn) -> int:
  """How many leading outputs of ``eqn`` are a loop's carry, which feeds its next
  iteration: every output of a ``while``, a scan's first ``num_carry``, none otherwise."""
  if eqn.primitive.name == 'while':
    return len(eqn.outvars)
  if eqn.primitive.name == 'scan':
    return eqn.params['num_carry']
  return 0


def _body_outputs(eqn, body, live_out: list[bool]) -> list[bool]:
  """Which outputs of a nested jaxpr reach the equation's live outputs (all, if unsure).

  A loop's carry is always live; each other output (a scan's stacked outputs) is the
  equation's output of the same index."""
  if len(body.outvars) != len(eqn.outvars):
    return [True] * len(body.outvars)
  carried = _carried(eqn)
  return [True] * carried + list(live_out[carried:])


def _live_vars(jaxpr, live_out: list[bool], spared: Mapping[str, int]) -> set:
  """The variables of ``jaxpr`` that its live outputs are computed from."""
  live = {v for v, keep in zip(jaxpr.outvars, live_out)
          if keep and isinstance(v, jex_core.Var)}
  for eqn in reversed(jaxpr.eqns):
    outs = [v in live for v in eqn.outvars]
    if not any(outs):
      continue
    needed = [eqn.primitive.name not in NO_GRADIENT] * len(eqn.invars)
    for i in _spared_operands(eqn, spared):
      needed[i] = False
    bodies = _sub_jaxprs(eqn)
    if bodies and not _spared_operands(eqn, spared):
      needed = [False] * len(eqn.invars)
      for body, operands in bodies:
        inner = _live_vars(body, _body_outputs(eqn, body, outs), spared)
        offset = len(eqn.invars) - len(operands)
        needed[:offset] = [True] * offset
        for i, b in enumerate(body.invars):
          needed[offset + i] = needed[offset + i] or b in inner
    live.update(v for v, keep in zip(eqn.invars, needed)
                if keep and isinstance(v, jex_core.Var))
  return live


def _walk_live(jaxpr, owners: dict, live_out: list[bool], spared: Mapping[str, int],
               report: Callable[[str, str], None],
               handed_back: Callable[[int, str], None] | None = None):
  """``handed_back(j, owner)``: the nested jaxpr's output ``j`` is an owner's param as it came
  in (``nnx.remat`` returns the module's state): the caller's output ``j`` is that param too,
  not a read."""
  owners = dict(owners)
  live = _live_vars(jaxpr, live_out, spared)
  for eqn in jaxpr.eqns:
    read = {i: owners[v] for i, v in enumerate(eqn.invars)
            if isinstance(v, jex_core.Var) and v in owners}
    outs = [v in live for v in eqn.outvars]
    if not read or not any(outs) or eqn.primitive.name in NO_GRADIENT:
      continue  # reads nothing, nothing it computes reaches the outputs, or no gradient
    for i in _spared_operands(eqn, spared):
      read.pop(i, None)
    if eqn.primitive.name == 'custom_vjp_call':
      own = _custom_vjp_name(eqn)
      read = {i: name for i, name in read.items() if own != segment_function_name(name)}
      if read and not own.startswith(SEGMENT_PREFIX):
        for name in read.values():
          report(name, f'custom_vjp_call {own}')
        continue
    if not read:
      continue
    bodies = _sub_jaxprs(eqn)
    if not bodies:
      for name in read.values():
        report(name, eqn.primitive.name)
      continue
    # A loop's carry feeds its next iteration: a param handed back there is a read. A
    # scan's stacked output is the equation's (nnx.remat inside nnx.scan hands each
    # iteration's slice of the stacked params back): the param, not a read.
    carried = _carried(eqn)

    def passed(j: int, owner: str, outvars=eqn.outvars, carried=carried):
      if j < carried:
        report(owner, 'output')
      else:
        owners[outvars[j]] = owner

    for body, operands in bodies:
      offset = len(eqn.invars) - len(operands)
      inner = {b: read[offset + i] for i, b in enumerate(body.invars) if offset + i in read}
      same_outputs = len(body.outvars) == len(eqn.outvars)
      _walk_live(body, inner, _body_outputs(eqn, body, outs), spared, report,
                 passed if same_outputs else None)
  for j, (v, keep) in enumerate(zip(jaxpr.outvars, live_out)):
    if keep and isinstance(v, jex_core.Var) and v in owners:
      if handed_back is not None:
        handed_back(j, owners[v])
      else:
        report(owners[v], 'output')
