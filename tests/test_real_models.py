"""Unmodified Hugging Face Flax models (tiny configs built in code) against independent references.

For GPT-2 (tied LM head), BERT, ViT, ResNet (BatchNorm in eval and train mode), Llama, CLIP
and Whisper, with the ordinary loss a user writes on ``hf_model.module``:

* ``perturbkit.value_and_grad``: the parameter gradients equal ``jax.grad``; every activation
  gradient equals the gradient with respect to an explicit delta added to that call's output
  by a separate interceptor written here (no perturbkit code), and a ``jax.jvp`` directional
  derivative agrees on two points;
* ``interleaved(propagate='original')``: one step equals ``jax.grad`` + the optax update;
* GPT-2 with its blocks as segments, ``propagate='updated'``: two steps equal a per-block
  reference written out with ``jax.vjp``;
* the default (layer-wise) segments: which calls, what goes to REST, and that steps train.
"""
import contextlib
import dataclasses
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

  def scalar_loss(self, variables, *batch):
    out = self.loss_fn(variables, *batch)
    return out[0] if self.case.has_aux else out


@pytest.fixture(scope='module', params=sorted(hf_models.CASES))
def built(request) -> Setup:
  case = hf_models.CASES[request.param]
  hf = hf_models.hf_model(case.model)
  loss_fn, batch = case.make(hf.module)
  return Setup(case, hf.module, hf_models.variables_of(hf), loss_fn, batch)


@pytest.fixture
def setup(built: Setup):
  with built.case.strictness():
    yield built


# --- The reference: explicit deltas added by an interceptor of our own ---------------------

def _is_model_call(module: nn.Module, method_name: str) -> bool:
  # Submodule method calls only: not the root (nor a root made by a nested `apply`, as GPT-2's
  # tied LM head does), not `setup`, not Flax's internal lambda-named helpers.
  return (module.scope is not None and bool(module.path) and method_name != 'setup'
          and method_name.isidentifier())


def _is_float(leaf) -> bool:
  return isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.inexact)


@contextlib.contextmanager
def explicit_deltas(deltas: dict | None = None, shapes: dict | None = None):
  """Adds ``deltas[path + (key,)][i]`` to the i-th float leaf of every submodule call's output.

  ``key`` is the method name, then ``'#1'``, ``'#2'``... for later calls of the same method of
  the same module. With ``shapes``, records the float leaves' shapes under the same names.
  """
  counts: dict = {}

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    module, method = context.module, context.method_name
    if not _is_model_call(module, method):
      return out
    path = tuple(module.path)
    n = counts.get((path, method), 0)
    counts[(path, method)] = n + 1
    name = path + (method if n == 0 else f'{method}#{n}',)
    leaves, treedef = jax.tree.flatten(out)
    where = [i for i, leaf in enumerate(leaves) if _is_float(leaf)]
    if not where:
      return out
    if shapes is not None:
      shapes[name] = [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in where]
    if deltas is not None:
      for i, delta in zip(where, deltas[name]):
        leaves[i] = leaves[i] + delta
    return jax.tree.unflatten(treedef, leaves)

  with nn.intercept_methods(interceptor):
    yield


def reference_points(s: Setup) -> dict:
  """``{path + (key,): [ShapeDtypeStruct per float leaf]}``, in execution order."""
  shapes: dict = {}

  def run(variables, *batch):
    with explicit_deltas(shapes=shapes):
      return s.loss_fn(variables, *batch)

  jax.eval_shape(run, s.variables, *s.batch)
  return shapes


def loss_with_deltas(s: Setup, deltas, variables, *batch):
  with explicit_deltas(deltas=deltas):
    return s.scalar_loss(variables, *batch)


def _zeros(shapes: dict) -> dict:
  return {name: [jnp.zeros(x.shape, x.dtype) for x in leaves] for name, leaves in shapes.items()}


def _at(tree, name: tuple):
  for k in name:
    tree = tree[k]
  return tree


def _max_abs(tree) -> float:
  return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))


# --- value_and_grad --------------------------------------------------------------------------

def test_value_and_grad_equals_explicit_deltas_and_jax_grad(setup):
  s = setup
  shapes = reference_points(s)
  names = list(shapes)
  assert len(names) > 10, names
  # Two points for the forward-mode check: the first call (an embedding or stem) and one in
  # the middle of the network; random directions there, zero elsewhere.
  probed = [names[0], names[len(names) // 2]]
  keys = iter(jax.random.split(jax.random.key(5), 64))
  direction = {n: [jax.random.normal(next(keys), x.shape, x.dtype) for x in shapes[n]]
               for n in probed}

  @jax.jit
  def reference(variables, *batch):
    def loss(params):
      return s.loss_fn({**variables, 'params': params}, *batch)
    value, param_grads = jax.value_and_grad(loss, has_aux=s.case.has_aux)(variables['params'])
    zeros = _zeros(shapes)
    act_grads = jax.grad(lambda d: loss_with_deltas(s, d, variables, *batch))(zeros)

    def along(t):
      deltas = {n: [t * d for d in direction[n]] if n in direction else z
                for n, z in zeros.items()}
      return loss_with_deltas(s, deltas, variables, *batch)

    _, derivative = jax.jvp(along, (jnp.float32(0.0),), (jnp.float32(1.0),))
    return value, param_grads, act_grads, derivative

  value, grads = jax.jit(perturbkit.value_and_grad(s.loss_fn, has_aux=s.case.has_aux))(
      s.variables, *s.batch)
  want_value, want_params, want_acts, derivative = reference(s.variables, *s.batch)

  chex.assert_trees_all_close(value, want_value, **TOL)
  chex.assert_trees_all_close(grads['params'], want_params, **TOL)
  got = grads['perturbations']
  assert len(jax.tree.leaves(got)) == sum(len(v) for v in shapes.values()), (
      'perturbkit has a different number of activation-gradient arrays than the reference '
      f'has float leaves over its {len(names)} calls')
  for name in names:
    got_leaves = jax.tree.leaves(_at(got, name))
    assert len(got_leaves) == len(want_acts[name]), name
    for g, w in zip(got_leaves, want_acts[name]):
      np.testing.assert_allclose(g, w, **TOL, err_msg='/'.join(name))
  assert _max_abs(want_acts) > 1e-3
  predicted = sum(jnp.vdot(g, d) for n in probed
                  for g, d in zip(jax.tree.leaves(_at(got, n)), direction[n]))
  np.testing.assert_allclose(predicted, derivative, rtol=1e-3, atol=1e-6)
  assert abs(float(derivative)) > 1e-4


# --- interleaved: 'original' -----------------------------------------------------------------

def test_interleaved_original_equals_jax_grad_and_optax(setup):
  s = setup
  tx = perturbkit.interleaved(s.loss_fn, optax.sgd(LR), propagate='original',
                              has_aux=s.case.has_aux)
  state = tx.init(s.variables, *s.batch)
  new_state, metrics = jax.jit(tx.step)(state, *s.batch)

  @jax.jit
  def standard(variables, *batch):
    params = variables['params']
    loss = lambda p: s.loss_fn({**variables, 'params': p}, *batch)
    value, grads = jax.value_and_grad(loss, has_aux=s.case.has_aux)(params)
    sgd = optax.sgd(LR)
    updates, _ = sgd.update(grads, sgd.init(params), params)
    return value, optax.apply_updates(params, updates)

  value, want_params = standard(s.variables, *s.batch)
  if s.case.has_aux:
    value, updates = value
    chex.assert_trees_all_close(new_state.variables['batch_stats'], updates['batch_stats'],
                                **TOL)
    assert _max_abs(jax.tree.map(jnp.subtract, updates['batch_stats'],
                                 s.variables['batch_stats'])) > 1e-3
  chex.assert_trees_all_close(metrics['loss'], value, **TOL)
  chex.assert_trees_all_close(new_state.params, want_params, **TOL)
  assert _max_abs(jax.tree.map(jnp.subtract, want_params, s.variables['params'])) > 1e-3


# --- interleaved: GPT-2 blocks, 'updated', against a per-block reference ---------------------

def _gpt2_reference_step(config, mask):
  """One update-then-propagate SGD step on GPT-2 with each block a segment, written out.

  The embeddings (``wte``, ``wpe``) and ``ln_f`` belong to no block: they get their ordinary
  gradient, which includes the tied LM head's read of ``wte``, and are updated at the end.
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
      dw, _ = vjp_old(g)                       # the block's gradient at its old weights
      new_blocks[i] = sgd(blocks[i], dw)       # its step, taken at once
      _, vjp_new = jax.vjp(lambda h, w=new_blocks[i]: run_block(w, h), inputs[i])
      (g,) = vjp_new(g)                        # what the block below receives: NEW weights
    (g_embed,) = embed_vjp(g)
    new_rest = sgd(rest, jax.tree.map(jnp.add, g_rest, g_embed))
    new_t = {**new_rest, 'h': {str(i): w for i, w in enumerate(new_blocks)}}
    return loss, {'transformer': new_t}

  return step


def test_gpt2_block_segments_updated_equals_per_block_reference():
  from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2Block
  case = hf_models.CASES['gpt2']
  hf = hf_models.hf_model(case.model)
  loss_fn, batch = case.make(hf.module)
  ids, mask, positions = batch
  variables = hf_models.variables_of(hf)
  assert set(variables['params']) == {'transformer'}
  with case.strictness():
    tx = perturbkit.interleaved(loss_fn, optax.sgd(LR),
                                segments=perturbkit.filters.by_type(FlaxGPT2Block))
    assert sorted(tx.segments(variables, *batch)) == ['transformer/h/0', 'transformer/h/1']
    state = tx.init(variables, *batch)
    step = jax.jit(tx.step)
    reference = jax.jit(_gpt2_reference_step(hf.config, mask))
    params = variables['params']
    for _ in range(2):
      state, metrics = step(state, *batch)
      loss, params = reference(params, ids, positions)
      chex.assert_trees_all_close(metrics['loss'], loss, **TOL)
      chex.assert_trees_all_close(state.params, params, **TOL)
    assert sorted(metrics['grad_norm']) == ['transformer/h/0', 'transformer/h/1']

    # Not vacuous: two plain SGD steps end elsewhere.
    plain = variables['params']
    grad = jax.jit(jax.grad(lambda p: loss_fn({'params': p}, *batch)))
    for _ in range(2):
      plain = jax.tree.map(lambda w, g: w - LR * g, plain, grad(plain))
  block0 = lambda p: p['transformer']['h']['0']
  assert _max_abs(jax.tree.map(jnp.subtract, block0(plain), block0(params))) > 1e-5


# --- the default, layer-wise segments (issue 7, item 4) --------------------------------------

def _segment_names(metrics) -> list[str]:
  return sorted(n for n in metrics['grad_norm'] if n != perturbkit.REST)


@pytest.mark.xfail(strict=False, reason='layer-wise default segments')
def test_default_segments_are_layerwise_and_train(setup):
  s = setup
  tx = perturbkit.interleaved(s.loss_fn, optax.sgd(LR), has_aux=s.case.has_aux)
  listing = tx.segments(s.variables, *s.batch)
  state = tx.init(s.variables, *s.batch)
  step = jax.jit(tx.step)
  losses = []
  for _ in range(3):
    state, metrics = step(state, *s.batch)
    losses.append(float(metrics['loss']))
  segments = _segment_names(metrics)
  owners = hf_models.direct_owners(s.variables['params'])
  print(f'{s.case.name}: {len(segments)} default segments; listing: {listing}')

  for layer in s.case.layers:
    assert any(n.startswith(layer + '/') for n in segments), (layer, segments)
  for tied in s.case.tied:
    assert tied not in segments and not any(tied.startswith(n + '/') for n in segments), (
        f'{tied} is read outside its own call (tied weights): it must go to REST')
    assert tied in str(listing), f'segments() does not say where {tied} went: {listing}'
  for n in segments:
    assert n in str(listing), (n, listing)
  if s.case.nested_owners:
    # Which of a module owning params and its submodules owning params is the segment is the
    # library's choice; each segment must still be a module with params.
    assert all(any(o == n or o.startswith(n + '/') for o in owners) for n in segments)
  else:
    assert set(segments) == set(owners) - set(s.case.tied)
  assert losses[-1] < losses[0], losses


@pytest.mark.xfail(strict=False, reason='layer-wise default segments')
def test_gpt2_default_segments_list_tied_embedding_in_rest():
  case = hf_models.CASES['gpt2']
  hf = hf_models.hf_model(case.model)
  loss_fn, batch = case.make(hf.module)
  variables = hf_models.variables_of(hf)
  with case.strictness():
    tx = perturbkit.interleaved(loss_fn, optax.sgd(LR))
    listing = tx.segments(variables, *batch)
  text = str(listing)
  assert 'transformer/wte' in text and perturbkit.REST in text, listing
  # At least one segment per layer; each block has six modules owning params.
  assert text.count('transformer/h/0/') >= 6 and text.count('transformer/h/1/') >= 6, listing
