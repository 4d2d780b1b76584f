"""Per-example gradient norms of calls that return a user's own pytree node: a
``flax.struct`` dataclass, as Hugging Face's Flax model outputs are.

The gradient reaching such an output flows into the per-example gradients of the module
that made it, whether that module's call is replayed by itself (a module owning a param
directly) or the whole ``apply`` is (the root owning one). The reference is ``jax.vmap``
of ``jax.grad`` on one example.
"""
import flax
import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import perturbkit


@flax.struct.dataclass
class Output:
  hidden: jax.Array
  activated: jax.Array
  steps: jax.Array  # an integer leaf: no gradient flows into it


def _output(h):
  return Output(hidden=h, activated=jnp.tanh(h), steps=jnp.arange(h.shape[0]))


class Encoder(nn.Module):
  """Returns an ``Output``; with ``own_param``, owns a param directly (its call is then
  replayed by itself)."""
  own_param: bool

  @nn.compact
  def __call__(self, x):
    if self.own_param:
      x = x * self.param('gain', nn.initializers.normal(1.0), (1, x.shape[-1]))
    return _output(nn.Dense(4)(x))


class Model(nn.Module):
  root_param: bool  # the root owns a param: the whole apply is replayed
  encoder_param: bool

  @nn.compact
  def __call__(self, x):
    if self.root_param:
      x = x * self.param('scale', nn.initializers.constant(1.5), (1, x.shape[-1]))
    out = Encoder(self.encoder_param)(x)
    return _output(nn.Dense(3)(out.activated + out.hidden))


@pytest.mark.parametrize('root_param, encoder_param', [(False, True), (True, False), (True, True)],
                         ids=['module_replayed', 'apply_replayed', 'both'])
def test_norms_through_dataclass_outputs_equal_vmap_grad(root_param, encoder_param):
  model = Model(root_param, encoder_param)
  x = jax.random.normal(jax.random.key(0), (3, 5))
  variables = model.init(jax.random.key(1), x)

  def loss_fn(variables, x):
    return jnp.mean(jnp.sum(model.apply(variables, x).activated ** 2, axis=1))

  _, norms = jax.jit(perturbkit.per_example_grad_norms(loss_fn))(variables, x)
  want = jax.vmap(lambda e: optax.tree.norm(jax.grad(loss_fn)(variables, e[None])))(x)
  np.testing.assert_allclose(norms.total, want, rtol=1e-5)


class Pairwise(nn.Module):
  """Embeddings and their similarities between examples (CLIP's ``logits_per_text``); the root
  owns a param, so the whole apply is replayed, one example at a time."""

  @nn.compact
  def __call__(self, x):
    e = nn.Dense(4)(x) * self.param('scale', nn.initializers.constant(1.5), ())
    return e, e @ e.T


def test_an_output_pairing_the_examples_that_the_loss_leaves_aside():
  """Replayed for one example, the ``(examples, examples)`` output has another shape; no
  gradient flows through it. A loss that uses it mixes the examples: a named error."""
  model = Pairwise()
  x = jax.random.normal(jax.random.key(0), (3, 5))
  variables = model.init(jax.random.key(1), x)
  per_example = lambda v, x: jnp.mean(jnp.sum(jnp.tanh(model.apply(v, x)[0]) ** 2, axis=1))
  _, norms = jax.jit(perturbkit.per_example_grad_norms(per_example))(variables, x)
  want = jax.vmap(lambda e: optax.tree.norm(jax.grad(per_example)(variables, e[None])))(x)
  np.testing.assert_allclose(norms.total, want, rtol=1e-5)
  contrastive = lambda v, x: jnp.mean(jax.nn.log_softmax(model.apply(v, x)[1]).diagonal())
  with pytest.raises(perturbkit.ExamplesMixedError):
    perturbkit.per_example_grad_norms(contrastive)(variables, x)


class _NnxEncoder(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.gain = nnx.Param(jax.random.normal(rngs.params(), (1, 5)))
    self.linear = nnx.Linear(5, 4, rngs=rngs)

  def __call__(self, x):
    return _output(self.linear(x * self.gain))


class _NnxModel(nnx.Module):
  """The NNX twin: a module owning a param returns an ``Output``, and so does the root."""

  def __init__(self, rngs: nnx.Rngs):
    self.encoder = _NnxEncoder(rngs)
    self.head = nnx.Linear(4, 3, rngs=rngs)
    self.scale = nnx.Param(jnp.full((1, 5), 1.5))

  def __call__(self, x):
    out = self.encoder(x * self.scale)
    return _output(self.head(out.activated + out.hidden))


def test_nnx_norms_through_dataclass_outputs_equal_nnx_grad():
  model, x = _NnxModel(nnx.Rngs(0)), jax.random.normal(jax.random.key(0), (3, 5))
  loss_fn = lambda m, x: jnp.mean(jnp.sum(m(x).activated ** 2, axis=1))
  _, norms = perturbkit.nnx.per_example_grad_norms(loss_fn)(model, x)
  want = [optax.tree.norm(nnx.grad(loss_fn)(model, x[i:i + 1])) for i in range(len(x))]
  # XLA's CPU tanh is an approximation whose rounding differs between a batch and one
  # example by up to about 2e-5 here (the float64 norms lie between the two).
  np.testing.assert_allclose(norms.total, want, rtol=5e-5)
