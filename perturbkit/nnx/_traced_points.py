"""An NNX function's selected calls as :class:`TracedPoints`, for the families to run."""
from typing import Any, Callable

import jax
from flax import nnx

from perturbkit.core._iterations import index_entries, per_iteration, stackings_of
from perturbkit.core._points import PointShape
from perturbkit.core._traced_points import TracedPoints
from perturbkit.core._trees import get_in
from perturbkit.core._types import CallFilter
from perturbkit.errors import ActivationsUnavailableError, NoPerturbationPointsError
from perturbkit.nnx._driver import check_module, discover, perturbed_call, warn_unperturbed


def traced_points(fn: Callable[..., Any], model: nnx.Module, args: tuple, kwargs: dict, *,
                  filter: CallFilter, strict: bool, function: str,
                  split_iterations: bool = True) -> TracedPoints:
  """The calls ``fn(model, *args, **kwargs)`` makes that ``filter`` selects.

  ``run`` works on a copy of the model merged inside its own trace (split once
  here), so it is a pure function that ``jax.vmap``, ``jax.grad`` and
  ``jax.lax.map`` can take; changes of the model's state in it (batch
  statistics, RNG counts) are dropped, and the caller's model is never touched.

  Args:
    fn: ``(model, *args, **kwargs) -> anything``.
    model: The NNX model.
    args: Example positional arguments (shapes and dtypes matter).
    kwargs: Example keyword arguments.
    filter: Which calls get a point.
    strict: Whether a selected call without floating-point output is an error.
    function: The public function, for messages.
    split_iterations: A call inside ``nnx.scan``/``nnx.vmap`` that maps the
      perturbations is one point per iteration (``'__call__[0]'``, ...; see
      ``core/_iterations.py``); ``False``: one point, its outputs and inputs
      stacked per iteration like its gradient.

  Returns:
    The points and a ``run`` that closes over the model's state.

  Raises:
    WrongFrontEndError: ``model`` is a Linen module or Linen variables.
    NoPerturbationPointsError: the filter selects no call.
    ActivationsUnavailableError: (from ``run``) a selected call runs inside
      an NNX transform its values cannot leave (``nnx.vmap`` with the module's
      state broadcast); the message names ``function``.
  """
  check_module(model, function)
  found = discover(fn, model, args, kwargs, points=filter, strict=strict, scalar=False)
  warn_unperturbed(found, stacklevel=4)
  if not found.points:
    raise NoPerturbationPointsError(found.seen, nnx=True, copies=found.copies)
  paths = tuple(p.path + (p.key,) for p in found.points)
  # From the abstract values discovery found (their devices' varying axes too).
  shapes = {path: PointShape.of(jax.tree.unflatten(p.structure,
                                                   [found.shapes[q] for q in p.leaf_paths()]))
            for path, p in zip(paths, found.points)}
  hand_placed = [PointShape.of(found.shapes[p]) for p in found.hand_placed]
  stackings = stackings_of({path: p.shapes for path, p in zip(paths, found.points)}, shapes,
                           found.marked)
  indices = index_entries(stackings) if split_iterations else {}
  graphdef, state = nnx.split(model)

  def run(perturbations, args, kwargs, edit=None, reads=True):
    flat = []
    for path in paths:
      value = perturbations[path] if path in perturbations else shapes[path].zeros()
      flat += jax.tree.leaves(value)
    flat += [shape.zeros() for shape in hand_placed]
    try:
      # A copy: Variables merged from the closed-over state belong to no trace, and a
      # module that updates its own state (BatchNorm in training mode) could not write them.
      model = nnx.merge(graphdef, state, copy=True)
      out, captured = perturbed_call(fn, model, flat, args, kwargs, found=found, points=filter,
                                     edit=edit, activations=True, inputs=True, reads=reads,
                                     per_iteration=bool(stackings), iterations=indices)
    except ActivationsUnavailableError as error:
      raise type(error)(error.where, function) from None
    if not reads:
      return out, {}, {}
    return (out, {p: get_in(captured['activations'], p) for p in paths},
            {p: get_in(captured['inputs'], p) for p in paths})

  return per_iteration(paths, shapes, stackings if split_iterations else {}, run)
