"""Call filters: which submodule calls get a point, are a segment or get a hook.

A filter is ``(module, method_name) -> bool``, the shape Flax uses for
``capture_intermediates``. The same filters serve Linen and NNX models
(``perturbkit.nnx.filters`` holds the same names); see ``help`` of each one.
``from perturbkit import filters`` and ``from perturbkit.filters import by_path``
both work.

Example:
  >>> import flax.linen as nn
  >>> from perturbkit.filters import all_of, by_depth, by_method, by_type
  >>> dense_only = by_type(nn.Dense)
  >>> shallow = all_of(by_depth(max_depth=2), by_method('__call__'))
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
