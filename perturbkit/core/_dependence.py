"""Which inputs of a call carry the examples: those computed from the batched arguments.

Each array input of a call is read off the traced computation, never guessed from
its shape:

* ``'example'``: computed from the loss's batched arguments (``batch_axes``); its
  axis 0 must be the examples.
* ``'shared'``: computed from the variables, keyword arguments or arguments with
  ``batch_axes`` ``None`` only: the same for every example, whatever its shape.
* ``'constant'``: computed from none of the loss's inputs (``jnp.arange``, a
  closed-over array). With as many rows as examples it is ambiguous (positions
  broadcast to the batch, or a table that happens to have that many rows), and
  ``_per_example_pass`` raises :class:`AmbiguousInputError` rather than guess.
"""
from typing import Any, Callable, Sequence

from jax.extend import core as jex_core


def single_subjaxpr(eqn: jex_core.JaxprEqn) -> jex_core.Jaxpr | None:
  """The jaxpr an equation runs on its own inputs and outputs (jit, checkpoint, custom rules)."""
  inner = list(jex_core.jaxprs_in_params(eqn.params))
  if (len(inner) == 1 and len(inner[0].invars) == len(eqn.invars)
      and len(inner[0].outvars) == len(eqn.outvars)):
    return inner[0]
  return None


def depends_on(jaxpr: jex_core.Jaxpr, marked: Sequence[bool]) -> list[bool]:
  """For each output of ``jaxpr``, whether it is computed from an input marked ``True``.

  Data dependence, equation by equation. Inside a call whose sub-jaxpr lines up
  with the equation (``jit``, ``checkpoint``, ``custom_jvp``/``custom_vjp``) it is
  followed exactly; through anything else (loops, conditionals) every output of
  the equation depends on every input, which may call an input per-example that
  is not, never the other way round. Constants are not marked.
  """
  if len(marked) != len(jaxpr.invars):
    raise ValueError(f'{len(marked)} marks for {len(jaxpr.invars)} jaxpr inputs.')
  marks = dict(zip(jaxpr.invars, marked))

  def read(var) -> bool:
    return False if isinstance(var, jex_core.Literal) else marks.get(var, False)

  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    inner = single_subjaxpr(eqn) if any(ins) else None
    outs = depends_on(inner, ins) if inner is not None else [any(ins)] * len(eqn.outvars)
    marks.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def source_kinds(jaxpr: jex_core.Jaxpr, batched: Sequence[bool]) -> list[str]:
  """``'example'``, ``'shared'`` or ``'constant'`` for each output of ``jaxpr``.

  ``batched`` marks the jaxpr inputs that hold examples; every other input is shared.
  """
  from_examples = depends_on(jaxpr, batched)
  from_shared = depends_on(jaxpr, [not b for b in batched])
  return ['example' if e else 'shared' if s else 'constant'
          for e, s in zip(from_examples, from_shared)]


def needed_inputs(jaxpr: jex_core.Jaxpr, wanted: Sequence[bool]) -> list[bool]:
  """For each input of ``jaxpr``, whether an output marked in ``wanted`` is computed from it.

  The reverse of :func:`depends_on`, equation by equation from the last; through a
  nested jaxpr every input of the equation is taken to feed every output.
  """
  _, needed = _backward_slice(jaxpr, wanted)
  return [v in needed for v in jaxpr.invars]


def _backward_slice(jaxpr: jex_core.Jaxpr, wanted: Sequence[bool]
                    ) -> tuple[list[jex_core.JaxprEqn], set]:
  """The equations the outputs marked in ``wanted`` are computed by, in order, and the
  variables they read (inputs included), equation by equation from the last."""
  if len(wanted) != len(jaxpr.outvars):
    raise ValueError(f'{len(wanted)} marks for {len(jaxpr.outvars)} jaxpr outputs.')
  needed = {v for v, w in zip(jaxpr.outvars, wanted)
            if w and not isinstance(v, jex_core.Literal)}
  kept = []
  for eqn in reversed(jaxpr.eqns):
    if any(v in needed for v in eqn.outvars):
      kept.append(eqn)
      needed.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
  return kept[::-1], needed


def computation_of(closed: jex_core.ClosedJaxpr,
                   wanted: Sequence[bool]) -> Callable[..., list[Any]]:
  """``(*inputs) -> [each output marked in wanted]`` of ``closed``, from only the equations
  those outputs need.

  The rest of the jaxpr is dropped, not traced again: the transpose of an embedding
  that a tied head is given, without the forward pass of the whole model around it.
  Differentiable like any JAX function (``jax.vjp`` of it is the VJP of that part).
  """
  jaxpr = closed.jaxpr
  kept, _ = _backward_slice(jaxpr, wanted)
  pruned = jaxpr.replace(eqns=kept, outvars=[v for v, w in zip(jaxpr.outvars, wanted) if w])
  return jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(pruned, closed.consts))
