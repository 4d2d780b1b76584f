"""Unmodified Hugging Face Flax models (tiny configs built in code) against independent references.

For GPT-2 (tied LM head), BERT, ViT, ResNet (BatchNorm in eval and train mode), Llama, CLIP
and Whisper, with the ordinary loss a user writes on ``hf_model.module``:

* ``perturbkit.value_and_grad``: the parameter gradients equal ``jax.grad``; every activation
  gradient equals the gradient with respect to an explicit delta added to that call's output
  by a separate interceptor written here (no perturbkit code), and (GPT-2, ResNet) a
  ``jax.jvp`` directional derivative agrees on two points;
* ``interleaved(propagate='original')``: one step equals ``jax.grad`` + the optax update;
* GPT-2 with its blocks as segments, ``propagate='updated'``: two steps equal a per-block
  reference written out with ``jax.vjp``;
* the default (layer-wise) segments: which calls, what goes to REST, and that steps train;
* BERT with Hugging Face's gradient checkpointing (every layer in ``nn.remat``): the same
  activation gradients as the plain model on the same variables.
* BART's decoder (handed the shared embedding) chosen as a segment: a named error;
* the same checkpointed BERT with dropout on and each layer a segment, ``propagate='updated'``:
  one step equals a per-layer reference run on the plain model at the layers' own paths.
* Wav2Vec2 for CTC, whose ``masked_spec_embed`` the loss does not read: its default segments
  are its layers (``masked_spec_embed`` in REST), and one 'updated' step equals a reference
  written per segment with ``nn.intercept_methods`` and ``jax.custom_vjp``.
"""
import dataclasses
import functools
import threading
from typing import Any, Callable

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hf_models
import perturbkit
from explicit_deltas import at, explicit_deltas, points_of, zeros

pytestmark = [pytest.mark.filterwarnings(f) for f in hf_models.FILTER_DEPRECATION]

# float32 throughout; the references run the same ops in a different order and fusion.
TOL = dict(rtol=1e-4, atol=1e-6)
LR = 0.1


@dataclasses.dataclass(frozen=True)
class Setup:
  case: hf_models.Case
  module: nn.Module
  variables: dict
  loss_fn: Callable[..., Any]
  batch: tuple


@pytest.fixture(scope='module', params=sorted(hf_models.CASES))
def built(request) -> Setup:
  case = hf_models.CASES[request.param]
  hf = hf_models.hf_model(case.model)
  loss_fn, batch = case.make(hf.module)
  return Setup(case, hf.module, hf.variables, loss_fn, batch)


@pytest.fixture
def setup(built: Setup):
  with built.case.strictness():
    yield built


def reference_points(s: Setup) -> dict:
  """``{path + (key,): [ShapeDtypeStruct per float leaf]}``, in execution order."""
  return points_of(s.loss_fn, s.variables, *s.batch)


def _max_abs(tree) -> float:
  # In numpy: an eager jnp.max per leaf shape would compile a program of its own.
  return max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(tree))


def _max_abs_diff(a, b) -> float:
  return _max_abs(jax.tree.map(lambda x, y: np.asarray(x) - np.asarray(y), a, b))


# --- value_and_grad --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Reference:
  points: dict          # {path + (key,): [ShapeDtypeStruct per float leaf]}, execution order
  value: Any            # loss (and aux) of the plain loss
  param_grads: Any      # jax.grad of the plain loss
  act_grads: dict       # {point: [d loss / d delta per float leaf]}
  direction: dict       # {point: [array]} for the two probed points (JVP_CASES only)
  derivative: Any       # jax.jvp of the loss along `direction` (None: not probed)
  sgd_params: Any       # the params after one optax.sgd(LR) step with `param_grads`


# The forward-mode check costs a compile of its own; two models of different kinds carry it.
JVP_CASES = ('gpt2', 'resnet_train')


@pytest.fixture(scope='module')
def reference(built: Setup) -> Reference:
  return reference_of(built.case.name)


@functools.cache
def reference_of(name: str) -> Reference:
  """The independent reference of one model, computed once per process (one jit) for the
  tests below."""
  case = hf_models.CASES[name]
  hf = hf_models.hf_model(case.model)
  loss_fn, batch = case.make(hf.module)
  s = Setup(case, hf.module, hf.variables, loss_fn, batch)
  with s.case.strictness():
    points = reference_points(s)
    names = list(points)
    # Two points for the forward-mode check: the first call (an embedding or stem) and one in
    # the middle of the network; random directions there, zero elsewhere.
    probed = [names[0], names[len(names) // 2]] if s.case.name in JVP_CASES else []

    @jax.jit
    def run(variables, *batch):
      # The directions are drawn in this program too (eagerly, each shape compiled its own).
      keys = iter(jax.random.split(jax.random.key(5), 64))
      direction = {n: [jax.random.normal(next(keys), x.shape, x.dtype) for x in points[n]]
                   for n in probed}
      def loss(params, deltas):
        with explicit_deltas(deltas=deltas):
          out = s.loss_fn({**variables, 'params': params}, *batch)
        return (out[0] if s.case.has_aux else out), out

      # At zero deltas the loss is the plain loss: one backward pass gives jax.grad's
      # parameter gradients and the gradient with respect to every call's delta.
      at_zero = zeros(points)
      params = variables['params']
      (_, value), (param_grads, act_grads) = jax.value_and_grad(
          loss, argnums=(0, 1), has_aux=True)(params, at_zero)
      # One optax SGD step with jax.grad's gradients, in the same program.
      sgd = optax.sgd(LR)
      updates, _ = sgd.update(param_grads, sgd.init(params), params)
      sgd_params = optax.apply_updates(params, updates)
      if not direction:
        return value, param_grads, act_grads, {}, None, sgd_params

      def along(t):
        deltas = {n: [t * d for d in direction[n]] if n in direction else z
                  for n, z in at_zero.items()}
        return loss(variables['params'], deltas)[0]

      _, derivative = jax.jvp(along, (jnp.float32(0.0),), (jnp.float32(1.0),))
      return value, param_grads, act_grads, direction, derivative, sgd_params

    value, param_grads, act_grads, direction, derivative, sgd_params = run(s.variables, *s.batch)
    return Reference(points, value, param_grads, act_grads, direction, derivative, sgd_params)


def test_value_and_grad_equals_explicit_deltas_and_jax_grad(setup, reference):
  s, ref = setup, reference
  value, grads = jax.jit(perturbkit.value_and_grad(s.loss_fn, has_aux=s.case.has_aux))(
      s.variables, *s.batch)
  _assert_equals_reference(value, grads, ref)


@pytest.mark.parametrize('name', sorted(hf_models.HF_CALL_LOSSES))
def test_hugging_face_call_equals_explicit_deltas_and_jax_grad(name):
  """The loss calls the HF model as HF's example scripts do, ``model(ids, params=...)``: the
  model builds its variables from the params, without the perturbations perturbkit hands the
  loss (a PerturbationsNotAppliedError before). The reference is the module-call loss's."""
  case = hf_models.CASES[name]
  hf = hf_models.hf_model(case.model)
  _, batch = case.make(hf.module)
  loss_fn = hf_models.HF_CALL_LOSSES[name](hf.model)
  with case.strictness():
    value, grads = jax.jit(perturbkit.value_and_grad(loss_fn, has_aux=case.has_aux))(
        hf.variables, *batch)
  _assert_equals_reference(value, grads, reference_of(name))


def _assert_equals_reference(value, grads, ref: Reference):
  chex.assert_trees_all_close(value, ref.value, **TOL)
  chex.assert_trees_all_close(grads['params'], ref.param_grads, **TOL)
  got = grads['perturbations']
  assert len(ref.points) > 10, list(ref.points)
  assert len(jax.tree.leaves(got)) == sum(len(v) for v in ref.points.values()), (
      'perturbkit has a different number of activation-gradient arrays than the reference '
      f'has float leaves over its {len(ref.points)} calls')
  for name in ref.points:
    got_leaves = jax.tree.leaves(at(got, name))
    assert len(got_leaves) == len(ref.act_grads[name]), name
    for g, w in zip(got_leaves, ref.act_grads[name]):
      np.testing.assert_allclose(g, w, **TOL, err_msg='/'.join(name))
  assert _max_abs(ref.act_grads) > 1e-3
  if not ref.direction:
    return
  # In numpy (float64): eager vdots would compile a program per leaf shape.
  predicted = sum(np.vdot(np.asarray(g, np.float64), np.asarray(d, np.float64))
                  for n in ref.direction
                  for g, d in zip(jax.tree.leaves(at(got, n)), ref.direction[n]))
  np.testing.assert_allclose(predicted, ref.derivative, rtol=1e-3, atol=1e-6)
  assert abs(float(ref.derivative)) > 1e-4


# --- interleaved: 'original' and the default (layer-wise) segments ---------------------------

def _skip_eval_mode_twin(s: Setup):
  if s.case.name == 'resnet_eval':
    pytest.skip('interleaved training runs on resnet_train (BatchNorm in train mode); the eval '
                'mode model is covered by the gradient test')


def test_interleaved_original_equals_jax_grad_and_optax(setup, reference):
  s, ref = setup, reference
  _skip_eval_mode_twin(s)
  tx = perturbkit.interleaved(s.loss_fn, optax.sgd(LR), propagate='original',
                              has_aux=s.case.has_aux)
  state = tx.init(s.variables, *s.batch)
  new_state, metrics = jax.jit(tx.step)(state, *s.batch)

  params = s.variables['params']
  want_params = ref.sgd_params  # jax.grad + optax.sgd(LR), in the reference's program
  value = ref.value
  if s.case.has_aux:
    value, mutated = value
    chex.assert_trees_all_close(new_state.variables['batch_stats'], mutated['batch_stats'],
                                **TOL)
    assert _max_abs_diff(mutated['batch_stats'], s.variables['batch_stats']) > 1e-3
  chex.assert_trees_all_close(metrics['loss'], value, **TOL)
  chex.assert_trees_all_close(new_state.params, want_params, **TOL)
  assert _max_abs_diff(want_params, params) > 1e-3


def _call_order(points: dict) -> list[str]:
  seen: list[str] = []
  for name in points:
    module = '/'.join(name[:-1])
    if module not in seen:
      seen.append(module)
  return seen


def test_default_segments_are_layerwise_and_train(setup, reference):
  """Every call of a module owning params directly is a segment, except tied params (REST)."""
  s, ref = setup, reference
  _skip_eval_mode_twin(s)
  # Adam: plain SGD at LR takes steps of norm ~10 on CLIP (gradient norms ~100 behind its
  # logit scale of 14), after which update-then-propagate overflows, as the README warns.
  tx = perturbkit.interleaved(s.loss_fn, optax.adam(1e-3), has_aux=s.case.has_aux)
  listing = tx.segments(s.variables, *s.batch)
  print(f'{s.case.name}: {len(listing.segments)} default segments, REST: {listing.rest}')

  owners = hf_models.direct_owners(s.variables['params'])
  # A module owning params whose own submodules also own params (ViT's and CLIP's vision
  # embeddings: a class token around a patch convolution) is one segment, the outer module.
  outermost = [o for o in owners if o and not any(o.startswith(p + '/') for p in owners if p)]
  assert set(listing.rest) == set(s.case.rest), listing.rest
  assert all(isinstance(why, str) and why for why in listing.rest.values()), listing.rest
  assert set(listing.segments) == set(outermost) - set(s.case.rest), listing.segments
  called = _call_order(ref.points)
  assert list(listing.segments) == [m for m in called if m in listing.segments]
  for layer in s.case.layers:
    assert any(n.startswith(layer + '/') for n in listing.segments), (layer, listing.segments)

  state = tx.init(s.variables, *s.batch)
  step = jax.jit(tx.step)
  losses = []
  for _ in range(3):
    state, metrics = step(state, *s.batch)
    losses.append(float(metrics['loss']))
  assert set(metrics['grad_norm']) - {perturbkit.REST} == set(listing.segments)
  assert losses[-1] < losses[0], losses


# --- interleaved: GPT-2 blocks, 'updated', against a per-block reference ---------------------

def _gpt2_reference_step(config, mask):
  """One update-then-propagate SGD step on GPT-2 with each block a segment, written out.

  The embeddings (``wte``, ``wpe``) and ``ln_f`` belong to no block: they get their ordinary
  gradient, which includes the tied LM head's read of ``wte``, and are updated at the end.
  Also returns how far the cotangent sent to the first block's input moved because it was
  computed with the block's new weights (so the comparison is not vacuous).
  """
  from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2Block
  block = FlaxGPT2Block(config)
  ln_f = nn.LayerNorm(epsilon=config.layer_norm_epsilon)

  def run_block(w, h):
    return block.apply({'params': w}, h, attention_mask=mask, deterministic=True)[0]

  def embed(rest, ids, positions):
    return (jnp.take(rest['wte']['embedding'], ids, axis=0)
            + jnp.take(rest['wpe']['embedding'], positions, axis=0))

  def head(rest, h, ids):
    logits = ln_f.apply({'params': rest['ln_f']}, h) @ rest['wte']['embedding'].T
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

  sgd = lambda w, g: jax.tree.map(lambda a, b: a - LR * b, w, g)

  def step(params, ids, positions):
    t = params['transformer']
    rest = {k: t[k] for k in ('wte', 'wpe', 'ln_f')}
    blocks = [t['h'][str(i)] for i in range(len(t['h']))]
    h0, embed_vjp = jax.vjp(lambda r: embed(r, ids, positions), rest)
    inputs = [h0]
    for w in blocks[:-1]:
      inputs.append(run_block(w, inputs[-1]))
    top = run_block(blocks[-1], inputs[-1])
    loss, (g_rest, g) = jax.value_and_grad(head, argnums=(0, 1))(rest, top, ids)
    new_blocks = list(blocks)
    for i in reversed(range(len(blocks))):
      _, vjp_old = jax.vjp(run_block, blocks[i], inputs[i])
      dw, g_at_old = vjp_old(g)                # the block's gradient at its old weights
      new_blocks[i] = sgd(blocks[i], dw)       # its step, taken at once
      _, vjp_new = jax.vjp(lambda h, w=new_blocks[i]: run_block(w, h), inputs[i])
      (g,) = vjp_new(g)                        # what the block below receives: NEW weights
    moved = jnp.max(jnp.abs(g - g_at_old)) / jnp.max(jnp.abs(g))
    (g_embed,) = embed_vjp(g)
    new_rest = sgd(rest, jax.tree.map(jnp.add, g_rest, g_embed))
    new_t = {**new_rest, 'h': {str(i): w for i, w in enumerate(new_blocks)}}
    return loss, {'transformer': new_t}, moved

  return step


def test_gpt2_block_segments_updated_equals_per_block_reference():
  from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2Block
  case = hf_models.CASES['gpt2']
  hf = hf_models.hf_model(case.model)
  loss_fn, batch = case.make(hf.module)
  ids, mask, positions = batch
  assert set(hf.variables['params']) == {'transformer'}
  blocks = perturbkit.filters.by_type(FlaxGPT2Block)
  with case.strictness():
    tx = perturbkit.interleaved(loss_fn, optax.sgd(LR), segments=blocks)
    listing = tx.segments(hf.variables, *batch)
    assert list(listing.segments) == ['transformer/h/0', 'transformer/h/1'], listing
    state = tx.init(hf.variables, *batch)
    step = jax.jit(tx.step)
    reference = jax.jit(_gpt2_reference_step(hf.config, mask))
    params = hf.variables['params']
    for _ in range(2):
      state, metrics = step(state, *batch)
      loss, params, moved = reference(params, ids, positions)
      chex.assert_trees_all_close(metrics['loss'], loss, **TOL)
      chex.assert_trees_all_close(state.params, params, **TOL)
      assert float(moved) > 1e-3, float(moved)
  assert set(metrics['grad_norm']) - {perturbkit.REST} == set(listing.segments)


def test_gpt2_chosen_segment_holding_the_tied_embedding_raises():
  """``segments=1`` makes ``transformer`` a segment, but the LM head reads its ``wte`` outside
  that call: an in-sweep step would miss that part of the gradient, so it is an error."""
  case = hf_models.CASES['gpt2']
  hf = hf_models.hf_model(case.model)
  loss_fn, batch = case.make(hf.module)
  tx = perturbkit.interleaved(loss_fn, optax.sgd(LR), segments=1)
  with case.strictness(), pytest.raises(perturbkit.SharedSegmentError, match="'transformer'"):
    tx.init(hf.variables, *batch)


def test_bart_decoder_chosen_as_a_segment_runs_the_shared_embedding_and_raises():
  """BART hands its encoder and decoder the model's shared embedding (``model/shared``) as an
  attribute: the decoder's call runs a module outside it, whose params its replay cannot see
  (it failed inside Flax with ScopeParamNotFoundError), so choosing it is an error that
  names both."""
  import transformers as T
  # BART adds its final logits bias (rank 2) to rank-3 logits in its own code.
  with jax.numpy_rank_promotion('allow'):
    config = T.BartConfig(vocab_size=hf_models.VOCAB, d_model=16, encoder_layers=1,
                          decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                          encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16)
    hf = T.FlaxBartForConditionalGeneration(config, _do_init=False)
    variables = hf_models.filled_variables(hf)
    ids, mask, positions = hf_models._tokens()

    def loss_fn(variables, ids, mask, positions):
      logits = hf.module.apply(variables, ids, mask, ids, mask, positions, positions).logits
      return hf_models._next_token_loss(logits, ids)

    decoder = perturbkit.interleaved(loss_fn, optax.sgd(LR),
                                     segments=perturbkit.filters.by_path('model/decoder'))
    with pytest.raises(perturbkit.SharedSegmentError, match="'model/decoder'.*'model/shared'"):
      decoder.segments(variables, ids, mask, positions)


def test_bert_with_gradient_checkpointing_gives_the_plain_models_gradients():
  """Hugging Face's gradient checkpointing runs every BERT layer inside ``nn.remat``. On the
  same variables, the loss and every activation gradient (the calls inside the layers
  included) equal the plain model's explicit-delta reference above, and the parameter
  gradients its ``jax.grad`` (``nn.remat`` recomputes, it does not change the function)."""
  import transformers as T
  case = hf_models.CASES['bert']
  plain = hf_models.hf_model(case.model)
  checkpointed = T.FlaxBertModel(plain.config, _do_init=False, gradient_checkpointing=True)
  loss_fn, batch = case.make(checkpointed.module)
  variables = plain.variables
  assert 'remat' in str(jax.make_jaxpr(loss_fn)(variables, *batch))  # jax.checkpoint's primitive
  value, grads = jax.jit(perturbkit.value_and_grad(loss_fn))(variables, *batch)
  ref = reference_of('bert')
  calls = flax.traverse_util.flatten_dict(grads['perturbations'], sep='/')
  assert 'encoder/layer/1/attention/self/query/__call__' in calls and len(calls) > 40
  assert len(jax.tree.leaves(grads['perturbations'])) == sum(map(len, ref.points.values()))
  chex.assert_trees_all_close(value, ref.value, **TOL)
  for name in ref.points:
    got_leaves = jax.tree.leaves(at(grads['perturbations'], name))
    assert len(got_leaves) == len(ref.act_grads[name]), name
    for g, w in zip(got_leaves, ref.act_grads[name]):
      np.testing.assert_allclose(g, w, **TOL, err_msg='/'.join(name))
  chex.assert_trees_all_close(grads['params'], ref.param_grads, **TOL)


def _bert_reference_step(plain, mask, key):
  """One update-then-propagate SGD step on BERT with each layer a segment, dropout on.

  Every piece runs on the plain (not checkpointed) module through ``method``, at the path it
  has in the whole model, so its dropout draws the same masks as the whole model does; the
  embeddings and the pooler belong to no layer and are updated at the end.
  """
  def run(params, name, *inputs, method):
    return plain.apply({'params': {**params, **name}}, *inputs, method=method,
                       rngs={'dropout': key})

  def run_layer(params, i, w, h):
    layers = {**params['encoder']['layer'], str(i): w}
    return run(params, {'encoder': {'layer': layers}}, h, method=lambda m, h: m.encoder.layer
               .layers[i](h, mask, None, None, None, False, False, False)[0])

  def embed(params, e, ids, positions):
    return run(params, {'embeddings': e}, ids, positions, method=lambda m, ids, p: m.embeddings(
        ids, jnp.zeros_like(ids), p, mask, deterministic=False))

  def head(params, pooler, h, target):
    pooled = run(params, {'pooler': pooler}, h, method=lambda m, h: m.pooler(h))
    return jnp.mean((h - target) ** 2) + jnp.mean(pooled ** 2)

  sgd = lambda w, g: jax.tree.map(lambda a, b: a - LR * b, w, g)

  def step(params, ids, positions, target):
    n = len(params['encoder']['layer'])
    layers = [params['encoder']['layer'][str(i)] for i in range(n)]
    h0, embed_vjp = jax.vjp(lambda e: embed(params, e, ids, positions), params['embeddings'])
    inputs = [h0]
    for i, w in enumerate(layers):
      inputs.append(run_layer(params, i, w, inputs[-1]))
    loss, (g_pooler, g) = jax.value_and_grad(lambda p, h: head(params, p, h, target),
                                             argnums=(0, 1))(params['pooler'], inputs.pop())
    new_layers = list(layers)
    for i in reversed(range(n)):
      _, vjp_old = jax.vjp(lambda w, h: run_layer(params, i, w, h), layers[i], inputs[i])
      dw, g_at_old = vjp_old(g)
      new_layers[i] = sgd(layers[i], dw)
      _, vjp_new = jax.vjp(lambda h: run_layer(params, i, new_layers[i], h), inputs[i])
      (g,) = vjp_new(g)
    moved = jnp.max(jnp.abs(g - g_at_old)) / jnp.max(jnp.abs(g))
    (g_embed,) = embed_vjp(g)
    return loss, {'embeddings': sgd(params['embeddings'], g_embed),
                  'encoder': {'layer': {str(i): w for i, w in enumerate(new_layers)}},
                  'pooler': sgd(params['pooler'], g_pooler)}, moved

  return step


def test_bert_checkpointed_layer_segments_with_dropout_updated_equals_per_layer_reference():
  """Each BERT layer, run by Hugging Face's gradient checkpointing inside ``nn.remat`` and
  given the integer attention mask, is a segment, with dropout on: the replays inside the
  rematerialized layer draw the model's own masks (they closed over the mask's tracer of
  the remat trace, and the step failed with an UnexpectedTracerError)."""
  import transformers as T
  plain = hf_models.hf_model('bert')
  checkpointed = T.FlaxBertModel(plain.config, _do_init=False, gradient_checkpointing=True)
  ids, mask, positions, target = hf_models.CASES['bert'].make(plain.module)[1]
  key = jax.random.key(3)

  def loss_fn(variables, ids, mask, positions, target, key):
    out = checkpointed.module.apply(variables, ids, mask, jnp.zeros_like(ids), positions,
                                    deterministic=False, rngs={'dropout': key})
    return jnp.mean((out.last_hidden_state - target) ** 2) + jnp.mean(out.pooler_output ** 2)

  batch = (ids, mask, positions, target, key)
  tx = perturbkit.interleaved(loss_fn, optax.sgd(LR),
                              segments=perturbkit.filters.by_path('encoder/layer/*[0-9]'))
  state, metrics = jax.jit(tx.step)(tx.init(plain.variables, *batch), *batch)
  assert set(metrics['grad_norm']) - {perturbkit.REST} == {'encoder/layer/0', 'encoder/layer/1'}
  loss, params, moved = jax.jit(_bert_reference_step(plain.module, mask, key))(
      plain.variables['params'], ids, positions, target)
  chex.assert_trees_all_close(metrics['loss'], loss, **TOL)
  chex.assert_trees_all_close(state.params, params, **TOL)
  assert float(moved) > 1e-3, float(moved)


# --- interleaved: Wav2Vec2 for CTC, its default segments -------------------------------------

W2V_SEGMENTS = tuple(
    ['wav2vec2/feature_extractor/conv_layers/0/conv',
     'wav2vec2/feature_extractor/conv_layers/0/layer_norm',
     'wav2vec2/feature_projection/layer_norm', 'wav2vec2/feature_projection/projection',
     'wav2vec2/encoder/pos_conv_embed/conv']
    + [f'wav2vec2/encoder/layers/{i}/{m}' for i in range(hf_models.LAYERS) for m in (
        'layer_norm', 'attention/q_proj', 'attention/k_proj', 'attention/v_proj',
        'attention/out_proj', 'final_layer_norm', 'feed_forward/intermediate_dense',
        'feed_forward/output_dense')]
    + ['wav2vec2/encoder/layer_norm', 'lm_head'])


@pytest.fixture(scope='module')
def wav2vec2():
  """``(loss_fn, variables, batch, value_and_grad)``: CTC loss of the tiny Wav2Vec2 on random
  audio, and its jitted ``jax.value_and_grad`` in the params (one compile for the tests)."""
  hf = hf_models.wav2vec2_ctc()
  audio = jax.random.normal(jax.random.key(0), (hf_models.BATCH, 100))
  labels = jax.random.randint(jax.random.key(1), (hf_models.BATCH, 3), 1, hf.config.vocab_size)

  def loss_fn(variables, audio, labels):
    logits = hf.module.apply(variables, audio)[0]
    no_padding = jnp.zeros(logits.shape[:2])
    return optax.ctc_loss(logits, no_padding, labels, jnp.zeros(labels.shape)).mean()

  value_and_grad = jax.jit(jax.value_and_grad(lambda p, *b: loss_fn({'params': p}, *b)))
  with jax.numpy_rank_promotion('allow'):
    yield loss_fn, hf.variables, (audio, labels), value_and_grad


def _updated_sgd_reference(loss_fn, names, lr):
  """One ``propagate='updated'`` SGD step with the modules at ``names`` as segments, written
  with ``nn.intercept_methods`` and ``jax.custom_vjp`` (no perturbkit code).

  Each named call runs as ``clone(parent=None).apply`` of its own params; its backward takes
  the params' gradient at the old values, steps, and sends the cotangent to its inputs through
  the NEW params. ``jax.grad`` then gives each segment the gradient its step used and every
  other param its ordinary gradient; all take one SGD step with them.
  """
  replaying = threading.local()

  def interceptor(next_fun, args, kwargs, context):
    module = context.module
    if getattr(replaying, 'depth', 0) or '/'.join(module.path) not in names:
      return next_fun(*args, **kwargs)
    leaves, treedef = jax.tree.flatten((args, kwargs))
    traced = [isinstance(leaf, jax.Array) for leaf in leaves]
    unbound = module.clone(parent=None)

    def run(w, arrays):
      given = iter(arrays)
      a, k = jax.tree.unflatten(treedef, [next(given) if t else leaf
                                          for leaf, t in zip(leaves, traced)])
      replaying.depth = getattr(replaying, 'depth', 0) + 1
      try:
        return unbound.apply({'params': w}, *a, **k, method=context.method_name)
      finally:
        replaying.depth -= 1

    @jax.custom_vjp
    def call(w, arrays):
      return run(w, arrays)

    def backward(saved, g):
      w, arrays = saved
      dw, _ = jax.vjp(run, w, arrays)[1](g)
      new = jax.tree.map(lambda a, b: a - lr * b, w, dw)
      (d_arrays,) = jax.vjp(lambda arrays: run(new, arrays), arrays)[1](g)
      return dw, d_arrays

    call.defvjp(lambda w, arrays: (run(w, arrays), (w, arrays)), backward)
    return call(module.variables['params'], [x for x, t in zip(leaves, traced) if t])

  def step(params, *batch):
    def loss(params):
      with nn.intercept_methods(interceptor):
        return loss_fn({'params': params}, *batch)
    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda a, b: a - lr * b, params, grads)

  return step


def test_wav2vec2_default_segments_updated_equals_a_reference_written_per_segment(wav2vec2):
  loss_fn, variables, batch, value_and_grad = wav2vec2
  lr = 1e-2  # the CTC loss is ~36 here: at 0.1 'updated' overflows (a skipped step)
  tx = perturbkit.interleaved(loss_fn, optax.sgd(lr))
  listing = tx.segments(variables, *batch)
  assert listing.segments == W2V_SEGMENTS, listing.segments
  assert list(listing.rest) == ['wav2vec2'], listing.rest
  state = tx.init(variables, *batch)
  assert set(state.opt_state) == set(W2V_SEGMENTS) | {perturbkit.REST}
  state, metrics = jax.jit(tx.step)(state, *batch)
  loss, params = jax.jit(_updated_sgd_reference(loss_fn, set(W2V_SEGMENTS), lr))(
      variables['params'], *batch)
  chex.assert_trees_all_close(metrics['loss'], loss, **TOL)
  chex.assert_trees_all_close(state.params, params, **TOL)
  # Not the ordinary step: the layers below the head took their gradient through new weights.
  plain = jax.jit(lambda p, *b: jax.tree.map(lambda a, g: a - lr * g, p,
                                             value_and_grad(p, *b)[1]))(variables['params'],
                                                                        *batch)
  assert _max_abs_diff(plain, params) > 1e-3
