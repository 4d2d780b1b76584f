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
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
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
  variables = jax.eval_shape(model.init, jax.random.key(2), inputs)  # only traced below
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
  variables = jax.jit(model.init)(jax.random.key(2), inputs)
  loss_fn = _loss(model)

  @jax.jit  # one compile for both sides
  def run(variables, inputs):
    return (perturbkit.per_example_grad_norms(loss_fn)(variables, inputs),
            _norms_of_vmap_grad(loss_fn, variables, inputs), loss_fn(variables, inputs))

  (loss, norms), want, want_loss = run(variables, inputs)
  np.testing.assert_allclose(norms.total, want, rtol=2e-4, atol=1e-5)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)


class _NormedEncoder(nn.Module):
  """A Dense applied with a weight-normalized kernel made from params of its own (Hugging
  Face Wav2Vec2's positional convolution): a nested apply."""

  @nn.compact
  def __call__(self, h):
    direction = self.param('direction', nn.initializers.normal(1.0), (6, 6))
    scale = self.param('scale', nn.initializers.ones, (6,))
    kernel = direction * (scale / jnp.linalg.norm(direction, axis=0))[None, :]
    return h + nn.Dense(6, name='normed').apply({'params': {'kernel': kernel, 'bias': scale}},
                                                jnp.tanh(h))


class _TiedDecoder(nn.Module):
  """An embedding and its tied output head (GPT-2's LM head): a nested apply."""

  def setup(self):
    self.embed = nn.Embed(7, 6)
    self.head = nn.Dense(7, use_bias=False)

  def __call__(self, ids, h):
    h = jnp.tanh(self.embed(ids).mean(axis=1) + h)
    return self.head.apply({'params': {'kernel': self.embed.variables['params']['embedding'].T}},
                           h)


class TwoNestedApplies(nn.Module):
  """Two nested applies in one call of the model, in two submodules (Hugging Face's speech
  encoder-decoder: a Wav2Vec2 encoder and a GPT-2 decoder)."""

  @nn.compact
  def __call__(self, ids):
    h = _NormedEncoder()(nn.Embed(7, 6)(ids).mean(axis=1))
    return _TiedDecoder()(ids, h)


def _norms_of_vmap_grad(loss_fn, variables, inputs):
  """Each example's gradient norm, by ``jax.vmap(jax.grad)`` of the loss of it alone."""
  def one(example):
    grads = jax.grad(lambda p: loss_fn({'params': p}, example[None]))(variables['params'])
    return jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads)))
  return jax.vmap(one)(inputs)


@pytest.mark.parametrize('applies', [1, 2], ids=['one_apply', 'the_loss_applies_twice'])
def test_every_nested_apply_counts_after_the_first(applies):
  """Each nested apply (and each of the loss's own applies) after the first is a read too: the
  tied head's part of the embedding's gradient, which per-example norms built from the
  embedding's own calls would miss."""
  model = TwoNestedApplies()
  variables = jax.jit(model.init)(jax.random.key(2), IDS)

  def loss_fn(variables, ids):
    out = jnp.mean(model.apply(variables, ids) ** 2)
    return out + jnp.mean(jnp.tanh(model.apply(variables, ids[:, ::-1]))) if applies == 2 else out

  (_, norms), want = jax.jit(lambda v, ids: (  # one compile for both sides
      perturbkit.per_example_grad_norms(loss_fn)(v, ids), _norms_of_vmap_grad(loss_fn, v, ids)))(
          variables, IDS)
  np.testing.assert_allclose(norms.total, want, rtol=2e-4, atol=1e-5)


class TiedLM(nn.Module):
  """A language model whose output head is its embedding, tied in one of three ways.

  ``'nested'``: a Dense layer applied on the transposed embedding (GPT-2's LM head);
  ``'stored_transposed'``: Hugging Face's ``FlaxConv1D`` (kernel stored ``(out, in)``)
  applied on the embedding itself; ``'attend'``: ``embed.attend``.
  """
  head: str
  vocab: int = 7
  width: int = 8

  def setup(self):
    self.embed = nn.Embed(self.vocab, self.width)
    self.body = nn.Dense(self.width)

  def __call__(self, ids):
    h = nn.tanh(self.body(self.embed(ids)))
    embedding = self.embed.variables['params']['embedding']
    if self.head == 'attend':
      return self.embed.attend(h)
    if self.head == 'nested':
      return nn.Dense(self.vocab, use_bias=False, parent=None).apply({'params': {'kernel': embedding.T}}, h)
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxConv1D
    return FlaxConv1D(self.vocab, use_bias=False, parent=None).apply({'params': {'kernel': embedding}}, h)


def _lm_loss(model):
  def loss_fn(variables, ids):
    logits = model.apply(variables, ids)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()
  return loss_fn


def _per_example_reference(loss_fn, variables, ids):
  """Each example's gradient by ``jax.vmap(jax.grad)``, and its norm."""
  @jax.jit
  def reference(variables, ids):
    grads = jax.vmap(lambda i: jax.grad(lambda p: loss_fn({'params': p}, i[None]))(
        variables['params']))(ids)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(len(ids), -1) ** 2, axis=1)
                         for g in jax.tree.leaves(grads)))
    return grads, norms
  return reference(variables, ids)


@functools.cache
def _tied_lm_problem(head):
  """``TiedLM(head)``'s variables, batch, loss and :func:`_per_example_reference` (computed
  once per head, for every dense method)."""
  # Six tokens out of seven ids: repeated ids, so the cross terms between the lookups and
  # the head (and between lookups) are all exercised.
  ids = jax.random.randint(jax.random.key(4), (4, 6), 0, 7)
  model = TiedLM(head)
  variables = jax.jit(model.init)(jax.random.key(5), ids)
  loss_fn = _lm_loss(model)
  return variables, ids, loss_fn, _per_example_reference(loss_fn, variables, ids)


@pytest.mark.parametrize('dense_method', ['auto', 'ghost', 'direct'])
@pytest.mark.parametrize('head', ['nested', 'stored_transposed', 'attend'])
def test_tied_heads_give_the_norms_and_clipped_sum_of_vmap_grad(head, dense_method):
  variables, ids, loss_fn, (grads, norms) = _tied_lm_problem(head)
  clip_norm = float(jnp.median(norms))  # half the examples clipped
  private = perturbkit.private_grad(loss_fn, clip_norm=clip_norm, noise_multiplier=0.0,
                                    dense_method=dense_method)
  norms_fn = perturbkit.per_example_grad_norms(loss_fn, dense_method=dense_method)
  # The norms and the clipped sum in one compile.
  (_, got), (got_sum, metrics) = jax.jit(lambda v, key, ids: (
      norms_fn(v, ids), private(v, key, ids)))(variables, jax.random.key(6), ids)
  np.testing.assert_allclose(got.total, norms, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got.by_layer['embed'], jnp.sqrt(jnp.sum(
      grads['embed']['embedding'] ** 2, axis=(1, 2))), rtol=1e-5, atol=1e-6)

  factors = jnp.minimum(1.0, clip_norm / norms)
  want = jax.tree.map(lambda g: jnp.tensordot(factors, g, axes=1) / len(ids), grads)
  chex.assert_trees_all_close(got_sum, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics['per_example_norms'], norms, rtol=1e-5, atol=1e-6)


def test_tied_head_norms_never_form_per_example_embedding_gradients():
  # A vocabulary large next to the tokens: the per-example embedding gradients
  # (examples x vocabulary x features) are the largest arrays the direct path has.
  ids = jax.random.randint(jax.random.key(4), (8, 4), 0, 2048)
  model = TiedLM('nested', vocab=2048, width=64)
  variables = jax.jit(model.init)(jax.random.key(5), ids)
  per_example_bytes = 8 * 2048 * 64 * 4

  def temp_bytes(dense_method):
    norms = perturbkit.per_example_grad_norms(_lm_loss(model), dense_method=dense_method)
    compiled = jax.jit(norms).lower(variables, ids).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp_bytes('direct') >= per_example_bytes  # formed in full
  assert temp_bytes('auto') < per_example_bytes / 4


class UntiedTwin(nn.Module):
  """``NestedTied`` with a head of its own, called as a submodule: no nested apply."""

  def setup(self):
    self.embed = nn.Embed(7, 6)
    self.body = nn.Dense(6)
    self.head = nn.Dense(7, use_bias=False)

  def __call__(self, ids):
    return self.head(self.body(self.embed(ids)).mean(axis=1))


def test_a_tied_heads_params_cost_no_trace_of_the_loss():
  """The params a tied head is given (the transposed embedding), and their VJP back to the
  embedding, are read off the loss's traced computation: the loss is traced as many times
  as for the same model with an untied head. (One more, a whole forward pass, when they
  were computed by running the loss again.)"""
  traces = {}
  for name, model in (('tied', NestedTied()), ('untied', UntiedTwin())):
    variables = jax.eval_shape(model.init, jax.random.key(2), IDS)  # only traced below
    count = [0]

    def loss_fn(variables, ids, model=model, count=count):
      count[0] += 1
      return jnp.mean(model.apply(variables, ids) ** 2)

    jax.jit(perturbkit.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=1.0)).trace(
        variables, jax.random.key(3), IDS)
    traces[name] = count[0]
  assert traces['tied'] == traces['untied'] > 0, traces


class _Penalized(nn.Module):
  """A model with a penalty of its own on its first layer, computed on a param, no example."""

  def setup(self):
    self.first, self.second = nn.Dense(4), nn.Dense(2)
    self.probe = self.param('probe', nn.initializers.normal(1.0), (1, 4))

  def __call__(self, x):
    return self.second(jnp.tanh(self.first(x)))

  def penalty(self):
    return jnp.sum(self.first(self.probe) ** 2)


def test_a_penalty_the_model_computes_on_no_example_is_refused_with_the_way_out():
  """The penalty's call of ``first`` sees no example: its gradient belongs to none of them."""
  model = _Penalized()
  variables = jax.eval_shape(model.init, jax.random.key(2), X)  # only traced below

  def loss_fn(variables, x):
    penalty = model.apply(variables, method='penalty')
    return jnp.mean(jnp.sum(model.apply(variables, x) ** 2, axis=1)) + 0.1 * penalty

  with pytest.raises(perturbkit.SharedCallError, match='belongs to no example'):
    jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn), variables, X)
