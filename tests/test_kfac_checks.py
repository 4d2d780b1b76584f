"""The K-FAC estimators refuse layers that do not describe the model they run.

``kfac_layers`` skips a layer whose params the model also reads outside its
calls; layers built by hand, or for another model or predict function, reach
the estimator unchecked otherwise, and their factors would precondition a
gradient they do not describe.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import perturbkit

TOKENS = jnp.array([[0, 1, 2], [3, 4, 5]])
LABELS = jnp.array([[1, 2, 3], [4, 5, 6]])
X = jnp.ones((2, 3))
Y = jnp.zeros((2,), jnp.int32)


class TiedHead(nn.Module):
  """Embed -> Dense -> an LM head on the embedding, ``h @ E.T`` (or an untied Dense head)."""
  tied: bool = True

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(11, 4)
    h = jnp.tanh(nn.Dense(4, name='hidden')(embed(tokens)))
    return h @ embed.embedding.T if self.tied else nn.Dense(11, name='head')(h)


class Twice(nn.Module):
  """One Dense applied once, or twice (the second call missing from layers made for once)."""
  twice: bool = False

  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(3)
    h = dense(x)
    return dense(jnp.tanh(h)) if self.twice else h


def _estimate(model, layers, variables, inputs, targets):
  predict = lambda v, x: model.apply(v, x)
  estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers)
  return jax.jit(estimate)(variables, inputs, targets, jax.random.key(0))


def test_hand_built_layers_with_a_tied_embedding_are_refused():
  untied, tied = TiedHead(tied=False), TiedHead()
  variables = tied.init(jax.random.key(0), TOKENS)
  predict = lambda v, x: tied.apply(v, x)
  assert list(perturbkit.kfac_layers(predict, variables, TOKENS).layers) == ['hidden']
  # The untied twin's layers include the embedding; its factors would miss the head's share.
  twin = untied.init(jax.random.key(0), TOKENS)
  layers = perturbkit.kfac_layers(lambda v, x: untied.apply(v, x), twin, TOKENS)
  layers = perturbkit.KFACLayers({k: v for k, v in layers.layers.items() if k != 'head'}, {})
  assert sorted(layers.layers) == ['Embed_0', 'hidden']
  with pytest.raises(perturbkit.KFACUnsupportedLayerError,
                     match=r'Embed_0 was selected.*read outside its calls \(by transpose\).*'
                           r'perturbkit\.kfac_layers'):
    _estimate(tied, layers, variables, TOKENS, LABELS)
  # The same layers on the untied model (reads through the calls only) are fine.
  _, _, stats = _estimate(untied, layers, twin, TOKENS, LABELS)
  assert stats['Embed_0'].a.shape == (11,)


def test_layers_of_another_model_are_a_shape_error():
  wide = nn.Sequential([nn.Dense(5)])
  layers = perturbkit.kfac_layers(lambda v, x: wide.apply(v, x),
                                  wide.init(jax.random.key(0), X), X)
  renamed = perturbkit.KFACLayers(
      {'Dense_0': layers.layers['layers_0']._replace(path=('Dense_0',))}, {})
  seq = nn.Sequential([nn.Dense(3)])
  with pytest.raises(perturbkit.KFACShapeError, match=r"layers_0.*\(3, 3\) in the model, "
                                                      r"\(3, 5\) in the layers"):
    _estimate(seq, layers, seq.init(jax.random.key(0), X), X, Y)
  with pytest.raises(perturbkit.KFACShapeError, match="Dense_0.*no 'kernel' param"):
    _estimate(seq, renamed, seq.init(jax.random.key(0), X), X, Y)


def test_a_call_left_out_of_the_layers_is_a_shape_error():
  once, twice = Twice(), Twice(twice=True)
  variables = once.init(jax.random.key(0), X)
  layers = perturbkit.kfac_layers(lambda v, x: once.apply(v, x), variables, X)
  assert layers.layers['Dense_0'].calls == ('__call__',)
  with pytest.raises(perturbkit.KFACShapeError,
                     match=r"Dense_0.*calls it as \['__call__', '__call__#1'\]"):
    _estimate(twice, layers, variables, X, Y)
  both = perturbkit.kfac_layers(lambda v, x: twice.apply(v, x), variables, X)
  _, _, stats = _estimate(twice, both, variables, X, Y)
  assert stats['Dense_0'].g.shape == (3, 3)


class NNXNet(nnx.Module):
  def __init__(self, width, rngs):
    self.hidden = nnx.Linear(3, width, rngs=rngs)
    self.out = nnx.Linear(width, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.hidden(x)))


def test_nnx_estimator_refuses_a_penalized_predict_and_another_model():
  model = NNXNet(4, nnx.Rngs(0))
  layers = perturbkit.nnx.kfac_layers(model, X)
  assert sorted(layers.layers) == ['hidden', 'out']
  penalized = lambda m, x: m(x) + jnp.sum(m.hidden.kernel[...] ** 2)
  estimate = perturbkit.nnx.kfac_estimator('softmax_cross_entropy', layers, predict=penalized)
  with pytest.raises(perturbkit.KFACUnsupportedLayerError,
                     match=r'hidden was selected.*\(by integer_pow\).*perturbkit\.nnx\.kfac_layers'):
    nnx.jit(estimate)(model, X, Y, jax.random.key(0))
  plain = perturbkit.nnx.kfac_estimator('softmax_cross_entropy', layers)
  with pytest.raises(perturbkit.KFACShapeError, match=r'hidden.*\(3, 6\) in the model'):
    nnx.jit(plain)(NNXNet(6, nnx.Rngs(0)), X, Y, jax.random.key(0))
  _, _, stats = nnx.jit(plain)(model, X, Y, jax.random.key(0))
  assert stats['hidden'].a.shape == (4, 4)


def test_hand_built_layer_infos_without_their_rule_s_needs_are_refused_where_given():
  """A kind without a rule, a Conv without its geometry: refused by the estimators and by
  kfac_segment when they are made, not deep in tracing."""
  model = nn.Sequential([nn.Dense(4), jnp.tanh, nn.Dense(3)])
  variables = model.init(jax.random.key(0), X)
  layers = perturbkit.kfac_layers(model.apply, variables, X)
  dense = layers.layers['layers_0']
  for info, match in [(dense._replace(kind='linear'), r"'layers_0'.*LayerInfo.kind is 'linear'"),
                      (dense._replace(kind='conv'), r"'layers_0'.*needs LayerInfo.conv")]:
    by_hand = layers._replace(layers={**layers.layers, 'layers_0': info})
    with pytest.raises(perturbkit.KFACLayerInfoError, match=match):
      perturbkit.kfac_estimator(model.apply, 'softmax_cross_entropy', by_hand)
    with pytest.raises(perturbkit.KFACLayerInfoError, match=match):
      perturbkit.nnx.kfac_estimator('softmax_cross_entropy', by_hand)
    with pytest.raises(perturbkit.KFACLayerInfoError, match=match):
      perturbkit.kfac_segment(info)


class Masked(nn.Module):
  """Token and position embeddings mixed along the sequence by a ``(length, length)`` mask
  given in the batch dict."""

  @nn.compact
  def __call__(self, batch):
    h = nn.Embed(11, 4)(batch['tokens'])
    return nn.Dense(2)(jnp.einsum('st,nte->ne', batch['mask'], h))


class NNXMasked(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(11, 4, rngs=rngs)
    self.out = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, batch):
    return self.out(jnp.einsum('st,nte->ne', batch['mask'], self.embed(batch['tokens'])))


def test_inputs_whose_arrays_disagree_on_the_examples_are_refused():
  """A ``(length, length)`` mask beside ``(examples, length)`` tokens in ``inputs``: the
  examples cannot be counted on the first array (the mask, sorted first), so every K-FAC
  entry point refuses the batch and says to pass the mask through predict_fn."""
  tokens = jnp.array([[1, 2, 3], [4, 5, 6]])
  batch = {'mask': jnp.tril(jnp.ones((3, 3))), 'tokens': tokens}
  match = r"\['mask'\]: 3, \['tokens'\]: 2.*through predict_fn.*functools\.partial"
  model = Masked()
  variables = model.init(jax.random.key(0), batch)
  with pytest.raises(perturbkit.KFACInputsError, match=match):
    perturbkit.kfac_layers(model.apply, variables, batch)
  nnx_model = NNXMasked(nnx.Rngs(0))
  with pytest.raises(perturbkit.KFACInputsError, match=match):
    perturbkit.nnx.kfac_layers(nnx_model, batch)
  # The fix the error gives: the mask through predict_fn, the tokens as the batch.
  predict = lambda v, x: model.apply(v, {'mask': batch['mask'], 'tokens': x})
  layers = perturbkit.kfac_layers(predict, variables, tokens)
  assert sorted(layers.layers) == ['Dense_0', 'Embed_0']
  # Layers made for one batch, estimators given the other.
  with pytest.raises(perturbkit.KFACInputsError, match=match):
    perturbkit.kfac_estimator(model.apply, 'softmax_cross_entropy', layers)(
        variables, batch, Y, jax.random.key(0))
  nnx_layers = perturbkit.nnx.kfac_layers(
      nnx_model, tokens, predict=lambda m, x: m({'mask': batch['mask'], 'tokens': x}))
  with pytest.raises(perturbkit.KFACInputsError, match=match):
    perturbkit.nnx.kfac_estimator('softmax_cross_entropy', nnx_layers)(
        nnx_model, batch, Y, jax.random.key(0))


def test_kfac_layers_given_params_or_an_nnx_model_says_what_to_pass():
  model = nn.Sequential([nn.Dense(4), jnp.tanh, nn.Dense(3)])
  variables = model.init(jax.random.key(0), X)
  with pytest.raises(perturbkit.NotVariablesError, match=r"pass the whole dict"):
    perturbkit.kfac_layers(model.apply, variables['params'], X)
  with pytest.raises(perturbkit.WrongFrontEndError, match=r'perturbkit\.nnx\.kfac_layers'):
    perturbkit.kfac_layers(lambda m, x: m(x), NNXNet(4, nnx.Rngs(0)), X)
