"""Who reads a parameter: the equations of a jaxpr that consume each input.

The interleaved schedule updates a segment's params inside the backward pass,
with the gradient that flows back through the segment's own call. A param read
anywhere else (a tied LM head reading the embedding matrix, an L2 term on the
weights) would be missing from that step, so every such read must be found.
Each segment call is one named ``custom_vjp_call`` equation; any other
equation that takes the param as an operand is a read outside the segment.
Calls to nested jaxprs (``jit``, ``remat``, ``scan``, ``cond``, ...) are
followed into their bodies.
"""
from typing import Any, Callable

from jax.extend import core as jex_core

SEGMENT_PREFIX = 'perturbkit_segment:'


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


def reads_outside(jaxpr: Any, owner_of: dict[int, str]) -> dict[str, set[str]]:
  """The equations reading each segment's params outside its own call.

  Args:
    jaxpr: A (closed) jaxpr whose inputs include the params.
    owner_of: Maps an input position of ``jaxpr`` to the name of the segment
      owning that param leaf.

  Returns:
    ``{segment name: {primitive names}}`` for each segment read elsewhere; a
    param returned directly as an output counts as a read (``'output'``).
  """
  jaxpr = getattr(jaxpr, 'jaxpr', jaxpr)
  found: dict[str, set[str]] = {}
  owners = {jaxpr.invars[i]: name for i, name in owner_of.items()}
  _walk(jaxpr, owners, lambda name, what: found.setdefault(name, set()).add(what))
  return found


def _walk(jaxpr, owners: dict, report: Callable[[str, str], None]):
  for eqn in jaxpr.eqns:
    read = {owners[v] for v in eqn.invars if isinstance(v, jex_core.Var) and v in owners}
    if not read:
      continue
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
