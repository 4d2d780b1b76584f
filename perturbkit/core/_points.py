"""Perturbation points: the zero arrays added to a call's output.

A point holds one zero array per floating-point leaf of the output; integer,
boolean and ``None`` leaves pass through untouched. The arrays live in the
``'perturbations'`` collection at the module's path, under the call's point key,
and are added with Flax's own ``Module.perturb``.
"""
from typing import Any, Callable, Mapping, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from perturbkit.core._values import is_array
from perturbkit.core._varying import vary, varying_axes
from perturbkit.errors import NonDifferentiableOutputError, PerturbationStructureError

COLLECTION = 'perturbations'


def is_inexact_array(leaf: Any) -> bool:
  return isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.inexact)


def differentiable_part(tree: Any, keep: Callable[[Any], bool] = is_inexact_array) -> Any:
  """The floating-point leaves of ``tree`` (those ``keep`` accepts), as a point holds them.

  Plain containers (tuple, list, dict) keep their shape, with ``None`` in place
  of every leaf that is not a floating-point array. A user's own pytree node (a
  ``flax.struct`` or frozen dataclass, a Hugging Face ``ModelOutput``) is never
  rebuilt with anything but arrays: it is kept as it is when every leaf is a
  floating-point array, and otherwise replaced by the tuple of its
  floating-point leaves (``None`` if it has none), in ``jax.tree.leaves`` order.
  """
  if keep(tree):
    return tree
  if type(tree) in (tuple, list):
    return type(tree)(differentiable_part(t, keep) for t in tree)
  if type(tree) in (dict, flax.core.FrozenDict):
    return type(tree)({k: differentiable_part(v, keep) for k, v in tree.items()})
  leaves = jax.tree.leaves(tree)
  if leaves and all(keep(leaf) for leaf in leaves):
    return tree
  return tuple(leaf for leaf in leaves if keep(leaf)) or None


def array_part(tree: Any) -> Any:
  """The array leaves of ``tree`` (a call's ``(args, kwargs)``), laid out as
  ``differentiable_part`` does: every leaf that is not an array (a Python flag,
  ``None``, a module) becomes ``None``."""
  return differentiable_part(tree, keep=is_array)


def has_differentiable_leaf(tree: Any) -> bool:
  """Whether ``tree`` has at least one floating-point array leaf."""
  return any(is_inexact_array(leaf) for leaf in jax.tree.leaves(tree))


def merge(tree: Any, part: Any) -> Any:
  """Puts the leaves of ``part`` (from ``differentiable_part``) back into ``tree``.

  Works on flat leaves: ``tree``'s own node types are rebuilt with arrays only.
  """
  leaves, treedef = jax.tree.flatten(tree)
  replacements = iter(jax.tree.leaves(part))
  return jax.tree.unflatten(
      treedef, [next(replacements) if is_inexact_array(leaf) else leaf for leaf in leaves])


def shapes_of(tree: Any) -> list[tuple[tuple[int, ...], Any]]:
  """``(shape, dtype)`` of each leaf, in ``jax.tree.leaves`` order."""
  return [(tuple(jnp.shape(leaf)), jnp.result_type(leaf)) for leaf in jax.tree.leaves(tree)]


def leaf_shapes(tree: Any) -> list[tuple[int, ...]]:
  """The shape of each leaf, in ``jax.tree.leaves`` order."""
  return [tuple(jnp.shape(leaf)) for leaf in jax.tree.leaves(tree)]


def stacked_axis(inside: tuple[int, ...], outside: tuple[int, ...]
                 ) -> tuple[int, tuple[int, ...]] | None:
  """``(axis, sizes)`` where ``outside`` is ``inside`` with the axes ``sizes`` inserted at
  ``axis``, else ``None``.

  A point made inside ``nn.scan``/``nnx.scan`` over stacked modules has the
  call's shape there (``inside``) and, outside, one value per iteration
  stacked along the scan axis (``outside``): ``sizes`` is ``(iterations,)``.
  Inside a scan inside a scan, each mapping the perturbations along axis 0,
  it is stacked along two leading axes, ``(outer, inner)`` iterations.
  """
  extra = len(outside) - len(inside)
  if extra == 1:
    for axis in range(len(outside)):
      if outside[:axis] + outside[axis + 1:] == inside:
        return axis, (outside[axis],)
  elif extra > 1 and tuple(outside[extra:]) == tuple(inside):
    return 0, tuple(outside[:extra])
  return None


def with_stacked_axis(shapes: list[tuple[int, ...]], stacking: tuple[int, tuple[int, ...]]
                      ) -> list[tuple[int, ...]]:
  """``shapes`` with the ``(axis, sizes)`` of :func:`stacked_axis` inserted in each."""
  axis, sizes = stacking
  return [tuple(shape[:axis]) + tuple(sizes) + tuple(shape[axis:]) for shape in shapes]


def leaf_dtypes(tree: Any) -> list[str]:
  return [str(getattr(leaf, 'dtype', type(leaf).__name__)) for leaf in jax.tree.leaves(tree)]


def transform_name(part: Any) -> str:
  """The lifted transform one part of a Linen scope's debug path names, ``''`` for none.

  Flax names each lifted transform in the debug path of the scopes it makes
  (``'cond(Block_0)'``, ``'switch()'``, ``'remat(scan(layers))'``:
  ``flax.core.lift.pack``'s ``name``); this is the outermost one of the part.
  """
  text = str(part)
  return text.split('(', 1)[0] if '(' in text else ''


def inside_lifted_transform(module: nn.Module) -> bool:
  """Whether the call runs inside a lifted transform (``nn.remat``, ``nn.scan``, ...).

  Flax binds a transformed module's body directly to a scope rather than to a
  parent module; the root (and ``wrap``'s inner module) is the only other
  module bound that way, at the empty path. A transform of a function of the
  root (``nn.cond(pred, f, g, self, x)`` in the root's method) binds a copy of
  the root at the empty path too, to a scope whose debug path names the
  transform (``'cond()'``).
  """
  while isinstance(module.parent, nn.Module):
    module = module.parent
  if module.path and module.scope is not None and not any(
      transform_name(part) for part in module.scope.debug_path):
    # A child of a root that is gone (`model.bind(v).encoder(x)`: Flax holds the parent
    # weakly), bound to a scope no transform made.
    return False
  return bool(module.path) or bool(module.scope is not None and module.scope.debug_path)


def collection_visible(module: nn.Module) -> bool:
  """Whether a perturbation added in ``module`` reaches the caller's collection.

  Inside a lifted transform (``nn.scan``, ``nn.vmap``) that does not map the
  ``'perturbations'`` collection, a variable created there would be dropped;
  this is the test Flax's ``perturb`` itself uses. Inside ``nn.while_loop``
  every iteration would read the same perturbation (one point summing the
  iterations' gradients), so none is added there.
  """
  if any(transform_name(part) == 'while_loop' for part in module.scope.debug_path):
    return False
  if module.is_mutable_collection(COLLECTION):
    return True
  return COLLECTION in module.scope.root._variables  # pylint: disable=protected-access


def _check_matches(module: nn.Module, key: str, part: Any, where: str):
  if not module.has_variable(COLLECTION, key):
    raise PerturbationStructureError(f'there is no perturbation for the call {where}')
  given = module.get_variable(COLLECTION, key)
  if jax.tree.structure(given) != jax.tree.structure(part):
    raise PerturbationStructureError(
        f'the perturbation for {where} has {len(jax.tree.leaves(given))} leaves in another '
        f'structure than the call\'s {len(jax.tree.leaves(part))} floating-point leaves')
  got, want = shapes_of(given), shapes_of(part)
  if got != want:
    first = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    raise PerturbationStructureError(
        f'leaf {first} of the perturbation for {where} has shape/dtype {got[first]}, the '
        f'call output {want[first]}')


def add_perturbation(module: nn.Module, key: str, output: Any, where: str,
                     *, strict: bool, reachable: bool = True) -> tuple[Any, bool]:
  """Adds the point's perturbation to ``output`` (creating zeros when initializing).

  Args:
    module: The bound module that made the call.
    key: The call's point key.
    output: The call's output.
    where: The call's name, for messages.
    strict: Raise if the output has no floating-point leaf (otherwise skip it).
    reachable: ``False`` where no point can be made whatever the collection (a
      Linen call inside ``nn.map_variables`` with writable mapped collections,
      ``Call.mapped``): ``output`` is returned as it is.

  Returns:
    ``(output plus the perturbation, True)``; ``(output, False)`` when the
    collection is absent (a plain ``apply``) or the call has nothing to perturb.

  Raises:
    NonDifferentiableOutputError: ``strict`` and no floating-point leaf.
    PerturbationStructureError: the collection is there but does not fit.
  """
  if not reachable:
    return output, False
  if not has_differentiable_leaf(output):
    if strict:
      raise NonDifferentiableOutputError(where, leaf_dtypes(output))
    return output, False
  if not collection_visible(module):
    return output, False
  part = differentiable_part(output)
  if not module.is_mutable_collection(COLLECTION):
    _check_matches(module, key, part, where)
  elif module.has_variable(COLLECTION, key):
    # A collection passed in and made mutable holds every mapping as a dict (a Hugging
    # Face ModelOutput among them), which Flax's perturb would add to the call's own node.
    value = in_structure_of(module.get_variable(COLLECTION, key), part)
    return merge(output, jax.tree.map(jnp.add, part, value)), True
  return merge(output, module.perturb(key, part)), True


def in_structure_of(value: Any, like: Any) -> Any:
  """``value`` in ``like``'s tree structure, each leaf looked up by its key path in ``value``.

  For a value Flax rebuilt with plain dicts where ``like`` has other mapping nodes
  (a dataclass that is a ``Mapping``, an ``OrderedDict``); as it is when the
  structures already agree.
  """
  if jax.tree.structure(value) == jax.tree.structure(like):
    return value
  flat, treedef = jax.tree_util.tree_flatten_with_path(like)
  leaves = []
  for path, _ in flat:
    node = value
    for entry in path:
      if isinstance(entry, jax.tree_util.DictKey):
        node = node[entry.key]
      elif isinstance(entry, jax.tree_util.SequenceKey):
        node = node[entry.idx]
      elif isinstance(entry, jax.tree_util.GetAttrKey):
        node = node[entry.name] if isinstance(node, Mapping) else getattr(node, entry.name)
      else:
        raise PerturbationStructureError(
            f'cannot read the perturbation at {jax.tree_util.keystr(path)}')
    leaves.append(node)
  return jax.tree.unflatten(treedef, leaves)


class PointShape(NamedTuple):
  """What a point holds, without its values: a treedef, each leaf's shape/dtype and the
  mesh axes each leaf varies over inside ``jax.shard_map`` (none elsewhere)."""
  treedef: Any
  leaves: tuple[jax.ShapeDtypeStruct, ...]
  varying: tuple[frozenset[str], ...] = ()

  @classmethod
  def of(cls, value: Any) -> 'PointShape':
    leaves, treedef = jax.tree.flatten(value)
    return cls(treedef, tuple(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
                              for x in leaves), tuple(map(varying_axes, leaves)))

  def zeros(self) -> Any:
    """Zeros of this shape, made inside the trace (rebuilt from arrays only), varying over
    the devices as the leaves do (see :mod:`perturbkit.core._varying`)."""
    varying = self.varying or (frozenset(),) * len(self.leaves)
    return jax.tree.unflatten(self.treedef, [vary(jnp.zeros(s.shape, s.dtype), v)
                                             for s, v in zip(self.leaves, varying)])

def point_key(method_name: str, index: int) -> str:
  """The point key of the ``index``-th call of ``method_name`` (0-based)."""
  return method_name if index == 0 else f'{method_name}#{index}'


def raise_counts(counts: dict, others: dict) -> None:
  """Each of the call ``counts`` at least as high as in ``others`` (both front ends count on
  past every branch of a conditional this way)."""
  for k, n in others.items():
    counts[k] = max(counts.get(k, 0), n)
