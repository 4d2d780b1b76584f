"""Nested-dict lookups by path, for the trees perturbkit keys by module path."""
from typing import Any


def get_in(tree: Any, path: tuple) -> Any:
  """``tree[path[0]][path[1]]...``; a missing key raises ``KeyError``."""
  for name in path:
    tree = tree[name]
  return tree


def find_in(tree: Any, path: tuple) -> Any:
  """The subtree at ``path``, or ``None`` where there is none."""
  for name in path:
    if not isinstance(tree, dict) or name not in tree:
      return None
    tree = tree[name]
  return tree
