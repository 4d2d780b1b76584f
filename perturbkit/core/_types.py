"""Type aliases shared by perturbkit's modules."""
from typing import Any, Callable, Mapping

import flax.linen as nn

PyTree = Any
Variables = Mapping[str, PyTree]
Perturbations = PyTree
CallFilter = Callable[[nn.Module, str], bool]
Path = tuple[str, ...]
