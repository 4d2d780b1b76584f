"""Interventions: run the unmodified model with edits at selected calls."""
from typing import Any, Callable, Mapping

from perturbkit.core._naming import named_after
from perturbkit.interpret._edits import edit_function
from perturbkit.interpret._points import Tracer, check_given, trace


def run_with_edits(tracer: Tracer, fn: Callable[..., Any], *, filter: Any,
                   function: str) -> Callable[..., Any]:
  """The front-end-neutral :func:`perturbkit.run_with_edits` (``tracer`` picks the API)."""
  check_given(fn, filter, function)

  @named_after(fn)
  def edited(model, edits: Mapping[Any, Any], *args, **kwargs):
    traced = trace(tracer, fn, model, args, kwargs, filter, function)
    out, _, _ = traced.run({}, args, kwargs, edit_function(edits, traced.paths), reads=False)
    return out

  return edited
