"""The reference for activation gradients of real models: explicit deltas added by an
interceptor of the tests' own (Flax's ``nn.intercept_methods``, no perturbkit code)."""
import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp


def _is_model_call(module: nn.Module, method_name: str) -> bool:
  # Submodule method calls only: not the root, not `setup`, not Flax's internal lambda-named
  # helpers.
  return (module.scope is not None and bool(module.path) and method_name != 'setup'
          and method_name.isidentifier())


def _is_float(leaf) -> bool:
  return isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.inexact)


@contextlib.contextmanager
def explicit_deltas(deltas: dict | None = None, shapes: dict | None = None):
  """Adds ``deltas[path + (key,)][i]`` to the i-th float leaf of every submodule call's output.

  ``key`` is the method name, then ``'#1'``, ``'#2'``... for later calls of the same method of
  the same module; a call made while the same method of the same module runs
  (``super().__call__``) is part of that call and gets no delta. A submodule's own ``apply``
  inside a call (GPT-2's tied LM head, ``self.lm_head.apply(...)``) is a call of that
  submodule; the calls inside it get none. With ``shapes``, records the float leaves' shapes
  under the same names.
  """
  counts: dict = {}
  running: set = set()
  modules: list = []  # the modules whose calls (or apply) run now, innermost last
  nested = [0]  # how many submodules' own applies run now

  def run(module, next_fun, args, kwargs):
    modules.append(module)
    try:
      return next_fun(*args, **kwargs)
    finally:
      modules.pop()

  def interceptor(next_fun, args, kwargs, context):
    module, method = context.module, context.method_name
    if module.scope is not None and not module.path and method != 'setup':
      if not (modules and module.name is not None and method.isidentifier()):
        return run(module, next_fun, args, kwargs)  # the model's own apply
      path = tuple(modules[-1].path) + (module.name,)  # a submodule's own apply
      nested[0] += 1
      try:
        out = run(module, next_fun, args, kwargs)
      finally:
        nested[0] -= 1
    elif nested[0] or not _is_model_call(module, method) or (id(module), method) in running:
      return next_fun(*args, **kwargs)
    else:
      running.add((id(module), method))
      try:
        out = run(module, next_fun, args, kwargs)
      finally:
        running.discard((id(module), method))
      path = tuple(module.path)
    n = counts.get((path, method), 0)
    counts[(path, method)] = n + 1
    name = path + (method if n == 0 else f'{method}#{n}',)
    leaves, treedef = jax.tree.flatten(out)
    where = [i for i, leaf in enumerate(leaves) if _is_float(leaf)]
    if not where:
      return out
    if shapes is not None:
      shapes[name] = [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in where]
    if deltas is not None:
      for i, delta in zip(where, deltas[name]):
        leaves[i] = leaves[i] + delta
    return jax.tree.unflatten(treedef, leaves)

  with nn.intercept_methods(interceptor):
    yield


def points_of(loss_fn, *args) -> dict:
  """``{path + (key,): [ShapeDtypeStruct per float leaf]}`` of ``loss_fn(*args)``, in order."""
  shapes: dict = {}

  def run(*args):
    with explicit_deltas(shapes=shapes):
      return loss_fn(*args)

  jax.eval_shape(run, *args)
  return shapes


def zeros(shapes: dict) -> dict:
  return {name: [jnp.zeros(x.shape, x.dtype) for x in leaves] for name, leaves in shapes.items()}


def at(tree, name: tuple):
  for k in name:
    tree = tree[k]
  return tree
