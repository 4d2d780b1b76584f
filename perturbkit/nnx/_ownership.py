"""Which module owns each trained NNX variable: the one at its path in the model's state.

One ``nnx.Variable`` may sit in several modules (``self.head.w = self.embed.embedding``,
``self.b.kernel = self.a.kernel``). ``nnx.state(model, wrt)`` lists it once, at
the first path the graph traversal meets; the module at that path owns it. In
any other module holding it, it is a read of another module's param, as a tied
head without params of its own reads the embedding. ``wrt`` is evaluated with
those model-level paths, as ``nnx.Optimizer`` evaluates it:
``nnx.PathContains('head')`` selects the head's params, which the head's own
state would list as ``('kernel',)``.

A module's variables are then of three kinds: those it owns (its segment's
params, its per-example gradients), the trained variables other modules own
(the reads of their params), and the rest (batch statistics, RNG streams,
variables not trained).
"""
from typing import Any, NamedTuple

from flax import nnx

from perturbkit.nnx._calls import NNXPath


class Ownership(NamedTuple):
  """The trained variables of a model, where the model's state lists them.

  Attributes:
    paths: The model-level path of each trained variable.
    variables: The ``id`` of each trained ``nnx.Variable`` object of the model
      the ownership was taken from (a copy an NNX transform makes inside the
      model has other objects: there, only ``paths`` is known).
  """
  paths: frozenset[NNXPath]
  variables: frozenset[int]


def ownership(model: nnx.Module, wrt: Any) -> Ownership:
  """The ``wrt`` variables of ``model``, as ``nnx.state(model, wrt)`` lists them."""
  flat = nnx.to_flat_state(nnx.state(model, wrt))
  return Ownership(frozenset(tuple(path) for path, _ in flat),
                   frozenset(id(var) for _, var in flat))


def owned_state(module: nnx.Module, prefix: NNXPath, owners: Ownership) -> nnx.State:
  """The variables the module at model path ``prefix`` owns (its children's included),
  keyed by their paths in the module (as ``nnx.state(module)``)."""
  return split_owned(module, prefix, owners)[0]


def split_owned(module: nnx.Module, prefix: NNXPath,
                owners: Ownership) -> tuple[nnx.State, nnx.State, nnx.State]:
  """``(owned, foreign, rest)``: the module's state split by who owns each variable.

  Args:
    module: The module at ``prefix`` (or a copy an NNX transform made of it).
    prefix: Its path in the model ``owners`` was taken from.
    owners: See :func:`ownership`.

  Returns:
    Three ``nnx.State`` s keyed by paths in the module: the trained variables
    whose model-level path lies under ``prefix``; the trained variables other
    modules own (known by object, so none for a copy); everything else.
  """
  owned, foreign, rest = [], [], []
  for path, var in nnx.to_flat_state(nnx.state(module)):
    if prefix + tuple(path) in owners.paths:
      owned.append((path, var))
    elif id(var) in owners.variables:
      foreign.append((path, var))
    else:
      rest.append((path, var))
  return tuple(nnx.from_flat_state(part) for part in (owned, foreign, rest))


def unowned_state(module: nnx.Module, prefix: NNXPath, owners: Ownership) -> nnx.State:
  """The module's variables it does not own: other modules' params it reads, and the rest."""
  _, foreign, rest = split_owned(module, prefix, owners)
  return nnx.from_flat_state(list(nnx.to_flat_state(foreign)) + list(nnx.to_flat_state(rest)))


def reads_foreign(module: nnx.Module, prefix: NNXPath, owners: Ownership) -> bool:
  """Whether the module holds trained variables another module owns."""
  return bool(list(nnx.to_flat_state(split_owned(module, prefix, owners)[1])))
