"""One use of a module at run time, and its call rebuilt as a function of the module's params.

A :class:`Pair` is what per-example methods run on: the call's inputs next to the
loss's gradient at its output, whose row ``i`` times the pass's scale
(``_pass.Pass.scale``) is d(loss term of example i)/d(output). ``weighted_grad`` gives ``sum_i w_i * grad_i`` of the
module's params with one VJP of the rebuilt call (the clipped sum of DP-SGD);
``per_example_grads`` vmaps that VJP over examples (the general path).
"""
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from perturbkit.core._values import is_array, is_typed_key
from perturbkit.core._varying import vary_like
from perturbkit.per_example._calls import Use, float_part
from perturbkit.errors import RandomCallError


class Pair(NamedTuple):
  """A use with its arrays.

  Attributes:
    use: What was recorded while tracing.
    args: The call's positional arguments.
    kwargs: The call's keyword arguments.
    grad: The loss's gradient at the call's floating-point outputs (``None``
      where an output leaf is not floating-point); row ``i`` is example ``i``'s,
      up to the pass's scale.
    variables: The module's other variables (Linen: its other collections,
      ``batch_stats``, ...; NNX: its state other than ``nnx.Param``), given to
      ``use.replay``.
  """
  use: Use
  args: tuple
  kwargs: dict
  grad: Any
  variables: dict


def call_output(pair: Pair, params: Any, args: tuple | None = None,
                kwargs: dict | None = None) -> Any:
  """The floating-point outputs of the use, replayed with ``params`` (the module's subtree).

  Raises:
    RandomCallError: the call draws random numbers: a typed PRNG key among its
      arguments, or (from the front end's replay) an RNG stream of the model
      (the replay cannot reproduce the batched forward pass's draws). (A raw
      ``uint32`` key cannot be told from data; a call drawing from one is
      replayed with the same key and a batch of one, which draws other numbers.)
  """
  args = pair.args if args is None else args
  kwargs = pair.kwargs if kwargs is None else kwargs
  where = '/'.join(pair.use.path + (pair.use.key,))
  if any(is_typed_key(leaf) for leaf in jax.tree.leaves((args, kwargs))):
    raise RandomCallError(where, 'it is given a PRNG key')
  return float_part(pair.use.replay(params, pair.variables, args, kwargs))


def _cotangent(out: jax.Array, grad_i: jax.Array) -> jax.Array:
  """One example's gradient of an output, for the output of that example's replay.

  An output whose shape depends on the number of examples other than along
  its first axis (CLIP's ``(examples, examples)`` similarities) is replayed
  for one example with another shape. No gradient flows through it: the
  examples would mix there, which ``find_uses`` refuses
  (``ExamplesMixedError``); its cotangent is zero.
  """
  if jnp.shape(grad_i[None]) == jnp.shape(out):
    return grad_i[None]
  return jnp.zeros_like(out)


def _scaled(tree: Any, weights: jax.Array) -> Any:
  def scale(t):
    return (t * weights.reshape((-1,) + (1,) * (t.ndim - 1)).astype(t.dtype))
  return jax.tree.map(scale, tree)


def weighted_grad(pair: Pair, params: Any, weights: jax.Array) -> Any:
  """``sum_i weights[i] * d(term_i)/d(params)`` through this use, by one VJP."""
  _, vjp = jax.vjp(lambda p: call_output(pair, p), params)
  return vjp(_scaled(pair.grad, weights))[0]


def per_example_grads(pair: Pair, params: Any, num_examples: int) -> Any:
  """Each example's gradient of the module's params through this use, leading axis examples.

  The call is replayed on one example at a time (a batch of one, vmapped), so the
  transient memory is one layer's gradient per example. The array inputs
  computed from the batched arguments (``Use.sources``, from the traced loss) are
  split along axis 0; the others are passed whole to every example.

  Inside ``jax.shard_map`` with ``check_vma=True`` the examples vary over the
  devices and replicated params do not, so JAX's reverse mode would sum each
  example's gradient with those of the other devices' examples at its position.
  The replay therefore differentiates a copy of the params typed to vary like the
  examples: each device gets its own examples' gradients, as the rules give them.
  """
  arrays_in = [x for x in jax.tree.leaves((pair.args, pair.kwargs, pair.grad))
               if isinstance(x, jax.Array)]  # what can vary over devices
  params = jax.tree.map(lambda p: vary_like(p, *arrays_in), params)
  leaves, treedef = jax.tree.flatten((pair.args, pair.kwargs))
  # NumPy inputs too (a batch as the data pipeline gives it): the trace that recorded
  # ``sources`` took them as arrays.
  arrays = [i for i, x in enumerate(leaves) if is_array(x)]
  batched = [kind == 'example' for kind in pair.use.sources]
  if len(batched) != len(arrays):
    raise ValueError(f'{len(arrays)} array inputs, {len(batched)} recorded: '
                     f'{"/".join(pair.use.path + (pair.use.key,))}')

  def one(arrays_i, grad_i):
    full = list(leaves)
    for i, x, b in zip(arrays, arrays_i, batched):
      full[i] = x[None] if b else x
    args, kwargs = jax.tree.unflatten(treedef, full)
    out, vjp = jax.vjp(lambda p: call_output(pair, p, args, kwargs), params)
    return vjp(jax.tree.map(_cotangent, out, grad_i))[0]

  in_axes = ([0 if b else None for b in batched], 0)
  return jax.vmap(one, in_axes=in_axes)([leaves[i] for i in arrays], pair.grad)
