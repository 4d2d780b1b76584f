"""An output layer tied to the input embedding, as Hugging Face writes it
(``self.lm_head.apply({'params': {'kernel': embedding.T}}, h)``: the submodule's own
``apply`` inside the model's call), is a call of that layer: a point with dL/d(logits),
a cached output, an edit target and a place for a backward hook. The references are
the model's logits and ``jax.vjp`` through them."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import perturbkit
from perturbkit import interpret

import hf_models

TOL = dict(rtol=1e-5, atol=1e-6)

pytestmark = [pytest.mark.filterwarnings(f) for f in hf_models.FILTER_DEPRECATION]


def _gpt2():
  hf = hf_models.hf_model('gpt2')
  ids, mask, positions = hf_models._tokens()
  logits = lambda v, ids: hf.module.apply(v, ids, mask, positions).logits
  return logits, hf.variables, ids, 'lm_head/__call__', lambda params: 0.0


def _bert_masked_lm():
  """BERT's masked-LM head: the decoder, tied to the word embedding, inside ``cls/predictions``
  and followed by a bias of its own."""
  import transformers as T
  config = T.BertConfig(**hf_models.SMALL_CONFIG)
  hf = T.FlaxBertForMaskedLM(config, _do_init=False)
  ids, mask, _ = hf_models._tokens()
  positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  logits = lambda v, ids: hf.module.apply(v, ids, mask, jnp.zeros_like(ids), positions,
                                          None).logits
  after = lambda params: params['cls']['predictions']['bias']  # added to the decoder's output
  return (logits, hf_models.filled_variables(hf), ids, 'cls/predictions/decoder/__call__',
          after)


# Each case: ``(logits function, variables, token ids, the tied layer's call, what the model
# adds to that call's output to make the logits, as a function of the params)``.
CASES = {'gpt2': _gpt2, 'bert_masked_lm': _bert_masked_lm}


@pytest.fixture(autouse=True, scope='module')
def _broadcasting():
  with jax.numpy_rank_promotion('allow'):  # as the Hugging Face models are written
    yield


@pytest.fixture(scope='module', params=sorted(CASES))
def case(request, _broadcasting):
  return CASES[request.param]()


def _loss_of(logits, ids):
  return optax.softmax_cross_entropy_with_integer_labels(logits, ids).mean()


def _at(tree, name: str):
  for part in name.split('/'):
    tree = tree[part]
  return tree


def test_the_tied_layer_is_a_point_with_the_gradient_of_the_logits(case):
  logits_fn, variables, ids, name, _ = case
  loss = lambda v, ids: _loss_of(logits_fn(v, ids), ids)
  value, grads = jax.jit(perturbkit.value_and_grad(loss))(variables, ids)
  logits = jax.jit(logits_fn)(variables, ids)
  # The layer's output is the logits, or they less a bias added after it: the same gradient.
  want = jax.grad(_loss_of)(logits, ids)
  np.testing.assert_allclose(_at(grads['perturbations'], name), want, **TOL)
  want_value, want_grads = jax.jit(jax.value_and_grad(loss))(variables, ids)
  chex.assert_trees_all_close(grads['params'], want_grads['params'], **TOL)
  np.testing.assert_allclose(value, want_value, **TOL)


def test_the_tied_layers_output_is_cached_and_edited(case):
  logits_fn, variables, ids, name, _ = case
  logits = jax.jit(logits_fn)(variables, ids)
  out, cache = jax.jit(perturbkit.run_with_cache(logits_fn))(variables, ids)
  bias = logits - _at(cache.outputs, name)  # BERT's bias after the decoder; 0 for GPT-2
  np.testing.assert_allclose(out, logits, **TOL)
  np.testing.assert_allclose(bias, jnp.broadcast_to(bias[0, 0], bias.shape), **TOL)
  delta = jax.random.normal(jax.random.key(1), (logits.shape[-1],))
  edited = jax.jit(perturbkit.run_with_edits(logits_fn))(
      variables, {name: interpret.add(delta, positions=[2], axis=1)}, ids)
  np.testing.assert_allclose(edited, logits.at[:, 2].add(delta), **TOL)


def test_a_backward_hook_on_the_tied_layer_changes_what_flows_through_it(case):
  """The hook zeroes the layer's output gradient at token 0: every param's gradient is then
  ``jax.vjp`` of the layer's output with that cotangent, plus that of what the model adds
  after the layer (BERT's bias) with the cotangent not hooked."""
  logits_fn, variables, ids, name, after = case
  layer = name.rsplit('/', 1)[0]
  loss = lambda v, ids: _loss_of(logits_fn(v, ids), ids)
  hook = perturbkit.backward_hook(lambda g: g.at[:, 0].set(0.0), filter=[layer])
  grads = jax.jit(perturbkit.grad(loss, hooks=[hook]))(variables, ids)

  @jax.jit
  def reference(params):
    output, layer_pullback = jax.vjp(lambda p: logits_fn({'params': p}, ids) - after(p), params)
    _, after_pullback = jax.vjp(lambda p: jnp.broadcast_to(after(p), output.shape), params)
    cotangent = jax.grad(_loss_of)(output + after(params), ids)
    return jax.tree.map(jnp.add, layer_pullback(cotangent.at[:, 0].set(0.0))[0],
                        after_pullback(cotangent)[0])

  chex.assert_trees_all_close(grads['params'], reference(variables['params']), **TOL)
  assert not np.allclose(_at(grads['perturbations'], name)[:, 0], 0.0)  # before the hook
