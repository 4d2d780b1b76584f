"""Params read outside their module's call through a nested ``apply``: tied output layers.

Hugging Face's tied LM heads (GPT-2, and others with ``tie_word_embeddings``) read the
embedding matrix inside the root module and run another module on it::

    kernel = self.transformer.variables['params']['wte']['embedding'].T
    logits = self.lm_head.apply({'params': {'kernel': kernel}}, hidden)

The nested ``apply`` is not a call of the module owning the embedding, so the
embedding's per-example gradient would miss the head's part. Such a nested
``apply`` is a *read*: its call is replayed per example like any other call
(the general path, on its inputs and output gradient), giving each example's
gradient of the params it was given; those are pulled back to the variables
they were computed from (a transpose here) by the VJP of that computation, the
same for every example, and added to the per-example gradients of the owning
module's own uses before the norm. Per-example gradients of a module with reads
are therefore formed in full (``examples × params`` of that module).

A nested ``apply`` made inside a call of the module whose params it is given (a
weight-normalized layer running ``self.inner.apply`` on ``v / ‖v‖``, as Wav2Vec2's
positional conv does) is not a read for that module: the replay of its call already
carries the nested apply's gradient.

The top-level ``apply`` of the loss is a read of the same kind (its params pulled back
by the identity) for the modules called inside lifted transforms (``nn.remat``,
``nn.scan``), whose inputs do not exist outside the transform: it covers every use and
nested apply of those modules inside it, at the cost of a per-example replay of the
whole ``apply`` (as ``jax.vmap(jax.grad)``), computed once for all of them.
"""
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from perturbkit.per_example._replay import Pair, per_example_grads
from perturbkit.per_example._rules import Head
from perturbkit.core._types import Path

READS = '__perturbkit_reads__'  # the key of the reads' zero perturbations in ``params``


class Read(NamedTuple):
  """One nested or top-level ``apply`` inside the loss, at run time.

  Attributes:
    pair: Its call: the unbound root module, its inputs and the per-example output gradient.
    params: The params the ``apply`` was given (computed from the variables).
    pullback: ``cotangent of params -> cotangent of the model's params``: the VJP of
      the computation of ``params`` from the variables, the same for every example.
    grads: ``() -> each example's gradient of the model's params through this apply``
      (leading axis examples), computed once however many modules read it.
  """
  pair: Pair
  params: Any
  pullback: Callable[[Any], Any]
  grads: Callable[[], Any]


def read_of(pair: Pair, params: Any, pullback: Callable[[Any], Any],
            num_examples: int) -> Read:
  """The :class:`Read` of a replayed ``apply`` given ``params``."""
  @functools.cache
  def grads():
    return jax.vmap(pullback)(per_example_grads(pair, params, num_examples))

  return Read(pair, params, pullback, grads)


def at_path(tree: Any, path: Path) -> Any:
  for name in path:
    tree = tree[name]
  return tree


def grads_with_reads(path: Path, pairs: list[Pair], params: Any, direct: dict,
                     reads: list[Read], num_examples: int) -> dict[str, jax.Array]:
  """Each example's gradient of the module's own params: its uses plus its reads.

  Returns ``{param name: (examples, *shape)}``.
  """
  total = {k: jnp.zeros((num_examples,) + v.shape, v.dtype) for k, v in direct.items()}
  for p in pairs:
    grads = per_example_grads(p, params, num_examples)
    total = {k: total[k] + grads[k] for k in total}
  for read in reads:
    own = at_path(read.grads(), path)
    total = {k: total[k] + own[k].astype(total[k].dtype) for k in total}
  return total


def _key(entry: Any) -> Any:
  return getattr(entry, 'key', getattr(entry, 'name', getattr(entry, 'idx', entry)))


def _leaf_paths(tree: Any) -> list[tuple]:
  return [tuple(_key(e) for e in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def tied_head(read: Read, path: Path, direct: dict) -> Head | None:
  """The read as a :class:`Head` of the embedding at ``path``, or ``None`` if it is not one.

  It is one when the read is a plain call of a Dense layer whose kernel is the
  module's ``embedding`` transposed (``nn.Dense``: ``kernel = embedding.T``; a
  kernel stored ``(out, in)`` like ``FlaxConv1D``: the embedding itself), so that
  the module's gradient through it is ``Gᵀ H``. Read off the VJP of the params'
  computation as a jaxpr: the embedding's cotangent must be the kernel's,
  transposed by one ``transpose`` or passed as it is, and nothing else.
  """
  pair = read.pair
  if (set(direct) != {'embedding'} or pair.use.kind.name != 'dense'
      or pair.use.method_name != '__call__' or len(pair.args) != 1 or pair.kwargs
      or not isinstance(pair.grad, jax.Array) or not isinstance(read.params, dict)
      or jnp.ndim(read.params.get('kernel')) != 2 or jnp.ndim(direct['embedding']) != 2):
    return None
  closed, out_shape = jax.make_jaxpr(read.pullback, return_shape=True)(read.params)
  jaxpr = closed.jaxpr
  inputs, outputs = _leaf_paths(read.params), _leaf_paths(out_shape)
  if ('kernel',) not in inputs or path + ('embedding',) not in outputs:
    return None
  kernel = jaxpr.invars[inputs.index(('kernel',))]
  embedding = jaxpr.outvars[outputs.index(path + ('embedding',))]
  if pair.use.kind.transposed:
    return Head(pair.args[0], pair.grad) if embedding is kernel else None
  producers = [e for e in jaxpr.eqns if any(v is embedding for v in e.outvars)]
  if (len(producers) == 1 and producers[0].primitive.name == 'transpose'
      and tuple(producers[0].params['permutation']) == (1, 0)
      and producers[0].invars[0] is kernel):
    return Head(pair.args[0], pair.grad)
  return None
