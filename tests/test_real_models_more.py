"""More unmodified Hugging Face Flax families: activation gradients and the cache.

Each family brings something the main set (``tests/test_real_models.py``) does not:
ALBERT runs one layer's modules at every depth (calls counted ``'#1'``, ``'#2'``...), BLOOM
has ALiBi attention, GPT-J rotary embeddings and attention parallel to the MLP, RoFormer
rotary embeddings in an encoder, ELECTRA an embedding projection, OPT a projected embedding
size, XGLM sinusoidal positions, BEiT relative position biases and layer scales, T5 a relative
position bias that each stack's first layer computes and hands to the later layers as an
output, an encoder and a decoder sharing one embedding with the LM head, BigBird
block-sparse attention (queries and keys gathered in blocks: global, sliding and random ones;
Flax's BigBird draws the random blocks from its ``'indices'`` stream only at its paper's lengths,
1024, 3072 and 4096 tokens, in training mode, and attends fixed blocks otherwise). For each:
``perturbkit.value_and_grad`` equals explicit deltas added by the tests' own interceptor
(``tests/explicit_deltas.py``) and ``jax.grad``; every call's cached output, patched back in,
gives the model's output bit for bit. OPT's feed-forward calls, on ``(examples * tokens,
features)``, are swept per token through a view.
"""
import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_models
from hf_models import SMALL_CONFIG
import perturbkit
from explicit_deltas import at, explicit_deltas, points_of, zeros
from perturbkit import filters, interpret

pytestmark = [pytest.mark.filterwarnings(f) for f in hf_models.FILTER_DEPRECATION]

TOL = dict(rtol=2e-5, atol=1e-6)
B, S, V, W = 2, hf_models.SEQ, hf_models.VOCAB, SMALL_CONFIG['hidden_size']
# BigBird's block-sparse attention runs its own code path only on a sequence of enough blocks:
# two global, three sliding and the random ones; 8 blocks of 4 tokens.
BLOCK_SPARSE_LENGTH = 32


def _ids():
  return jax.random.randint(jax.random.key(0), (B, S), 3, V)


def _positions():
  return jnp.broadcast_to(jnp.arange(S), (B, S))


def _causal(module):
  ids = _ids()
  return lambda v, ids: module.apply(v, ids, jnp.ones_like(ids), _positions()).logits, ids


def _bloom(module):
  ids = _ids()
  return lambda v, ids: module.apply(v, ids, jnp.ones_like(ids)).logits, ids


def _encoder(module):
  ids = _ids()
  return (lambda v, ids: module.apply(v, ids, jnp.ones_like(ids), jnp.zeros_like(ids),
                                      _positions(), None).logits, ids)


def _roformer(module):
  ids = _ids()
  return (lambda v, ids: module.apply(v, ids, jnp.ones_like(ids), jnp.zeros_like(ids),
                                      None).logits, ids)


def _albert(module):
  ids = _ids()
  return (lambda v, ids: module.apply(v, ids, jnp.ones_like(ids), jnp.zeros_like(ids),
                                      _positions()).last_hidden_state, ids)


def _t5(module):
  ids = _ids()
  decoder_ids = ids[:, ::-1][:, :5]  # another length than the encoder's
  return (lambda v, ids: module.apply(v, ids, jnp.ones_like(ids), decoder_ids,
                                      jnp.ones_like(decoder_ids)).logits, ids)


def _block_sparse(module):
  ids = jax.random.randint(jax.random.key(0), (B, BLOCK_SPARSE_LENGTH), 3, V)
  positions = jnp.broadcast_to(jnp.arange(BLOCK_SPARSE_LENGTH), ids.shape)
  return (lambda v, ids: module.apply(v, ids, jnp.ones_like(ids), jnp.zeros_like(ids),
                                      positions, None).logits, ids)


def _image(module):
  pixels = jax.random.normal(jax.random.key(1), (B, hf_models.IMAGE, hf_models.IMAGE, 3))
  return lambda v, pixels: module.apply(v, pixels).last_hidden_state, pixels


def _families():
  import transformers as T
  return {
      'albert': (lambda: T.FlaxAlbertModel(T.AlbertConfig(
          embedding_size=8, num_hidden_groups=1, **SMALL_CONFIG), _do_init=False), _albert),
      'bloom': (lambda: T.FlaxBloomForCausalLM(T.BloomConfig(
          vocab_size=V, hidden_size=W, n_layer=2, n_head=2), _do_init=False), _bloom),
      'gptj': (lambda: T.FlaxGPTJForCausalLM(T.GPTJConfig(
          vocab_size=V, n_embd=W, n_layer=2, n_head=2, rotary_dim=4, n_positions=16),
          _do_init=False), _causal),
      'electra': (lambda: T.FlaxElectraForMaskedLM(T.ElectraConfig(
          embedding_size=8, **SMALL_CONFIG), _do_init=False), _encoder),
      'roformer': (lambda: T.FlaxRoFormerForMaskedLM(T.RoFormerConfig(
          embedding_size=W, **SMALL_CONFIG), _do_init=False), _roformer),
      'xglm': (lambda: T.FlaxXGLMForCausalLM(T.XGLMConfig(
          vocab_size=V, d_model=W, num_layers=2, attention_heads=2, ffn_dim=32,
          max_position_embeddings=16), _do_init=False), _causal),
      # One decoder layer: the encoder's two show the bias handed on, at half the compile.
      't5': (lambda: T.FlaxT5ForConditionalGeneration(T.T5Config(
          **{**hf_models.T5_CONFIG, 'num_decoder_layers': 1}), _do_init=False), _t5),
      'opt': (lambda: T.FlaxOPTForCausalLM(T.OPTConfig(
          vocab_size=V, hidden_size=W, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32,
          max_position_embeddings=16, word_embed_proj_dim=8), _do_init=False), _causal),
      'bigbird': (lambda: T.FlaxBigBirdForMaskedLM(T.BigBirdConfig(
          attention_type='block_sparse', block_size=4, num_random_blocks=1, **{
              **SMALL_CONFIG, 'num_hidden_layers': 1,
              'max_position_embeddings': BLOCK_SPARSE_LENGTH}),
          input_shape=(1, BLOCK_SPARSE_LENGTH), _do_init=False), _block_sparse),
      'beit': (lambda: T.FlaxBeitModel(T.BeitConfig(
          image_size=hf_models.IMAGE, patch_size=8, use_relative_position_bias=True,
          layer_scale_init_value=0.1, **{k: v for k, v in SMALL_CONFIG.items() if k not in (
              'vocab_size', 'max_position_embeddings')}), _do_init=False), _image),
  }


@pytest.mark.parametrize('name', ['albert', 'beit', 'bigbird', 'bloom', 'electra', 'gptj', 'opt',
                                  'roformer', 't5', 'xglm'])
def test_activation_gradients_and_cache_equal_the_model_run_by_hand(name):
  build, make = _families()[name]
  # t5_numpy: what T5's own code needs of jax.numpy (the others do not run it).
  with jax.numpy_rank_promotion('allow'), hf_models.t5_numpy():
    hf = build()
    variables = hf_models.filled_variables(hf)
    run, inputs = make(hf.module)
    loss_fn = lambda v, x: jnp.sum(jnp.tanh(run(v, x)) ** 2)

    points = {}

    @jax.jit
    def plain_run(variables, inputs):
      """The plain model, its calls' float outputs recorded on the way (their shapes only, the
      values left as they are) by the tests' interceptor: the points the reference adds its
      deltas to."""
      with explicit_deltas(shapes=points):
        return run(variables, inputs)

    plain = plain_run(variables, inputs)

    @jax.jit
    def gradients(variables, inputs):
      """The reference and ``perturbkit.value_and_grad``, compiled together."""
      def loss(params, deltas):
        with explicit_deltas(deltas=deltas):
          return loss_fn({**variables, 'params': params}, inputs)
      return (jax.value_and_grad(loss, argnums=(0, 1))(variables['params'], zeros(points)),
              perturbkit.value_and_grad(loss_fn)(variables, inputs))

    (value, (param_grads, act_grads)), (got_value, grads) = gradients(variables, inputs)
    # The runs compared with the plain model bit for bit, each compiled on its own as it is.
    output, cache = jax.jit(perturbkit.run_with_cache(run))(variables, inputs)
    back = {'/'.join(point): interpret.replace(at(cache.outputs, point)) for point in points}
    patched = jax.jit(perturbkit.run_with_edits(run))(variables, back, inputs)

  chex.assert_trees_all_close(got_value, value, **TOL)
  chex.assert_trees_all_close(grads['params'], param_grads, **TOL)
  assert len(points) > 10
  assert len(jax.tree.leaves(grads['perturbations'])) == sum(map(len, points.values()))
  for point in points:
    for g, want in zip(jax.tree.leaves(at(grads['perturbations'], point)), act_grads[point]):
      np.testing.assert_allclose(g, want, **TOL, err_msg='/'.join(point))
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(act_grads)) > 1e-3
  if name == 'albert':  # one layer's modules at both depths
    assert any(point[-1] == '__call__#1' for point in points)
  if name == 't5':  # the first layer's bias, an output of its attention, and the tied head
    bias = ('encoder', 'block', '0', 'layer', '0', 'SelfAttention', '__call__')
    assert len(points[bias]) == 2 and ('lm_head', '__call__') in points
    assert float(jnp.abs(act_grads[bias][1]).max()) > 0
  np.testing.assert_array_equal(output, plain)
  np.testing.assert_array_equal(patched, plain)
  # The cache holds exactly the calls the interceptor by hand adds its deltas to: each entry
  # is one of them (the call's path, then the keys of its output's structure, if any).
  cached = [next((path[:i] for i in range(1, len(path) + 1) if path[:i] in points), path)
            for path in flax.traverse_util.flatten_dict(cache.outputs)]
  assert set(cached) == set(points), set(cached) ^ set(points)


def test_opt_feed_forward_calls_are_swept_per_token_through_a_view():
  """OPT runs each layer's ``final_layer_norm``, ``fc1`` and ``fc2`` on ``(examples * tokens,
  features)``. Along axis 1 those are features, of two lengths: the sweep refuses them by name.
  Viewed as ``(examples, tokens, features)`` they are swept per token: attribution patching
  equals ``vdot(a_clean - a_corrupted, g)`` over each token's rows, with the activations from
  ``capture_intermediates`` and ``g`` from explicit deltas (``tests/explicit_deltas.py``), and
  activation patching of one token equals the model with that token's clean rows of ``fc2``
  written in by an interceptor of this test."""
  build, make = _families()['opt']
  token = 3
  with jax.numpy_rank_promotion('allow'):
    hf = build()
    variables = hf_models.filled_variables(hf)
    run, ids = make(hf.module)
    corrupted = ids.at[:, token].set(jnp.where(ids[:, token] == 3, 4, 3))
    metric = lambda v, ids: jnp.sum(jnp.tanh(run(v, ids)) ** 2)
    flattened = filters.by_path(*(f'model/decoder/layers/*/{name}'
                                  for name in ('final_layer_norm', 'fc1', 'fc2')))
    with pytest.raises(perturbkit.AxisLengthMismatchError, match='fc1/__call__ has 32'):
      perturbkit.attribution_patching(metric, axis=1, filter=flattened)(
          variables, ids, corrupted)
    view = dict(axis=1, view=(B, S, -1), filter=flattened)

    @jax.jit
    def under_test(variables, ids, corrupted):
      """Attribution patching of every flattened call and activation patching of one token of
      fc2, compiled together."""
      return (perturbkit.attribution_patching(metric, **view)(variables, ids, corrupted),
              perturbkit.activation_patching(
                  metric, axis=1, view=(B, S, -1), positions=[token],
                  filter=filters.by_path('model/decoder/layers/0/fc2'))(variables, ids, corrupted))

    got, one_patch = under_test(variables, ids, corrupted)

    points = points_of(metric, variables, corrupted)
    fc2 = ('model', 'decoder', 'layers', '0', 'fc2')

    @jax.jit
    def reference(variables):
      def loss(deltas):
        with explicit_deltas(deltas=deltas):
          return metric(variables, corrupted)
      capture = lambda x: hf.module.apply(
          variables, x, jnp.ones_like(x), _positions(), capture_intermediates=True,
          mutable=['intermediates'])[1]['intermediates']
      clean = capture(ids)
      return jax.grad(loss)(zeros(points)), clean, capture(corrupted), effect(variables, clean)

    def effect(variables, clean):
      """The metric with the token's clean rows of fc2 written in, less the corrupted one."""
      def write_clean_rows(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if tuple(context.module.path) != fc2 or context.method_name != '__call__':
          return out
        rows = at(clean, fc2 + ('__call__',))[0].reshape(B, S, -1)
        return out.reshape(B, S, -1).at[:, token].set(rows[:, token]).reshape(out.shape)

      with nn.intercept_methods(write_clean_rows):
        patched = metric(variables, corrupted)
      return patched - metric(variables, corrupted)

    grads, clean, dirty, want_effect = reference(variables)

  assert len(got.paths) == 6 and got.positions == tuple(range(S))
  scale = float(jnp.abs(got.effects).max())  # the filled weights are small: so are the effects
  for row, path in enumerate(got.paths):
    point = tuple(path.split('/'))
    per_token = lambda tree: at(tree, point)[0].reshape(B, S, -1)
    g = grads[point][0].reshape(B, S, -1)
    want = jnp.einsum('bsf,bsf->s', per_token(clean) - per_token(dirty), g)
    np.testing.assert_allclose(got.effects[row], want, rtol=1e-4, atol=1e-5 * scale,
                               err_msg=path)
  # Every call moves the metric at the changed token; before it (causal), none does.
  assert float(jnp.abs(got.effects[:, token]).min()) > 0.01 * scale > 0
  np.testing.assert_array_equal(got.effects[:, :token], 0.0)
  np.testing.assert_allclose(one_patch.effects[0, 0], want_effect, rtol=1e-3,
                             atol=1e-5 * abs(float(want_effect)))
  assert abs(float(want_effect)) > 0.01 * scale


def test_t5_encode_and_decode_as_hugging_face_calls_them_give_the_tied_head_its_point():
  """Hugging Face's ``decode`` runs a function given to ``apply`` (``method=``): the decoder
  it returns, then the LM head tied to the embedding, ``module.lm_head.apply({'params':
  {'kernel': embedding.T}}, h)``. The head is a call with its point, whose gradient equals
  ``jax.grad`` of the loss at the logits; the params' gradients equal ``jax.grad``'s."""
  import transformers as T
  with jax.numpy_rank_promotion('allow'), hf_models.t5_numpy():
    hf = T.FlaxT5ForConditionalGeneration(
        T.T5Config(**{**hf_models.T5_CONFIG, 'num_decoder_layers': 1}), _do_init=False)
    variables = hf_models.filled_variables(hf)
    ids = _ids()
    decoder_ids = ids[:, ::-1][:, :5]

    def logits_of(params, ids, decoder_ids):
      mask, decoder_mask = jnp.ones_like(ids), jnp.ones_like(decoder_ids)
      encoded = hf.encode(ids, attention_mask=mask, params=params)
      return hf.decode(decoder_ids, encoded, encoder_attention_mask=mask,
                       decoder_attention_mask=decoder_mask, params=params).logits

    of_logits = lambda logits: jnp.mean(jnp.tanh(logits) ** 2)
    loss_fn = lambda v, ids, decoder_ids: of_logits(logits_of(v['params'], ids, decoder_ids))

    @jax.jit
    def by_hand(variables, ids, decoder_ids):
      logits = logits_of(variables['params'], ids, decoder_ids)
      return jax.grad(loss_fn)(variables, ids, decoder_ids), jax.grad(of_logits)(logits)

    want, at_logits = by_hand(variables, ids, decoder_ids)
    _, grads = jax.jit(perturbkit.value_and_grad(loss_fn))(variables, ids, decoder_ids)
  chex.assert_trees_all_close(grads['params'], want['params'], **TOL)
  np.testing.assert_allclose(grads['perturbations']['lm_head']['__call__'], at_logits, **TOL)
  assert float(jnp.abs(at_logits).max()) > 1e-4
