"""Ready-made call filters.

A call filter has the shape Flax uses for ``capture_intermediates``: a function
``(module, method_name) -> bool`` that says whether a submodule call gets a
perturbation point, is a segment of ``interleaved``, or gets a hook. The root
module's own call is never a point: its output is the model's output.
Ready-made: ``all_calls``, ``by_type``, ``by_path``, ``by_depth``, ``top_level``,
``by_method``, and the combinators ``all_of``, ``any_of``, ``negate``.

The same filters serve both front ends: ``perturbkit.filters`` works on NNX
modules too, and ``perturbkit.nnx.filters`` re-exports them for NNX code (an NNX
module's path reads like ``layers/0``).

Inside an interleaved segment's replay, paths are full paths with the segment's
path in front; ``perturbkit.filters.module_path(module)`` gives that full path to
a filter of your own, where ``module.path`` is relative to the segment.

Example:
  >>> import flax.linen as nn
  >>> from perturbkit import filters
  >>> dense_only = filters.by_type(nn.Dense)
  >>> shallow = filters.all_of(filters.by_depth(max_depth=2), filters.by_method('__call__'))
"""
import contextlib
import fnmatch
import threading
from typing import Iterator, Sequence

import flax.linen as nn

from perturbkit.core._callables import call_filter
from perturbkit.core._types import CallFilter
from perturbkit.core._validate import count
from perturbkit.errors import FilterError, InvalidOptionError, PathPatternError


def all_calls(module: nn.Module, method_name: str) -> bool:
  """Selects every submodule call, at every depth.

  Example:
    >>> from perturbkit import filters
    >>> filters.all_calls(None, '__call__')
    True
  """
  del module, method_name
  return True


def by_type(*types: type) -> CallFilter:
  """Selects calls on modules that are instances of any of ``types``.

  Args:
    *types: Module classes, e.g. ``nn.Dense, nn.Conv``.

  Returns:
    A call filter.

  Example:
    >>> import flax.linen as nn
    >>> from perturbkit import filters
    >>> filters.by_type(nn.Dense)(nn.Dense(3), '__call__')
    True
  """
  if not types or not all(isinstance(t, type) for t in types):
    raise FilterError('filters.by_type', 'module classes', types)
  return lambda module, method_name: isinstance(module, types)


class _LinenPrefix(threading.local):
  """The path of the Linen module being replayed as its own ``apply`` in this thread."""

  def __init__(self):
    self.path: tuple = ()


_LINEN_PREFIX = _LinenPrefix()


@contextlib.contextmanager
def linen_path_prefix(prefix: Sequence[str]) -> Iterator[None]:
  """Inside the block, a Linen module's path starts with ``prefix``.

  A segment is replayed as a fresh ``apply`` of its module, where Flax gives the
  calls inside paths relative to it; with its path as ``prefix``, filters see
  them under their paths in the whole model, as in an ordinary call.
  """
  previous = _LINEN_PREFIX.path
  _LINEN_PREFIX.path = tuple(prefix)
  try:
    yield
  finally:
    _LINEN_PREFIX.path = previous


def module_path(module) -> tuple | None:
  """The module's path: a Linen module's ``.path`` (in a segment replay, with the
  segment's path before it), or, for an NNX module, its attribute path in the
  model (``('layers', 0)``), which it carries only while perturbkit runs it
  (``None`` otherwise)."""
  path_of = getattr(type(module), '_perturbkit_path_of', None)
  if path_of is None:
    return _LINEN_PREFIX.path + tuple(module.path)
  path = path_of(module)
  return None if path is None else tuple(path)


def path_string(module) -> str | None:
  """The module's path as ``'Block_0/Dense_1'`` (the key path of its params)."""
  path = module_path(module)
  return None if path is None else '/'.join(map(str, path))


def _check_not_regex(pattern: str) -> None:
  """Raises :class:`PathPatternError` for a pattern only a regular expression would have:
  Flax and NNX module paths are names and indices joined by ``/``, never with these."""
  reasons = [why for found, why in (('\\' in pattern, 'a backslash'),
                                    (pattern.startswith('^'), '`^` first'),
                                    (pattern.endswith('$'), '`$` last'),
                                    ('|' in pattern, '`|`')) if found]
  if not reasons:
    return
  parts = []
  for part in pattern.split('|'):
    part = part.removeprefix('^').removesuffix('$')
    for regex, glob in ((r'\d+', '*'), (r'\d*', '*'), (r'\d', '[0-9]'), ('.*', '*'),
                        ('.+', '*'), (r'\.', '.'), (r'\/', '/')):
      part = part.replace(regex, glob)
    parts += [part] if part else []
  if not parts or any(c in part for part in parts for c in '\\()^$'):
    suggestion = "a shell-style pattern, e.g. 'encoder/layers/*'"
  elif len(parts) > 1:
    suggestion = f'filters.by_path({", ".join(map(repr, parts))})'
  elif pattern.endswith('$') and parts[0].endswith('*'):
    # `*` also matches `/`: the regex's end says the submodules are not wanted.
    suggestion = (f'filters.all_of(filters.by_path({parts[0]!r}), '
                  f'filters.negate(filters.by_path({parts[0] + "/*"!r}))) (`*` also matches '
                  f'`/`: the second pattern leaves out the submodules)')
  else:
    suggestion = repr(parts[0])
  raise PathPatternError(pattern, ', '.join(reasons), suggestion)


def by_path(*patterns: str) -> CallFilter:
  """Selects calls on modules whose path matches any shell-style pattern.

  The path is joined with ``/`` like the params tree, e.g. ``'Block_0/Dense_1'``;
  ``*`` matches across ``/`` too, as in ``fnmatch``.

  Args:
    *patterns: ``fnmatch`` patterns, e.g. ``'Block_*'`` or ``'*/Dense_0'``.

  Returns:
    A call filter.

  Raises:
    FilterError: a pattern is not a string.
    PathPatternError: a pattern reads as a regular expression
      (``r'layers/\\d+$'``: a backslash, ``^`` first, ``$`` last or ``|``), which no
      module path matches; the message gives the pattern to write.

  Example:
    >>> from perturbkit import filters
    >>> f = filters.by_path('encoder/*')
  """
  if not patterns or not all(isinstance(p, str) for p in patterns):
    raise FilterError('filters.by_path', 'string patterns', patterns)
  for pattern in patterns:
    _check_not_regex(pattern)

  def selected(module, method_name):
    path = path_string(module)
    return path is not None and any(fnmatch.fnmatchcase(path, p) for p in patterns)

  return selected


def by_depth(max_depth: int, min_depth: int = 1) -> CallFilter:
  """Selects calls on modules nested ``min_depth`` to ``max_depth`` levels deep.

  Direct children of the root are at depth 1.

  Args:
    max_depth: The deepest level selected.
    min_depth: The shallowest level selected (default 1).

  Returns:
    A call filter.

  Example:
    >>> from perturbkit import filters
    >>> two_levels = filters.by_depth(2)
  """
  count('max_depth', max_depth)
  count('min_depth', min_depth)
  if max_depth < min_depth:
    raise InvalidOptionError('min_depth, max_depth', (min_depth, max_depth),
                             'integers with 1 <= min_depth <= max_depth')

  def selected(module, method_name):
    path = module_path(module)
    return path is not None and min_depth <= len(path) <= max_depth

  return selected


top_level: CallFilter = by_depth(1)
top_level.__doc__ = 'Selects calls on direct children of the root module.'


def by_method(*names: str) -> CallFilter:
  """Selects calls of the named methods, e.g. ``'__call__'``.

  Example:
    >>> from perturbkit import filters
    >>> filters.by_method('__call__')(None, 'encode')
    False
  """
  if not names or not all(isinstance(name, str) for name in names):
    raise FilterError('filters.by_method', "one or more method names, e.g. by_method('__call__', "
                      "'encode')", names)
  return lambda module, method_name: method_name in names


def _filters_given(function: str, filters: tuple) -> None:
  """Raises :class:`FilterError` unless every item of ``filters`` is a call filter."""
  for item in filters:
    call_filter(item, function, 'call filters, e.g. filters.by_type(nn.Dense)')


def all_of(*filters: CallFilter) -> CallFilter:
  """Selects the calls that every filter selects.

  Example:
    >>> from perturbkit import filters
    >>> f = filters.all_of(filters.top_level, filters.by_method('__call__'))
  """
  _filters_given('filters.all_of', filters)
  return lambda module, method_name: all(f(module, method_name) for f in filters)


def any_of(*filters: CallFilter) -> CallFilter:
  """Selects the calls that any filter selects.

  Example:
    >>> import flax.linen as nn
    >>> from perturbkit import filters
    >>> f = filters.any_of(filters.by_type(nn.Dense), filters.by_type(nn.Conv))
  """
  _filters_given('filters.any_of', filters)
  return lambda module, method_name: any(f(module, method_name) for f in filters)


def negate(filter: CallFilter) -> CallFilter:
  """Selects the calls that ``filter`` does not select.

  Example:
    >>> import flax.linen as nn
    >>> from perturbkit import filters
    >>> not_dropout = filters.negate(filters.by_type(nn.Dropout))
  """
  _filters_given('filters.negate', (filter,))
  return lambda module, method_name: not filter(module, method_name)


def as_filter(filter: CallFilter | bool | Sequence[str] | None) -> CallFilter:
  """Turns the accepted spellings of a filter into a call filter.

  ``None`` or ``True`` select every call; a callable is used as it is; a list of
  strings is a list of path patterns (see :func:`by_path`).
  """
  if filter is None or filter is True:
    return all_calls
  if filter is False:
    raise InvalidOptionError('filter', False, 'None or True to select every call (False '
                             'selects nothing), a call filter, or a list of path patterns')
  if isinstance(filter, (list, tuple)) and all(isinstance(p, str) for p in filter):
    return by_path(*filter)
  return call_filter(filter, 'filter=', 'a callable (module, method_name) -> bool, True, or a '
                     'list of path patterns')
