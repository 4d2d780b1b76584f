"""Call filters for NNX models.

The same vocabulary as ``perturbkit.filters``: a filter is ``(module,
method_name) -> bool``. The type, method and combinator filters work for both
front ends and are re-exported here; the path filters read the module's path in
the model (``('layers', 0)``, joined as ``'layers/0'``), which an NNX module
only carries while perturbkit runs it.

Example:
  >>> from flax import nnx
  >>> from perturbkit.nnx import filters
  >>> linear_only = filters.by_type(nnx.Linear)
  >>> first_block = filters.all_of(filters.by_path('blocks/0/*'), filters.by_method('__call__'))
"""
import fnmatch
from typing import Any

from perturbkit._filters import all_calls, all_of, any_of, by_method, by_type, negate
from perturbkit._nnx_calls import path_of
from perturbkit._types import CallFilter

__all__ = ['all_calls', 'all_of', 'any_of', 'as_filter', 'by_depth', 'by_method', 'by_path',
           'by_type', 'negate', 'path_string', 'top_level']


def path_string(module: Any) -> str | None:
  """The path of an NNX module in the model being run, as ``'layers/0'``.

  ``None`` outside a perturbkit call (the module carries no path then).
  """
  path = path_of(module)
  return None if path is None else '/'.join(map(str, path))


def by_path(*patterns: str) -> CallFilter:
  """Selects calls on modules whose path matches any shell-style pattern.

  The path is the module's attribute path joined with ``/``, list indices
  included: ``'blocks/0/linear'``. ``*`` matches across ``/`` too, as in
  ``fnmatch``.

  Args:
    *patterns: ``fnmatch`` patterns, e.g. ``'blocks/*'`` or ``'*/linear'``.

  Returns:
    A call filter.

  Example:
    >>> from perturbkit.nnx import filters
    >>> encoder_calls = filters.by_path('encoder/*')
  """
  if not patterns or not all(isinstance(p, str) for p in patterns):
    raise TypeError(f'by_path takes string patterns, got {patterns!r}.')

  def selected(module, method_name):
    path = path_string(module)
    return path is not None and any(fnmatch.fnmatchcase(path, p) for p in patterns)

  return selected


def by_depth(max_depth: int, min_depth: int = 1) -> CallFilter:
  """Selects calls on modules nested ``min_depth`` to ``max_depth`` path parts deep.

  Direct attributes of the model are at depth 1; an item of an ``nnx.List``
  attribute (``('layers', 0)``) is at depth 2, as its params are.

  Args:
    max_depth: The deepest level selected.
    min_depth: The shallowest level selected (default 1).

  Returns:
    A call filter.

  Example:
    >>> from perturbkit.nnx import filters
    >>> two_levels = filters.by_depth(2)
  """
  if min_depth < 1 or max_depth < min_depth:
    raise ValueError(f'Need 1 <= min_depth <= max_depth, got {min_depth}, {max_depth}.')

  def selected(module, method_name):
    path = path_of(module)
    return path is not None and min_depth <= len(path) <= max_depth

  return selected


top_level: CallFilter = by_depth(1)
top_level.__doc__ = 'Selects calls on direct attributes of the model.'


def as_filter(filter: CallFilter | bool | list[str] | tuple[str, ...] | None) -> CallFilter:
  """Turns the accepted spellings of a filter into a call filter.

  ``None`` or ``True`` select every call; a callable is used as it is; a list of
  strings is a list of NNX path patterns (see :func:`by_path`).

  Example:
    >>> from perturbkit.nnx import filters
    >>> filters.as_filter(None) is filters.all_calls
    True
  """
  if filter is None or filter is True:
    return all_calls
  if filter is False:
    raise ValueError('filter=False selects nothing; pass None or True to select every call.')
  if callable(filter):
    return filter
  if isinstance(filter, (list, tuple)) and all(isinstance(p, str) for p in filter):
    return by_path(*filter)
  raise TypeError(
      f'A filter is a callable (module, method_name) -> bool, True, or a list of path '
      f'patterns; got {filter!r}.')
