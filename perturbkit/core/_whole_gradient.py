"""Optax transformations that look at the whole gradient at once.

An interleaved step hands each segment's optimizer that segment's gradient alone,
before the gradients below it exist, so such a transformation acts on one
segment at a time: ``optax.clip_by_global_norm`` clips each segment by its own
norm. Optax builds transformations as closures; the ones it is made of are found
by the names of the functions in those closures.
"""
import functools
import inspect
from typing import Any, Iterator

import optax

# The optax functions whose update reads the norm of the whole gradient (or update).
WHOLE_GRADIENT = ('clip_by_global_norm', 'normalize_by_update_norm')


def _functions(obj: Any, seen: set[int], depth: int = 0) -> Iterator[Any]:
  if depth > 12 or id(obj) in seen:
    return
  seen.add(id(obj))
  if isinstance(obj, optax.GradientTransformation):
    yield from _functions(obj.update, seen, depth + 1)
  elif isinstance(obj, (tuple, list)):
    for item in obj:
      yield from _functions(item, seen, depth + 1)
  elif isinstance(obj, dict):
    for item in obj.values():
      yield from _functions(item, seen, depth + 1)
  elif isinstance(obj, functools.partial):
    yield from _functions(obj.func, seen, depth + 1)
  elif inspect.isfunction(obj):
    yield obj
    for cell in obj.__closure__ or ():
      try:
        contents = cell.cell_contents
      except ValueError:  # a cell not filled yet
        continue
      yield from _functions(contents, seen, depth + 1)


def whole_gradient_transforms(tx: optax.GradientTransformation) -> list[str]:
  """The names (``'optax.clip_by_global_norm'``) of the whole-gradient transformations
  ``tx`` is made of, in the order found."""
  names = []
  for function in _functions(tx, set()):
    if function.__module__.split('.')[0] != 'optax':
      continue
    name = function.__qualname__.split('.<locals>')[0]
    if name in WHOLE_GRADIENT and f'optax.{name}' not in names:
      names.append(f'optax.{name}')
  return names
