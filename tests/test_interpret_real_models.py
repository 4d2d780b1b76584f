"""perturbkit.interpret on unmodified Hugging Face BERT, ViT, Llama, ResNet (eval mode), Whisper
and CLIP (ViT also called as Hugging Face's scripts call it, ``model(pixels, params=...)``).

Tiny configs built in code (``hf_models``); GPT-2 is covered in ``test_interpret.py``. Each
model is checked against references that use no perturbkit code:

* caching every call's output and patching the same values back in with ``run_with_edits``
  gives the unedited output, bit for bit;
* the cached outputs equal Linen's ``capture_intermediates`` on the same inputs;
* activation patching of two layers (every token, or two rows of a feature map) equals a
  Python loop of single patched runs with ``run_with_edits(replace(...))``, and one entry
  equals the model run with the clean value written in by an ``nn.intercept_methods``
  interceptor of this file;
* attribution patching equals ``jnp.vdot(a_clean - a_corrupted, g)`` at each position, the
  activations from ``capture_intermediates`` and ``g`` from ``jax.value_and_grad`` with
  respect to an explicit delta added by that interceptor;
* Grad-CAM of ResNet's two stages equals its formula with the same activations and gradients;
* BERT with gradient checkpointing (its layers in ``nn.remat``) equals the plain model.
"""
import dataclasses
import functools
from typing import Any, Callable

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_models
import perturbkit
from perturbkit import filters, interpret

pytestmark = [pytest.mark.filterwarnings(f) for f in hf_models.FILTER_DEPRECATION]

# float32; the references run the same ops in another order or fusion.
TOL = dict(rtol=1e-4, atol=1e-5)


@dataclasses.dataclass(frozen=True)
class Problem:
  """A model, a scalar metric of its output, clean and corrupted inputs, two layers.

  Attributes:
    forward: ``(variables, inputs, **apply_kwargs) -> module.apply(...)``.
    head: The array of the model's output the metric reads (logits, hidden states).
    score: ``head's array -> scalar``.
    layers: The two layers patched, as module paths.
    axis: The axis of their outputs swept (tokens; rows of a feature map).
    positions: The positions swept along ``axis`` (``None``: all).
    tied: The output layer tied to the input embedding, which runs as its own ``apply``
      (``self.lm_head.apply(...)``) and returns ``head``'s array, if the model has one.
  """
  variables: dict
  forward: Callable[..., Any]
  head: Callable[[Any], jax.Array]
  score: Callable[[jax.Array], jax.Array]
  clean: jax.Array
  corrupted: jax.Array
  layers: tuple[str, str]
  axis: int = 1
  positions: tuple[int, ...] | None = None
  tied: str | None = None

  def run(self, variables, inputs):
    return self.head(self.forward(variables, inputs))

  def metric(self, variables, inputs):
    return self.score(self.run(variables, inputs))

  def intermediates(self, variables, inputs) -> tuple[jax.Array, dict[str, Any]]:
    """The output and ``{'a/b/__call__': output}`` of each module's first ``__call__``.

    From Flax itself (``capture_intermediates``).
    """
    out, state = self.forward(variables, inputs, capture_intermediates=True,
                              mutable=['intermediates'])
    calls = flat(flax.core.unfreeze(state['intermediates']))
    return self.head(out), {k: v[0] for k, v in calls.items()}


def _bert(hf):
  ids, mask, positions = hf_models._tokens()
  forward = lambda v, ids, **kw: hf.module.apply(v, ids, mask, jnp.zeros_like(ids), positions,
                                                 **kw)
  return dict(forward=forward, head=lambda out: out.last_hidden_state,
              score=lambda h: jnp.mean(jnp.tanh(h[:, 0, :8])), clean=ids,
              corrupted=ids.at[:, 3].set(7), layers=('encoder/layer/0', 'encoder/layer/1'))


def _vit(hf):
  pixels = hf_models._image()
  return dict(forward=hf.module.apply, head=lambda out: out.last_hidden_state,
              score=lambda h: jnp.mean(jnp.tanh(h[:, 0, :8])), clean=pixels,
              corrupted=pixels.at[:, :8, :8].set(0.0),  # the first of the four patches
              layers=('encoder/layer/0', 'encoder/layer/1'))


def _llama(hf):
  ids, mask, positions = hf_models._tokens()
  forward = lambda v, ids, **kw: hf.module.apply(v, ids, mask, positions, **kw)
  return dict(forward=forward, head=lambda out: out.logits,
              score=lambda logits: jnp.mean(logits[:, -1, 5] - logits[:, -1, 6]), clean=ids,
              corrupted=ids.at[:, 2].set(7), layers=('model/layers/0', 'model/layers/1'))


def _resnet(hf):
  pixels = hf_models._image()
  forward = lambda v, x, **kw: hf.module.apply(v, x, deterministic=True, **kw)
  return dict(forward=forward, head=lambda out: out.logits,
              score=lambda logits: jnp.mean(logits[:, 0] - logits[:, 1]), clean=pixels,
              corrupted=pixels.at[:, :8].multiply(-1.0),
              layers=('resnet/encoder/stages/0', 'resnet/encoder/stages/1'), positions=(0, 1))


def _whisper(hf):
  """The decoder's layers (self- and cross-attention) on a changed token; the audio features
  fixed."""
  ids, mask, positions = hf_models._tokens()
  features = jax.random.normal(jax.random.key(3), (hf_models.BATCH, 8, 2 * hf_models.SEQ))
  forward = lambda v, ids, **kw: hf.module.apply(v, features, ids, mask, positions, **kw)
  return dict(forward=forward, head=lambda out: out.logits,
              score=lambda logits: jnp.mean(logits[:, -1, 5] - logits[:, -1, 6]), clean=ids,
              corrupted=ids.at[:, 2].set(7),
              layers=('model/decoder/layers/0', 'model/decoder/layers/1'), tied='lm_head')


def _clip(hf):
  """The vision tower's layers on a changed image patch; the text fixed."""
  ids, mask, positions = hf_models._tokens()
  pixels = hf_models._image()
  forward = lambda v, pixels, **kw: hf.module.apply(v, ids, pixels, mask, positions, **kw)
  return dict(forward=forward, head=lambda out: out.logits_per_image,
              score=lambda logits: jnp.mean(logits[:, 0] - logits[:, 1]), clean=pixels,
              corrupted=pixels.at[:, :8, :8].set(0.0),  # the first of the four patches
              layers=('vision_model/encoder/layers/0', 'vision_model/encoder/layers/1'))


def _vit_hf_call(hf):
  """ViT called as Hugging Face's example scripts call it, ``model(pixels, params=...)``: the
  model builds its variables from the params. (Flax's ``capture_intermediates``, a reference,
  runs through the Linen module.)"""
  def forward(variables, pixels, **apply_kwargs):
    if apply_kwargs:
      return hf.module.apply(variables, pixels, **apply_kwargs)
    return hf.model(hf_models._nchw(pixels), params=variables['params'])
  return {**_vit(hf), 'forward': forward}


MAKERS = {'bert': _bert, 'vit': _vit, 'vit_hf_call': _vit_hf_call, 'llama': _llama,
          'resnet_eval': _resnet, 'whisper': _whisper, 'clip': _clip}
CASE_OF = {'vit_hf_call': 'vit'}  # the model and settings of a maker named otherwise


# --- The independent reference: an interceptor of this file -----------------------------

def flat(outputs: dict, prefix: str = '') -> dict[str, Any]:
  """``{'a/b/__call__': output}``; outputs that are mappings (HF's ModelOutput) stay whole."""
  out = {}
  for key, value in outputs.items():
    if type(value) is dict:
      out.update(flat(value, f'{prefix}{key}/'))
    else:
      out[f'{prefix}{key}'] = value
  return out


def hidden(output):
  """A layer's hidden state: HF's layers return a tuple starting with it, ResNet's stages
  the array itself."""
  return output[0] if isinstance(output, tuple) else output


def by_hand(p: Problem) -> Callable[..., jax.Array]:
  """``(variables, inputs, deltas, replaced) -> metric``, each layer's hidden state ``h``
  edited to ``where(mask, value, h) + delta``.

  ``deltas[layer]`` is an array like ``h``; ``replaced[layer] = (mask, value)``. Written
  with ``nn.intercept_methods`` alone, no perturbkit code.
  """

  def metric(variables, inputs, deltas, replaced):
    def interceptor(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      path = '/'.join(context.module.path)
      if context.method_name != '__call__' or path not in deltas:
        return out
      mask, value = replaced[path]
      edited = jnp.where(mask, value, hidden(out)) + deltas[path]
      return (edited,) + out[1:] if isinstance(out, tuple) else edited

    with nn.intercept_methods(interceptor):
      return p.metric(variables, inputs)

  return metric


def at_position(p: Problem, shape: tuple[int, ...], position: int) -> jax.Array:
  """A boolean mask, True at ``position`` along ``p.axis``, broadcasting to ``shape``."""
  return jnp.expand_dims(jnp.arange(shape[p.axis]) == position,
                         tuple(i for i in range(len(shape)) if i != p.axis))


@dataclasses.dataclass(frozen=True)
class Runs:
  """What every test reads, computed once per model.

  Attributes:
    output: The model's output on the clean inputs, from ``run_with_cache``.
    cached: ``run_with_cache``'s outputs of every call on the clean inputs, flattened.
    captured_output: The model's output on the clean inputs, from the capture run.
    clean: ``capture_intermediates`` on the clean inputs, flattened.
    corrupted: The same on the corrupted inputs.
    reference: ``jax.value_and_grad`` of :func:`by_hand` w.r.t. the deltas, jitted.
    corrupted_metric: The metric on the corrupted inputs, from ``reference``.
    grads: d metric / d hidden state of each layer on the corrupted inputs, from ``reference``.
    activation: ``activation_patching`` of the two layers, jitted with ``run_with_cache``.
    attribution: ``attribution_patching`` of the two layers, jitted with it too.
    patched_back: ``run_with_edits`` on the clean inputs with every cached call's output put
      back in (``interpret.replace``), jitted with them too.
  """
  output: jax.Array
  cached: dict[str, Any]
  captured_output: jax.Array
  clean: dict[str, Any]
  corrupted: dict[str, Any]
  reference: Callable[..., Any]
  corrupted_metric: jax.Array
  grads: dict[str, jax.Array]
  activation: Any
  attribution: Any
  patched_back: jax.Array

  def nothing_replaced(self, p: Problem) -> dict[str, tuple[jax.Array, jax.Array]]:
    """A mask False everywhere and a zero value, of the shapes a replaced position has (so
    ``reference`` runs on them and on one replaced position with one compile)."""
    out = {}
    for layer in p.layers:
      h = hidden(self.corrupted[f'{layer}/__call__'])
      out[layer] = (jnp.zeros_like(at_position(p, h.shape, 0)), jnp.zeros_like(h))
    return out

  def zero_deltas(self, p: Problem) -> dict[str, jax.Array]:
    return {layer: jnp.zeros_like(hidden(self.corrupted[f'{layer}/__call__']))
            for layer in p.layers}


@functools.cache
def build(name: str) -> tuple[hf_models.Case, Problem, Runs]:
  """A model's :class:`Problem` and :class:`Runs`, once per process (the module's tests and
  Grad-CAM's read the same compiled runs)."""
  case = hf_models.CASES[CASE_OF.get(name, name)]
  hf = hf_models.hf_model(case.model)
  p = Problem(hf.variables, **MAKERS[name](hf))
  layers = filters.by_path(*p.layers)
  sweep = dict(filter=layers, axis=p.axis, positions=p.positions)

  def under_test(variables, clean, corrupted):
    """The functions under test, compiled together (one compile per model)."""
    output, cache = perturbkit.run_with_cache(p.run)(variables, clean)
    back = {name: interpret.replace(value) for name, value in flat(cache.outputs).items()}
    return ((output, cache),
            perturbkit.activation_patching(p.metric, **sweep)(variables, clean, corrupted),
            perturbkit.attribution_patching(p.metric, **sweep)(variables, clean, corrupted),
            perturbkit.run_with_edits(p.run)(variables, back, clean))

  with case.strictness():
    (output, cache), activation, attribution, patched_back = jax.jit(under_test)(
        p.variables, p.clean, p.corrupted)
    captured = jax.jit(p.intermediates)
    captured_output, clean = captured(p.variables, p.clean)
    _, corrupted = captured(p.variables, p.corrupted)
    reference = jax.jit(jax.value_and_grad(by_hand(p), argnums=2))
    partial = Runs(output, flat(cache.outputs), captured_output, clean, corrupted, reference,
                   None, None, activation, attribution, patched_back)
    value, grads = reference(p.variables, p.corrupted, partial.zero_deltas(p),
                             partial.nothing_replaced(p))
  return case, p, dataclasses.replace(partial, corrupted_metric=value, grads=grads)


@pytest.fixture(scope='module', params=sorted(MAKERS))
def built(request) -> tuple[hf_models.Case, Problem, Runs]:
  return build(request.param)


@pytest.fixture
def problem(built) -> tuple[Problem, Runs]:
  case, p, runs = built
  with case.strictness():
    yield p, runs


def _floats(tree) -> list[jax.Array]:
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]


def _positions(p: Problem, output: jax.Array) -> tuple[int, ...]:
  return p.positions if p.positions is not None else tuple(range(output.shape[p.axis]))


def test_cache_patch_back_and_capture_intermediates(problem):
  p, runs = problem
  chex.assert_trees_all_close(runs.output, runs.captured_output, **TOL)

  # (a) Every call's cached output put back: the unedited output, bit for bit.
  np.testing.assert_array_equal(runs.patched_back, runs.output)

  # (b) Flax's capture_intermediates: every module's __call__, the layers among them. A tied
  # output layer runs as its own apply, which Flax does not capture: its output is the logits.
  calls = [name for name in runs.cached if name.endswith('/__call__')]
  assert {f'{layer}/__call__' for layer in p.layers} <= set(calls)
  tied = [f'{p.tied}/__call__'] if p.tied else []
  assert sorted(set(calls) - set(runs.clean)) == tied and len(calls) > 10
  for name in tied:
    chex.assert_trees_all_close(runs.cached[name], runs.output, **TOL)
    calls.remove(name)
  for name in calls:
    chex.assert_trees_all_close(_floats(runs.cached[name]), _floats(runs.clean[name]), **TOL)


def test_activation_patching(problem):
  p, runs = problem
  layers = filters.by_path(*p.layers)
  result = runs.activation
  names = tuple(f'{layer}/__call__' for layer in p.layers)
  assert result.paths == names
  chex.assert_trees_all_close(result.corrupted_metric, runs.corrupted_metric, **TOL)
  positions = _positions(p, hidden(runs.cached[names[0]]))
  assert result.positions == positions

  # A Python loop of single patched runs, one compile: every layer gets its clean value
  # at the position, all but one switched off.
  single = jax.jit(perturbkit.run_with_edits(p.metric, filter=layers))
  loop = []
  for name in names:
    for position in positions:
      edits = {other: interpret.replace(runs.cached[other], positions=[position], axis=p.axis)
               for other in names}
      edits = {other: dataclasses.replace(edit, active=jnp.asarray(other == name))
               for other, edit in edits.items()}
      loop.append(single(p.variables, edits, p.corrupted) - runs.corrupted_metric)
  chex.assert_trees_all_close(result.effects, jnp.array(loop).reshape(result.effects.shape),
                              **TOL)
  assert float(jnp.abs(result.effects).max()) > 1e-4  # the corruption does something
  # A patch of a value the corrupted run has too, bit for bit (each token before the changed
  # one of a causal model), is the corrupted run itself: exactly 0, also in one batch.
  for i, name in enumerate(names):
    for j, position in enumerate(positions):
      if jnp.array_equal(jnp.take(hidden(runs.clean[name]), position, p.axis),
                         jnp.take(hidden(runs.corrupted[name]), position, p.axis)):
        assert result.effects[i, j] == 0, (name, position)

  # One entry by hand: the clean hidden state from capture_intermediates written in.
  layer, position = p.layers[1], positions[-1]
  clean_hidden = hidden(runs.clean[f'{layer}/__call__'])
  replaced = {**runs.nothing_replaced(p),
              layer: (at_position(p, clean_hidden.shape, position), clean_hidden)}
  value, _ = runs.reference(p.variables, p.corrupted, runs.zero_deltas(p), replaced)
  chex.assert_trees_all_close(result.effects[1, -1], value - runs.corrupted_metric, **TOL)


def test_attribution_patching(problem):
  p, runs = problem
  result = runs.attribution
  chex.assert_trees_all_close(result.corrupted_metric, runs.corrupted_metric, **TOL)
  # g: the metric's gradient w.r.t. a delta added to each layer's hidden state (jax.grad).
  difference = {layer: hidden(runs.clean[f'{layer}/__call__'])
                - hidden(runs.corrupted[f'{layer}/__call__']) for layer in p.layers}
  positions = _positions(p, difference[p.layers[0]])
  want = [[jnp.vdot(jnp.take(difference[layer], position, axis=p.axis),
                    jnp.take(runs.grads[layer], position, axis=p.axis))
           for position in positions] for layer in p.layers]
  assert result.positions == positions
  chex.assert_trees_all_close(result.effects, jnp.array(want), **TOL)


def test_grad_cam_of_resnet_stages_equals_the_formula_by_hand():
  """Grad-CAM of the unmodified Hugging Face ResNet's two stages, whose outputs are feature
  maps ``(batch, height, width, channels)``: ``relu(sum_c mean_hw(G)_c A_c)`` per example, with
  ``A`` from ``capture_intermediates`` and ``G`` from ``jax.grad`` of the interceptor's deltas."""
  # The model's activations and the reference's gradients come from the runs the tests above
  # read (compiled once per process): the reference run here on the clean inputs.
  case, p, runs = build('resnet_eval')
  with case.strictness():
    value, maps = jax.jit(perturbkit.grad_cam(p.metric, filter=filters.by_path(*p.layers)))(
        p.variables, p.clean)
    feature_maps = {layer: hidden(runs.clean[f'{layer}/__call__']) for layer in p.layers}
    want_value, grads = runs.reference(p.variables, p.clean, runs.zero_deltas(p),
                                       runs.nothing_replaced(p))
  want = {f'{layer}/__call__': jax.nn.relu(jnp.einsum(
      'bhwc,bc->bhw', feature_maps[layer], grads[layer].mean(axis=(1, 2)))) for layer in p.layers}
  assert all(m.ndim == 4 for m in feature_maps.values())
  assert all(float(m.max()) > 1e-6 for m in want.values())
  chex.assert_trees_all_close((value, maps), (want_value, want), **TOL)


def test_bert_with_gradient_checkpointing_equals_the_plain_model():
  """Hugging Face's gradient checkpointing runs each BERT layer inside ``nn.remat``: caching
  every call (the calls inside the layers included), attribution patching of every call and
  activation patching of the layers equal the plain model's on the same variables (checked
  against the references above). With dropout on, the cached run is the model's own run: the
  same output as ``apply`` with the same dropout key. ``value_and_grad``'s activations equal
  the plain model's."""
  case = hf_models.CASES['bert']
  plain = hf_models.hf_model(case.model)
  # What `enable_gradient_checkpointing()` builds: the same module with its layers in nn.remat.
  checkpointed = dataclasses.replace(plain, module=plain.module.clone(gradient_checkpointing=True))
  p, twin = (Problem(plain.variables, **_bert(hf)) for hf in (checkpointed, plain))
  # Every call but the pooler's, whose (batch, features) outputs have no token axis.
  every_call = filters.negate(filters.by_path('pooler*'))
  layers = filters.by_path(*p.layers)

  def runs(metric):
    """Caching, ``value_and_grad`` with activations, attribution and activation patching,
    compiled together (one compile per model)."""
    def run(variables, clean, corrupted):
      return (perturbkit.run_with_cache(metric, grads=True)(variables, clean),
              perturbkit.value_and_grad(metric, return_activations=True)(variables, clean),
              perturbkit.attribution_patching(metric, filter=every_call, axis=1)(
                  variables, clean, corrupted),
              perturbkit.activation_patching(metric, filter=layers, axis=1)(
                  variables, clean, corrupted))
    return jax.jit(run)

  with case.strictness():
    got_all = runs(p.metric)(p.variables, p.clean, p.corrupted)
    want_all = runs(twin.metric)(p.variables, p.clean, p.corrupted)
    got, want = got_all[0], want_all[0]
    assert 'encoder/layer/1/attention/self/query/__call__' in flat(got[1].outputs)
    chex.assert_trees_all_close(got, want, **TOL)
    # The model's output without dropout: the encoder's, cached above.
    plain_output = flat(want[1].outputs)['encoder/__call__']['last_hidden_state']
    # value_and_grad's activations too: the encoder's point holds a ModelOutput, which the
    # replay with the perturbations mutable reads back as a dict.
    chex.assert_trees_all_close(got_all[1], want_all[1], **TOL)
    for got, want in zip(got_all[2:], want_all[2:], strict=True):
      assert got.paths == want.paths
      chex.assert_trees_all_close(got, want, **TOL)
      assert float(jnp.abs(want.effects).max()) > 1e-4

    rngs = {'dropout': jax.random.key(3)}
    dropped = lambda v, ids: p.head(p.forward(v, ids, deterministic=False, rngs=rngs))
    # The cached run and the model's own, compiled together.
    (out, _), own = jax.jit(lambda v, ids: (perturbkit.run_with_cache(dropped)(v, ids),
                                            dropped(v, ids)))(p.variables, p.clean)
    np.testing.assert_array_equal(out, own)
    assert not np.allclose(out, plain_output)


def test_checkpointed_whisper_encoder_through_a_returned_submodule_equals_the_plain_model():
  """Hugging Face's ``model.encode`` calls the encoder that a root method returns
  (``module._get_encoder_module()``); with gradient checkpointing its layers run inside
  ``nn.remat``. ``run_with_cache`` equals Linen's ``capture_intermediates`` of the plain
  model, and ``run_with_edits`` equals the plain model with the same delta added by an
  ``nn.intercept_methods`` interceptor."""
  with hf_models.CASES['whisper'].strictness():
    plain = hf_models.hf_model('whisper')
    # What `enable_gradient_checkpointing()` builds.
    checkpointed = plain.module.clone(gradient_checkpointing=True)
    variables = plain.variables
    features = jax.random.normal(jax.random.key(3), (2, 8, 16))
    encoder = lambda m, f: m._get_encoder_module()(f).last_hidden_state
    encode = lambda v, f: checkpointed.apply(v, f, method=encoder)
    fc2 = 'model/encoder/layers/0/fc2'
    delta = jax.random.normal(jax.random.key(4), (2, 8, plain.config.d_model))

    def edited_by_hand(v, f):
      def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        return out + delta if '/'.join(context.module.path) == fc2 else out
      with nn.intercept_methods(interceptor):
        return plain.module.apply(v, f, method=encoder)

    captured = functools.partial(plain.module.apply, method=encoder, capture_intermediates=True,
                                 mutable=['intermediates'])
    want, state = jax.jit(captured)(variables, features)
    wanted = flat(state['intermediates'])
    out, cache = jax.jit(perturbkit.run_with_cache(encode))(variables, features)
    got = flat(cache.outputs)
    chex.assert_trees_all_close(out, want, **TOL)
    for path in ('model/encoder/layers/0/self_attn_layer_norm', fc2, 'model/encoder/layers/0'):
      chex.assert_trees_all_close(hidden(got[f'{path}/__call__']),
                                  hidden(wanted[f'{path}/__call__'][0]), **TOL)
    edited = jax.jit(perturbkit.run_with_edits(encode))(
        variables, {f'{fc2}/__call__': interpret.add(delta)}, features)
    chex.assert_trees_all_close(edited, jax.jit(edited_by_hand)(variables, features), **TOL)
    assert float(jnp.abs(edited - want).max()) > 1e-3
