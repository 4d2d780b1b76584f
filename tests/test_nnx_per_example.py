"""perturbkit.nnx's per-example norms and DP-SGD against ``jax.vmap`` of ``nnx.grad``,
against the Linen twins of the same weights, and against optax on the reference.

The reference splits the model, and a vmapped function merges it and takes
``nnx.grad`` of the loss of one example alone (a batch of one): it shares nothing
with perturbkit's rules (ghost norms, patches, replayed calls) or its NNX pass.
"""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_models as M
import perturbkit
from perturbkit.errors import (ExamplesMixedError, ParamsReadOutsideError,
                               ReductionMismatchError, WrongFrontEndError)

TOL = dict(rtol=2e-4, atol=1e-5)


def _strings(tree):
  """Nested dicts with string keys (``nnx.List`` items' integer keys as strings)."""
  if isinstance(tree, dict):
    return {str(k): _strings(v) for k, v in tree.items()}
  return tree


def reference_grads(loss_fn, model, *args):
  """Each example's ``nnx.Param`` gradient (leading axis examples), as nested dicts."""
  graphdef, state = nnx.split(model)

  def one(state, *example):
    alone = nnx.merge(graphdef, state)
    grads = nnx.grad(lambda m: loss_fn(m, *[a[None] for a in example]))(alone)
    return nnx.to_pure_dict(grads)

  return jax.jit(jax.vmap(one, in_axes=(None,) + (0,) * len(args)))(state, *args)


@jax.jit  # one compile per tree instead of one op-by-op compile per leaf shape
def norms_of(per_example):
  sq = jax.tree.map(lambda g: jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1), per_example)
  return jax.tree.map(jnp.sqrt, sq), jnp.sqrt(sum(jax.tree.leaves(sq)))


def assert_norms_equal(norms, per_example):
  """By param, in total, and each layer's from its own params."""
  by_param, total = norms_of(per_example)
  chex.assert_trees_all_close(norms.by_param, by_param, **TOL)
  np.testing.assert_allclose(norms.total, total, **TOL)
  for name, layer in norms.by_layer.items():
    keys = [k for k in name.split('/') if k]  # '': the root module's own params
    node = functools.reduce(lambda t, k: t[k] if k in t else t[int(k)], keys, by_param)
    own = [v for v in node.values() if not isinstance(v, dict)]
    np.testing.assert_allclose(layer, jnp.sqrt(sum(v ** 2 for v in own)), **TOL)
  assert float(jnp.min(total)) > 1e-3


def squared_error(model, x, reduction='mean'):
  out = model(x)
  terms = jnp.sum(jnp.sin(out) ** 2, axis=tuple(range(1, out.ndim)))
  return terms.mean() if reduction == 'mean' else terms.sum()


def _mlp():
  return M.MLP(rngs=nnx.Rngs(0)), M.random_batch((6, 3))


def _cnn():
  model = M.CNN(rngs=nnx.Rngs(0))  # Conv (fast rule), BatchNorm (replayed), Linear
  model.eval()  # running averages; Dropout off
  return model, M.random_batch((4, 6, 6, 1))


def _transformer():
  return M.TransformerBlock(rngs=nnx.Rngs(0)), M.random_batch((4, 5, 8))


MODELS = {'mlp': _mlp, 'cnn': _cnn, 'transformer': _transformer}


@pytest.fixture(scope='module', params=list(MODELS))
def case(request):
  model, x = MODELS[request.param]()
  return request.param, model, x


@pytest.fixture(scope='module')
def references():
  return {}


def _reference(references, name, model, x, reduction):
  if (name, reduction) not in references:
    loss_fn = functools.partial(squared_error, reduction=reduction)
    references[name, reduction] = reference_grads(loss_fn, model, x)
  return references[name, reduction]


# -- norms against vmap(nnx.grad) ----------------------------------------------------------


@pytest.mark.parametrize('reduction, method', [('mean', 'direct'), ('sum', 'ghost')])
def test_norms_equal_vmap_of_nnx_grad(case, references, reduction, method):
  name, model, x = case
  loss_fn = functools.partial(squared_error, reduction=reduction)
  run = perturbkit.nnx.per_example_grad_norms(loss_fn, reduction=reduction,
                                              dense_method=method)
  loss, norms = jax.jit(run)(model, x)
  assert_norms_equal(norms, _reference(references, name, model, x, reduction))
  np.testing.assert_allclose(loss, nnx.jit(loss_fn)(model, x), rtol=1e-5)


def test_norms_equal_the_linen_twins():
  """The NNX MLP and Transformer block give their Linen twins' norms with the same weights."""
  for model, x, twin in [(*_mlp(), M.LinenMLP()),
                         (*_transformer(), M.LinenTransformerBlock())]:
    variables = M.linen_variables(model)
    linen_loss = lambda v, x, twin=twin: squared_error(functools.partial(twin.apply, v), x)
    _, want = jax.jit(perturbkit.per_example_grad_norms(linen_loss))(variables, x)
    _, norms = jax.jit(perturbkit.nnx.per_example_grad_norms(squared_error))(model, x)
    chex.assert_trees_all_close(norms.by_param, _strings(want.by_param), **TOL)
    np.testing.assert_allclose(norms.total, want.total, **TOL)


# -- DP-SGD --------------------------------------------------------------------------------


def reference_private_grad(per_example, grads_like, key, clip_norm, noise_multiplier):
  """``(Σ_i c_i g_i + σC ξ) / B``, ξ drawn per leaf of the ``nnx.State`` from ``key``."""
  _, total = norms_of(per_example)
  factors = jnp.minimum(1.0, clip_norm / total)
  summed = jax.tree.map(lambda g: jnp.tensordot(factors, g, axes=1), per_example)
  leaves = [functools.reduce(lambda t, k: t[k], path, summed)
            for path, _ in nnx.to_flat_state(grads_like)]
  keys = jax.random.split(key, len(leaves))
  batch = total.shape[0]
  return [(s + noise_multiplier * clip_norm * jax.random.normal(k, s.shape)) / batch
          for s, k in zip(leaves, keys)], total


def _leaves(state):
  return [var.get_value() for _, var in nnx.to_flat_state(state)]


def test_private_grad_without_clipping_or_noise_is_nnx_grad():
  model, x = _cnn()
  dp = perturbkit.nnx.private_grad(squared_error, clip_norm=1e6, noise_multiplier=0.0)
  grads, metrics = jax.jit(dp)(model, jax.random.key(0), x)
  want = nnx.jit(nnx.grad(squared_error))(model, x)
  assert isinstance(grads, nnx.State)
  chex.assert_trees_all_close(M.pure(grads), M.pure(want), **TOL)
  assert float(metrics['fraction_clipped']) == 0 and int(metrics['dropped']) == 0


def test_private_grad_refuses_a_term_over_the_batch_token_count():
  """DP-SGD refuses what the norms accept: each term divided by the whole batch's count."""
  model, x = _cnn()

  def loss_fn(model, x):
    weights = (x[:, 0, 0, 0] > 0).astype(jnp.float32)
    terms = jnp.sum(jnp.sin(model(x)) ** 2, axis=1)
    return jnp.sum(terms * weights) / jnp.maximum(jnp.sum(weights), 1.0)

  jax.eval_shape(perturbkit.nnx.per_example_grad_norms(loss_fn), model, x)
  with pytest.raises(perturbkit.ExamplesCoupledError, match='`div` combines values'):
    jax.eval_shape(perturbkit.nnx.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=1.0),
                   model, jax.random.key(0), x)


def test_private_grad_clips_and_noises_as_the_reference(references):
  model, x = _mlp()
  per_example = _reference(references, 'mlp', model, x, 'mean')
  clip = float(jnp.median(norms_of(per_example)[1]))  # about half the examples clipped
  key = jax.random.key(7)
  dp = perturbkit.nnx.private_grad(squared_error, clip_norm=clip, noise_multiplier=0.7)
  grads, metrics = jax.jit(dp)(model, key, x)
  want, total = reference_private_grad(per_example, grads, key, clip, 0.7)
  chex.assert_trees_all_close(_leaves(grads), want, **TOL)
  np.testing.assert_allclose(metrics['per_example_norms'], total, **TOL)
  assert 0 < float(metrics['fraction_clipped']) < 1


def test_dp_sgd_step_is_optax_on_the_reference(references):
  model, x = _mlp()
  per_example = _reference(references, 'mlp', model, x, 'mean')
  tx = perturbkit.nnx.dp_sgd(squared_error, optax.sgd(0.5), clip_norm=0.3,
                             noise_multiplier=1.0)
  state = tx.init(model)
  step = jax.jit(chex.assert_max_traces(tx.step, n=1))
  key = jax.random.key(3)
  new_state, metrics = step(state, key, x)
  params = nnx.state(model, nnx.Param)
  want, _ = reference_private_grad(per_example, params, key, 0.3, 1.0)
  expected = [p - 0.5 * g for p, g in zip(_leaves(params), want)]
  chex.assert_trees_all_close(_leaves(nnx.state(new_state.model(), nnx.Param)), expected,
                              **TOL)
  assert int(new_state.step) == 1 and not bool(metrics['skipped'])
  step(new_state, jax.random.key(4), x)  # no retrace


def test_dp_sgd_skips_a_step_whose_gradient_is_not_finite():
  model, x = _mlp()
  # Noise of standard deviation 3e38 (float32's largest is 3.4e38): some entries are inf.
  tx = perturbkit.nnx.dp_sgd(squared_error, optax.adam(0.1), clip_norm=1e30,
                             noise_multiplier=3e8)
  state = tx.init(model)
  new_state, metrics = jax.jit(tx.step)(state, jax.random.key(0), x)
  assert bool(metrics['skipped']) and int(metrics['dropped']) == 0
  chex.assert_trees_all_equal(nnx.state(new_state.model()), nnx.state(state.model()))
  chex.assert_trees_all_equal(new_state.opt_state, state.opt_state)
  assert int(new_state.step) == 1


# -- checks and named errors ----------------------------------------------------------------


class RootScale(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(3, 2, rngs=rngs)
    self.scale = nnx.Param(jnp.ones((2,)))

  def __call__(self, x):
    return self.dense(x) * self.scale[...][None, :]


def test_named_errors():
  model, x = _mlp()
  nnx_norms = perturbkit.nnx.per_example_grad_norms(squared_error)
  with pytest.raises(WrongFrontEndError):
    nnx_norms(M.linen_variables(model), x)
  with pytest.raises(WrongFrontEndError):
    perturbkit.per_example_grad_norms(squared_error)(model, x)
  with pytest.raises(WrongFrontEndError):
    perturbkit.check_per_example(squared_error, model, x)
  # The refusals are made while tracing: an abstract run (eval_shape) raises them without
  # compiling the eager ops of each model.
  with pytest.raises(ReductionMismatchError):
    jax.eval_shape(perturbkit.nnx.per_example_grad_norms(
        functools.partial(squared_error, reduction='sum')), model, x)
  training = M.CNN(rngs=nnx.Rngs(0))  # BatchNorm in training mode
  cnn_loss = lambda m, x: jnp.mean(m(x) ** 2)
  with pytest.raises(ExamplesMixedError, match='BatchNorm'):
    nnx.eval_shape(perturbkit.nnx.per_example_grad_norms(cnn_loss), training,
                   M.random_batch((4, 6, 6, 1)))
  with pytest.raises(ExamplesMixedError):
    perturbkit.nnx.check_per_example(cnn_loss, training, M.random_batch((4, 6, 6, 1)))
  with pytest.raises(ParamsReadOutsideError, match='<root>'):  # read outside the model call
    jax.eval_shape(perturbkit.nnx.private_grad(
        lambda m, x: squared_error(m, x) + jnp.sum(m.scale[...]), clip_norm=1.0,
        noise_multiplier=0.0), RootScale(nnx.Rngs(0)), jax.random.key(0), x)
  # A call the loss makes itself on an input made from no batched argument: the message
  # speaks of the model call, which it is outside of, not of Linen's model.apply.
  tied = TiedLM(nnx.Rngs(0))
  outside = lambda m, tokens: next_token_loss(m, tokens) + jnp.sum(m.hidden(jnp.ones((1, 6))))
  with pytest.raises(perturbkit.SharedCallError, match='outside any call of the model') as error:
    nnx.eval_shape(perturbkit.nnx.per_example_grad_norms(outside), tied,
                   jnp.ones((3, 5), jnp.int32))
  assert 'model.apply' not in str(error.value)
  perturbkit.nnx.check_per_example(squared_error, model, x)


# -- a tied output head: one nnx.Embed called and then attend-ed ------------------------------


class TiedLM(nnx.Module):
  """Token embedding, a hidden layer, and the output logits from the same embedding."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(11, 6, rngs=rngs)
    self.hidden = nnx.Linear(6, 6, rngs=rngs)

  def __call__(self, tokens):
    return self.embed.attend(jnp.tanh(self.hidden(self.embed(tokens))))


def next_token_loss(model, tokens, reduction='mean'):
  logits = model(tokens[:, :-1])
  terms = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).sum(axis=1)
  return terms.mean() if reduction == 'mean' else terms.sum()


@pytest.mark.parametrize('reduction', ['mean', 'sum'])
def test_tied_head_norms_equal_vmap_of_nnx_grad(reduction):
  """The embedding's per-example gradient is the sum over its lookup and its ``attend``."""
  model = TiedLM(nnx.Rngs(1))
  tokens = jax.random.randint(jax.random.key(2), (5, 7), 0, 11)
  loss_fn = functools.partial(next_token_loss, reduction=reduction)
  _, norms = jax.jit(perturbkit.nnx.per_example_grad_norms(loss_fn, reduction=reduction))(
      model, tokens)
  assert_norms_equal(norms, reference_grads(loss_fn, model, tokens))
  # The clipped mean with nothing clipped and no noise is the mean loss's gradient.
  dp = perturbkit.nnx.private_grad(loss_fn, clip_norm=1e6, noise_multiplier=0.0,
                                   reduction=reduction)
  grads, _ = jax.jit(dp)(model, jax.random.key(0), tokens)
  want = nnx.jit(nnx.grad(next_token_loss))(model, tokens)
  chex.assert_trees_all_close(M.pure(grads), M.pure(want), **TOL)


class NoisyCell(nnx.LSTMCell):
  """An LSTM cell whose initial carry ``nnx.RNN`` draws at random from its stream."""

  def initialize_carry(self, input_shape, rngs=None, carry_init=None):
    return super().initialize_carry(input_shape, rngs, carry_init=nnx.initializers.normal())


class RandomCarry(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.embed = nnx.Linear(3, 4, rngs=rngs)
    self.rnn = nnx.RNN(NoisyCell(4, 4, rngs=rngs))
    self.head = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.head(self.rnn(self.embed(x)))


def test_a_draw_the_output_is_not_computed_from_is_replayed():
  """``nnx.RNN`` draws a key from its stream for the initial carry in every call, which the
  per-example replay of the whole model runs again; with the LSTM's default zero carry the
  output is not computed from that key, so the replay is exact: the norms equal vmap(nnx.grad).
  So do those of a Linen MLP inside the model through ``nnx.bridge.ToNNX``, which hands a key
  of its stream to every Linen call."""
  from flax.nnx import bridge
  bridged, features = M.Bridged(rngs=nnx.Rngs(0)), M.random_batch((3, 4))
  bridge.lazy_init(bridged, features)
  sequences = M.random_batch((3, 5, 3))
  for model, x in [(M.Recurrent(rngs=nnx.Rngs(0)), sequences), (bridged, features)]:
    _, norms = jax.jit(perturbkit.nnx.per_example_grad_norms(squared_error))(model, x)
    assert_norms_equal(norms, reference_grads(squared_error, model, x))


def test_an_rnn_drawing_its_initial_carry_is_refused_by_its_stream():
  """An initial carry drawn at random from the RNN's own stream, in the call that the
  per-example replay runs again: the refusal names that stream, not only the replayed call."""
  # An abstract model and batch (the refusal is made while tracing, values play no part).
  model = nnx.eval_shape(lambda: RandomCarry(rngs=nnx.Rngs(0)))
  x = jax.ShapeDtypeStruct((2, 5, 3), jnp.float32)
  with pytest.raises(perturbkit.RandomCallError, match=r'stream rnn\.rngs .*initial carry'):
    nnx.eval_shape(perturbkit.nnx.per_example_grad_norms(squared_error), model, x)  # tracing


def test_a_replayed_call_drawing_from_an_nnx_rngs_argument_is_refused():
  """A module owning params (no fast rule) that draws dropout from the ``nnx.Rngs`` the
  loss passes in: the replay cannot redraw the mask, a named refusal."""

  class Owner(nnx.Module):
    def __init__(self, rngs):
      self.w = nnx.Param(jax.random.normal(rngs.params(), (3, 4)))
      self.dropout = nnx.Dropout(0.5)

    def __call__(self, x, rngs):
      return self.dropout(jnp.tanh(x @ self.w[...]), rngs=rngs)

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.owner = Owner(rngs)
      self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x, rngs):
      return self.head(self.owner(x, rngs))

  loss_fn = lambda m, x, rngs: jnp.mean(jnp.sum(m(x, rngs) ** 2, axis=1))
  with pytest.raises(perturbkit.RandomCallError, match=r'owner/__call__'):
    nnx.eval_shape(perturbkit.nnx.per_example_grad_norms(loss_fn, batch_axes=(0, None)),
                   Net(nnx.Rngs(0)), M.random_batch((3, 3)), nnx.Rngs(dropout=1))


# -- one Variable in two modules that own params of their own ----------------------------------


def _shared_kernel():
  return M.SharedKernel(rngs=nnx.Rngs(0)), M.random_batch((5, 4), seed=1)


def _biased_tied_lm():
  return M.BiasedTiedLM(rngs=nnx.Rngs(0)), jax.random.randint(jax.random.key(2), (4, 5), 0, 7)


def _sequence_loss(model, tokens):
  return next_token_loss(model, tokens)


@pytest.mark.parametrize('make, loss_fn', [(_shared_kernel, squared_error),
                                           (_biased_tied_lm, _sequence_loss)],
                         ids=['shared-kernel', 'biased-tied-head'])
def test_a_variable_held_by_two_owners_counts_once(make, loss_fn):
  """The shared Variable is the param of the module where ``nnx.state`` lists it: its
  per-example gradient sums its reads in both modules, and the other module reports only
  its own params. (``nnx.jit``: ``jax.jit`` flattens the model as a pytree, which unties it.)"""
  model, x = make()
  _, norms = nnx.jit(perturbkit.nnx.per_example_grad_norms(loss_fn))(model, x)
  assert_norms_equal(norms, reference_grads(loss_fn, model, x))
  dp = perturbkit.nnx.private_grad(loss_fn, clip_norm=1e6, noise_multiplier=0.0)
  grads, _ = nnx.jit(dp)(model, jax.random.key(0), x)
  chex.assert_trees_all_close(M.pure(grads), M.pure(nnx.jit(nnx.grad(loss_fn))(model, x)),
                              **TOL)
