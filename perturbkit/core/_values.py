"""The leaves of a function's arguments that a trace should see as they are.

``jax.grad`` hands the arguments it does not differentiate to the function as they
are: a flag (``train=True`` given positionally), a string naming a mode, a module.
perturbkit's abstract runs (``jax.eval_shape``) must do the same, or such an
argument becomes a tracer (``if train:`` fails) or is no array at all (a string):
only array leaves are traced there, every other leaf stays a constant of the trace.
"""
import functools
from typing import Any, Callable

import jax
import numpy as np


def is_array(leaf: Any) -> bool:
  """Whether a trace takes ``leaf`` as an array: a JAX array (a tracer too) or a NumPy one.
  A NumPy scalar, like a Python number, is a value."""
  return isinstance(leaf, (jax.Array, np.ndarray))


def is_typed_key(leaf: Any) -> bool:
  """Whether ``leaf`` is an array of typed PRNG keys (``jax.random.key``); a raw ``uint32``
  key cannot be told from data."""
  return is_array(leaf) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def partition_values(tree: Any, keep: Callable[[Any], bool] = lambda leaf: False,
                     ) -> tuple[list, Callable[[list], Any]]:
  """``(arrays, rebuild)``: the array leaves of ``tree`` (and the nodes ``keep`` selects, left
  whole), and ``rebuild(new_arrays)``, ``tree`` with those in their places and every other
  leaf as it was."""
  leaves, treedef = jax.tree.flatten(tree, is_leaf=keep)
  traced = [keep(leaf) or is_array(leaf) for leaf in leaves]

  def rebuild(arrays: list) -> Any:
    given = iter(arrays)
    return jax.tree.unflatten(
        treedef, [next(given) if t else leaf for leaf, t in zip(leaves, traced)])

  return [leaf for leaf, t in zip(leaves, traced) if t], rebuild


def values_closed_over(fn: Callable[..., Any], args: tuple) -> tuple[Callable[..., Any], tuple]:
  """``(fn_on_arrays, hollow_args)``: ``args`` with every leaf that is no array set to
  ``None`` (a subtree with no leaves, so each argument keeps its position), and
  ``fn_on_arrays(first, *hollow_args, **kwargs)``, which calls ``fn`` with those leaves put
  back. Code that maps or traces every leaf of the arguments then sees only arrays."""
  arrays, rebuild = partition_values(args)
  if len(arrays) == len(jax.tree.leaves(args)):
    return fn, args
  hollow = jax.tree.map(lambda leaf: leaf if is_array(leaf) else None, args)

  @functools.wraps(fn)
  def fn_on_arrays(first, *given, **kwargs):
    return fn(first, *rebuild(jax.tree.leaves(given)), **kwargs)

  return fn_on_arrays, hollow


def jax_arrays(tree: Any) -> Any:
  """``tree`` with each NumPy array, NumPy scalar or Python number leaf as a JAX array, every
  other leaf as it is: what ``jax.jit`` hands a function for these leaves.

  State restored from a checkpoint (``flax.serialization``) holds NumPy arrays where
  the state a step returns holds JAX ones, and a hyperparameter set by hand between
  steps (``state.hyperparams['learning_rate'] = 1e-4`` for
  ``optax.inject_hyperparams``) is a Python float; code that splits a state into its
  floating-point arrays must see all of these as the arrays the optimizer's update
  returns in their place (under ``jax.jit`` they are tracers already, and nothing
  changes)."""
  return jax.tree.map(
      lambda leaf: jax.numpy.asarray(leaf)
      if isinstance(leaf, (np.ndarray, np.generic, bool, int, float, complex)) else leaf,
      tree)
