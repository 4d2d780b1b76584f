"""Which Linen calls are segments: the calls of a loss, for the shared choice.

The rules (a segment's params used by its call only; the layer-wise default;
the checks of a chosen set) are framework-neutral and live in
``_segment_choice``. Linen finds the calls with ``nn.intercept_methods``; a
call inside ``nn.scan``/``nn.vmap`` sees params sliced from the stacked ones
(along their first axis: a segment per iteration), and ``segments=int`` counts
scope levels of the params tree.
"""
from typing import Any, Callable, Mapping

import jax
from flax import traverse_util

from perturbkit.core._callables import selects
from perturbkit.core._values import partition_values
from perturbkit.core import filters as _filters, _segment_choice
from perturbkit.core._consumers import reads_outside
from perturbkit.core._segment_vjp import FORWARD_ONLY
from perturbkit.core._unread import unread_owners
from perturbkit.errors import SegmentationError
from perturbkit.linen._branches import branching_transform
from perturbkit.linen._interceptor import intercept, transforms_of
from perturbkit.core._segment_choice import (CallRecord, Exactly, SegmentSpec,  # noqa: F401
                                        Segmentation, exactly, flat_leaf_owners)
from perturbkit.linen._segments import params_sliced, segmented_loss, stacked_iterations
from perturbkit.core._types import CallFilter, Path, Variables


def name_of(path: Path) -> str:
  return '/'.join(path)


def path_of(name: str) -> Path:
  return tuple(name.split('/')) if name else ()


def param_owners(params: Mapping) -> list[Path]:
  """Paths of the modules that hold params directly (not only through children)."""
  return sorted({path[:-1] for path in traverse_util.flatten_dict(params)})


def module_paths(params: Mapping, depth: int) -> list[Path]:
  """Paths of the module scopes ``depth`` levels down that hold params."""
  return sorted({path[:depth] for path in traverse_util.flatten_dict(params)
                 if len(path) > depth})


def record_calls(loss_fn: Callable[..., Any], variables: Variables, args: tuple,
                 filter: CallFilter = _filters.all_calls) -> list[CallRecord]:
  """Every submodule call of ``loss_fn``, in execution order, from an abstract run."""
  calls: list[CallRecord] = []
  params = variables['params']
  open_calls = _segment_choice.OpenCalls()

  def on_call(call, run):
    # Params a scan broadcasts to every iteration are shared by its calls like sliced
    # ones are copied: the nearest enclosing plain call takes them (the scan's own call).
    sliced = params_sliced(call, params) or 'scan' in transforms_of(call.module)
    branch = branching_transform(call.module) or ('nn.while_loop' if call.in_function else '')
    calls.append(CallRecord(call.path, sliced, selects(filter, call.module, call.method_name),
                            call.key, stacked_iterations(call, params) if sliced else 0,
                            open_calls.nested(call.path), open_calls.running(), branch))
    return open_calls.around(call.path, run)

  def traced(variables, *args):
    with intercept(_filters.all_calls, on_call):
      return loss_fn(variables, *args)

  arrays, rebuild = partition_values(args)
  jax.eval_shape(lambda v, arrays: traced(v, *rebuild(arrays)), variables, arrays)
  return calls


def outside_reads(loss_fn: Callable[..., Any], variables: Variables, args: tuple,
                  paths: list[Path], iterations: Mapping[str, int]) -> dict[str, set[str]]:
  """For each segment, the primitives that read its params outside its own call."""
  names = {p: name_of(p) for p in paths}
  # Only traced forward: the backward steps are never called.
  fn = segmented_loss(loss_fn, variables, args, names, lambda *_: FORWARD_ONLY,
                      iterations=iterations)
  carriers = {n: () for n in names.values()}
  params = variables['params']
  jaxpr = jax.make_jaxpr(lambda p: fn(p, carriers))(params)
  return reads_outside(jaxpr, flat_leaf_owners(params, list(names.values())))


def unread(loss_fn: Callable[..., Any], variables: Variables, args: tuple) -> set[Path]:
  """The modules none of whose own params ``loss_fn`` reads."""
  arrays, rebuild = partition_values(args)
  fn = lambda params, arrays: loss_fn({**variables, 'params': params}, *rebuild(arrays))
  return unread_owners(fn, variables['params'], [arrays], lambda keys: keys[:-1])


def _in_lifted_transform(name: str) -> SegmentationError:
  return SegmentationError(
      f'The segment {name!r} runs inside a lifted transform (nn.scan, nn.vmap) whose params '
      'are sliced other than along their first axis (or from a scan inside a scan), so its '
      "step cannot be taken on its slice; stack them along axis 0 (variable_axes={'params': "
      "0}), make the whole transformed module one segment (its parent), or choose other "
      'segments.')


def choose(loss_fn: Callable[..., Any], variables: Variables, args: tuple,
           spec: SegmentSpec) -> Segmentation:
  """The segments of ``loss_fn`` for ``spec`` (None: layer-wise; int: depth; filter).

  Raises:
    SegmentationError: a chosen segment runs inside ``nn.scan``/``nn.vmap``.
    NoSegmentError: nothing can be a segment (a ``SegmentationError``).
    SharedSegmentError: a chosen segment's params are used by more than its call.
  """
  params = variables['params']
  by_filter = callable(spec) and not isinstance(spec, Exactly)
  calls = record_calls(loss_fn, variables, args, spec if by_filter else _filters.all_calls)
  return _segment_choice.choose(
      spec, calls, param_owners(params),
      at_depth=lambda depth: module_paths(params, depth),
      outside_reads=lambda paths, scanned: outside_reads(loss_fn, variables, args, paths,
                                                          scanned),
      transforms=('nn.scan/nn.vmap with its params broadcast to every iteration or stacked other '
                  'than along their first axis'),
      in_transform_error=_in_lifted_transform,
      unread=lambda: unread(loss_fn, variables, args))
