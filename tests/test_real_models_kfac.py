"""Whole-model K-FAC on unmodified Hugging Face Flax models (tiny configs built in code).

BERT (Dense + Embed + LayerNorm, token-classification logits), ViT (Conv patch embedding +
Dense, image logits), GPT-2 (tied LM head, ``FlaxConv1D`` layers), Llama (bias-free Dense, its
own RMSNorm module with a ``weight``, untied LM head) and ResNet in train mode (Conv + Dense, BatchNorm through
``has_aux``), each with the ordinary softmax cross-entropy (and T5's encoder, whose own
``FlaxT5LayerNorm`` is an RMSNorm with a ``weight`` too):

* ``kfac_layers`` against the module tree seen by an interceptor written here: every
  Dense/Conv/Embed/LayerNorm owner, every Hugging Face ``FlaxConv1D`` (a Dense layer with a
  ``(d_out, d_in)`` kernel) and ``FlaxLlamaRMSNorm`` is a layer of its kind and shape, every
  other owner is skipped with its type named; GPT-2's tied ``wte`` (also read by the LM head) is skipped with the read named
  and refused when a filter selects it;
* the estimator's A and G of three layers per model (empirical Fisher on the true labels, and
  sampled with a fixed key) against a reference without perturbkit: the layer inputs captured by
  an ``nn.intercept_methods`` interceptor, the per-example output gradients from explicit deltas
  that interceptor adds to the call's output, A and G formed in numpy with the documented
  conventions (A sums over locations and averages over examples; G averages over every row; an
  Embed's A is the token counts over examples; a Conv's rows are its patches; a LayerNorm's
  (RMSNorm's) factors are the mean square of each example's scale and bias gradients,
  ``Σ_t g_t ⊙ x̂_t`` and ``Σ_t g_t``, with ``x̂`` normalised here in float64);
* jitted ``kfac_preconditioner`` + optax steps: the first update of a layer is
  ``(A + λI)⁻¹ [∇W; ∇b] (G + λI)⁻¹`` of the returned factors (``∇θ / (F + λ)`` for a
  LayerNorm), and two steps lower the loss.
"""
import dataclasses
import functools
from typing import Any, Callable

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hf_models
import perturbkit

pytestmark = [pytest.mark.filterwarnings(f) for f in hf_models.FILTER_DEPRECATION]

TOL = dict(rtol=1e-4, atol=1e-6)
DAMPING, LR = 0.1, 0.05
RULES = {nn.Dense: 'dense', nn.Conv: 'conv', nn.Embed: 'embed'}


def rule_of(module: nn.Module) -> str | None:
  """The kind of layer K-FAC should make of ``module``: ``'conv1d'`` for Hugging Face's
  ``FlaxConv1D`` (``x @ kernel.T + bias``), ``'norm'`` for a LayerNorm, ``'rms'`` for
  Llama's RMSNorm and T5's LayerNorm (``weight * x / sqrt(mean(x²) + eps)``), else by
  type."""
  if type(module).__name__ == 'FlaxConv1D':
    return 'conv1d'
  if type(module).__name__ in ('FlaxLlamaRMSNorm', 'FlaxT5LayerNorm'):
    return 'rms'
  if type(module) is nn.LayerNorm:
    return 'norm'
  return next((k for t, k in RULES.items() if isinstance(module, t)), None)


def weight_of(kind: str) -> str:
  return {'embed': 'embedding', 'norm': 'scale', 'rms': 'weight'}.get(kind, 'kernel')


@dataclasses.dataclass(frozen=True)
class KFACCase:
  """A model, its prediction, a batch with labels and the layers checked by hand.

  Attributes:
    name: Key into ``hf_models.CASES`` (for the model and its rank-promotion setting).
    predict: ``(module) -> predict_fn(variables, inputs)``.
    batch: ``() -> (inputs, labels)``.
    checked: Module paths of the layers whose factors are checked by hand.
    stepped: The layer whose first preconditioned update is checked by hand.
    has_aux: ``predict_fn`` returns ``(logits, mutated collections)``.
    tied: Owners read outside their calls (skipped with the read named).
  """
  name: str
  predict: Callable[[nn.Module], Callable[..., Any]]
  batch: Callable[[], tuple]
  checked: tuple[str, ...]
  stepped: str
  has_aux: bool = False
  tied: tuple[str, ...] = ()


def _labels(n, classes, seed=7):
  return jax.random.randint(jax.random.key(seed), (hf_models.BATCH,) + n, 0, classes)


def _positions(ids):
  """Each example's positions, ``(examples, length)``: passed in the batch, as K-FAC needs
  every embedding's input to come from it (made inside ``predict`` they would be a constant
  every example might share, and the position table would be skipped)."""
  return jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)


def _bert_predict(module):
  # Token classification on the hidden states (WIDTH classes); the batch is (ids, token
  # types, positions).
  def predict(variables, batch):
    ids, types, positions = batch
    return module.apply(variables, ids, jnp.ones_like(ids), types, positions).last_hidden_state
  return predict


def _vit_predict(module):
  return lambda variables, pixels: module.apply(variables, pixels).pooler_output


def _causal_lm_predict(module):
  # Next-token logits (GPT-2, Llama); the batch is (ids, positions), the labels are the ids
  # shifted by one.
  def predict(variables, batch):
    ids, positions = batch
    return module.apply(variables, ids, jnp.ones_like(ids), positions).logits[:, :-1]
  return predict


def _resnet_predict(module):
  def predict(variables, pixels):
    out, updates = module.apply(variables, pixels, deterministic=False, mutable=['batch_stats'])
    return out.logits, updates
  return predict


def _token_batch():
  ids = hf_models._tokens()[0]
  return (ids, jnp.zeros_like(ids), _positions(ids)), _labels((hf_models.SEQ,), hf_models.WIDTH)


def _next_token_batch():
  ids = hf_models._tokens()[0]
  return (ids, _positions(ids)), ids[:, 1:]


def _image_batch():
  return hf_models._image(), _labels((), 3)


CASES = {c.name: c for c in [
    KFACCase('bert', _bert_predict, _token_batch,
             ('embeddings/word_embeddings', 'encoder/layer/0/attention/self/query',
              'encoder/layer/1/output/dense', 'encoder/layer/0/output/LayerNorm'),
             'encoder/layer/0/attention/self/query'),
    KFACCase('vit', _vit_predict, _image_batch,
             ('embeddings/patch_embeddings/projection',
              'encoder/layer/0/attention/attention/value', 'encoder/layer/1/intermediate/dense'),
             'encoder/layer/1/intermediate/dense'),
    KFACCase('gpt2', _causal_lm_predict, _next_token_batch,
             ('transformer/wpe', 'transformer/h/0/attn/c_attn', 'transformer/h/1/mlp/c_proj',
              'transformer/h/1/ln_2'), 'transformer/h/1/mlp/c_fc', tied=('transformer/wte',)),
    KFACCase('llama', _causal_lm_predict, _next_token_batch,
             ('model/embed_tokens', 'model/layers/0/self_attn/q_proj', 'lm_head',
              'model/layers/1/post_attention_layernorm'),
             'model/layers/1/mlp/down_proj'),
    KFACCase('resnet_train', _resnet_predict, _image_batch,
             ('resnet/embedder/embedder/convolution',
              'resnet/encoder/stages/1/layers/0/shortcut/convolution', 'classifier/1'),
             'classifier/1', has_aux=True),
]}


@dataclasses.dataclass(frozen=True)
class Setup:
  case: KFACCase
  hf: hf_models.Case
  predict: Callable[..., Any]
  variables: dict
  inputs: Any
  labels: jax.Array
  layers: perturbkit.KFACLayers


@functools.cache
def build(name: str) -> Setup:
  """The model, its K-FAC layers and batch, once per process."""
  case = CASES[name]
  hf_case = hf_models.CASES[case.name]
  hf = hf_models.hf_model(hf_case.model)
  predict = case.predict(hf.module)
  inputs, labels = case.batch()
  with hf_case.strictness():
    layers = perturbkit.kfac_layers(predict, hf.variables, inputs)
  return Setup(case, hf_case, predict, hf.variables, inputs, labels, layers)


@pytest.fixture(scope='module', params=list(CASES))
def built(request) -> Setup:
  return build(request.param)


@pytest.fixture
def setup(built: Setup):
  with built.hf.strictness():
    yield built


# --- The reference: a module tree and explicit deltas of our own ------------------------------

def _called(module: nn.Module, method_name: str) -> bool:
  return module.scope is not None and bool(module.path) and method_name.isidentifier()


def _logits(s: Setup, out):
  return out[0] if s.case.has_aux else out


def _nll_sum(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum()


@dataclasses.dataclass(frozen=True)
class Reference:
  inputs: dict       # {path: the call's input}
  outputs: dict      # {path: the call's output}
  modules: dict      # {path: (kind, kernel_size, strides, padding)} static attributes
  g_true: dict       # {path: d(sum of per-example losses at the labels)/d delta}
  g_sampled: dict    # the same at labels drawn from the model with KEY
  param_grads: Any   # jax.grad of the mean loss
  tree: dict         # {path: (a bound module, {method names called})} of every submodule call


KEY = jax.random.key(11)


def reference(s: Setup) -> Reference:
  """Inputs, outputs and per-example output gradients of the checked calls, without perturbkit."""
  checked = {tuple(p.split('/')) for p in s.case.checked}
  modules: dict = {}
  tree: dict = {}

  def forward(variables, deltas):
    inputs, outputs = {}, {}

    def interceptor(next_fun, args, kwargs, context):
      module = context.module
      if _called(module, context.method_name) and context.method_name != 'setup':
        tree.setdefault('/'.join(module.path), (module, set()))[1].add(context.method_name)
      path = tuple(module.path) if module.scope is not None else None
      if context.method_name != '__call__' or path not in checked:
        return next_fun(*args, **kwargs)
      name = '/'.join(path)
      assert name not in inputs, f'{name} is called twice'
      out = next_fun(*args, **kwargs)
      inputs[name], outputs[name] = (args[0] if args else kwargs['inputs']), out
      kind = rule_of(module)
      if kind == 'conv':
        modules[name] = (kind, module.kernel_size, module.strides, module.padding)
      elif kind == 'norm':
        modules[name] = (kind, module.epsilon)
      elif kind == 'rms':  # T5 keeps its epsilon in a field, Llama in its config
        eps = module.eps if hasattr(module, 'eps') else module.config.rms_norm_eps
        modules[name] = (kind, eps)
      else:
        modules[name] = (kind,)
      return out if deltas is None else out + deltas[name]

    with nn.intercept_methods(interceptor):
      out = s.predict(variables, s.inputs)
    return _logits(s, out), (inputs, outputs)

  @jax.jit
  def run(variables, labels):
    logits, (inputs, outputs) = forward(variables, None)
    zeros = jax.tree.map(jnp.zeros_like, outputs)
    sampled = jax.random.categorical(KEY, logits.astype(jnp.float32), axis=-1)
    # One backward pass gives the param gradients and the deltas' at the true labels.
    summed = lambda p, d, y: _nll_sum(forward({**variables, 'params': p}, d)[0], y)
    param_grads, g_true = jax.grad(summed, argnums=(0, 1))(variables['params'], zeros, labels)
    g_sampled = jax.grad(summed, argnums=1)(variables['params'], zeros, sampled)
    param_grads = jax.tree.map(lambda g: g / labels.shape[0], param_grads)
    return inputs, outputs, g_true, g_sampled, param_grads

  inputs, outputs, g_true, g_sampled, param_grads = run(s.variables, s.labels)
  return Reference(inputs, outputs, modules, g_true, g_sampled, param_grads, tree)


def _pairs(value, n):
  return (value,) * n if isinstance(value, int) else tuple(value)


def hand_patches(x, kernel_size, strides, padding) -> np.ndarray:
  """``(N, out_h, out_w, kh*kw*C)`` windows of an NHWC input, in the HWIO kernel's order."""
  kernel_size, strides = _pairs(kernel_size, 2), _pairs(strides or 1, 2)
  if padding == 'VALID':
    pads = [(0, 0)] * 2
  elif padding == 'SAME':
    pads = []
    for size, k, s in zip(x.shape[1:3], kernel_size, strides):
      total = max((-(-size // s) - 1) * s + k - size, 0)
      pads.append((total // 2, total - total // 2))
  else:
    pads = [(p, p) if isinstance(p, int) else tuple(p) for p in _pairs(padding, 2)]
  x = np.pad(np.asarray(x, np.float64), [(0, 0), *pads, (0, 0)])
  (kh, kw), (sh, sw) = kernel_size, strides
  oh, ow = (x.shape[1] - kh) // sh + 1, (x.shape[2] - kw) // sw + 1
  windows = [x[:, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw, :]
             for i in range(kh) for j in range(kw)]
  return np.stack(windows, axis=3).reshape(x.shape[0], oh, ow, -1)


def hand_norm_diagonals(ref: Reference, name: str, params: dict, g: np.ndarray):
  """The diagonal Fisher of a LayerNorm's scale and bias (an RMSNorm's weight): the mean over
  examples of the square of each example's gradients, ``Σ_t g_t ⊙ x̂_t`` and ``Σ_t g_t``."""
  kind, eps = ref.modules[name]
  x = np.asarray(ref.inputs[name], np.float64)
  centered = x - x.mean(axis=-1, keepdims=True) if kind == 'norm' else x
  x_hat = centered / np.sqrt((centered ** 2).mean(axis=-1, keepdims=True) + eps)
  scale = np.asarray(params['scale' if kind == 'norm' else 'weight'])
  bias = np.asarray(params['bias']) if kind == 'norm' else 0.0
  # The hand normalisation is the layer: scale and bias on it give the model's own output.
  np.testing.assert_allclose(x_hat * scale + bias, ref.outputs[name], rtol=1e-4, atol=1e-4,
                             err_msg=name)
  per_example = lambda t: t.reshape(x.shape[0], -1, x.shape[-1]).sum(axis=1)
  scale_diagonal = np.mean(per_example(g * x_hat) ** 2, axis=0)
  return scale_diagonal, (np.mean(per_example(g) ** 2, axis=0) if kind == 'norm' else np.zeros(0))


def hand_factors(s: Setup, ref: Reference, name: str, grads: dict) -> tuple[np.ndarray, ...]:
  """A and G of one layer from the captured input and per-example output gradients."""
  kind = ref.modules[name][0]
  x = np.asarray(ref.inputs[name])
  g = np.asarray(grads[name], np.float64)
  g = g.reshape(-1, g.shape[-1])
  examples = x.shape[0]
  params = s.variables['params']
  for k in name.split('/'):
    params = params[k]
  if kind == 'embed':
    a = np.bincount(x.ravel(), minlength=params['embedding'].shape[0]) / examples
    return a, g.T @ g / g.shape[0]
  if kind in ('norm', 'rms'):
    return hand_norm_diagonals(ref, name, params, np.asarray(grads[name], np.float64))
  if kind == 'conv':
    _, size, strides, padding = ref.modules[name]
    rows = hand_patches(x, size, strides, padding)
    kernel = np.asarray(params['kernel'], np.float64)
    conv = rows @ kernel.reshape(-1, kernel.shape[-1]) + (
        np.asarray(params['bias']) if 'bias' in params else 0.0)
    # The hand patches are the convolution: the model's own output.
    np.testing.assert_allclose(conv, ref.outputs[name], rtol=1e-4, atol=1e-5, err_msg=name)
  else:
    rows = x
  rows = np.asarray(rows, np.float64).reshape(-1, rows.shape[-1])
  if 'bias' in params:
    rows = np.concatenate([rows, np.ones((rows.shape[0], 1))], axis=1)
  return rows.T @ rows / examples, g.T @ g / g.shape[0]


def assert_close(got, want, what):
  want = np.asarray(want, np.float64)
  if want.size == 0:      # a norm without a bias: its bias diagonal is empty
    assert np.shape(got) == want.shape, what
    return
  scale = float(np.max(np.abs(want)))
  assert scale > 0, f'{what}: the reference is all zeros'
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-5 * scale,
                             err_msg=what)


# --- kfac_layers -------------------------------------------------------------------------------

def test_layers_are_the_dense_conv_embed_calls_of_the_module_tree(setup, ref):
  """``kfac_layers`` against the module tree the reference's interceptor saw."""
  s = setup
  tree = ref.tree
  owners = hf_models.direct_owners(s.variables['params'])
  expected_layers, expected_skipped = {}, {}
  for owner in owners:
    module, methods = tree[owner]
    kind = rule_of(module)
    if owner in s.case.tied:
      continue
    if kind is None:
      expected_skipped[owner] = f'{type(module).__name__} has no K-FAC rule'
      continue
    assert methods == {'__call__'}, (owner, methods)
    params = s.variables['params']
    for k in owner.split('/'):
      params = params[k]
    expected_layers[owner] = ({'conv1d': 'dense', 'rms': 'norm'}.get(kind, kind),
                              params[weight_of(kind)].shape, 'bias' in params, kind == 'conv1d')
  got = {name: (info.kind, info.kernel_shape, info.use_bias, info.transposed)
         for name, info in s.layers.layers.items()}
  assert got == expected_layers
  assert {k: v for k, v in s.layers.skipped.items() if k not in s.case.tied} == expected_skipped
  assert all(s.layers.layers[name].calls == ('__call__',) for name in s.layers.layers)
  for name in s.case.tied:
    assert 'read outside its calls (by transpose)' in s.layers.skipped[name]
    assert name not in s.layers.layers


def test_bert_with_gradient_checkpointing_gets_the_plain_models_layers_and_factors():
  """Hugging Face's gradient checkpointing runs each BERT layer inside ``nn.remat``: the
  layers there are preconditioned like the plain model's (the same layers and skips), and the
  estimator's loss, gradients and factors equal the plain model's, whose factors the tests
  above check against the explicit-delta reference."""
  s = build('bert')
  plain = hf_models.hf_model(s.hf.model)
  # What `enable_gradient_checkpointing()` builds: the same module with its layers in nn.remat.
  predict = _bert_predict(plain.module.clone(gradient_checkpointing=True))
  with s.hf.strictness():
    layers = perturbkit.kfac_layers(predict, s.variables, s.inputs)
    assert layers == s.layers
    assert 'encoder/layer/1/attention/self/query' in layers.layers
    # The plain model's: its empirical estimate and the sampled one of its first K-FAC step
    # (the same estimator at KEY), computed once for this test and the factor tests below.
    plain = {'empirical': empirical_estimate('bert'), 'sampled': sampled_steps('bert')[0][:3]}
    estimator = functools.partial(perturbkit.kfac_estimator, predict, 'softmax_cross_entropy',
                                  layers)
    # Both estimates of the checkpointed model, compiled together.
    got = jax.jit(lambda variables, inputs, labels, key: {
        'empirical': estimator(fisher='empirical')(variables, inputs, labels),
        'sampled': estimator(fisher='sampled')(variables, inputs, labels, key)})(
            s.variables, s.inputs, s.labels, KEY)
    for fisher in ('empirical', 'sampled'):
      chex.assert_trees_all_close(got[fisher], plain[fisher], **TOL)


def test_gpt2_conv1d_layers_are_transposed_dense_and_the_tied_embedding_is_named():
  """GPT-2's four ``FlaxConv1D`` projections per block are Dense layers with ``(d_out, d_in)``
  kernels, and its LayerNorms are layers; its ``wte`` embedding is also the transposed LM-head
  kernel, so K-FAC factors of its ``__call__`` would miss part of its gradient: skipped by
  default, and an error when a filter selects it."""
  s = build('gpt2')
  conv1d = {n for n, info in s.layers.layers.items() if info.transposed}
  assert len(conv1d) == 4 * hf_models.LAYERS and all(
      s.layers.layers[n].kind == 'dense' for n in conv1d), s.layers.layers
  norms = {n for n, info in s.layers.layers.items() if info.kind == 'norm'}
  assert len(norms) == 2 * hf_models.LAYERS + 1
  assert set(s.layers.layers) == conv1d | norms | {'transformer/wpe'}
  assert list(s.layers.skipped) == ['transformer/wte']
  filters = perturbkit.filters
  with s.hf.strictness():
    with pytest.raises(perturbkit.KFACUnsupportedLayerError,
                       match=r"transformer/wte.*read outside its calls \(by transpose\)"
                             r".*filters\.negate\(perturbkit\.filters\.by_path"):
      perturbkit.kfac_layers(s.predict, s.variables, s.inputs, filter=filters.by_type(nn.Embed))
    # The fix the error suggests: leave the tied embedding out of the filter.
    only = perturbkit.kfac_layers(
        s.predict, s.variables, s.inputs,
        filter=filters.all_of(filters.by_type(nn.Embed),
                              filters.negate(filters.by_path('transformer/wte'))))
  assert list(only.layers) == ['transformer/wpe']
  assert only.skipped['transformer/wte'] == 'not selected by the filter'


def test_t5_layer_norms_get_the_rms_diagonal():
  """Hugging Face's T5 normalises with a ``FlaxT5LayerNorm`` of its own, an RMSNorm with a
  ``weight`` and an ``eps`` field: each of its encoder's (every sublayer's and the final one)
  is a norm layer whose empirical factor is the mean square of each example's
  ``Σ_t g_t ⊙ x̂_t``, against the explicit-delta reference (token classification on the
  hidden states). Its relative position table, looked up at buckets the model makes itself,
  is skipped."""
  t5 = hf_models.t5('FlaxT5EncoderModel')
  ids = hf_models._tokens()[0]
  labels = _labels((hf_models.SEQ,), t5.config.d_model)
  predict = lambda variables, ids: t5.module.apply(variables, ids,
                                                   jnp.ones_like(ids)).last_hidden_state
  checked = ('encoder/block/0/layer/0/layer_norm', 'encoder/final_layer_norm')
  with jax.numpy_rank_promotion('allow'), hf_models.t5_numpy():
    layers = perturbkit.kfac_layers(predict, t5.variables, ids)
    s = Setup(KFACCase('t5', None, None, checked, checked[0]), None, predict, t5.variables,
              ids, labels, layers)
    ref = reference(s)
    _, grads, stats = jax.jit(perturbkit.kfac_estimator(
        predict, 'softmax_cross_entropy', layers, fisher='empirical'))(t5.variables, ids, labels)
  norms = {name for name, info in layers.layers.items() if info.kind == 'norm'}
  assert len(norms) == 2 * hf_models.LAYERS + 1, norms
  assert all(name.endswith('layer_norm') and layers.layers[name].param == 'weight'
             and not layers.layers[name].use_bias for name in norms)
  bias = 'encoder/block/0/layer/0/SelfAttention/relative_attention_bias'
  assert list(layers.skipped) == [bias]
  # Its buckets cannot be passed in the batch: the reason says so, not only how to pass ids.
  assert "T5's relative position buckets" in layers.skipped[bias]
  chex.assert_trees_all_close(grads, ref.param_grads, **TOL)
  for name in checked:
    a, g = hand_factors(s, ref, name, ref.g_true)
    assert_close(stats[name].a, a, f'{name}.a')
    assert_close(stats[name].g, g, f'{name}.g')


def test_batchnorm_in_train_mode_needs_has_aux():
  s = build('resnet_train')
  estimate = perturbkit.kfac_estimator(s.predict, 'softmax_cross_entropy', s.layers)
  with pytest.raises(perturbkit.KFACOutputError, match='has_aux=True'):
    jax.eval_shape(lambda v: estimate(v, s.inputs, s.labels, KEY), s.variables)


# --- factors -----------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def ref(built: Setup) -> Reference:
  with built.hf.strictness():
    return reference(built)


def _tx(s: Setup):
  return optax.chain(perturbkit.kfac_preconditioner(s.layers, damping=DAMPING, inverse_every=1,
                                                    stats_every=1),
                     optax.sgd(LR))


@functools.cache
def estimates(name: str) -> tuple[list, tuple]:
  """Three calls of one jitted sampled-Fisher K-FAC step (two updates, then the loss): each
  ``(loss, grads, stats, updates, opt_state, new variables)``; and the empirical-Fisher
  estimate on the true labels at the model's variables, compiled in the same program (one
  compile per model), from the first call. Once per process."""
  s = build(name)
  estimate = perturbkit.kfac_estimator(s.predict, 'softmax_cross_entropy', s.layers,
                                       has_aux=s.case.has_aux)
  empirical = perturbkit.kfac_estimator(s.predict, 'softmax_cross_entropy', s.layers,
                                        fisher='empirical', has_aux=s.case.has_aux)
  tx = _tx(s)

  @jax.jit
  def step(variables, opt_state, key):
    out = estimate(variables, s.inputs, s.labels, key)
    loss, grads, stats = out[:3]
    updates, opt_state = tx.update(grads, opt_state, variables['params'], kfac_stats=stats)
    new = {**variables, 'params': optax.apply_updates(variables['params'], updates)}
    if s.case.has_aux:
      new.update(out[3])
    return (loss, grads, stats, updates, opt_state, new), empirical(variables, s.inputs, s.labels)

  with s.hf.strictness():
    variables, opt_state = s.variables, jax.jit(tx.init)(s.variables['params'])
    results = []
    for _ in range(3):
      result, empirical_out = step(variables, opt_state, KEY)
      results.append(result)
      if len(results) == 1:
        first_empirical = empirical_out
      variables, opt_state = result[5], result[4]
  return results, first_empirical


def sampled_steps(name: str) -> list:
  """The three sampled-Fisher steps of :func:`estimates`."""
  return estimates(name)[0]


@pytest.fixture(scope='module')
def steps(built: Setup):
  return sampled_steps(built.case.name)


def empirical_estimate(name: str) -> tuple:
  """The jitted empirical-Fisher estimate on the true labels (:func:`estimates`)."""
  return estimates(name)[1]


def test_sampled_factors_and_gradient_equal_the_explicit_delta_reference(setup, ref, steps):
  s = setup
  _, grads, stats, *_ = steps[0]
  chex.assert_trees_all_close(grads, ref.param_grads, **TOL)
  for name in s.case.checked:
    a, g = hand_factors(s, ref, name, ref.g_sampled)
    assert_close(stats[name].a, a, f'{name}.a')
    assert_close(stats[name].g, g, f'{name}.g (sampled)')


def test_empirical_factors_equal_the_explicit_delta_reference(setup, ref):
  s = setup
  out = empirical_estimate(s.case.name)
  loss, grads, stats = out[:3]
  chex.assert_trees_all_close(grads, ref.param_grads, **TOL)
  for name in s.case.checked:
    a, g = hand_factors(s, ref, name, ref.g_true)
    assert_close(stats[name].a, a, f'{name}.a')
    assert_close(stats[name].g, g, f'{name}.g (empirical)')
  if s.case.has_aux:
    assert set(out[3]) == {'batch_stats'}


# --- preconditioner + optax --------------------------------------------------------------------

def test_preconditioned_step_is_the_damped_sandwich_and_lowers_the_loss(setup, steps):
  s = setup
  (loss0, grads, _, updates, opt_state, _), (loss1, *_), (loss2, *_) = steps
  info = s.layers.layers[s.case.stepped]
  factors = opt_state[0].factors[s.case.stepped]
  layer_grads, layer_updates = grads, updates
  for k in info.path:
    layer_grads, layer_updates = layer_grads[k], layer_updates[k]
  grad = np.asarray(layer_grads[info.param], np.float64)
  # A FlaxConv1D kernel is stored (d_out, d_in): the matrix the factors act on is its transpose.
  matrix = lambda w: w.T if info.transposed else w.reshape(-1, w.shape[-1])
  theta = matrix(grad)
  if info.use_bias:
    theta = np.concatenate([theta, np.asarray(layer_grads['bias'])[None]], axis=0)
  a, g = np.asarray(factors.a, np.float64), np.asarray(factors.g, np.float64)
  eye = lambda n: np.eye(n)
  g_inv = np.linalg.inv(g + DAMPING * eye(len(g)))
  if info.kind == 'embed':
    want = (theta / (a + DAMPING)[:, None]) @ g_inv
  else:
    want = np.linalg.solve(a + DAMPING * eye(len(a)), theta) @ g_inv
  got = matrix(np.asarray(layer_updates[info.param], np.float64))
  if info.use_bias:
    got = np.concatenate([got, np.asarray(layer_updates['bias'])[None]], axis=0)
  assert_close(-got / LR, want, f'{s.case.stepped} preconditioned update')
  # Each norm's scale and bias: the gradient over its damped diagonal Fisher.
  for name, info in s.layers.layers.items():
    if info.kind != 'norm':
      continue
    layer_grads, layer_updates = grads, updates
    for k in info.path:
      layer_grads, layer_updates = layer_grads[k], layer_updates[k]
    diagonals = opt_state[0].factors[name]
    leaves = ((info.param, diagonals.a),) + ((('bias', diagonals.g),) if info.use_bias else ())
    for leaf, diagonal in leaves:
      want = np.asarray(layer_grads[leaf], np.float64) / (np.asarray(diagonal) + DAMPING)
      assert_close(-np.asarray(layer_updates[leaf], np.float64) / LR, want, f'{name}/{leaf}')
  # Everything that is not a K-FAC layer (BatchNorm, a tied embedding) takes the plain
  # gradient through the fallback.
  owned = {info.path for info in s.layers.layers.values()}
  flat_g = jax.tree_util.tree_flatten_with_path(grads)[0]
  flat_u = jax.tree.leaves(updates)
  for (path, g_leaf), u_leaf in zip(flat_g, flat_u):
    keys = tuple(k.key for k in path)
    if keys[:-1] not in owned:
      np.testing.assert_allclose(u_leaf, -LR * g_leaf, rtol=1e-6, atol=1e-9,
                                 err_msg='/'.join(keys))
  assert float(loss1) < float(loss0) and float(loss2) < float(loss1), (loss0, loss1, loss2)


# --- Position tables every example shares -------------------------------------------------------

def _pair_predict(ids_index, output):
  """``predict(variables, batch)`` of a model taking two batched arrays, one of them token ids,
  then their positions (passed per example, in the batch), returning ``output`` of its
  result."""
  def make(module):
    def predict(variables, batch):
      *pair, positions = batch
      mask = jnp.ones_like(pair[ids_index])
      return getattr(module.apply(variables, *pair, mask, positions), output)
    return predict
  return make


@pytest.mark.parametrize('name, predict, shared', [
    ('clip', _pair_predict(0, 'logits_per_image'), 'vision_model/embeddings/position_embedding'),
    ('whisper', _pair_predict(1, 'logits'), 'model/encoder/embed_positions')], ids=['clip', 'whisper'])
def test_position_tables_the_model_looks_up_itself_are_skipped(name, predict, shared):
  """CLIP's vision positions (a ``(1, patches)`` id buffer) and Whisper's encoder positions
  (``jnp.arange`` inside the model) are outputs every example shares: the gradient at them sums
  over the examples, so K-FAC skips them; the text/decoder positions passed per example stay."""
  hf_case = hf_models.CASES[name]
  hf = hf_models.hf_model(hf_case.model)
  ids = hf_models._tokens()[0]
  batch = ((ids, hf_models._image()) if name == 'clip' else
           (jax.random.normal(jax.random.key(3), (hf_models.BATCH, 8, 2 * hf_models.SEQ)), ids))
  batch = (*batch, _positions(ids))
  with hf_case.strictness():
    layers = perturbkit.kfac_layers(predict(hf.module), hf.variables, batch)
  assert 'is not computed from the batch' in layers.skipped[shared]
  per_example = {'clip': 'text_model/embeddings/position_embedding',
                 'whisper': 'model/decoder/embed_positions'}[name]
  assert layers.layers[per_example].kind == 'embed'


def test_opt_feed_forward_layers_on_token_rows_average_over_the_batch():
  """OPT runs each layer's ``fc1``/``fc2`` and ``final_layer_norm`` on ``(examples * tokens,
  features)`` rows. Its Dense layers' A sums over those rows and averages over the batch's
  examples (captured by an interceptor written here); its ``final_layer_norm``, whose rows
  cannot be told apart by example, is skipped with the reason."""
  import test_real_models_more as more
  build, make = more._families()['opt']
  with jax.numpy_rank_promotion('allow'):
    hf = build()
    variables = hf_models.filled_variables(hf)
    ids = jax.random.randint(jax.random.key(0), (hf_models.BATCH, hf_models.SEQ), 3,
                             hf_models.VOCAB)

    def predict(v, ids):
      positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
      return hf.module.apply(v, ids, jnp.ones_like(ids), positions).logits[:, :-1]

    layers = perturbkit.kfac_layers(predict, variables, ids)
    estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                         fisher='empirical')
    _, _, stats = jax.jit(estimate)(variables, ids, ids[:, 1:])

    @jax.jit  # the forward pass, compiled rather than op by op: only its values are read
    def inputs_seen(variables, ids):
      seen = {}

      def interceptor(next_fun, args, kwargs, context):
        if context.method_name == '__call__' and context.module.scope is not None:
          seen.setdefault('/'.join(context.module.path), args[0] if args else None)
        return next_fun(*args, **kwargs)

      with nn.intercept_methods(interceptor):
        predict(variables, ids)
      return {'model/decoder/layers/0/fc1': seen['model/decoder/layers/0/fc1']}

    seen = inputs_seen(variables, ids)
  for i in range(2):
    assert "does not have the batch's 2 examples" in layers.skipped[
        f'model/decoder/layers/{i}/final_layer_norm']
  x = np.asarray(seen['model/decoder/layers/0/fc1'], np.float64)
  assert x.shape == (hf_models.BATCH * hf_models.SEQ, x.shape[-1])
  rows = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)
  assert_close(stats['model/decoder/layers/0/fc1'].a, rows.T @ rows / hf_models.BATCH,
               'fc1.a')
