"""perturbkit.interpret on unmodified Hugging Face BERT, ViT, Llama and ResNet (eval mode).

Tiny configs built in code (``hf_models``); GPT-2 is covered in ``test_interpret.py``. Each
model is checked against references that use no perturbkit code:

* caching every call's output and patching the same values back in with ``run_with_edits``
  gives the unedited output;
* the cached outputs equal Linen's ``capture_intermediates`` on the same inputs;
* activation patching of two layers (every token, or two rows of a feature map) equals a
  Python loop of single patched runs with ``run_with_edits(replace(...))``, and one entry
  equals the model run with the clean value written in by an ``nn.intercept_methods``
  interceptor of this file;
* attribution patching equals ``jnp.vdot(a_clean - a_corrupted, g)`` at each position, the
  activations from ``capture_intermediates`` and ``g`` from ``jax.vjp`` with respect to an
  explicit delta added by that interceptor.
"""
import dataclasses
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

  def run(self, variables, inputs):
    return self.head(self.forward(variables, inputs))

  def metric(self, variables, inputs):
    return self.score(self.run(variables, inputs))

  def intermediates(self, variables, inputs) -> dict[str, Any]:
    """``{'a/b/__call__': output}`` of each module's first ``__call__``, from Flax itself."""
    _, state = self.forward(variables, inputs, capture_intermediates=True,
                            mutable=['intermediates'])
    return {k: v[0] for k, v in flat(flax.core.unfreeze(state['intermediates'])).items()}


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


MAKERS = {'bert': _bert, 'vit': _vit, 'llama': _llama, 'resnet_eval': _resnet}


@dataclasses.dataclass(frozen=True)
class Runs:
  """What every test reads, computed once per model.

  Attributes:
    output: The model's output on the clean inputs (jitted, unedited).
    cached: ``run_with_cache``'s outputs of every call on the clean inputs, flattened.
    clean: ``capture_intermediates`` on the clean inputs, flattened.
    corrupted: The same on the corrupted inputs.
    corrupted_metric: The metric on the corrupted inputs (jitted).
  """
  output: jax.Array
  cached: dict[str, Any]
  clean: dict[str, Any]
  corrupted: dict[str, Any]
  corrupted_metric: jax.Array


@pytest.fixture(scope='module', params=sorted(MAKERS))
def built(request) -> tuple[hf_models.Case, Problem, Runs]:
  case = hf_models.CASES[request.param]
  hf = hf_models.hf_model(case.model)
  p = Problem(hf.variables, **MAKERS[request.param](hf))
  with case.strictness():
    output, cache = jax.jit(perturbkit.run_with_cache(p.run))(p.variables, p.clean)
    captured = jax.jit(p.intermediates)
    runs = Runs(output, flat(cache.outputs), captured(p.variables, p.clean),
                captured(p.variables, p.corrupted),
                jax.jit(p.metric)(p.variables, p.corrupted))
  return case, p, runs


@pytest.fixture
def problem(built) -> tuple[Problem, Runs]:
  case, p, runs = built
  with case.strictness():
    yield p, runs


# --- The independent reference: an interceptor of this file -----------------------------

def hand_edited(fn: Callable[..., Any], edits: dict[str, Callable[[jax.Array], jax.Array]]):
  """``fn`` with ``edits[path](hidden)`` in place of that layer's hidden state.

  HF's layers return a tuple whose first item is the hidden state; ResNet's stages return
  the array itself. Written with ``nn.intercept_methods`` alone, no perturbkit code.
  """

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    path = '/'.join(context.module.path)
    if context.method_name != '__call__' or path not in edits:
      return out
    if isinstance(out, tuple):
      return (edits[path](out[0]),) + out[1:]
    return edits[path](out)

  def edited(variables, inputs):
    with nn.intercept_methods(interceptor):
      return fn(variables, inputs)

  return edited


def hidden(output):
  return output[0] if isinstance(output, tuple) else output


def flat(outputs: dict, prefix: str = '') -> dict[str, Any]:
  """``{'a/b/__call__': output}``; outputs that are mappings (HF's ModelOutput) stay whole."""
  out = {}
  for key, value in outputs.items():
    if type(value) is dict:
      out.update(flat(value, f'{prefix}{key}/'))
    else:
      out[f'{prefix}{key}'] = value
  return out


def _floats(tree) -> list[jax.Array]:
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]


def test_cache_patch_back_and_capture_intermediates(problem):
  p, runs = problem
  np.testing.assert_array_equal(runs.output, jax.jit(p.run)(p.variables, p.clean))

  # (a) Every call's cached output put back: the unedited output, bit for bit.
  back = {name: interpret.replace(value) for name, value in runs.cached.items()}
  edited = jax.jit(perturbkit.run_with_edits(p.run))(p.variables, back, p.clean)
  np.testing.assert_array_equal(edited, runs.output)

  # (b) Flax's capture_intermediates: every module's __call__, the layers among them.
  calls = [name for name in runs.cached if name.endswith('/__call__')]
  assert {f'{layer}/__call__' for layer in p.layers} <= set(calls)
  assert set(calls) <= set(runs.clean) and len(calls) > 10
  for name in calls:
    chex.assert_trees_all_close(_floats(runs.cached[name]), _floats(runs.clean[name]), **TOL)


def _positions(p: Problem, output: jax.Array) -> tuple[int, ...]:
  return p.positions if p.positions is not None else tuple(range(output.shape[p.axis]))


def test_activation_patching(problem):
  p, runs = problem
  layers = filters.by_path(*p.layers)
  result = jax.jit(perturbkit.activation_patching(p.metric, filter=layers, axis=p.axis,
                                                  positions=p.positions))(
      p.variables, p.clean, p.corrupted)
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

  # One entry by hand: the clean hidden state from capture_intermediates written in.
  layer, position = p.layers[1], positions[-1]
  clean_hidden = hidden(runs.clean[f'{layer}/__call__'])
  put = lambda h: jnp.where(
      jnp.expand_dims(jnp.arange(h.shape[p.axis]) == position,
                      tuple(i for i in range(h.ndim) if i != p.axis)), clean_hidden, h)
  by_hand = hand_edited(p.metric, {layer: put})(p.variables, p.corrupted)
  chex.assert_trees_all_close(result.effects[1, -1], by_hand - runs.corrupted_metric, **TOL)


def test_attribution_patching(problem):
  p, runs = problem
  result = jax.jit(perturbkit.attribution_patching(
      p.metric, filter=filters.by_path(*p.layers), axis=p.axis, positions=p.positions))(
          p.variables, p.clean, p.corrupted)
  difference = {layer: hidden(runs.clean[f'{layer}/__call__'])
                - hidden(runs.corrupted[f'{layer}/__call__']) for layer in p.layers}

  # g: the metric's gradient w.r.t. a delta added to each layer's hidden state, by jax.vjp.
  def with_deltas(deltas):
    edits = {layer: (lambda h, layer=layer: h + deltas[layer]) for layer in p.layers}
    return hand_edited(p.metric, edits)(p.variables, p.corrupted)

  zeros = {layer: jnp.zeros_like(d) for layer, d in difference.items()}
  value, vjp = jax.vjp(with_deltas, zeros)
  (g,) = jax.jit(vjp)(jnp.ones_like(value))
  positions = _positions(p, difference[p.layers[0]])
  want = [[jnp.vdot(jnp.take(difference[layer], position, axis=p.axis),
                    jnp.take(g[layer], position, axis=p.axis)) for position in positions]
          for layer in p.layers]
  assert result.positions == positions
  chex.assert_trees_all_close(result.effects, jnp.array(want), **TOL)
  chex.assert_trees_all_close(result.corrupted_metric, value, **TOL)
