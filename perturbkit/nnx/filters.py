"""Call filters for NNX models.

The same filters as ``perturbkit.filters``, which serve both front ends: a
filter is ``(module, method_name) -> bool``, and the path filters read an NNX
module's path in the model (``('layers', 0)``, joined as ``'layers/0'``; an
item of an ``nnx.List`` attribute is at depth 2, as its params are), which it
carries only while perturbkit runs it.

Example:
  >>> from flax import nnx
  >>> from perturbkit.nnx import filters
  >>> linear_only = filters.by_type(nnx.Linear)
  >>> first_block = filters.all_of(filters.by_path('blocks/0/*'), filters.by_method('__call__'))
"""
from perturbkit.core.filters import all_calls  # noqa: F401
from perturbkit.core.filters import all_of  # noqa: F401
from perturbkit.core.filters import any_of  # noqa: F401
from perturbkit.core.filters import as_filter  # noqa: F401
from perturbkit.core.filters import by_depth  # noqa: F401
from perturbkit.core.filters import by_method  # noqa: F401
from perturbkit.core.filters import by_path  # noqa: F401
from perturbkit.core.filters import by_type  # noqa: F401
from perturbkit.core.filters import module_path  # noqa: F401
from perturbkit.core.filters import negate  # noqa: F401
from perturbkit.core.filters import path_string  # noqa: F401
from perturbkit.core.filters import top_level  # noqa: F401

__all__ = ['all_calls', 'all_of', 'any_of', 'as_filter', 'by_depth', 'by_method', 'by_path',
           'by_type', 'module_path', 'negate', 'path_string', 'top_level']
