"""Tiny Hugging Face ``transformers`` Flax models, built in code, with the losses a user writes.

Nothing is downloaded: ``Flax*Model(config, _do_init=False)`` gives the params' tree and
shapes, and :func:`hf_model` fills them locally.
Each :class:`Case` names an HF model, a batch, and an ordinary loss on the model's
underlying Linen module (``hf_model.module``) applied to ``{'params': hf_model.params}``
(plus ``batch_stats`` for ResNet), exactly as one would write it without perturbkit.
"""
import contextlib
import dataclasses
import functools
import inspect
import types
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

BATCH, SEQ, VOCAB, WIDTH, HEADS, LAYERS, IMAGE = 2, 8, 100, 32, 2, 2, 16
# A tiny text config in the names most Hugging Face configs share, for the families that
# are tested beyond CASES (tests/test_real_models_more.py, test_real_models_per_example.py).
SMALL_CONFIG = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=32, max_position_embeddings=16)

# transformers 4.x logs (not warns) that its Flax classes are deprecated; should a release
# turn that into a Python warning, it must not fail the suite (pytest turns warnings into errors).
FILTER_DEPRECATION = [
    'ignore:.*(TensorFlow and JAX classes are deprecated|Flax).*:FutureWarning',
    'ignore:.*(TensorFlow and JAX classes are deprecated|Flax).*:DeprecationWarning',
]


def _gpt2():
  import transformers as T
  config = T.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=WIDTH, n_layer=LAYERS,
                        n_head=HEADS)
  return T.FlaxGPT2LMHeadModel(config, _do_init=False)


def _bert():
  import transformers as T
  config = T.BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
                        max_position_embeddings=16)
  return T.FlaxBertModel(config, _do_init=False)


def _vit():
  import transformers as T
  config = T.ViTConfig(image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=WIDTH,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       intermediate_size=2 * WIDTH)
  return T.FlaxViTModel(config, _do_init=False)


def _resnet():
  import transformers as T
  config = T.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                          layer_type='basic', num_labels=3)
  return T.FlaxResNetForImageClassification(config, input_shape=(1, IMAGE, IMAGE, 3),
                                            _do_init=False)


def _llama():
  import transformers as T
  config = T.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=HEADS, max_position_embeddings=2 * WIDTH)
  # max_position_embeddings >= 2 * head_dim: Flax Llama's rotary table keeps only the first
  # max_position_embeddings columns of its [sin | cos] rows.
  return T.FlaxLlamaForCausalLM(config, _do_init=False)


def _clip():
  import transformers as T
  text = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
              num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=16)
  vision = dict(image_size=IMAGE, patch_size=8, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                num_hidden_layers=LAYERS, num_attention_heads=HEADS)
  config = T.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
  return T.FlaxCLIPModel(config, _do_init=False)


def _whisper():
  import transformers as T
  config = T.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, encoder_layers=LAYERS,
                           decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                           decoder_attention_heads=HEADS, d_model=WIDTH,
                           encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH,
                           max_source_positions=SEQ, max_target_positions=16, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
  # Whisper's encoder wants 2 * max_source_positions frames (its second conv has stride 2).
  return T.FlaxWhisperForConditionalGeneration(config, input_shape=(1, 8, 2 * SEQ),
                                               _do_init=False)


def _next_token_loss(logits, ids):
  return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


def _hidden_state_loss(out, target):
  return jnp.mean((out.last_hidden_state - target) ** 2) + jnp.mean(out.pooler_output ** 2)


def _tokens(seed=0):
  ids = jax.random.randint(jax.random.key(seed), (BATCH, SEQ), 3, VOCAB)
  mask = jnp.ones((BATCH, SEQ), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ))
  return ids, mask, positions


def _image(seed=1):
  return jax.random.normal(jax.random.key(seed), (BATCH, IMAGE, IMAGE, 3))


def _gpt2_case(module):
  def loss_fn(variables, ids, mask, positions):
    logits = module.apply(variables, ids, mask, positions).logits
    return _next_token_loss(logits, ids)
  return loss_fn, _tokens()


def _llama_case(module):
  def loss_fn(variables, ids, mask, positions):
    logits = module.apply(variables, ids, mask, positions).logits
    return _next_token_loss(logits, ids)
  return loss_fn, _tokens()


def _bert_case(module):
  def loss_fn(variables, ids, mask, positions, target):
    out = module.apply(variables, ids, mask, jnp.zeros_like(ids), positions)
    return _hidden_state_loss(out, target)
  target = jax.random.normal(jax.random.key(2), (BATCH, SEQ, WIDTH))
  return loss_fn, _tokens() + (target,)


def _vit_case(module):
  def loss_fn(variables, pixels, target):
    return _hidden_state_loss(module.apply(variables, pixels), target)
  pixels = _image()
  target = jax.random.normal(jax.random.key(2), (BATCH, (IMAGE // 8) ** 2 + 1, WIDTH))
  return loss_fn, (pixels, target)


def _resnet_eval_case(module):
  def loss_fn(variables, pixels, labels):
    logits = module.apply(variables, pixels, deterministic=True).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return loss_fn, (_image(), jnp.array([0, 2]))


def _resnet_train_case(module):
  def loss_fn(variables, pixels, labels):
    out, updates = module.apply(variables, pixels, deterministic=False, mutable=['batch_stats'])
    return optax.softmax_cross_entropy_with_integer_labels(out.logits, labels).mean(), updates
  return loss_fn, (_image(), jnp.array([0, 2]))


def _clip_case(module):
  def loss_fn(variables, ids, pixels, mask, positions):
    out = module.apply(variables, ids, pixels, mask, positions)
    labels = jnp.arange(len(ids))
    return (optax.softmax_cross_entropy_with_integer_labels(out.logits_per_image, labels).mean()
            + optax.softmax_cross_entropy_with_integer_labels(out.logits_per_text, labels).mean())
  ids, mask, positions = _tokens()
  return loss_fn, (ids, _image(), mask, positions)


def _whisper_case(module):
  def loss_fn(variables, features, ids, mask, positions):
    logits = module.apply(variables, features, ids, mask, positions).logits
    return _next_token_loss(logits, ids)
  features = jax.random.normal(jax.random.key(3), (BATCH, 8, 2 * SEQ))
  return (loss_fn, (features,) + _tokens())


def _nchw(pixels):
  return jnp.transpose(pixels, (0, 3, 1, 2))  # Hugging Face's vision models take NCHW


def _gpt2_hf_call(hf):
  def loss_fn(variables, ids, mask, positions):
    return _next_token_loss(hf(ids, mask, positions, params=variables['params']).logits, ids)
  return loss_fn


def _bert_hf_call(hf):
  def loss_fn(variables, ids, mask, positions, target):
    out = hf(ids, mask, jnp.zeros_like(ids), positions, params=variables['params'])
    return _hidden_state_loss(out, target)
  return loss_fn


def _vit_hf_call(hf):
  def loss_fn(variables, pixels, target):
    return _hidden_state_loss(hf(_nchw(pixels), params=variables['params']), target)
  return loss_fn


def _resnet_train_hf_call(hf):
  def loss_fn(variables, pixels, labels):
    out, updates = hf(_nchw(pixels), params=variables, train=True)  # params and batch_stats
    return optax.softmax_cross_entropy_with_integer_labels(out.logits, labels).mean(), updates
  return loss_fn


# The CASES' losses as Hugging Face's example scripts write them: the HF model called with
# the params, ``model(ids, params=variables['params'])``, which builds its variables itself
# and applies its Linen module. ``hf -> loss_fn``, the same function as the case's loss.
HF_CALL_LOSSES = {'gpt2': _gpt2_hf_call, 'bert': _bert_hf_call, 'vit': _vit_hf_call,
                  'resnet_train': _resnet_train_hf_call}


@dataclasses.dataclass(frozen=True)
class Case:
  """One model and loss.

  Attributes:
    name: The test id.
    model: Key into ``BUILDERS`` (ResNet's two cases share one model).
    make: ``module -> (loss_fn, batch)``; ``loss_fn(variables, *batch)``.
    has_aux: The loss returns ``(loss, mutated collections)`` (BatchNorm in train mode).
    rank_promotion: ``'allow'`` for models whose own code broadcasts across ranks.
    layers: Module paths of the repeated layers (each must get a default segment).
    rest: Module paths whose params no default segment may own: tied weights read outside
      their module's call, and ``''`` for params created in the root module itself.
  """
  name: str
  model: str
  make: Callable[[Any], tuple[Callable[..., Any], tuple]]
  has_aux: bool = False
  rank_promotion: str = 'raise'
  layers: tuple[str, ...] = ()
  rest: tuple[str, ...] = ()

  def strictness(self):
    """The rank-promotion setting the model runs under, as a context manager."""
    if self.rank_promotion == 'raise':
      return contextlib.nullcontext()
    return jax.numpy_rank_promotion(self.rank_promotion)


def _layers(prefix, n=LAYERS):
  return tuple(f'{prefix}/{i}' for i in range(n))


BUILDERS = {'gpt2': _gpt2, 'bert': _bert, 'vit': _vit, 'resnet': _resnet, 'llama': _llama,
            'clip': _clip, 'whisper': _whisper}

# GPT-2 (Conv1D bias), Llama (RMSNorm weight) and Whisper (position embeddings) add a
# rank-1 array to a rank-3 one in their own code, which the suite's strict
# jax_numpy_rank_promotion='raise' rejects; those three run with 'allow', only inside the
# test that uses them.
CASES = {c.name: c for c in [
    Case('gpt2', 'gpt2', _gpt2_case, rank_promotion='allow', layers=_layers('transformer/h'),
         rest=('transformer/wte',)),
    Case('bert', 'bert', _bert_case, layers=_layers('encoder/layer')),
    Case('vit', 'vit', _vit_case, layers=_layers('encoder/layer')),
    Case('resnet_eval', 'resnet', _resnet_eval_case,
         layers=_layers('resnet/encoder/stages', 2)),
    Case('resnet_train', 'resnet', _resnet_train_case, has_aux=True,
         layers=_layers('resnet/encoder/stages', 2)),
    Case('llama', 'llama', _llama_case, rank_promotion='allow', layers=_layers('model/layers')),
    Case('clip', 'clip', _clip_case,
         layers=_layers('text_model/encoder/layers') + _layers('vision_model/encoder/layers'),
         rest=('',)),  # CLIP's logit_scale is a param of the root module
    Case('whisper', 'whisper', _whisper_case, rank_promotion='allow',
         layers=_layers('model/encoder/layers') + _layers('model/decoder/layers'),
         rest=('model/decoder/embed_tokens',)),
]}


@dataclasses.dataclass(frozen=True)
class Built:
  """An HF model's Linen module, its variables and its config, and the HF model itself
  (``model``: called as ``model(ids, params=variables['params'])`` it builds its variables
  from the params and applies ``module``)."""
  module: Any
  variables: dict
  config: Any
  model: Any


def _initial_value(path: tuple, shape: tuple, rng: np.random.Generator) -> np.ndarray:
  # HF's own recipe in numpy: normal(0, 0.02) weights and embeddings (initializer_range),
  # He-normal over fan-out for ResNet's convolutions, zero biases and means, unit norm scales
  # and variances, CLIP's logit scale log(1 / 0.07).
  name = path[-1]
  if name in ('scale', 'weight', 'var'):
    return np.ones(shape, np.float32)
  if name in ('bias', 'mean'):
    return np.zeros(shape, np.float32)
  if name == 'logit_scale':
    return np.full(shape, np.log(1 / 0.07), np.float32)
  std = np.sqrt(2.0 / (np.prod(shape[:2]) * shape[-1])) if len(shape) == 4 else 0.02
  return (std * rng.standard_normal(shape)).astype(np.float32)


@functools.cache
def hf_model(model: str) -> Built:
  """The HF model, built once per process, with params made locally.

  ``Flax*Model(config, _do_init=False)`` traces the model's own ``init`` abstractly; the
  params (same tree, shapes and dtypes) are then filled in numpy with a fixed seed. HF's
  ``init_weights`` would compile or dispatch op by op a whole initialization per model, the
  largest part of this suite's time on a small CPU, for values no test depends on.
  """
  with next(c for c in CASES.values() if c.model == model).strictness():
    hf = BUILDERS[model]()
  return Built(hf.module, filled_variables(hf), hf.config, hf)


@functools.cache
def wav2vec2_ctc() -> Built:
  """Hugging Face's ``FlaxWav2Vec2ForCTC``, tiny (one conv of the feature extractor, two
  layers), built once per process. Its ``wav2vec2`` module owns ``masked_spec_embed`` around
  the whole encoder and reads it only when ``mask_time_indices`` is given. Its positional
  convolution adds a rank-1 bias to a rank-3 array: run it under
  ``jax.numpy_rank_promotion('allow')``."""
  import transformers as T
  config = T.Wav2Vec2Config(vocab_size=12, hidden_size=16, num_hidden_layers=LAYERS,
                            num_attention_heads=HEADS, intermediate_size=32, conv_dim=(8,),
                            conv_stride=(5,), conv_kernel=(10,), num_conv_pos_embeddings=4,
                            num_conv_pos_embedding_groups=2, do_stable_layer_norm=True,
                            feat_extract_norm='layer')
  with jax.numpy_rank_promotion('allow'):
    hf = T.FlaxWav2Vec2ForCTC(config, input_shape=(1, 100), _do_init=False)
  return Built(hf.module, filled_variables(hf), hf.config, hf)


# T5 in the names of its own config: the smallest model with every part of the real one (two
# layers per stack, two heads, a relative position bias of 8 buckets).
T5_CONFIG = dict(vocab_size=VOCAB, d_model=16, d_ff=32, num_layers=LAYERS,
                 num_decoder_layers=LAYERS, num_heads=HEADS, d_kv=8,
                 relative_attention_num_buckets=8, relative_attention_max_distance=16,
                 dropout_rate=0.0)


class _NumpyWithClipKeywords(types.ModuleType):
  """``jax.numpy``, whose ``clip`` also takes the ``a_min``/``a_max`` keywords that JAX has
  since removed (now ``min``/``max``), as older JAX did."""

  def __getattr__(self, name):
    return getattr(jnp, name)

  @staticmethod
  def clip(x, a_min=None, a_max=None, **kwargs):
    return jnp.clip(x, kwargs.pop('min', a_min), kwargs.pop('max', a_max), **kwargs)


@contextlib.contextmanager
def t5_numpy():
  """Runs Hugging Face's Flax T5 and LongT5 (mT5 is T5) on this JAX, unmodified otherwise.

  Their relative position buckets call ``jnp.clip(x, a_max=...)``, a keyword JAX no longer
  takes; while this runs, their modules' ``jnp`` is one whose ``clip`` takes it as older JAX
  did (a bucket index: nothing differentiable). Building a T5 model and tracing a function
  that runs it must happen inside. Nothing changes where JAX still takes the keyword.
  """
  if 'a_max' in inspect.signature(jnp.clip).parameters:
    yield
    return
  import transformers.models.longt5.modeling_flax_longt5 as longt5
  import transformers.models.t5.modeling_flax_t5 as t5
  modules = (t5, longt5)
  saved = [m.jnp for m in modules]
  try:
    for m in modules:
      m.jnp = _NumpyWithClipKeywords('jax.numpy')
    yield
  finally:
    for m, numpy in zip(modules, saved):
      m.jnp = numpy


@functools.cache
def t5(model: str = 'FlaxT5ForConditionalGeneration', gradient_checkpointing: bool = False,
       **config) -> Built:
  """Hugging Face's Flax T5 ``model`` (``FlaxT5EncoderModel``: the encoder alone) at
  :data:`T5_CONFIG` (updated by ``config``), built once per process; run it inside
  :func:`t5_numpy` and ``jax.numpy_rank_promotion('allow')`` (its LayerNorm scales a rank-3
  array by a rank-1 weight). Each stack's first layer owns the relative position bias and
  hands it to the later layers as an output; the encoder, the decoder and the (tied) LM head
  share one embedding."""
  import transformers as T
  with t5_numpy(), jax.numpy_rank_promotion('allow'):
    hf = getattr(T, model)(T.T5Config(**{**T5_CONFIG, **config}), _do_init=False,
                           gradient_checkpointing=gradient_checkpointing)
  return Built(hf.module, filled_variables(hf), hf.config, hf)


def filled_variables(hf) -> dict:
  """The variables of an HF Flax model built with ``_do_init=False``, filled in numpy."""
  shapes = flax.traverse_util.flatten_dict(flax.core.unfreeze(hf.params_shape_tree))
  rng = np.random.default_rng(0)
  flat = {path: jnp.asarray(_initial_value(path, leaf.shape, rng))
          for path, leaf in sorted(shapes.items())}
  params = flax.traverse_util.unflatten_dict(flat)
  return params if 'params' in params else {'params': params}


def direct_owners(params, prefix=()) -> list[str]:
  """Module paths whose params dict holds arrays directly (not only through submodules)."""
  out = []
  if any(not isinstance(v, dict) for v in params.values()):
    out.append('/'.join(prefix))
  for k, v in params.items():
    if isinstance(v, dict):
      out.extend(direct_owners(v, prefix + (k,)))
  return out
