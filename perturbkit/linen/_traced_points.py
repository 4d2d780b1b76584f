"""A Linen function's selected calls as :class:`TracedPoints`, for the families to run."""
from typing import Any, Callable

from perturbkit.core._points import PointShape
from perturbkit.core._traced_points import PointEdit, TracedPoints, point_name
from perturbkit.core._types import CallFilter, Variables
from perturbkit.errors import ActivationsUnavailableError, NoPerturbationPointsError
from perturbkit.linen._driver import check_variables, discover, nested, perturbed_apply
from perturbkit.linen._interceptor import suspended


def traced_points(fn: Callable[..., Any], variables: Variables, args: tuple, kwargs: dict, *,
                  filter: CallFilter, strict: bool, function: str) -> TracedPoints:
  """The calls ``fn(variables, *args, **kwargs)`` makes that ``filter`` selects.

  Args:
    fn: ``(variables, *args, **kwargs) -> anything``; it calls ``model.apply``.
    variables: The model's variables.
    args: Example positional arguments (shapes and dtypes matter).
    kwargs: Example keyword arguments.
    filter: Which calls get a point.
    strict: Whether a selected call without floating-point output is an error.
    function: The public function, for messages.

  Returns:
    The points and a ``run`` that closes over ``variables``.

  Raises:
    NotVariablesError: ``variables`` are not Linen variables.
    WrongFrontEndError: ``variables`` is an NNX model.
    NoPerturbationPointsError: the filter selects no call.
    ActivationsUnavailableError: (from ``run``) a selected call runs inside a
      lifted transform, where its output does not exist outside; the message
      names ``function``.
  """
  check_variables(variables, function)
  expected: set[tuple] = set()
  lifted: set[tuple] = set()
  with suspended():
    found, seen = discover(fn, variables, args, kwargs, filter=filter, strict=strict,
                           point_paths=expected, lifted=lifted)
  if not expected:
    raise NoPerturbationPointsError(seen)
  first = {name: i for i, name in reversed(list(enumerate(seen)))}
  paths = tuple(sorted(expected, key=lambda p: first.get(point_name(p), len(seen))))
  shapes: dict[tuple, PointShape] = {p: found[p] for p in paths}

  def run(perturbations, args, kwargs, edit: PointEdit | None = None):
    tree = nested({p: perturbations[p] if p in perturbations else shape.zeros()
                   for p, shape in found.items()})
    with suspended():
      try:
        out, captured = perturbed_apply(fn, variables, tree, args, kwargs, points=filter,
                                        strict=strict, expected=expected, edit=edit,
                                        activations=True, inputs=True, lifted=lifted)
      except ActivationsUnavailableError as error:
        raise ActivationsUnavailableError(error.where, function) from None
    return out, captured['activations'], captured['inputs']

  return TracedPoints(paths, shapes, run)
