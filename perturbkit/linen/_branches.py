"""Calls inside the branches of ``nn.cond``/``nn.switch``."""
import flax.linen as nn

from perturbkit.core._points import COLLECTION, transform_name
from perturbkit.errors import BranchesUnseparatedError
from perturbkit.linen._interceptor import Call


def branching_transform(module: nn.Module) -> str | None:
  """``'nn.cond'`` or ``'nn.switch'`` where ``module`` runs in a branch of one, else ``None``
  (the first of them its scope's debug path names)."""
  for part in module.scope.debug_path:
    if (name := transform_name(part)) in ('cond', 'switch'):
      return f'nn.{name}'
  return None


def check_branch_point(call: Call):
  """Raises unless a selected call in a branch makes its point where none was made before.

  Each branch starts from the variables its transform was given, so while the
  points are made (``init``, discovery) the point of a call in a branch exists
  already only where a call of an earlier transform got the same key: two
  transforms in a row that the interceptor took for one (``run_function``).

  Raises:
    BranchesUnseparatedError: the point exists already.
  """
  branching = branching_transform(call.module)
  if branching and call.module.has_variable(COLLECTION, call.key):
    raise BranchesUnseparatedError(branching, [call.name])
