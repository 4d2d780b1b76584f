"""A function's selected calls, and a pure way to run it with their points open.

Each front end turns ``fn(variables or model, *args)`` into a :class:`TracedPoints`:
the point path and shape of every selected call, found by an abstract run, and
``run(perturbations, args, kwargs, edit)``, which runs ``fn`` with the given
perturbations added at the points (zeros where none is given) and each call's
output edited first, and returns the output with every selected call's output and
inputs. ``run`` is a pure function of its arguments, so families build on it with
``jax.grad``, ``jax.vmap`` and ``jax.lax.map`` without knowing which Flax API made
the model.
"""
from typing import Any, Callable, NamedTuple

from perturbkit.core._points import PointShape

# ``(point path, the floating-point part of a call's output) -> that part edited``.
PointEdit = Callable[[tuple, Any], Any]
# ``(perturbations by point path, args, kwargs, edit or None, reads=True) ->
#   (output, {point path: call output}, {point path: call (args, kwargs)})``.
PointsRun = Callable[..., tuple[Any, dict[tuple, Any], dict[tuple, Any]]]


class TracedPoints(NamedTuple):
  """The selected calls of one traced function and how to run it with their points open.

  Attributes:
    paths: Each selected call's point path (module path, then the point key), in
      call order.
    shapes: ``{point path: PointShape}``: what each point holds.
    run: ``(perturbations, args, kwargs, edit, reads=True) -> (output, outputs,
      inputs)``; the outputs are each call's own output, before its edit and
      perturbation, and the inputs its ``(args, kwargs)`` (array leaves), both
      flat by point path. With ``reads=False`` both are empty: a run that only
      edits then works where ``fn`` applies a JAX transform (``jax.jit``,
      ``jax.vmap``) around the model itself, whose values could not be read
      (``CaptureInJaxTransformError``).
  """
  paths: tuple[tuple, ...]
  shapes: dict[tuple, PointShape]
  run: PointsRun


def point_name(path: tuple) -> str:
  """``'Dense_0/__call__'``, ``'layers/0/__call__'``: a point path as one string."""
  return '/'.join(map(str, path))
