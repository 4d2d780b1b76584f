"""Params read outside their module's calls: covered by a replay, or refused by name.

A read of a layer's params anywhere but its own calls (inline, by another module)
adds a part of the gradient that per-example gradients built call by call would
miss. Inside the model's ``apply`` it is covered by a per-example replay of that
``apply``; outside it (a weight penalty or an inline product in the loss) it raises
``ParamsReadOutsideError`` naming the layer and the reading primitive. Shared
modules, methods such as ``attend``, nested applies on tied weights and reads inside
the ``apply`` must all give the norms of ``jax.vmap(jax.grad)``, as must a read under
``jax.lax.stop_gradient`` (it adds nothing to the gradient).
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import perturbkit


class InlineTied(nn.Module):
  """The output layer is the embedding matrix, read inline in the root's ``__call__``."""

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(7, 6)
    h = nn.Dense(6)(embed(ids)).mean(axis=1)
    return h @ embed.variables['params']['embedding'].T


class NestedTied(nn.Module):
  """The output layer is a nested apply on the transposed embedding (GPT-2's LM head)."""
  inline_too: bool = False

  def setup(self):
    self.embed = nn.Embed(7, 6)
    self.body = nn.Dense(6)
    self.head = nn.Dense(7, use_bias=False)

  def __call__(self, ids):
    h = self.body(self.embed(ids)).mean(axis=1)
    kernel = self.embed.variables['params']['embedding'].T
    out = self.head.apply({'params': {'kernel': kernel}}, h)
    return out + h @ kernel if self.inline_too else out


class Reuse(nn.Module):
  """A Dense kernel multiplied by hand a second time, outside its module."""

  @nn.compact
  def __call__(self, x):
    first = nn.Dense(5)
    h = nn.tanh(first(x))
    return nn.Dense(2)(h @ first.variables['params']['kernel'].T)


class StoppedReuse(nn.Module):
  """``Reuse`` with the second use under ``stop_gradient``: no gradient, so not a read."""
  transpose_first: bool = False

  @nn.compact
  def __call__(self, x):
    first = nn.Dense(5)
    h = nn.tanh(first(x))
    kernel = first.variables['params']['kernel']
    stopped = (jax.lax.stop_gradient(kernel.T) if self.transpose_first
               else jax.lax.stop_gradient(kernel).T)
    return nn.Dense(2)(h @ stopped)


class Shared(nn.Module):
  """One Dense called twice, a module with its own param and a child, an Embed's attend."""

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(7, 4)
    dense = nn.Dense(4)
    h = dense(nn.tanh(dense(embed(ids))))
    h = h * nn.DenseGeneral(4)(h) + Scaled()(h)
    return embed.attend(h.mean(axis=1))


class Scaled(nn.Module):
  @nn.compact
  def __call__(self, h):
    return nn.Dense(4)(h) * self.param('scale', nn.initializers.normal(1.0), (4,))[None, None]


IDS = jax.random.randint(jax.random.key(0), (3, 4), 0, 7)
X = jax.random.normal(jax.random.key(1), (3, 4))


def _loss(model, penalty=None):
  def loss_fn(variables, inputs):
    loss = jnp.mean(model.apply(variables, inputs) ** 2)
    return loss if penalty is None else loss + penalty(variables['params'])
  return loss_fn


@pytest.mark.parametrize('model, inputs, penalty, layer, primitive', [
    (Reuse(), X, lambda p: 1e-3 * jnp.sum(p['Dense_1']['kernel'] ** 2), 'Dense_1',
     'integer_pow'),
    (InlineTied(), IDS, lambda p: jnp.sum(p['Dense_0']['kernel'] @ p['Embed_0']['embedding'].T),
     'Embed_0', 'transpose'),
], ids=['weight_penalty', 'inline_in_the_loss'])
def test_reads_outside_the_apply_are_refused(model, inputs, penalty, layer, primitive):
  variables = model.init(jax.random.key(2), inputs)
  loss_fn = _loss(model, penalty)
  match = f'{layer} \\(read by [a-z_, ]*{primitive}'
  with pytest.raises(perturbkit.ParamsReadOutsideError, match=match):
    jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn), variables, inputs)
  with pytest.raises(perturbkit.ParamsReadOutsideError, match='penalty outside'):
    jax.eval_shape(perturbkit.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=1.0),
                   variables, jax.random.key(3), inputs)


@pytest.mark.parametrize('model, inputs', [
    (NestedTied(), IDS), (Shared(), IDS), (StoppedReuse(), X),
    (StoppedReuse(transpose_first=True), X), (InlineTied(), IDS), (Reuse(), X),
    (NestedTied(inline_too=True), IDS)],
    ids=['nested_tied_head', 'shared_attend_child', 'stop_gradient', 'transpose_stop_gradient',
         'inline_tied', 'reused_kernel', 'nested_and_inline'])
def test_covered_reads_give_the_norms_of_vmap_grad(model, inputs):
  variables = model.init(jax.random.key(2), inputs)
  loss_fn = _loss(model)
  loss, norms = jax.jit(perturbkit.per_example_grad_norms(loss_fn))(variables, inputs)

  def one(example):
    grads = jax.grad(lambda p: loss_fn({'params': p}, example[None]))(variables['params'])
    return jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads)))

  np.testing.assert_allclose(norms.total, jax.vmap(one)(inputs), rtol=2e-4, atol=1e-5)
  np.testing.assert_allclose(loss, loss_fn(variables, inputs), rtol=1e-5)
