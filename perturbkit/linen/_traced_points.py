"""A Linen function's selected calls as :class:`TracedPoints`, for the families to run."""
import warnings
from typing import Any, Callable

from perturbkit.core._iterations import index_entries, leaf_shapes_of, per_iteration, stackings_of
from perturbkit.core._points import PointShape
from perturbkit.core._traced_points import TracedPoints, point_name
from perturbkit.core._types import CallFilter, Variables
from perturbkit.errors import (ActivationsUnavailableError, NoPerturbationPointsError,
                               UnperturbedCallsWarning)
from perturbkit.linen._driver import check_variables, discover, nested, perturbed_apply
from perturbkit.linen._interceptor import suspended


def traced_points(fn: Callable[..., Any], variables: Variables, args: tuple, kwargs: dict, *,
                  filter: CallFilter, strict: bool, function: str,
                  split_iterations: bool = True) -> TracedPoints:
  """The calls ``fn(variables, *args, **kwargs)`` makes that ``filter`` selects.

  Args:
    fn: ``(variables, *args, **kwargs) -> anything``; it calls ``model.apply``.
    variables: The model's variables.
    args: Example positional arguments (shapes and dtypes matter).
    kwargs: Example keyword arguments.
    filter: Which calls get a point.
    strict: Whether a selected call without floating-point output is an error.
    function: The public function, for messages.
    split_iterations: A call inside ``nn.scan``/``nn.vmap`` with
      ``'perturbations'`` in ``variable_axes`` is one point per iteration
      (``'__call__[0]'``, ...; see ``core/_iterations.py``); ``False``: one
      point, its outputs and inputs stacked per iteration like its gradient.

  Returns:
    The points and a ``run`` that closes over ``variables``.

  Raises:
    NotVariablesError: ``variables`` are not Linen variables.
    WrongFrontEndError: ``variables`` is an NNX model.
    NoPerturbationPointsError: the filter selects no call.
    ActivationsUnavailableError: (from ``run``) a selected call runs inside a
      lifted transform whose values do not come out (one that carries no
      collection out); the message names ``function``.
  """
  check_variables(variables, function)
  expected: set[tuple] = set()
  lifted: set[tuple] = set()
  inside: dict[tuple, PointShape] = {}
  marked: dict[tuple, tuple[int, ...]] = {}
  jitted: set[tuple] = set()
  with suspended():
    unperturbed: list[str] = []
    applied: list[str] = []  # calls of an apply nested in a call, on variables given to it
    found, seen = discover(fn, variables, args, kwargs, filter=filter, strict=strict,
                           point_paths=expected, lifted=lifted, inside=inside, marked=marked,
                           unreachable=unperturbed, nested_applies=True, jitted=jitted,
                           in_nested_applies=applied)
  if unperturbed:
    warnings.warn(UnperturbedCallsWarning(unperturbed), stacklevel=2)
  if applied:
    warnings.warn(UnperturbedCallsWarning(applied, nested_apply=True), stacklevel=2)
  if not expected:
    raise NoPerturbationPointsError(seen, lifted=unperturbed)
  first = {name: i for i, name in reversed(list(enumerate(seen)))}
  paths = tuple(sorted(expected, key=lambda p: first.get(point_name(p), len(seen))))
  shapes: dict[tuple, PointShape] = {p: found[p] for p in paths}
  stackings = stackings_of({p: leaf_shapes_of(inside[p]) for p in paths if p in inside}, found,
                           marked)
  indices = index_entries(stackings) if split_iterations else {}

  def run(perturbations, args, kwargs, edit=None, reads=True):
    tree = nested({**{p: perturbations[p] if p in perturbations else shape.zeros()
                      for p, shape in found.items()}, **indices})
    with suspended():
      try:
        out, captured = perturbed_apply(fn, variables, tree, args, kwargs, points=filter,
                                        strict=strict, expected=expected, edit=edit,
                                        activations=True, inputs=True, reads=reads, lifted=lifted,
                                        per_iteration=bool(stackings), nested_applies=True,
                                        jitted=bool(jitted))
      except ActivationsUnavailableError as error:
        raise type(error)(error.where, function) from None
    if not reads:
      return out, {}, {}
    return out, captured['activations'], captured['inputs']

  return per_iteration(paths, shapes, stackings if split_iterations else {}, run)
