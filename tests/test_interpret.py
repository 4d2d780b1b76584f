"""perturbkit.interpret against independent references, on Linen, NNX and GPT-2.

* Cached outputs against Flax's ``capture_intermediates``; metric gradients against
  ``jax.vjp`` of the MLP written out by hand with explicit additive deltas.
* Edits against the same hand-written MLP with the edit written into it; patching a
  cached value back in is bit for bit the unedited run.
* Activation patching against each patch run by hand, in batches (jitted) and as one
  ``vmap``; the patches of equal clean and corrupted values are exact zeros and do not run
  (a callback in the metric counts the runs); its gradient against the patches by hand.
* Attribution patching and gradient x activation against ``jnp.vdot`` with the
  ``jax.vjp`` gradients; attribution patching close to activation patching for a
  small difference.
* NNX: the MLP with a module called twice against its Linen twin, and the model's
  state untouched; GPT-2 (tuple outputs) against ``capture_intermediates`` and by-hand
  patching. Every named error, and the fix its message suggests.
"""
import functools
import inspect
import re
import warnings

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hand_mlp
import hf_models
import models
import nnx_models
import perturbkit
import perturbkit.interpret._sweep as sweep_module
from perturbkit.interpret._positions import spread
from hand_mlp import NAMES, SHAPE, metric_of
from perturbkit import filters, interpret

TOL = dict(rtol=1e-5, atol=1e-6)
mlp_by_hand = hand_mlp.by_hand  # models.MLP


@pytest.fixture(scope='module', name='mlp')
def _mlp():
  model = models.MLP()
  variables, clean, corrupted = hand_mlp.problem(model)
  metric = lambda v, x: metric_of(model.apply(v, x))
  return model, variables, clean, corrupted, metric


by_hand_outputs = hand_mlp.outputs_by_hand


def by_hand_grads(params, x):
  """d metric / d output of each Dense call, by ``jax.vjp`` of explicit additive deltas."""
  zeros = {k: jnp.zeros_like(v) for k, v in by_hand_outputs(params, x).items()}
  value, vjp = jax.vjp(lambda d: metric_of(mlp_by_hand(params, x, lambda n, h: h + d[n])), zeros)
  return value, vjp(jnp.ones_like(value))[0]


def flat(tree):
  return models.unnest(tree)


def per_token(values):
  return jnp.einsum('btd->t', values)


# --- caching -------------------------------------------------------------------------


def test_cache_equals_capture_intermediates_and_grads_equal_vjp(mlp):
  model, variables, x, _, metric = mlp
  out, cache = jax.jit(perturbkit.run_with_cache(model.apply, return_inputs=True))(variables, x)
  plain, state = jax.jit(functools.partial(model.apply, capture_intermediates=True,
                                           mutable=['intermediates']))(variables, x)
  want = {f'{k}/__call__': v['__call__'][0] for k, v in state['intermediates'].items()
          if k != '__call__'}
  chex.assert_trees_all_close(flat(cache.outputs), want, **TOL)
  chex.assert_trees_all_close(out, plain, **TOL)
  (h,), kwargs = cache.inputs['Dense_1']['__call__']
  chex.assert_trees_all_close(h, nn.relu(want['Dense_0/__call__']), **TOL)
  assert kwargs == {} and cache.grads is None

  value, cache = jax.jit(perturbkit.run_with_cache(metric, grads=True))(variables, x)
  want_value, want_grads = jax.jit(by_hand_grads)(variables['params'], x)
  chex.assert_trees_all_close(value, want_value, **TOL)
  chex.assert_trees_all_close(flat(cache.grads), want_grads, **TOL)
  chex.assert_trees_all_close(flat(cache.outputs), want, **TOL)


# --- interventions -------------------------------------------------------------------


def test_patching_the_cached_value_back_is_exactly_the_unedited_run(mlp):
  model, variables, x, _, _ = mlp
  plain = model.apply(variables, x)
  _, cache = perturbkit.run_with_cache(model.apply)(variables, x)
  edited = perturbkit.run_with_edits(model.apply)
  back = {name: interpret.replace(v) for name, v in flat(cache.outputs).items()}
  np.testing.assert_array_equal(edited(variables, back, x), plain)
  at = {'Dense_1': {'__call__': interpret.replace(cache.outputs['Dense_1']['__call__'],
                                                  positions=[0, 3], axis=1)}}
  np.testing.assert_array_equal(edited(variables, at, x), plain)
  np.testing.assert_array_equal(edited(variables, {'Dense_2/__call__': interpret.scale(1.0)}, x),
                                plain)


def _on_tokens(f, tokens):
  """``f`` at ``tokens`` of axis 1, the output elsewhere: an edit written by hand."""
  def edit(h):
    mask = jnp.zeros(h.shape[1], bool).at[jnp.asarray(tokens)].set(True)[None, :, None]
    return jnp.where(mask, f(h), h)
  return edit


EDITS = {
    'replace': (lambda v: interpret.replace(v), lambda v: lambda h: jnp.broadcast_to(v, h.shape)),
    'add': (lambda v: interpret.add(v), lambda v: lambda h: h + jnp.broadcast_to(v, h.shape)),
    'scale': (lambda v: interpret.scale(-2.0), lambda v: lambda h: -2.0 * h),
    'zero': (lambda v: interpret.zero_ablate(), lambda v: jnp.zeros_like),
}


@pytest.mark.parametrize('kind', sorted(EDITS))
def test_edits_equal_the_model_with_the_edit_written_by_hand(mlp, kind):
  model, variables, x, _, _ = mlp
  make, by_hand = EDITS[kind]
  value = jax.random.normal(jax.random.key(3), (8,))
  edited = perturbkit.run_with_edits(model.apply)
  got = edited(variables, {'Dense_1/__call__': make(value)}, x)
  want = mlp_by_hand(variables['params'], x,
                     lambda n, h: by_hand(value)(h) if n == 'Dense_1/__call__' else h)
  chex.assert_trees_all_close(got, want, **TOL)

  edit = make(value)
  at_tokens = interpret.Edit(edit.scale, edit.shift, jnp.array([1, 4]), edit.active, 1)
  got = edited(variables, {'Dense_1': {'__call__': at_tokens}}, x)
  want = mlp_by_hand(variables['params'], x, lambda n, h: _on_tokens(by_hand(value), [1, 4])(h)
                     if n == 'Dense_1/__call__' else h)
  chex.assert_trees_all_close(got, want, **TOL)


def _on_head(f, head, heads=2):
  """``f`` at ``head`` of the last axis split into ``heads``, the output elsewhere, by hand."""
  def edit(h):
    split = h.reshape(h.shape[:-1] + (heads, h.shape[-1] // heads))
    return split.at[..., head, :].set(f(split[..., head, :])).reshape(h.shape)
  return edit


def test_edits_of_a_view_equal_the_head_edited_by_hand(mlp):
  """Dense_1's 8 features as 2 heads of 4: ``view=(-1, 5, 2, 4)``, head 1 along axis 2."""
  model, variables, x, corrupted, _ = mlp
  params = variables['params']
  edited = perturbkit.run_with_edits(model.apply)
  view = (-1, SHAPE[1], 2, 4)
  by_hand = lambda f: mlp_by_hand(params, x, lambda n, h: _on_head(f, 1)(h)
                                  if n == 'Dense_1/__call__' else h)
  got = edited(variables, {'Dense_1/__call__': interpret.zero_ablate(
      positions=[1], axis=2, view=view)}, x)
  chex.assert_trees_all_close(got, by_hand(jnp.zeros_like), **TOL)
  assert float(jnp.abs(got - model.apply(variables, x)).max()) > 1e-3

  value = jax.random.normal(jax.random.key(5), (4,))  # one head's features
  got = edited(variables, {'Dense_1/__call__': interpret.replace(
      value, positions=[1], axis=2, view=view)}, x)
  chex.assert_trees_all_close(got, by_hand(lambda h: jnp.broadcast_to(value, h.shape)), **TOL)

  _, cache = perturbkit.run_with_cache(model.apply)(variables, corrupted)
  reference = cache.outputs['Dense_1']['__call__']
  got = edited(variables, {'Dense_1/__call__': interpret.mean_ablate(
      reference, positions=[1], axis=2, view=view)}, x)
  mean = reference.reshape(view).mean(0)[:, 1]  # (tokens, head_dim)
  chex.assert_trees_all_close(got, by_hand(lambda h: jnp.broadcast_to(mean, h.shape)), **TOL)


def test_mean_ablation_vmap_over_stacked_edits_and_grad_through_them(mlp):
  model, variables, x, corrupted, metric = mlp
  params = variables['params']
  _, cache = perturbkit.run_with_cache(model.apply)(variables, corrupted)
  reference = cache.outputs['Dense_0']['__call__']
  edited = perturbkit.run_with_edits(model.apply)
  got = edited(variables, {'Dense_0/__call__': interpret.mean_ablate(reference)}, x)
  want = mlp_by_hand(params, x, lambda n, h: jnp.broadcast_to(reference.mean(0), h.shape)
                     if n == 'Dense_0/__call__' else h)
  chex.assert_trees_all_close(got, want, **TOL)

  # A padded reference batch: each token position averaged over the examples where it is kept,
  # written out as a loop; a position kept nowhere gives NaN. Its mean is then put at tokens
  # -1 and 0 only.
  kept = np.ones(reference.shape[:2], bool)
  kept[0, :2] = kept[1, -1] = False
  kept[:, 1] = False
  masked = np.full(reference.shape[1:], np.nan, np.float32)
  for t in range(reference.shape[1]):
    rows = [np.asarray(reference[b, t]) for b in range(reference.shape[0]) if kept[b, t]]
    if rows:
      masked[t] = sum(rows) / len(rows)
  edit = interpret.mean_ablate(reference, where=jnp.asarray(kept)[:, :, None],
                               positions=[-1, 0], axis=1)
  got = edited(variables, {'Dense_0/__call__': edit}, x)
  want = mlp_by_hand(params, x, lambda n, h: _on_tokens(
      lambda h: jnp.broadcast_to(masked, h.shape), [-1, 0])(h) if n == 'Dense_0/__call__' else h)
  chex.assert_trees_all_close(got, want, **TOL)
  assert np.isnan(interpret.apply_edit(interpret.mean_ablate(reference, where=kept[:, :, None]),
                                       reference)[:, 1]).all()
  for wrong in (kept.astype(int)[:, :, None], kept):
    with pytest.raises(perturbkit.InvalidOptionError, match='where'):
      interpret.mean_ablate(reference, where=wrong)

  factors = jnp.array([0.0, 0.5, 3.0])
  stack = jax.vmap(lambda s: {'Dense_1/__call__': interpret.scale(s, positions=[2], axis=1)})(
      factors)
  got = jax.vmap(lambda e: edited(variables, e, x))(stack)
  for s, g in zip(factors, got):
    want = mlp_by_hand(params, x, lambda n, h: _on_tokens(lambda h: s * h, [2])(h)
                       if n == 'Dense_1/__call__' else h)
    chex.assert_trees_all_close(g, want, **TOL)

  steered = lambda v: metric_of(edited(variables, {'Dense_1/__call__': interpret.add(v)}, x))
  by_hand = lambda v: metric_of(mlp_by_hand(
      params, x, lambda n, h: h + jnp.broadcast_to(v, h.shape) if n == 'Dense_1/__call__' else h))
  v = jax.random.normal(jax.random.key(4), (8,))
  chex.assert_trees_all_close(jax.grad(steered)(v), jax.grad(by_hand)(v), **TOL)


# --- activation patching -------------------------------------------------------------


def patching_by_hand(v, clean, corrupted):
  """``(calls, tokens)``: each Dense call's output patched from ``clean`` at one token, by hand."""
  params = v['params']
  outputs = by_hand_outputs(params, clean)
  base = metric_of(mlp_by_hand(params, corrupted))
  return jnp.array([[metric_of(mlp_by_hand(params, corrupted, lambda n, h, c=call, t=token:
                                           _on_tokens(lambda _: outputs[n], [t])(h)
                                           if n == c else h)) - base
                     for token in range(SHAPE[1])] for call in NAMES])


def attribution_by_hand(params, clean, corrupted):
  """``(calls, tokens)``: ``(a_clean - a_corrupted) . g`` per token, ``g`` from ``jax.vjp``."""
  a_clean, a_corrupted = by_hand_outputs(params, clean), by_hand_outputs(params, corrupted)
  _, grads = by_hand_grads(params, corrupted)
  return jnp.stack([per_token((a_clean[n] - a_corrupted[n]) * grads[n]) for n in NAMES])


def gxa_by_hand(params, x):
  """``(calls, tokens)``: ``a . g`` per token, ``g`` from ``jax.vjp``."""
  outputs, (_, grads) = by_hand_outputs(params, x), by_hand_grads(params, x)
  return jnp.stack([per_token(outputs[n] * grads[n]) for n in NAMES])


# The references, compiled once for every test of this file (once per input shape).
compiled_patching_by_hand = jax.jit(patching_by_hand)
compiled_attribution_by_hand = jax.jit(attribution_by_hand)
compiled_gxa_by_hand = jax.jit(gxa_by_hand)
metric_by_hand = jax.jit(lambda params, x: metric_of(mlp_by_hand(params, x)))


@pytest.mark.parametrize('groups', [1, 2, 8])
def test_activation_patching_equals_each_patch_by_hand(mlp, groups, monkeypatch):
  """At most ``groups`` groups of neighbouring calls: one group of all three, groups of two
  calls and one, each call its own group (the default)."""
  monkeypatch.setattr(sweep_module, 'GROUPS', groups)
  model, variables, clean, corrupted, metric = mlp
  params = variables['params']
  result = perturbkit.activation_patching(metric, axis=1)(variables, clean, corrupted)
  assert result.paths == NAMES and result.positions == (0, 1, 2, 3, 4)
  base = metric_by_hand(params, corrupted)
  chex.assert_trees_all_close(result.effects, compiled_patching_by_hand(variables, clean, corrupted),
                              **TOL)
  chex.assert_trees_all_close((result.clean_metric, result.corrupted_metric),
                              (metric_by_hand(params, clean), base), **TOL)

  whole = perturbkit.activation_patching(metric)(variables, clean, corrupted)
  assert whole.positions is None and whole.effects.shape == (3, 1)
  chex.assert_trees_all_close(whole.effects[2, 0], whole.clean_metric - base, **TOL)

  chunked = jax.jit(perturbkit.activation_patching(metric, axis=1, batch_size=4))(
      variables, clean, corrupted)
  assert chunked.paths == result.paths and chunked.positions == result.positions
  chex.assert_trees_all_close(chunked.effects, result.effects, **TOL)


@pytest.mark.parametrize('batch_size', [1, 2, 4, None])
def test_patches_of_equal_values_are_exact_zeros_and_are_not_run(mlp, batch_size, monkeypatch):
  """Inputs that differ only at tokens 1 and 3 of 5: the MLP works token by token, so each
  call's clean and corrupted outputs differ only there. Patching another token is the
  corrupted run itself: its effect is exactly 0 and, in batches, it does not run (the metric
  counts its runs with a callback: the clean and corrupted runs, then per call the batches
  that hold tokens 1 and 3). The progress bar still reaches all 15 patches."""
  bars = []

  class Recorded(sweep_module.tqdm):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      bars.append(self)

  monkeypatch.setattr(sweep_module, 'tqdm', Recorded)
  model, variables, clean, _, _ = mlp
  corrupted = clean.at[:, [1, 3]].set(jax.random.normal(jax.random.key(3), (SHAPE[0], 2, 3)))
  runs = []

  def metric(v, x):
    value = metric_of(model.apply(v, x))
    jax.debug.callback(lambda m: runs.append(float(m)), value)
    return value

  result = jax.jit(perturbkit.activation_patching(metric, axis=1, batch_size=batch_size,
                                                  progress=True))(variables, clean, corrupted)
  jax.effects_barrier()
  assert [bar.n for bar in bars] == [len(NAMES) * SHAPE[1]]
  want = compiled_patching_by_hand(variables, clean, corrupted)[:, jnp.array([1, 3])]
  chex.assert_trees_all_close(result.effects[:, jnp.array([1, 3])], want, **TOL)
  assert float(jnp.abs(want).min()) > 1e-5
  assert np.all(np.asarray(result.effects[:, jnp.array([0, 2, 4])]) == 0)
  tokens = SHAPE[1]
  per_call = tokens if batch_size is None or batch_size >= tokens else -(-2 // batch_size) * batch_size
  assert len(runs) == 2 + len(NAMES) * per_call


@pytest.fixture(scope='module')
def patching_derivatives(mlp):
  """``jax.grad`` (w.r.t. the params and both inputs) of a loss of activation patching's effects
  and ``jax.jvp`` of the effects, and the same of the patches by hand: made once, so that each
  compiles once for all the inputs below."""
  metric = mlp[-1]
  weights = jax.random.normal(jax.random.key(4), (len(NAMES), SHAPE[1]))
  # Linear and quadratic: the derivative of a square alone vanishes where an effect is 0.
  loss = lambda effects: jnp.sum(weights * effects + effects ** 2)
  grad = lambda effects: jax.grad(lambda *a: loss(effects(*a)), argnums=(0, 1, 2))
  jvp = lambda effects: jax.jit(lambda a, t: jax.jvp(effects, a, t))
  patched = lambda batch_size: lambda *a: perturbkit.activation_patching(
      metric, axis=1, batch_size=batch_size)(*a).effects
  return {'grad_by_hand': jax.jit(grad(patching_by_hand)),
          'grad_in_one_vmap': jax.jit(grad(patched(None))),
          'grad_in_batches_of_2': jax.jit(grad(patched(2))),
          'grad_in_batches_of_2_op_by_op': grad(patched(2)),
          'jvp_by_hand': jvp(patching_by_hand), 'jvp_in_batches_of_2': jvp(patched(2))}


@pytest.mark.parametrize('changed_from', [0, 3])
def test_activation_patching_differentiates_as_the_patches_by_hand(mlp, patching_derivatives,
                                                                  changed_from):
  """``jax.grad`` of a loss of the effects, with respect to the params and both inputs: one
  ``jax.vmap`` (``batch_size=None``) and in batches of 2, each under ``jax.jit`` (in batches
  also outside it), against the same loss of the patched runs written by hand; and
  ``jax.jvp`` of the effects in batches, along all three, against ``jax.jvp`` of the
  hand-written ones. The corrupted input differs from the clean one at every token, or from
  token 3 on: then the patches of tokens 0-2 change nothing and in batches do not run, their
  effects are exactly 0, and their derivatives are not (moving the clean input there changes
  what they patch). Outside ``jax.jit``, only the second."""
  _, variables, clean, corrupted, _ = mlp
  corrupted = clean.at[:, changed_from:].set(corrupted[:, changed_from:])
  derivatives = patching_derivatives
  args = (variables, clean, corrupted)
  want = derivatives['grad_by_hand'](*args)
  assert float(jnp.abs(want[1][:, :3]).max()) > 1e-3
  # Outside jax.jit (op by op, the slowest to run) only where the skipped patches are in play.
  eager = ('grad_in_batches_of_2_op_by_op',) if changed_from else ()
  for grad in ('grad_in_one_vmap', 'grad_in_batches_of_2', *eager):
    chex.assert_trees_all_close(derivatives[grad](*args), want, rtol=1e-4, atol=1e-6)
  directions = jax.tree.map(lambda x: jax.random.normal(jax.random.key(5), x.shape), args)
  got = derivatives['jvp_in_batches_of_2'](args, directions)
  want = derivatives['jvp_by_hand'](args, directions)
  chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)
  if changed_from:
    assert not jnp.any(got[0][:, :changed_from]) and jnp.all(got[0][:, changed_from:])


# The batches of 4 within each group of calls, 5 tokens per call (3 calls: one group; two
# calls and one; each call its own).
@pytest.mark.parametrize('groups, batches', [(1, [4, 4, 4, 3]), (2, [4, 4, 2, 4, 1]),
                                             (8, [4, 1, 4, 1, 4, 1])])
def test_progress_bar_counts_the_patched_runs_of_each_run(mlp, capsys, monkeypatch, groups,
                                                          batches):
  """15 (call, token) runs, 5 tokens for each of 3 calls, in batches of 4 within each group of
  calls: the bar moves by each batch's runs (the groups in any order) and reaches 15 on every
  run of the compiled sweep; the effects do not change."""
  monkeypatch.setattr(sweep_module, 'GROUPS', groups)
  _, variables, clean, corrupted, metric = mlp
  recorded = []

  class Recorded(sweep_module.tqdm):
    def update(self, n=1):
      super().update(n)
      recorded.append(self.n)

  monkeypatch.setattr(sweep_module, 'tqdm', Recorded)
  plain = perturbkit.activation_patching(metric, axis=1)(variables, clean, corrupted)
  patch = jax.jit(perturbkit.activation_patching(metric, axis=1, batch_size=4, progress=True))
  capsys.readouterr()
  for _ in range(2):
    result = patch(variables, clean, corrupted)
    chex.assert_trees_all_close(result.effects, plain.effects, **TOL)
  jax.effects_barrier()
  steps = [b - a if b > a else b for a, b in zip([0] + recorded, recorded)]
  assert len(recorded) == 2 * len(batches) and recorded[len(batches) - 1] == recorded[-1] == 15
  assert sorted(steps) == sorted(batches * 2)
  assert capsys.readouterr().err.count('activation patching: 100%') == 2


def recorded_bars(monkeypatch) -> list[list[int]]:
  """The progress bars made from now on, each as the counts it showed after each update."""
  bars = []

  class Recorded(sweep_module.tqdm):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      bars.append([])

    def update(self, n=1):
      super().update(n)
      bars[-1].append(self.n)

  monkeypatch.setattr(sweep_module, 'tqdm', Recorded)
  return bars


def test_progress_bar_counts_each_run_once_when_differentiated(mlp, monkeypatch):
  """``jax.grad`` (which recomputes each batch in the backward pass) and ``jax.jvp`` of the
  batched sweep, under ``jax.jit``: one bar per run, reaching 15 (the skipped runs of tokens
  0-2, where the inputs agree, counted at the end), never more."""
  _, variables, clean, corrupted, metric = mlp
  corrupted = clean.at[:, 3:].set(corrupted[:, 3:])
  bars = recorded_bars(monkeypatch)
  patch = perturbkit.activation_patching(metric, axis=1, batch_size=4, progress=True)
  effects = lambda v: patch(v, clean, corrupted).effects
  jax.jit(jax.grad(lambda v: jnp.sum(effects(v) ** 2)))(variables)
  jax.jit(lambda v: jax.jvp(effects, (v,), (v,)))(variables)
  jax.effects_barrier()
  assert len(bars) == 2 and all(bar[-1] == 15 and max(bar) == 15 for bar in bars), bars


def test_effects_per_example_under_vmap_and_one_bar_per_run(mlp, monkeypatch):
  """Effects per example: ``jax.vmap`` over (clean, corrupted) pairs of a metric of one example,
  under ``jax.jit``, against each example's patches and attributions by hand. The two examples
  differ from token 3 on and at token 1 only, so their batched sweeps skip different patches;
  the gradient of a loss of the effects through ``vmap`` against the same by hand. The bar
  counts the 15 runs of one sweep once per run, not once per example: under ``vmap``, under
  ``jax.grad`` of it, and under ``vmap`` of ``vmap``."""
  model, variables, clean, corrupted, _ = mlp
  params = variables['params']
  corrupted = jnp.stack([clean[0].at[3:].set(corrupted[0, 3:]),
                         clean[1].at[1].set(corrupted[1, 1])])
  metric = lambda v, x: metric_of(model.apply(v, x[None]))
  bars = recorded_bars(monkeypatch)
  examples = range(SHAPE[0])
  one = lambda f, i: f(variables, clean[i:i + 1], corrupted[i:i + 1])
  patched = jnp.stack([one(compiled_patching_by_hand, i) for i in examples])
  attributed = jnp.stack([compiled_attribution_by_hand(params, clean[i:i + 1], corrupted[i:i + 1])
                          for i in examples])
  assert float(jnp.abs(patched[0, :, 3:]).min()) > 1e-6 and not jnp.any(patched[0, :, :3])
  patch = perturbkit.activation_patching(metric, axis=1, batch_size=2, progress=True)
  per_example = jax.vmap(patch, in_axes=(None, 0, 0))
  got = jax.jit(per_example)(variables, clean, corrupted)
  chex.assert_trees_all_close(got.effects, patched, **TOL)
  chex.assert_trees_all_close(got.corrupted_metric,
                              jnp.stack([metric_by_hand(params, x[None]) for x in corrupted]),
                              **TOL)
  attribute = jax.jit(jax.vmap(perturbkit.attribution_patching(metric, axis=1),
                               in_axes=(None, 0, 0)))
  chex.assert_trees_all_close(attribute(variables, clean, corrupted).effects, attributed, **TOL)

  weights = jax.random.normal(jax.random.key(4), patched.shape)
  loss = lambda effects: jnp.sum(weights * effects + effects ** 2)
  # Each example's patches by hand, batched with jax.vmap (one example traced, not two).
  want = jax.jit(jax.grad(lambda v: loss(jax.vmap(
      lambda c, x: patching_by_hand(v, c[None], x[None]))(clean, corrupted))))(variables)
  got = jax.jit(jax.grad(lambda v: loss(per_example(v, clean, corrupted).effects)))(variables)
  chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)
  nested = jax.jit(jax.vmap(per_example, in_axes=(None, 0, 0)))(
      variables, clean[None], corrupted[None])
  chex.assert_trees_all_close(nested.effects[0], patched, **TOL)
  jax.effects_barrier()
  assert len(bars) == 3 and all(bar[-1] == 15 and max(bar) == 15 for bar in bars), bars


def test_patching_and_attribution_per_head_of_a_view_equal_the_heads_by_hand(mlp):
  """Dense_0's and Dense_1's 8 features as 2 heads of 4 (``view=(-1, 5, 2, 4)``, ``axis=2``):
  one row per head, patched (activation patching) or attributed by hand."""
  model, variables, clean, corrupted, metric = mlp
  params = variables['params']
  names = NAMES[:2]
  calls = filters.by_path('Dense_0', 'Dense_1')
  view = dict(axis=2, view=(-1, SHAPE[1], 2, 4))
  clean_outputs = by_hand_outputs(params, clean)
  base = metric_of(mlp_by_hand(params, corrupted))
  clean_head = lambda n, head: clean_outputs[n].reshape(SHAPE[:2] + (2, 4))[..., head, :]
  patched = lambda name, head: metric_of(mlp_by_hand(params, corrupted, lambda n, h: _on_head(
      lambda _: clean_head(n, head), head)(h) if n == name else h))
  want = jnp.array([[patched(n, head) - base for head in (0, 1)] for n in names])
  result = jax.jit(perturbkit.activation_patching(metric, filter=calls, batch_size=3, **view))(
      variables, clean, corrupted)
  assert result.paths == names and result.positions == (0, 1)
  chex.assert_trees_all_close(result.effects, want, **TOL)
  assert float(jnp.abs(want).min()) > 1e-5

  a_corrupted = by_hand_outputs(params, corrupted)
  _, grads = by_hand_grads(params, corrupted)
  per_head = lambda v: jnp.einsum('btkd->k', v.reshape(v.shape[:-1] + (2, 4)))
  want = jnp.stack([per_head((clean_outputs[n] - a_corrupted[n]) * grads[n]) for n in names])
  got = perturbkit.attribution_patching(metric, filter=calls, **view)(variables, clean, corrupted)
  chex.assert_trees_all_close(got.effects, want, **TOL)
  # Both heads' rows add up to the whole output's attribution.
  whole = perturbkit.attribution_patching(metric, filter=calls)(variables, clean, corrupted)
  chex.assert_trees_all_close(got.effects.sum(1), whole.effects[:, 0], **TOL)

  with pytest.raises(perturbkit.EditViewError, match='Dense_2/__call__'):
    perturbkit.attribution_patching(metric, **view)(variables, clean, corrupted)
  with pytest.raises(perturbkit.InvalidOptionError, match='view'):
    perturbkit.activation_patching(metric, axis=2, view=(-1, -1, 8))


# --- attribution patching and gradient x activation ----------------------------------


def test_attribution_patching_equals_vdot_with_vjp_gradients(mlp):
  model, variables, clean, corrupted, metric = mlp
  params = variables['params']
  result = perturbkit.attribution_patching(metric, axis=1)(variables, clean, corrupted)
  assert result.paths == NAMES
  chex.assert_trees_all_close(result.effects,
                              compiled_attribution_by_hand(params, clean, corrupted), **TOL)
  a_clean, a_corrupted = by_hand_outputs(params, clean), by_hand_outputs(params, corrupted)
  _, grads = by_hand_grads(params, corrupted)
  whole = perturbkit.attribution_patching(metric)(variables, clean, corrupted)
  chex.assert_trees_all_close(
      whole.effects[:, 0], jnp.array([jnp.vdot(a_clean[n] - a_corrupted[n], grads[n])
                                      for n in NAMES]), **TOL)

  every = compiled_gxa_by_hand(params, corrupted)
  # Scattered, unordered, negative (a run that ends at the last token), neighbouring and
  # repeated positions.
  for positions in ([0, 3], [3, 0], [-2, -1], [1, 2], [2, 0, 2]):
    gxa = perturbkit.grad_times_activation(metric, axis=1, positions=positions)(
        variables, corrupted)
    chex.assert_trees_all_close(gxa.effects, every[:, jnp.array(positions)], **TOL)


@pytest.fixture(scope='module')
def attribution_derivatives(mlp):
  """``jax.grad`` of a loss of the attribution patching (w.r.t. the params and both inputs) and
  gradient x activation (the params and the input) effects, and the same of their formulas
  written with the hand MLP's outputs and ``jax.vjp`` gradients: each compiled once for all the
  inputs below."""
  metric = mlp[-1]
  weights = jax.random.normal(jax.random.key(4), (len(NAMES), SHAPE[1]))
  # Linear and quadratic: the derivative of a square alone vanishes where an effect is 0.
  loss = lambda effects: jnp.sum(weights * effects + effects ** 2)
  attribution = perturbkit.attribution_patching(metric, axis=1)
  gxa = perturbkit.grad_times_activation(metric, axis=1)

  return {
      'attribution': jax.jit(jax.grad(lambda v, c, x: loss(attribution(v, c, x).effects),
                                      argnums=(0, 1, 2))),
      'attribution_by_hand': jax.jit(jax.grad(
          lambda v, c, x: loss(attribution_by_hand(v['params'], c, x)), argnums=(0, 1, 2))),
      'gxa': jax.jit(jax.grad(lambda v, x: loss(gxa(v, x).effects), argnums=(0, 1))),
      'gxa_by_hand': jax.jit(jax.grad(lambda v, x: loss(gxa_by_hand(v['params'], x)),
                                      argnums=(0, 1)))}


@pytest.mark.parametrize('changed_from', [0, 3])
def test_attributions_differentiate_as_their_formulas_by_hand(mlp, attribution_derivatives,
                                                              changed_from):
  """The effects are differentiable again: ``jax.grad`` of a loss of the attribution
  patching (and gradient x activation) effects, with respect to the params and the
  inputs, equals ``jax.grad`` of the same loss of the formulas written with the hand
  MLP's outputs and ``jax.vjp`` gradients; also where the clean and corrupted inputs (and
  outputs) agree, on tokens 0-2, where ``a_clean - a_corrupted`` is 0 and its derivative
  is not."""
  _, variables, clean, corrupted, _ = mlp
  corrupted = clean.at[:, changed_from:].set(corrupted[:, changed_from:])
  grads = attribution_derivatives
  got = grads['attribution'](variables, clean, corrupted)
  want = grads['attribution_by_hand'](variables, clean, corrupted)
  chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)
  assert float(jnp.abs(want[1][:, :3]).max()) > 1e-3
  got = grads['gxa'](variables, corrupted)
  want = grads['gxa_by_hand'](variables, corrupted)
  chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)
  assert float(jnp.abs(got[1]).max()) > 1e-3


class MaskedScores(nn.Module):
  """Causal attention scores, ``-inf`` above the diagonal, as a call of their own."""

  @nn.compact
  def __call__(self, h):
    causal = jnp.tril(jnp.ones((h.shape[1],) * 2, bool))
    return jnp.where(causal, jnp.einsum('btf,bsf->bts', h, h), -jnp.inf)


class MaskedAttention(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4)(x)
    return nn.Dense(2)(jax.nn.softmax(MaskedScores()(h), axis=-1) @ h)


def test_attributions_of_a_model_with_infinite_outputs_are_finite_where_defined(mlp):
  """A call whose output is ``-inf`` at masked entries, in both runs: the runs stay exact
  (no ``0 * inf`` enters the model), the masked entries do not move (their clean and
  corrupted values are equal), and every effect equals the formula by hand, summed over
  the finite entries."""
  _, _, clean, corrupted, _ = mlp
  model = MaskedAttention()
  variables = jax.jit(model.init)(jax.random.key(0), clean)
  params = variables['params']
  names = ('Dense_0/__call__', 'MaskedScores_0/__call__', 'Dense_1/__call__')

  def by_hand(x, deltas):
    h = nn.Dense(4).apply({'params': params['Dense_0']}, x) + deltas[0]
    scores = MaskedScores().apply({}, h) + deltas[1]
    return nn.Dense(2).apply({'params': params['Dense_1']}, jax.nn.softmax(scores, -1) @ h
                             ) + deltas[2]

  def outputs(x):
    h = nn.Dense(4).apply({'params': params['Dense_0']}, x)
    scores = MaskedScores().apply({}, h)
    return [h, scores, by_hand(x, [0.0] * 3)]

  metric = lambda v, x: metric_of(model.apply(v, x))

  @jax.jit
  def references(clean, corrupted):
    """The formulas by hand, compiled once."""
    a_clean, a_corrupted = outputs(clean), outputs(corrupted)
    zeros = [jnp.zeros_like(a) for a in a_corrupted]
    grads = jax.grad(lambda d: metric_of(by_hand(corrupted, d)))(zeros)
    finite = [jnp.isfinite(a) for a in a_corrupted]
    want = jnp.stack([jnp.einsum('bt...->t', jnp.where(f, (a - b) * g, 0.0))
                      for a, b, g, f in zip(a_clean, a_corrupted, grads, finite)])
    want_gxa = [per_token(jnp.where(finite[i], a_corrupted[i] * grads[i], 0.0))
                for i in range(3)]
    return (want, want_gxa, metric_of(a_corrupted[2]), finite[1].all(),
            jnp.isfinite(jnp.stack(grads[1])).all())

  want, want_gxa, corrupted_metric, all_finite, grads_finite = references(clean, corrupted)
  assert not bool(all_finite) and bool(grads_finite)
  result = jax.jit(perturbkit.attribution_patching(metric, axis=1))(variables, clean, corrupted)
  assert result.paths == names
  chex.assert_trees_all_close(result.effects, want, **TOL)
  chex.assert_trees_all_close(result.corrupted_metric, corrupted_metric, **TOL)

  gxa = jax.jit(perturbkit.grad_times_activation(metric, axis=1))(variables, corrupted)
  chex.assert_trees_all_close(gxa.clean_metric, corrupted_metric, **TOL)
  for i in range(3):  # the masked scores (gradient exactly 0) contribute 0, no 0 * inf
    chex.assert_trees_all_close(gxa.effects[i], want_gxa[i], **TOL)


def test_integrated_gradients_through_masked_infinite_scores(mlp):
  """Zero baseline against ``-inf`` masked scores: at every Gauss-Legendre node (inside
  ``(0, 1)``) the masked entries are ``-inf`` with gradient 0, so they contribute 0, and each
  call's effects equal ``(a - b) . mean_alpha grad`` by hand over the finite entries; the
  effects sum to the metric change with the masked entries kept infinite. The trapezoid rule's
  first node is the baseline itself, so there the scores' effects at tokens with masked entries
  are NaN, never a number."""
  _, _, x, _, _ = mlp
  model = MaskedAttention()
  variables = jax.jit(model.init)(jax.random.key(0), x)
  params = variables['params']

  def by_hand(scores_of=lambda s: s, delta=0.0):
    h = nn.Dense(4).apply({'params': params['Dense_0']}, x)
    scores = scores_of(MaskedScores().apply({}, h)) + delta
    return metric_of(nn.Dense(2).apply({'params': params['Dense_1']},
                                       jax.nn.softmax(scores, -1) @ h))

  h = nn.Dense(4).apply({'params': params['Dense_0']}, x)
  a = MaskedScores().apply({}, h)
  finite = jnp.isfinite(a)
  nodes, weights = np.polynomial.legendre.leggauss(16)
  want = 0.0
  for alpha, weight in zip((nodes + 1) / 2, weights / 2):
    on_path = lambda s, alpha=alpha: jnp.where(finite, alpha * s, -jnp.inf)
    grad = jax.grad(lambda d: by_hand(on_path, d))(jnp.zeros_like(a))
    want = want + weight * per_token(jnp.where(finite, a * grad, 0.0))
  metric = lambda v, x: metric_of(model.apply(v, x))
  result = perturbkit.layer_integrated_gradients(metric, axis=1)(variables, x)
  assert result.paths[1] == 'MaskedScores_0/__call__'
  chex.assert_trees_all_close(result.effects[1], want, rtol=1e-4, atol=1e-6)
  kept = by_hand(lambda s: jnp.where(finite, 0.0, -jnp.inf))
  np.testing.assert_allclose(result.effects[1].sum(), by_hand() - kept, rtol=1e-3, atol=1e-5)
  trapezoid = perturbkit.layer_integrated_gradients(metric, axis=1, method='riemann_trapezoid')(
      variables, x)
  masked = ~finite.all(axis=(0, 2))  # the tokens whose scores hold masked entries
  assert bool(masked.any()) and bool(jnp.isnan(trapezoid.effects[1, masked]).all())
  assert bool(jnp.isfinite(trapezoid.effects[jnp.array([0, 2])]).all())


def test_edits_and_patching_of_a_model_with_infinite_outputs_are_exact(mlp):
  """Replacing an output whose masked entries are ``-inf`` gives the value given there, not
  ``0 * inf = nan``: every call's cached output patched back in is the unedited run bit for
  bit, zero-ablating the scores is softmax over zeros, and activation patching equals each
  patched run written by hand (the clean value put in at one token)."""
  _, _, clean, corrupted, _ = mlp
  model = MaskedAttention()
  variables = jax.jit(model.init)(jax.random.key(0), clean)
  params = variables['params']
  names = ('Dense_0/__call__', 'MaskedScores_0/__call__', 'Dense_1/__call__')

  def by_hand(x, edit=lambda i, a: a):
    h = edit(0, nn.Dense(4).apply({'params': params['Dense_0']}, x))
    scores = edit(1, MaskedScores().apply({}, h))
    return edit(2, nn.Dense(2).apply({'params': params['Dense_1']},
                                      jax.nn.softmax(scores, -1) @ h))

  record = []
  by_hand(clean, lambda i, a: record.append(a) or a)
  assert not bool(jnp.isfinite(record[1]).all())
  edited = jax.jit(perturbkit.run_with_edits(model.apply))
  _, cache = perturbkit.run_with_cache(model.apply)(variables, clean)
  back = {name: interpret.replace(cache.outputs[name.split('/')[0]]['__call__'])
          for name in names}
  np.testing.assert_array_equal(edited(variables, back, clean), model.apply(variables, clean))
  zeroed = edited(variables, {names[1]: interpret.zero_ablate()}, clean)
  want = by_hand(clean, lambda i, a: jnp.zeros_like(a) if i == 1 else a)
  assert bool(jnp.isfinite(zeroed).all())
  chex.assert_trees_all_close(zeroed, want, **TOL)

  metric = lambda v, x: metric_of(model.apply(v, x))
  result = jax.jit(perturbkit.activation_patching(metric, axis=1))(variables, clean, corrupted)
  base = metric_of(by_hand(corrupted))
  for i in range(3):
    for t in range(SHAPE[1]):
      patch = lambda j, a, i=i, t=t: a.at[:, t].set(record[i][:, t]) if j == i else a
      want = metric_of(by_hand(corrupted, patch)) - base
      np.testing.assert_allclose(result.effects[i, t], want, **TOL, err_msg=f'{names[i]} {t}')
  assert bool(jnp.isfinite(result.effects).all())


@pytest.mark.parametrize('axis, positions, shape', [
    (None, None, (2, 5, 3)), (1, (0, 1, 2, 3, 4), (2, 5, 3)), (1, (1, 2), (2, 5, 3)),
    (-2, (-1, 0, 3), (2, 5, 3)), (2, (2, 0, 2), (2, 5, 3)), (0, (1,), (2, 5, 3))])
def test_spread_is_the_adjoint_of_the_per_position_sum(axis, positions, shape):
  """The attributions are gradients with respect to scalars that ``spread`` puts along the axis:
  ``grad_s sum(spread(s) * v)`` must be ``v`` summed over every other axis at the positions
  (numpy), and ``spread`` zero elsewhere."""
  values = jax.random.normal(jax.random.key(0), shape)
  count = 1 if positions is None else len(positions)
  scalars = jnp.arange(1.0, count + 1.0)
  grad = jax.grad(lambda s: jnp.sum(spread(s, axis, positions, shape) * values))(scalars)
  v = np.asarray(values)
  sums = (np.array([v.sum()]) if axis is None else
          np.moveaxis(v, axis, 0).reshape(shape[axis], -1).sum(axis=1)[list(positions)])
  np.testing.assert_allclose(grad, sums, rtol=1e-5, atol=1e-6)
  dense = np.broadcast_to(np.asarray(spread(scalars, axis, positions, shape)), shape)
  want = np.zeros(shape)
  for j, value in enumerate(np.asarray(scalars)):
    index = [slice(None)] * len(shape)
    if axis is not None:
      index[axis] = positions[j]
    want[tuple(index)] += value
  np.testing.assert_array_equal(dense, want)


def test_attribution_patching_is_close_to_activation_patching_for_a_small_difference(mlp):
  _, variables, clean, _, metric = mlp
  near = clean + 1e-3 * jax.random.normal(jax.random.key(5), SHAPE)
  estimate = perturbkit.attribution_patching(metric, axis=1)(variables, clean, near)
  measured = perturbkit.activation_patching(metric, axis=1)(variables, clean, near)
  scale = float(jnp.abs(measured.effects).max())
  assert scale > 1e-5
  chex.assert_trees_all_close(estimate.effects, measured.effects, rtol=0, atol=2e-2 * scale)


# --- NNX, against its Linen twin -----------------------------------------------------


@pytest.fixture(scope='module', name='twins')
def _twins():
  model = nnx_models.MLP(rngs=nnx.Rngs(0))
  variables = nnx_models.linen_variables(model)
  linen = nnx_models.LinenMLP()
  clean = jax.random.normal(jax.random.key(1), SHAPE)
  corrupted = jax.random.normal(jax.random.key(2), SHAPE)
  return model, variables, linen, clean, corrupted


def test_nnx_equals_its_linen_twin(twins):
  model, variables, linen, clean, corrupted = twins
  before = nnx_models.pure(nnx.state(model))
  nnx_metric = lambda m, x: metric_of(m(x))
  linen_metric = lambda v, x: metric_of(linen.apply(v, x))

  edits = {'dense_1': {'__call__': interpret.zero_ablate(positions=[1], axis=1)},
           'dense_2/__call__': interpret.add(jnp.ones(2)),
           'dense_0/__call__': interpret.scale(-1.0, positions=[0], axis=2,
                                               view=(-1, SHAPE[1], 2, 3))}
  heads = dict(axis=2, view=(-1, SHAPE[1], 2, 3))  # dense_0 and dense_1: 2 heads of 3
  sweeps = ('activation_patching', 'attribution_patching')

  def everything(api, metric, apply):
    """Each function below on one front end (``perturbkit`` or ``perturbkit.nnx``), compiled
    together: one compile per front end."""
    def run(model, clean, corrupted):
      results = {'cache': api.run_with_cache(metric, grads=True, return_inputs=True)(
          model, clean), 'edits': api.run_with_edits(apply)(model, edits, clean)}
      for name in sweeps:
        results[name] = getattr(api, name)(metric, axis=1)(model, clean, corrupted)
        results[f'{name} per head'] = getattr(api, name)(
            metric, filter=filters.by_path('dense_0'), **heads)(model, clean, corrupted)
      return results
    return run

  got_all = nnx.jit(everything(perturbkit.nnx, nnx_metric, lambda m, x: m(x)))(
      model, clean, corrupted)
  want_all = jax.jit(everything(perturbkit, linen_metric, linen.apply))(
      variables, clean, corrupted)
  got, want = got_all['cache'], want_all['cache']
  assert set(got[1].outputs['dense_1']) == {'__call__', '__call__#1'}
  chex.assert_trees_all_close(got, want, **TOL)

  def back(m, x):
    """The NNX model's cached output of dense_1's second call patched back in."""
    _, cache = perturbkit.nnx.run_with_cache(lambda m, x: m(x))(m, x)
    back = {'dense_1/__call__#1': interpret.replace(cache.outputs['dense_1']['__call__#1'])}
    return perturbkit.nnx.run_with_edits(lambda m, x: m(x))(m, back, x), m(x)

  patched_back, plain = nnx.jit(back)(model, clean)
  np.testing.assert_array_equal(patched_back, plain)
  chex.assert_trees_all_close(got_all['edits'], want_all['edits'], **TOL)

  for name in sweeps:
    got, want = got_all[name], want_all[name]
    assert got.paths == want.paths == ('dense_0/__call__', 'dense_1/__call__',
                                       'dense_1/__call__#1', 'dense_2/__call__')
    chex.assert_trees_all_close(got, want, **TOL)
    got, want = got_all[f'{name} per head'], want_all[f'{name} per head']
    assert got.effects.shape == (1, 2)
    chex.assert_trees_all_close(got, want, **TOL)
  chex.assert_trees_all_close(nnx_models.pure(nnx.state(model)), before, rtol=0, atol=0)


class _NestedBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, name='mlp')(nn.Dense(3, name='attn')(x)) + x


class _NestedNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1, name='head')(_NestedBlock(name='block1')(_NestedBlock(name='block0')(x)))


class _NNXNestedBlock(nnx.Module):
  def __init__(self, rngs):
    self.attn, self.mlp = nnx.Linear(3, 3, rngs=rngs), nnx.Linear(3, 3, rngs=rngs)

  def __call__(self, x):
    return self.mlp(self.attn(x)) + x


class _NNXNestedNet(nnx.Module):
  def __init__(self, rngs):
    self.block0, self.block1 = _NNXNestedBlock(rngs), _NNXNestedBlock(rngs)
    self.head = nnx.Linear(3, 1, rngs=rngs)

  def __call__(self, x):
    return self.head(self.block1(self.block0(x)))


def test_nested_calls_are_listed_in_the_same_order_by_both_apis():
  """A call comes before the calls made inside it (the order the calls start in), on both
  front ends: the rows of a result line up between a model and its twin."""
  x = jax.random.normal(jax.random.key(0), (2, 3))
  linen = _NestedNet()
  variables = jax.jit(linen.init)(jax.random.key(1), x)
  model = _NNXNestedNet(nnx.Rngs(1))
  want = tuple(f'{block}/{call}__call__' for block in ('block0', 'block1')
               for call in ('', 'attn/', 'mlp/')) + ('head/__call__',)
  for name in ('activation_patching', 'attribution_patching'):
    # Traced only: the paths are known before anything runs.
    got = nnx.eval_shape(getattr(perturbkit.nnx, name)(lambda m, x: jnp.sum(m(x))), model, x, -x)
    assert got.paths == want, (name, got.paths)
    got = jax.eval_shape(getattr(perturbkit, name)(lambda v, x: jnp.sum(linen.apply(v, x))),
                         variables, x, -x)
    assert got.paths == want, (name, got.paths)


def test_nnx_batched_patching_differentiates_as_its_linen_twin(twins):
  """``jax.grad`` with respect to the clean input of the batched sweep's effects under
  ``nnx.jit``, against the Linen twin's under ``jax.jit`` (the Linen one is checked against
  hand-written patches above); the corrupted input agrees with the clean one on tokens 0-2."""
  model, variables, linen, clean, corrupted = twins
  corrupted = clean.at[:, 3:].set(corrupted[:, 3:])
  nnx_patch = perturbkit.nnx.activation_patching(lambda m, x: metric_of(m(x)), axis=1,
                                                  batch_size=2)
  linen_patch = perturbkit.activation_patching(lambda v, x: metric_of(linen.apply(v, x)), axis=1,
                                               batch_size=2)
  loss = lambda effects: jnp.sum(jnp.sin(effects))
  got = nnx.jit(lambda m, c: jax.grad(lambda c: loss(nnx_patch(m, c, corrupted).effects))(c))(
      model, clean)
  want = jax.jit(jax.grad(lambda c: loss(linen_patch(variables, c, corrupted).effects)))(clean)
  assert float(jnp.abs(want).max()) > 1e-3
  chex.assert_trees_all_close(got, want, **TOL)


def test_nnx_effects_per_example_under_nnx_vmap_equal_its_linen_twin(twins):
  """``nnx.vmap`` and ``jax.vmap`` over (clean, corrupted) pairs of the NNX functions, a metric
  of one example, against ``jax.vmap`` of the Linen twin's (checked against patches by hand
  above). ``nnx.vmap`` binds its arguments by the returned function's signature, which is its
  own ``(model, clean, corrupted)``, not the metric's ``(model, x)``."""
  model, variables, linen, clean, corrupted = twins
  nnx_metric = lambda m, x: metric_of(m(x[None]))
  linen_metric = lambda v, x: metric_of(linen.apply(v, x[None]))
  axes = dict(in_axes=(None, 0, 0))
  for name in ('activation_patching', 'attribution_patching', 'layer_integrated_gradients'):
    nnx_fn = getattr(perturbkit.nnx, name)(nnx_metric, axis=1)
    linen_fn = getattr(perturbkit, name)(linen_metric, axis=1)
    args = (clean, corrupted) if name != 'layer_integrated_gradients' else (clean, 0 * clean)
    want = jax.jit(jax.vmap(linen_fn, **axes))(variables, *args)
    assert want.effects.shape == (SHAPE[0], 4, SHAPE[1])
    for vmap in (nnx.vmap, jax.vmap):
      chex.assert_trees_all_close(nnx.jit(vmap(nnx_fn, **axes))(model, *args), want, **TOL)
    assert list(inspect.signature(linen_fn).parameters)[1:] == list(
        inspect.signature(nnx_fn).parameters)[1:] == (
            ['clean', 'corrupted'] if name != 'layer_integrated_gradients'
            else ['inputs', 'baseline'])


class _BatchNormNet(nnx.Module):
  """Linear -> BatchNorm (training mode) -> relu -> Linear, with an explicit delta after the norm."""

  def __init__(self, rngs: nnx.Rngs):
    self.dense_0 = nnx.Linear(3, 4, rngs=rngs)
    self.norm = nnx.BatchNorm(4, rngs=rngs)
    self.dense_1 = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x, delta=0.0):
    return self.dense_1(jax.nn.relu(self.norm(self.dense_0(x)) + delta))


def test_nnx_batchnorm_in_training_mode_gives_grads_and_keeps_the_model():
  """The batch statistics update inside the cached run without touching the caller's model."""
  model = _BatchNormNet(nnx.Rngs(0))
  model.train()
  x = jax.random.normal(jax.random.key(3), (5, 3))
  before = nnx_models.pure(nnx.state(model))
  fn = lambda m, x: jnp.sum(m(x)[:, 0] ** 2)
  value, cache = nnx.jit(perturbkit.nnx.run_with_cache(fn, grads=True))(model, x)
  graphdef, state = nnx.split(model)
  want_value, want_grad = jax.jit(jax.value_and_grad(
      lambda d: fn(lambda x: nnx.merge(graphdef, state, copy=True)(x, d), x)))(
          jnp.zeros((5, 4)))
  np.testing.assert_allclose(value, want_value, **TOL)
  np.testing.assert_allclose(cache.grads['norm']['__call__'], want_grad, **TOL)
  assert float(jnp.abs(want_grad).max()) > 1e-3
  attributions = nnx.jit(perturbkit.nnx.grad_times_activation(fn))(model, x)
  assert 'norm/__call__' in attributions.paths
  chex.assert_trees_all_close(nnx_models.pure(nnx.state(model)), before, rtol=0, atol=0)


# --- GPT-2: tuple outputs ------------------------------------------------------------


@pytest.mark.filterwarnings(hf_models.FILTER_DEPRECATION[0])
@pytest.mark.filterwarnings(hf_models.FILTER_DEPRECATION[1])
def test_gpt2_blocks_cache_and_patching():
  hf = hf_models.hf_model('gpt2')
  ids, mask, positions = hf_models._tokens()
  corrupted = ids.at[:, 2].set(7)
  blocks = filters.by_path('transformer/h/0', 'transformer/h/1')
  logits = lambda v, ids: hf.module.apply(v, ids, mask, positions).logits
  metric = lambda v, ids: metric_of_logits(logits(v, ids))
  with jax.numpy_rank_promotion('allow'):
    out, cache = jax.jit(perturbkit.run_with_cache(logits, filter=blocks))(hf.variables, ids)
    _, state = jax.jit(functools.partial(hf.module.apply, capture_intermediates=True,
                                         mutable=['intermediates']))(
                                             hf.variables, ids, mask, positions)
    for i in ('0', '1'):
      want = state['intermediates']['transformer']['h'][i]['__call__'][0]
      chex.assert_trees_all_close(cache.outputs['transformer']['h'][i]['__call__'], want, **TOL)
    back = {f'transformer/h/{i}/__call__': interpret.replace(
        cache.outputs['transformer']['h'][i]['__call__']) for i in ('0', '1')}
    edited = jax.jit(perturbkit.run_with_edits(logits, filter=blocks))
    np.testing.assert_array_equal(edited(hf.variables, back, ids), out)

    result = jax.jit(perturbkit.activation_patching(metric, filter=blocks, axis=1, batch_size=8))(
        hf.variables, ids, corrupted)
    assert result.paths == ('transformer/h/0/__call__', 'transformer/h/1/__call__')
    assert result.effects.shape == (2, hf_models.SEQ)
    patches = [({f'transformer/h/{i}/__call__': interpret.replace(
        cache.outputs['transformer']['h'][str(i)]['__call__'], positions=[token], axis=1)},
                i, token) for i, token in ((0, 2), (1, 5))]
    # Both patched runs by hand, compiled together.
    by_hand = jax.jit(lambda v, ids: [metric_of_logits(edited(v, patch, ids))
                                      - metric_of_logits(logits(v, ids))
                                      for patch, _, _ in patches])
    for want, (_, i, token) in zip(by_hand(hf.variables, corrupted), patches):
      chex.assert_trees_all_close(result.effects[i, token], want, rtol=1e-4, atol=1e-6)
    # Before the corrupted token nothing changes; block 1's last token carries it all.
    chex.assert_trees_all_close(result.effects[:, :2], jnp.zeros((2, 2)), atol=1e-6)
    chex.assert_trees_all_close(result.effects[1, -1], result.clean_metric
                                - result.corrupted_metric, rtol=1e-4, atol=1e-6)


@pytest.mark.filterwarnings(hf_models.FILTER_DEPRECATION[0])
@pytest.mark.filterwarnings(hf_models.FILTER_DEPRECATION[1])
def test_gpt2_one_attention_head_ablated_through_a_view():
  """Head 1 of block 0's query, key and value (``c_attn``'s ``(batch, tokens, 3 * width)``
  output viewed as ``(batch, tokens, 3, heads, head_dim)``) zeroed, against an interceptor
  written here that does the same by hand."""
  hf = hf_models.hf_model('gpt2')
  ids, mask, positions = hf_models._tokens()
  heads, head_dim = hf_models.HEADS, hf_models.WIDTH // hf_models.HEADS
  logits = lambda v, ids: hf.module.apply(v, ids, mask, positions).logits
  path = 'transformer/h/0/attn/c_attn'

  def by_hand(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if '/'.join(context.module.path) != path or context.method_name != '__call__':
      return out
    split = out.reshape(out.shape[:-1] + (3, heads, head_dim))
    return split.at[..., 1, :].set(0.0).reshape(out.shape)

  with jax.numpy_rank_promotion('allow'):
    edit = interpret.zero_ablate(positions=[1], axis=3,
                                 view=(-1, hf_models.SEQ, 3, heads, head_dim))
    got = jax.jit(perturbkit.run_with_edits(logits))(hf.variables, {f'{path}/__call__': edit}, ids)
    with nn.intercept_methods(by_hand):  # traced here, with the interceptor: its own function
      want = jax.jit(lambda v, ids: logits(v, ids))(hf.variables, ids)
    plain = jax.jit(logits)(hf.variables, ids)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  assert float(jnp.abs(got - plain).max()) > 1e-4


@pytest.mark.filterwarnings(hf_models.FILTER_DEPRECATION[0])
@pytest.mark.filterwarnings(hf_models.FILTER_DEPRECATION[1])
def test_gpt2_prefill_with_a_kv_cache_called_as_hugging_faces_generate_calls_it():
  """A decoding step as Hugging Face's ``generate`` takes it: the model called with the params
  and a KV cache, ``model(ids, past_key_values=cache, params=...)``, which builds its
  variables (the cache a mutable collection among them) itself. ``run_with_cache`` returns
  the plain call's logits and written cache, bit for bit, and the blocks' outputs equal
  ``capture_intermediates`` on the module with the same cache; ``value_and_grad`` gives
  ``jax.grad``'s param gradients and, at the LM head, d metric / d logits."""
  hf = hf_models.hf_model('gpt2')
  ids, _, positions = hf_models._tokens()
  mask = jnp.ones((hf_models.BATCH, 2 * hf_models.SEQ), jnp.int32)  # the cache's length
  blocks = filters.by_path('transformer/h/0', 'transformer/h/1')

  def prefill(variables, ids, kv):
    out = hf.model(ids, mask, positions, params=variables['params'], past_key_values=kv)
    return out.logits, out.past_key_values

  def prefill_intermediates(variables, ids, kv):
    return hf.module.apply({**variables, 'cache': kv}, ids, mask, positions,
                           capture_intermediates=True, mutable=['cache', 'intermediates'])

  metric = lambda v, ids, kv: metric_of_logits(prefill(v, ids, kv)[0])
  with jax.numpy_rank_promotion('allow'):
    # HF's init_cache: zeros, shaped by an init on ids as long as the cache.
    full = jnp.broadcast_to(jnp.arange(2 * hf_models.SEQ), mask.shape)
    shapes = jax.eval_shape(lambda: hf.module.init(jax.random.key(0), full, mask, full,
                                                   init_cache=True))['cache']
    kv = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    (logits, written), cache = jax.jit(perturbkit.run_with_cache(prefill, filter=blocks))(
        hf.variables, ids, kv)
    want_logits, want_written = jax.jit(prefill)(hf.variables, ids, kv)
    _, state = jax.jit(prefill_intermediates)(hf.variables, ids, kv)
    (value, grads) = jax.jit(perturbkit.value_and_grad(metric))(hf.variables, ids, kv)
    want_value, want_grads = jax.jit(jax.value_and_grad(metric))(hf.variables, ids, kv)
  np.testing.assert_array_equal(logits, want_logits)
  chex.assert_trees_all_equal(written, want_written)
  assert float(jnp.abs(written['transformer']['h']['1']['attn']['cached_key']).max()) > 0
  for i in ('0', '1'):
    chex.assert_trees_all_close(cache.outputs['transformer']['h'][i]['__call__'],
                                state['intermediates']['transformer']['h'][i]['__call__'][0],
                                **TOL)
  chex.assert_trees_all_close(value, want_value, **TOL)
  chex.assert_trees_all_close(grads['params'], want_grads['params'], **TOL)
  chex.assert_trees_all_close(grads['perturbations']['lm_head']['__call__'],
                              jax.grad(metric_of_logits)(want_logits), **TOL)

  # The cache made inside the function with Hugging Face's own `init_cache` (a `module.init`
  # on ones, as `generate` makes it): that init is no call of the model, so the prefill's calls
  # keep the keys they had with the cache passed in.
  def own_cache(variables, ids):
    return prefill(variables, ids, hf.model.init_cache(hf_models.BATCH, 2 * hf_models.SEQ))

  with jax.numpy_rank_promotion('allow'):
    (own_logits, _), own = jax.jit(perturbkit.run_with_cache(own_cache, filter=blocks))(
        hf.variables, ids)
    own_grads = jax.jit(perturbkit.grad(lambda v, ids: metric_of_logits(own_cache(v, ids)[0])))(
        hf.variables, ids)
  np.testing.assert_array_equal(own_logits, want_logits)
  chex.assert_trees_all_equal(own.outputs, cache.outputs)
  chex.assert_trees_all_close(own_grads, grads, **TOL)


@pytest.mark.filterwarnings(hf_models.FILTER_DEPRECATION[0])
@pytest.mark.filterwarnings(hf_models.FILTER_DEPRECATION[1])
def test_gpt2_generate_steered_at_the_prompt_and_at_each_new_token_equals_an_interceptor_by_hand():
  """A steering vector added to block 0's output inside Hugging Face's greedy ``generate``.
  ``generate`` makes its KV cache with a ``module.init`` (no call of the model), runs the
  prompt (the block's ``'__call__'``), then each new token inside a ``lax.while_loop``
  (``'__call__#1'``, one edit for every iteration). Each edit gives the tokens of plain Flax
  ``generate`` under an interceptor that adds the vector to those calls' outputs by hand. A
  cache of ``generate`` is a named error: the calls inside the loop cannot be read out."""
  hf = hf_models.hf_model('gpt2')
  prompt = hf_models._tokens()[0][:, :4]
  steer = 20 * jax.random.normal(jax.random.key(3), (hf_models.WIDTH,))

  def generate(variables, ids):
    return hf.model.generate(ids, params=variables['params'], max_length=2 * hf_models.SEQ,
                             do_sample=False, pad_token_id=0).sequences

  def steered_by_hand(variables, ids, prompt_steer, token_steer):
    steered = []  # the block's calls so far, init's left out

    def add_steer(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      module = context.module
      if (context.method_name == '__call__' and module.scope.path == ('transformer', 'h', '0')
          and not module.is_initializing()):
        out = (out[0] + (token_steer if steered else prompt_steer), *out[1:])
        steered.append(None)
      return out

    with nn.intercept_methods(add_steer):
      return generate(variables, ids)

  def edits(prompt_steer, token_steer):
    return {'transformer/h/0/__call__': interpret.add(prompt_steer),
            'transformer/h/0/__call__#1': interpret.add(token_steer)}

  edited = jax.jit(perturbkit.run_with_edits(generate))
  by_hand = jax.jit(steered_by_hand)
  zero = jnp.zeros_like(steer)
  with jax.numpy_rank_promotion('allow'):
    plain = by_hand(hf.variables, prompt, zero, zero)  # x + 0 is x: the unsteered tokens
    np.testing.assert_array_equal(edited(hf.variables, edits(zero, zero), prompt), plain)
    for steers in ((steer, zero), (zero, steer), (steer, steer)):
      got = edited(hf.variables, edits(*steers), prompt)
      want = by_hand(hf.variables, prompt, *steers)
      np.testing.assert_array_equal(got, want)
      assert not np.array_equal(want, plain)  # each edit changes the generated tokens
    # The calls of the new tokens cannot leave the loop: a cache says so, naming the first
    # (while it is traced: under jax.jit, nothing runs op by op before the error).
    with pytest.raises(perturbkit.CaptureInJaxTransformError,
                       match=r"transformer/wte/__call__#1.*Hugging Face's generate"):
      jax.jit(perturbkit.run_with_cache(generate))(hf.variables, prompt)


def metric_of_logits(logits):
  return jnp.mean(logits[:, -1, 5] - logits[:, -1, 6])


# --- named errors --------------------------------------------------------------------


def test_edit_at_an_unknown_path(mlp):
  model, variables, x, _, _ = mlp
  edited = perturbkit.run_with_edits(model.apply)
  with pytest.raises(perturbkit.UnknownEditPathError, match=r"'Dense_9/__call__'.*Dense_0/__call__"):
    edited(variables, {'Dense_9': {'__call__': interpret.zero_ablate()}}, x)
  # A second call of a module called once: the message lists that module's calls first.
  with pytest.raises(perturbkit.UnknownEditPathError,
                     match=r"'Dense_0/__call__#1'.*The selected calls of Dense_0 are "
                           r"Dense_0/__call__\. The calls with points"):
    edited(variables, {'Dense_0/__call__#1': interpret.zero_ablate()}, x)
  edited = perturbkit.run_with_edits(model.apply, filter=filters.by_path('Dense_2'))
  with pytest.raises(perturbkit.UnknownEditPathError, match='widen the filter') as raised:
    edited(variables, {'Dense_0/__call__': interpret.zero_ablate()}, x)
  assert 'The selected calls of' not in str(raised.value)  # Dense_0 has no selected call


def test_edit_of_another_shape(mlp):
  model, variables, x, _, _ = mlp
  edited = perturbkit.run_with_edits(model.apply)
  with pytest.raises(perturbkit.EditShapeError, match=r'shift of shape \(3, 8\).*\(2, 5, 8\)'):
    edited(variables, {'Dense_0/__call__': interpret.replace(jnp.zeros((3, 8)))}, x)
  with pytest.raises(perturbkit.EditShapeError, match='scale of shape'):
    edited(variables, {'Dense_0/__call__': interpret.scale(jnp.ones(5))}, x)
  # The fix: a value that broadcasts.
  got = edited(variables, {'Dense_0/__call__': interpret.replace(jnp.zeros((1, 5, 8)))}, x)
  want = mlp_by_hand(variables['params'], x, lambda n, h: 0 * h if n == 'Dense_0/__call__' else h)
  chex.assert_trees_all_close(got, want, **TOL)


def test_mean_ablation_over_an_axis_the_reference_lacks(mlp):
  model, variables, x, corrupted, _ = mlp
  _, cache = perturbkit.run_with_cache(model.apply)(variables, corrupted)
  reference = cache.outputs['Dense_0']['__call__']  # (2, 5, 8)
  for over in (3, (0, -4)):
    with pytest.raises(perturbkit.InvalidOptionError, match=r'over.*\[-3, 3\).*\(2, 5, 8\)'):
      interpret.mean_ablate(reference, over=over)
  with pytest.raises(perturbkit.InvalidOptionError, match=r'\[-2, 2\) .*as viewed'):
    interpret.mean_ablate(reference, over=2, view=(-1, 8))
  # The fix: an axis the reference has (the last one, counted from the end).
  got = perturbkit.run_with_edits(model.apply)(
      variables, {'Dense_0/__call__': interpret.mean_ablate(reference, over=(0, -1))}, x)
  mean = np.asarray(reference).mean(axis=(0, 2), keepdims=True)
  want = mlp_by_hand(variables['params'], x, lambda n, h: jnp.broadcast_to(mean, h.shape)
                     if n == 'Dense_0/__call__' else h)
  chex.assert_trees_all_close(got, want, **TOL)


class _WithWeights(nn.Module):
  """An attention-like call returning ``(output, weights)``: (B, T, D) and (B, H, T, T)."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(x.shape[-1])(x)
    weights = jax.nn.softmax(jnp.einsum('btd,bsd->bts', h, x))[:, None]
    return jnp.einsum('bhts,bsd->btd', weights, x), weights


class _Attends(nn.Module):
  @nn.compact
  def __call__(self, x):
    out, _ = _WithWeights(name='attn')(x)
    return jnp.sum(out ** 2)


def test_one_array_for_a_call_returning_arrays_of_different_shapes():
  """A (D,) steering vector at a call returning (B, T, D) and (B, H, T, T) with T == D would
  also be added to the weights; it is refused by name, and a value per array is the fix (for
  steering vectors and gates, ``leaves=0``). Their gradient is the hand-written one's."""
  model, x = _Attends(), jax.random.normal(jax.random.key(1), (2, 4, 4))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  delta = jnp.arange(4.0)
  edited = perturbkit.run_with_edits(model.apply)
  with pytest.raises(perturbkit.AmbiguousEditError, match=r'shift of shape \(4,\).*\(2, 1, 4, 4\)'):
    edited(variables, {'attn/__call__': interpret.add(delta)}, x)
  steer = {'steer': interpret.steering_vector('attn/__call__', (4,))}
  steered = perturbkit.run_with_interventions(model.apply, steer)
  with pytest.raises(perturbkit.AmbiguousEditError):
    steered(variables, interpret.init_interventions(steer), x)
  got = jax.jit(lambda v, x: edited(v, {'attn/__call__': interpret.add((delta, 0.0))}, x))(
      variables, x)
  out, _ = jax.jit(_WithWeights().apply)({'params': variables['params']['attn']}, x)
  chex.assert_trees_all_close(got, jnp.sum((out + delta[None, None]) ** 2), **TOL)

  logits = jnp.linspace(-2.0, 2.0, 4)
  by_hand = {'steer': lambda v: jnp.sum((out + v[None, None]) ** 2),
             'gate': lambda g: jnp.sum((out * jax.nn.sigmoid(g)[None, None]) ** 2)}
  for name, intervention, params in (
      ('steer', interpret.steering_vector('attn/__call__', (4,), leaves=0), delta),
      ('gate', interpret.gates('attn/__call__', (4,), leaves=[0]), logits)):
    run = jax.jit(perturbkit.run_with_interventions(model.apply, {name: intervention}))
    value, grads = jax.jit(jax.value_and_grad(lambda p: run(variables, {name: p}, x)))(params)
    want, want_grads = jax.jit(jax.value_and_grad(by_hand[name]))(params)
    chex.assert_trees_all_close((value, grads), (want, want_grads), **TOL)
  beyond = interpret.steering_vector('attn/__call__', (4,), leaves=2)
  with pytest.raises(perturbkit.InvalidOptionError, match=r'attn/__call__ returns, but it returns 2'):
    perturbkit.run_with_interventions(model.apply, {'s': beyond})(
        variables, {'s': delta}, x)
  with pytest.raises(perturbkit.InvalidOptionError, match='leaves'):
    interpret.gates('attn/__call__', (4,), leaves=-1)


@flax.struct.dataclass
class _Labelled:
  logits: jax.Array
  label: jax.Array


class _DictHead(nn.Module):
  @nn.compact
  def __call__(self, h):
    return {'p': h * 2.0, 'q': h + 1.0}


class _LabelledHead(nn.Module):
  @nn.compact
  def __call__(self, h):
    logits = nn.Dense(3)(h)
    return _Labelled(logits=logits, label=jnp.argmax(logits, -1))


class _StructuredNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    d = _DictHead(name='dh')(x)
    return jnp.sum(_LabelledHead(name='head')(d['p'] + d['q']).logits ** 2)


def test_edit_values_of_another_structure_than_the_output():
  """A value in the output's own dataclass (whose integer field the cache leaves out), a dict
  missing a key or with an extra one: named errors showing both structures; a value in the
  cache's structure is the fix, against the model with the edit written by hand."""
  model, x = _StructuredNet(), jax.random.normal(jax.random.key(1), (2, 4))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  edited = perturbkit.run_with_edits(model.apply)
  _, cache = perturbkit.run_with_cache(model.apply)(variables, x)
  assert isinstance(cache.outputs['head']['__call__'], tuple)
  wrong = [('head/__call__', interpret.replace(_Labelled(logits=jnp.zeros(3), label=None)),
            r'head/__call__ has a shift of structure _Labelled\(logits=\(3,\).*is \(\(2, 3\),\)'),
           ('dh/__call__', interpret.replace({'p': jnp.zeros(4)}),
            r"structure \{'p': \(4,\)\}.*\{'p': \(2, 4\), 'q': \(2, 4\)\}"),
           ('dh/__call__', interpret.add({'p': 1.0, 'q': 1.0, 'r': 1.0}), r"'r': \(\)")]
  for path, edit, match in wrong:
    with pytest.raises(perturbkit.EditStructureError, match=match):
      edited(variables, {path: edit}, x)
  # The fix: values in the cache's structure.
  params = variables['params']['head']['Dense_0']
  head = lambda h: h @ params['kernel'] + params['bias'][None]
  got = edited(variables, {'head/__call__': interpret.replace((jnp.ones(3),)),
                           'dh/__call__': interpret.add({'p': 1.0, 'q': 0.0})}, x)
  chex.assert_trees_all_close(got, jnp.float32(2 * 3), **TOL)
  got = edited(variables, {'dh/__call__': interpret.add({'p': 1.0, 'q': 0.0})}, x)
  chex.assert_trees_all_close(got, jnp.sum(head(x * 2.0 + 1.0 + x + 1.0) ** 2), **TOL)


def test_edit_view_of_another_size_and_invalid_views(mlp):
  model, variables, x, _, _ = mlp
  edited = perturbkit.run_with_edits(model.apply)
  with pytest.raises(perturbkit.EditViewError, match=r'\(2, 5, 8\) as \(-1, 5, 3, 4\).*-1'):
    edited(variables, {'Dense_0/__call__': interpret.zero_ablate(view=(-1, 5, 3, 4))}, x)
  with pytest.raises(perturbkit.EditViewError, match=r'as \(2, 5, 2, 2\)'):
    edited(variables, {'Dense_0/__call__': interpret.zero_ablate(view=(2, 5, 2, 2))}, x)
  with pytest.raises(perturbkit.PositionOutOfRangeError, match=r'\[2\].*axis 2.*\(2, 5, 2, 4\)'):
    edited(variables, {'Dense_0/__call__': interpret.zero_ablate(
        positions=[2], axis=2, view=(-1, 5, 2, 4))}, x)
  for view in [(-1, -1, 8), (2, 0, 8), (2.5, 8), 'heads']:
    with pytest.raises(perturbkit.InvalidOptionError, match='view'):
      interpret.add(1.0, view=view)
  # The fix: a view of the output's size.
  got = edited(variables, {'Dense_0/__call__': interpret.zero_ablate(view=(-1, 5, 2, 4))}, x)
  want = mlp_by_hand(variables['params'], x, lambda n, h: 0 * h if n == 'Dense_0/__call__' else h)
  chex.assert_trees_all_close(got, want, **TOL)


def test_position_out_of_range(mlp):
  model, variables, x, corrupted, metric = mlp
  edited = perturbkit.run_with_edits(model.apply)
  with pytest.raises(perturbkit.PositionOutOfRangeError, match=r'\[5\].*axis 1.*\[-5, 5\)'):
    edited(variables, {'Dense_0/__call__': interpret.zero_ablate(positions=[5], axis=1)}, x)
  with pytest.raises(perturbkit.PositionOutOfRangeError, match='axis 3'):
    edited(variables, {'Dense_0/__call__': interpret.zero_ablate(positions=[0], axis=3)}, x)
  with pytest.raises(perturbkit.PositionOutOfRangeError, match='Dense_0/__call__'):
    perturbkit.activation_patching(metric, axis=1, positions=[0, 7])(variables, x, corrupted)
  with pytest.raises(perturbkit.PositionOutOfRangeError, match='axis 3'):
    perturbkit.attribution_patching(metric, axis=3)(variables, x, corrupted)


@pytest.mark.parametrize('transform', ['jit', 'vmap'])
def test_traced_positions_out_of_range_give_nan_and_in_range_ones_the_edit_by_hand(mlp,
                                                                                  transform):
  model, variables, x, _, _ = mlp
  edited = perturbkit.run_with_edits(model.apply)
  positions = [[1], [-1], [5], [-6], [7]]  # tokens: 5, so the last three are out of range
  run = lambda p: edited(variables, {'Dense_1/__call__': interpret.zero_ablate(positions=p,
                                                                               axis=1)}, x)
  stack = jnp.array(positions)
  got = jax.vmap(run)(stack) if transform == 'vmap' else jnp.stack([jax.jit(run)(p)
                                                                    for p in stack])
  for (p,), out in zip(positions[:2], got[:2]):
    want = mlp_by_hand(variables['params'], x, lambda n, h: h.at[:, p].set(0.0)
                       if n == 'Dense_1/__call__' else h)
    chex.assert_trees_all_close(out, want, **TOL)
  assert bool(jnp.isnan(got[2:]).all()), got[2:]


class _Pooled(nn.Module):
  """Token outputs ``(batch, 5, 8)``, attention-like ``(output, weights)`` with the weights
  ``(batch, 2 heads, 5, 5)``, and a pooler ``(batch, 6)``: axis 1 is tokens, heads, features."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8, name='tokens')(x)
    out, weights = _Attention(name='attn')(h)
    pooled = nn.Dense(6, name='pooler')(out[:, 0])
    return jnp.sum(jnp.tanh(out)) + jnp.sum(jnp.tanh(pooled)) + jnp.sum(weights[:, :, 0] ** 2)


def _weights(h):
  weights = jax.nn.softmax(jnp.einsum('btf,bsf->bts', h, h) / 8)
  return jnp.stack([weights, weights ** 2], axis=1)


class _Attention(nn.Module):
  @nn.compact
  def __call__(self, h):
    return h + nn.Dense(8)(jnp.einsum('bhts,bsf->btf', _weights(h), h)), _weights(h)


class _PooledTwin(nn.Module):
  """``_Pooled`` whose attention returns its output alone; the weights, the same numbers, are
  computed outside any call, where no sweep reaches them."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8, name='tokens')(x)
    out = _AttentionOutput(name='attn')(h)
    pooled = nn.Dense(6, name='pooler')(out[:, 0])
    return jnp.sum(jnp.tanh(out)) + jnp.sum(jnp.tanh(pooled)) + jnp.sum(_weights(h)[:, :, 0] ** 2)


class _AttentionOutput(nn.Module):
  @nn.compact
  def __call__(self, h):
    return h + nn.Dense(8)(jnp.einsum('bhts,bsf->btf', _weights(h), h))


class _NNXPooled(nnx.Module):
  """``_Pooled`` in NNX, without the pooler; ``alone``: its twin, as ``_PooledTwin``."""

  def __init__(self, alone: bool):
    self.tokens = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    self.attn = _NNXAttention(alone)

  def __call__(self, x):
    h = self.tokens(x)
    out = self.attn(h) if self.attn.alone else self.attn(h)[0]
    return jnp.sum(jnp.tanh(out)) + jnp.sum(_weights(h)[:, :, 0] ** 2)


class _NNXAttention(nnx.Module):
  def __init__(self, alone: bool):
    self.alone = alone
    self.proj = nnx.Linear(8, 8, rngs=nnx.Rngs(1))

  def __call__(self, h):
    out = h + self.proj(jnp.einsum('bhts,bsf->btf', _weights(h), h))
    return out if self.alone else (out, _weights(h))


def test_calls_of_another_length_along_the_swept_axis():
  """Without ``positions``, every call is swept at all of the first call's positions: a
  pooler's features (6 on axis 1) or attention weights' heads (2) are not tokens (5), so the
  sweeps refuse them by name (read as tokens, the pooler's first 5 features would be)."""
  model = _Pooled()
  x = jax.random.normal(jax.random.key(0), (3, 5, 4))
  corrupted = x.at[:, 2].add(1.0)
  variables = jax.jit(model.init)(jax.random.key(1), x)
  for function in (perturbkit.attribution_patching, perturbkit.activation_patching):
    with pytest.raises(perturbkit.AxisLengthMismatchError,
                       match=r"tokens/__call__ has 5, but attn/__call__ \(array 1 of the 2 it "
                             r"returns\) has 2 \(shape \(3, 2, 5, 5\)\), and 1 more call.*"
                             r"by_path\('attn', 'pooler'\)\)\), sweep only the first array "
                             r"each call returns \(leaves=0\)"):
      function(model.apply, axis=1)(variables, x, corrupted)
    with pytest.raises(perturbkit.AxisLengthMismatchError,
                       match=r"has 5, but pooler/__call__ has 6.*by_path\('pooler'\)"):
      function(model.apply, axis=1, filter=filters.by_path('tokens', 'pooler'))(
          variables, x, corrupted)
  with pytest.raises(perturbkit.PositionOutOfRangeError):  # the subclass
    perturbkit.grad_times_activation(model.apply, axis=1)(variables, x)
  # The fixes the message names: leave the calls out, or give the positions.
  tokens = perturbkit.attribution_patching(model.apply, axis=1,
                                           filter=filters.by_path('tokens', 'attn/Dense_0'))
  left_out = perturbkit.attribution_patching(
      model.apply, axis=1, filter=filters.negate(filters.by_path('pooler', 'attn')))
  got, want = jax.jit(left_out)(variables, x, corrupted), jax.jit(tokens)(variables, x, corrupted)
  assert got.paths == want.paths == ('tokens/__call__', 'attn/Dense_0/__call__')
  assert got.positions == tuple(range(5)) and float(jnp.abs(got.effects).max()) > 0
  np.testing.assert_array_equal(got.effects, want.effects)
  given = jax.jit(perturbkit.attribution_patching(model.apply, axis=1, positions=[0, 1]))(
      variables, x, corrupted)
  assert given.paths == ('tokens/__call__', 'attn/__call__', 'attn/Dense_0/__call__',
                         'pooler/__call__')
  np.testing.assert_allclose(given.effects[0], want.effects[0, :2], rtol=1e-6)


def test_leaves_sweep_one_array_of_a_call_as_a_call_returning_it_alone():
  """``leaves=0`` sweeps the attention's output and leaves the weights it also returns as the
  run makes them: each sweep on ``_Pooled`` equals the same sweep of its twin whose attention
  returns the output alone (the weights computed outside any call), on both front ends."""
  model, twin = _Pooled(), _PooledTwin()
  x = jax.random.normal(jax.random.key(0), (3, 5, 4))
  corrupted = x.at[:, 2].add(1.0)
  variables = jax.jit(model.init)(jax.random.key(1), x)
  keep = filters.negate(filters.by_path('pooler'))
  paired = (('activation_patching', True, {}),  # (name, takes the corrupted input, options)
            ('attribution_patching', True, {}),
            ('grad_times_activation', False, {}),
            ('layer_integrated_gradients', False, {'steps': 4}))

  def sweeps(apply, **leaves):
    """Every sweep, compiled together (one compile per model)."""
    def run(variables, x, corrupted):
      return [getattr(perturbkit, name)(apply, axis=1, filter=keep, **leaves, **options)(
          variables, *((x, corrupted) if two else (x,))) for name, two, options in paired]
    return jax.jit(run)

  for (name, _, _), got, want in zip(paired, sweeps(model.apply, leaves=0)(variables, x, corrupted),
                                     sweeps(twin.apply)(variables, x, corrupted), strict=True):
    assert got.paths == want.paths == ('tokens/__call__', 'attn/__call__',
                                       'attn/Dense_0/__call__'), name
    chex.assert_trees_all_close(got, want, **TOL)
    assert float(jnp.abs(got.effects[1]).max()) > 1e-3, name
  # Every array named is the default; a call returning fewer arrays is named.
  attn = dict(axis=1, positions=[0, 1], filter=filters.by_path('attn'))
  named = perturbkit.attribution_patching(model.apply, leaves=[1, 0], **attn)
  every = perturbkit.attribution_patching(model.apply, **attn)
  chex.assert_trees_all_close(jax.jit(named)(variables, x, corrupted),
                              jax.jit(every)(variables, x, corrupted), **TOL)
  with pytest.raises(perturbkit.InvalidOptionError, match='tokens/__call__ returns 1'):
    perturbkit.attribution_patching(model.apply, axis=1, leaves=1)(variables, x, corrupted)
  for bad in (-1, [], [0, 0], True, 'a', 1.5):
    with pytest.raises(perturbkit.InvalidOptionError, match='leaves'):
      perturbkit.activation_patching(model.apply, axis=1, leaves=bad)

  nnx_metric = lambda m, x: m(x)
  got = nnx.jit(perturbkit.nnx.attribution_patching(nnx_metric, axis=1, leaves=0))(
      _NNXPooled(alone=False), x, corrupted)
  want = nnx.jit(perturbkit.nnx.attribution_patching(nnx_metric, axis=1))(
      _NNXPooled(alone=True), x, corrupted)
  assert got.paths == want.paths
  assert sorted(got.paths) == ['attn/__call__', 'attn/proj/__call__', 'tokens/__call__']
  chex.assert_trees_all_close(got, want, **TOL)
  with pytest.raises(perturbkit.AxisLengthMismatchError, match='leaves=0'):
    perturbkit.nnx.activation_patching(nnx_metric, axis=1)(_NNXPooled(alone=False), x, corrupted)


def test_metric_that_is_not_a_scalar(mlp):
  model, variables, x, corrupted, _ = mlp
  with pytest.raises(perturbkit.NonScalarMetricError, match='run_with_cache.*shape'):
    perturbkit.run_with_cache(model.apply, grads=True)(variables, x)
  with pytest.raises(perturbkit.NonScalarLossError, match='activation_patching'):
    perturbkit.activation_patching(model.apply)(variables, x, corrupted)
  with pytest.raises(perturbkit.NonScalarMetricError, match='grad_times_activation'):
    perturbkit.grad_times_activation(lambda v, x: model.apply(v, x).sum(-1))(variables, x)


def test_clean_and_corrupted_inputs_that_make_different_calls(mlp):
  _, variables, x, _, metric = mlp
  with pytest.raises(perturbkit.CallStructureMismatchError,
                     match=r'Dense_0/__call__.*\(2, 5, 8\).*\(2, 4, 8\).*same shape'):
    perturbkit.activation_patching(metric, axis=1)(variables, x, x[:, :4])
  with pytest.raises(perturbkit.CallStructureMismatchError, match='Dense_0/__call__'):
    perturbkit.attribution_patching(metric)(variables, x, x[:, :4])


def test_clean_and_corrupted_inputs_of_one_type_share_a_trace_of_the_calls(mlp):
  """A trace sees only its inputs' types, so a corrupted input of the clean one's shapes and
  dtypes (a NumPy array too) reuses the clean trace of the calls: attribution patching
  traces the metric once more than gradient x activation (its clean run), and layer
  integrated gradients from a baseline once more than from none (the baseline's run). An
  input of another shape is traced, and refused by name
  (``test_clean_and_corrupted_inputs_that_make_different_calls``)."""
  _, variables, clean, corrupted, metric = mlp
  count = [0]

  def counted(v, x):
    count[0] += 1
    return metric(v, x)

  def traces(fn, *inputs):
    count[0] = 0
    jax.eval_shape(fn, variables, *inputs)
    return count[0]

  alone = traces(perturbkit.grad_times_activation(counted), corrupted)
  assert traces(perturbkit.attribution_patching(counted), clean, corrupted) == alone + 1
  assert traces(perturbkit.attribution_patching(counted), clean, np.asarray(corrupted)) == (
      alone + 1)
  integrated = perturbkit.layer_integrated_gradients(counted, steps=2)
  assert traces(integrated, clean, corrupted) == traces(integrated, clean) + 1


def test_invalid_batch_size_and_positions_without_axis():
  with pytest.raises(perturbkit.InvalidOptionError, match='batch_size'):
    perturbkit.activation_patching(lambda v, x: 0.0, batch_size=0)
  with pytest.raises(perturbkit.InvalidOptionError, match='progress'):
    perturbkit.activation_patching(lambda v, x: 0.0, progress='yes')
  with pytest.raises(perturbkit.InvalidOptionError, match='axis'):
    interpret.zero_ablate(positions=[1])


@pytest.mark.parametrize('sweep', ['activation_patching', 'attribution_patching',
                                   'grad_times_activation', 'layer_integrated_gradients'])
def test_sweep_positions_that_are_no_indices_are_refused_where_given(sweep):
  """``positions=[1.5]`` would be read as token 1, ``[]`` as nothing, positions without an
  axis as whole outputs: each is an error when the function is made, before any run."""
  make = getattr(perturbkit, sweep)
  metric = lambda v, x: 0.0
  for options, name in [(dict(axis=1, positions=[1.5]), 'positions'),
                        (dict(axis=1, positions=[]), 'positions'),
                        (dict(axis=1, positions=[[0, 1]]), 'positions'),
                        (dict(positions=[1]), 'axis'),
                        (dict(axis=1.0), 'axis'),
                        (dict(axis=True), 'axis')]:
    with pytest.raises(perturbkit.InvalidOptionError, match=rf'^{name}='):
      make(metric, **options)
  with pytest.raises(perturbkit.InvalidOptionError, match='not .*0, 1.*]]'):
    make(metric, axis=1, positions=[[0, 1]])
  with pytest.raises(perturbkit.InvalidOptionError, match='an int whenever positions are given'):
    make(metric, positions=[1])
  # A slice or a boolean mask is refused with how to write it as indices.
  for given in (slice(1, 3), np.array([True, False, True])):
    with pytest.raises(perturbkit.InvalidOptionError, match='range.*flatnonzero'):
      make(metric, axis=1, positions=given)
    with pytest.raises(perturbkit.InvalidOptionError, match='range.*flatnonzero'):
      interpret.zero_ablate(axis=1, positions=given)
  # Integer positions of any integer type are fine.
  make(metric, axis=1, positions=np.array([0, 3], np.int32))


def test_edits_that_are_no_dict_nested_positions_and_metrics_of_other_arguments(mlp):
  """Edits as a list, an array as an edit, nested positions in an edit, and a metric of
  ``(variables, x, y)`` given to patching (which passes one input): named errors saying what
  each must be, not Python's own errors from inside."""
  model, variables, x, corrupted, metric = mlp
  edited = perturbkit.run_with_edits(model.apply)
  with pytest.raises(perturbkit.NotEditsError, match=r'a list for the edits.*a dict'):
    edited(variables, [interpret.zero_ablate()], x)
  with pytest.raises(perturbkit.NotEditsError, match=r"edit at 'Dense_0/__call__'.*a dict"):
    edited(variables, {'Dense_0/__call__': jnp.zeros(8)}, x)
  twice = {'Dense_0/__call__': interpret.zero_ablate(), 'Dense_0': {'__call__': interpret.scale(1.0)}}
  with pytest.raises(perturbkit.DuplicateEditError, match=r"'Dense_0/__call__' two edits"):
    edited(variables, twice, x)
  with pytest.raises(perturbkit.DuplicateEditError, match=r"'Dense_0/__call__' two edits"):
    edited(variables, dict(reversed(twice.items())), x)
  with pytest.raises(perturbkit.InvalidOptionError, match=r'^positions=\[\[0, 1\]\].*flat'):
    edited(variables, {'Dense_0/__call__': interpret.zero_ablate(positions=[[0, 1]], axis=1)}, x)
  two = lambda v, x, y: metric(v, x)
  for make in (perturbkit.activation_patching, perturbkit.attribution_patching):
    with pytest.raises(perturbkit.MetricSignatureError,
                       match=r'fn\(variables, inputs\).*\(v, x, y\).*ONE pytree'):
      make(two)(variables, x, corrupted)
  with pytest.raises(perturbkit.MetricSignatureError, match=r'fn\(model, inputs\)'):
    perturbkit.nnx.grad_times_activation(lambda m, x, y: m(x).mean())(
        nnx.Linear(3, 1, rngs=nnx.Rngs(0)), x)


JAX_TRANSFORMS_IN_FN = {
    # A new function each time: JAX traces jax.jit(model.apply) (and jax.checkpoint's) once,
    # and perturbkit would not see its calls in a later run.
    'jit': lambda apply: lambda v, x: jax.jit(lambda v, x: apply(v, x))(v, x),
    'checkpoint': lambda apply: lambda v, x: jax.checkpoint(lambda v, x: apply(v, x))(v, x),
    'vmap': lambda apply: lambda v, x: jax.vmap(lambda xi: apply(v, xi[None])[0])(x),
    'lax.map': lambda apply: lambda v, x: jax.lax.map(lambda xi: apply(v, xi[None])[0], x),
}


@pytest.mark.parametrize('transform', list(JAX_TRANSFORMS_IN_FN))
def test_reading_calls_inside_a_jax_transform_of_fn_is_a_named_error_and_edits_work(
    mlp, transform):
  """``fn`` wrapping ``model.apply`` in a JAX transform: the calls' values cannot leave it, so
  reading them (the cache, patching) is refused by name, where they were leaked tracers; edits,
  which read nothing, equal the model edited by hand. The fix the message gives, the transform
  around the perturbkit function, caches what ``capture_intermediates`` does."""
  model, variables, x, corrupted, _ = mlp
  fn = JAX_TRANSFORMS_IN_FN[transform](model.apply)
  metric = lambda v, x: metric_of(fn(v, x))
  with pytest.raises(perturbkit.CaptureInJaxTransformError,
                     match=r'run_with_cache cannot read .*Dense_0/__call__.*model.apply'):
    perturbkit.run_with_cache(fn)(variables, x)
  for name in ('activation_patching', 'attribution_patching'):
    with pytest.raises(perturbkit.CaptureInJaxTransformError, match=rf'{name} cannot read'):
      getattr(perturbkit, name)(metric)(variables, x, corrupted)
  edits = {'Dense_1/__call__': interpret.add(jnp.arange(8.0))}
  want = mlp_by_hand(variables['params'], x,
                     lambda n, h: h + jnp.arange(8.0)[None, None] if n == 'Dense_1/__call__' else h)
  chex.assert_trees_all_close(perturbkit.run_with_edits(fn)(variables, edits, x), want, **TOL)
  _, cache = jax.jit(perturbkit.run_with_cache(model.apply))(variables, x)
  _, state = model.apply(variables, x, capture_intermediates=True, mutable=['intermediates'])
  chex.assert_trees_all_close(cache.outputs['Dense_0']['__call__'],
                              state['intermediates']['Dense_0']['__call__'][0], **TOL)


def test_reading_calls_of_a_lifted_transform_inside_jax_jit_of_fn_is_a_named_error():
  """``nn.remat`` inside the model, ``jax.jit`` around ``model.apply`` in ``fn``: the captures
  that leave the lifted transform through a collection are still the jit's tracers."""
  model = models.Lifted(transform='remat')
  x = jax.random.normal(jax.random.key(1), (2, 3))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  fn = JAX_TRANSFORMS_IN_FN['jit'](model.apply)
  with pytest.raises(perturbkit.CaptureInJaxTransformError, match='block/Dense_0/__call__'):
    perturbkit.run_with_cache(fn, filter=filters.by_path('block/Dense_0'))(variables, x)
  edits = {'block/Dense_0/__call__': interpret.scale(0.0)}
  twin = models.Lifted(transform='none')
  chex.assert_trees_all_close(perturbkit.run_with_edits(fn)(variables, edits, x),
                              perturbkit.run_with_edits(twin.apply)(variables, edits, x), **TOL)


@pytest.mark.parametrize('transform', ['vmap', 'checkpoint'])
def test_nnx_reading_calls_inside_a_jax_transform_of_fn_is_a_named_error(transform):
  model = nnx_models.MLP(rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (4, 3))
  fn = {'vmap': lambda m, x: jax.vmap(lambda xi: m(xi))(x),
        'checkpoint': lambda m, x: jax.checkpoint(lambda x: m(x))(x)}[transform]
  with pytest.raises(perturbkit.CaptureInJaxTransformError,
                     match=r'nnx.run_with_cache cannot read .*dense_0/__call__'):
    perturbkit.nnx.run_with_cache(fn)(model, x)
  got = perturbkit.nnx.run_with_edits(fn)(model, {'dense_2/__call__': interpret.zero_ablate()}, x)
  chex.assert_trees_all_close(got, jnp.zeros((4, 2)), **TOL)
  _, cache = perturbkit.nnx.run_with_cache(lambda m, x: m(x))(model, x)
  chex.assert_trees_all_close(cache.outputs['dense_0']['__call__'], model.dense_0(x), **TOL)


@pytest.mark.parametrize('transform', ['remat', 'jit'])
def test_calls_inside_remat_and_jit_equal_the_model_without_the_transform(transform):
  """``nn.remat`` or ``nn.jit`` around a block: the calls inside it are read, edited and
  patched through a mutable collection that the transform carries out. Caching (outputs,
  inputs, gradients), edits inside the block, activation and attribution patching of every
  call, and ``value_and_grad``'s activations and inputs equal the same model without the
  transform on the same variables; the cached output inside equals its
  ``capture_intermediates``."""
  model, twin = models.Lifted(transform=transform), models.Lifted(transform='none')
  x = jax.random.normal(jax.random.key(1), (2, 3))
  corrupted = jax.random.normal(jax.random.key(2), (2, 3))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  metric = lambda m: lambda v, x: jnp.sum(jnp.tanh(m.apply(v, x)))
  inner = ('block', 'Dense_0', '__call__')

  edits = {'/'.join(inner): interpret.add(jnp.ones(4)),
           'block/__call__': interpret.scale(2.0, positions=[1], axis=0)}
  grads = dict(return_activations=True, return_inputs=True)

  def everything(m):
    """Caching, edits, both patchings and ``value_and_grad``, compiled together (one compile
    per model)."""
    def run(variables, x, corrupted):
      return {'cache': perturbkit.run_with_cache(metric(m), grads=True, return_inputs=True)(
                  variables, x),
              'edits': perturbkit.run_with_edits(m.apply)(variables, edits, x),
              'activation_patching': perturbkit.activation_patching(metric(m), axis=0)(
                  variables, x, corrupted),
              'attribution_patching': perturbkit.attribution_patching(metric(m), axis=0)(
                  variables, x, corrupted),
              'value_and_grad': perturbkit.value_and_grad(metric(m), **grads)(variables, x)}
    return jax.jit(run)

  got_all = everything(model)(variables, x, corrupted)
  want_all = everything(twin)(variables, x, corrupted)
  got, want = got_all['cache'], want_all['cache']
  assert set(flat(got[1].outputs)) == {'Dense_0/__call__', 'block/Dense_0/__call__',
                                       'block/__call__', 'Dense_1/__call__'}
  chex.assert_trees_all_close(got, want, **TOL)
  _, state = jax.jit(functools.partial(twin.apply, capture_intermediates=True,
                                       mutable=['intermediates']))(variables, x)
  chex.assert_trees_all_close(got[1].outputs['block']['Dense_0']['__call__'],
                              state['intermediates']['block']['Dense_0']['__call__'][0], **TOL)
  assert float(jnp.abs(got[1].grads['block']['Dense_0']['__call__']).max()) > 1e-3

  chex.assert_trees_all_close(got_all['edits'], want_all['edits'], **TOL)
  for name in ('activation_patching', 'attribution_patching'):
    got, want = got_all[name], want_all[name]
    assert got.paths == want.paths and '/'.join(inner) in got.paths
    chex.assert_trees_all_close(got, want, **TOL)
  assert float(jnp.abs(want.effects).max()) > 1e-3
  chex.assert_trees_all_close(got_all['value_and_grad'], want_all['value_and_grad'], **TOL)


def test_calls_inside_remat_with_batch_statistics_equal_the_model_without_the_transform():
  """A BatchNorm in training mode inside ``nn.remat``, applied with ``mutable=['batch_stats']``:
  the cached run returns the model's output and its updated statistics, as the model run
  without perturbkit does, and caching and attribution patching equal the model without the
  transform."""
  model, twin = models.RematNorm(), models.RematNorm(remat=False)
  x = jax.random.normal(jax.random.key(1), (5, 3))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  run = lambda m: lambda v, x: m.apply(v, x, mutable=['batch_stats'])
  metric = lambda m: lambda v, x: jnp.sum(jnp.tanh(run(m)(v, x)[0]))

  @jax.jit
  def references(variables, x):
    """The model run without perturbkit, and the twin's cache and attributions."""
    return (run(model)(variables, x), perturbkit.run_with_cache(run(twin))(variables, x)[1],
            perturbkit.attribution_patching(metric(twin), axis=0)(variables, x, 2 * x))

  plain, twin_cache, want = references(variables, x)
  (out, updates), cache = jax.jit(perturbkit.run_with_cache(run(model)))(variables, x)
  chex.assert_trees_all_close((out, updates), plain, **TOL)
  assert not np.allclose(updates['batch_stats']['block']['BatchNorm_0']['mean'],
                         variables['batch_stats']['block']['BatchNorm_0']['mean'])
  assert 'BatchNorm_0' in cache.outputs['block']
  chex.assert_trees_all_close(cache, twin_cache, **TOL)
  got = jax.jit(perturbkit.attribution_patching(metric(model), axis=0))(variables, x, 2 * x)
  chex.assert_trees_all_close(got, want, **TOL)


@pytest.mark.parametrize('transform', ['remat', 'jit'])
def test_nnx_calls_inside_remat_and_jit_equal_the_model_without_the_transform(transform):
  """``nnx.remat`` or ``nnx.jit`` around a block with BatchNorm in training mode and a Linear
  called twice: its calls are read, edited and patched through the modules' capture state,
  which the transform carries out. Caching (outputs, inputs, gradients), edits inside the
  block, activation and attribution patching of every call, and ``value_and_grad``'s
  activations, inputs and batch statistics equal the same model without the transform."""
  model = nnx_models.Lifted(transform, rngs=nnx.Rngs(0))
  twin = nnx_models.Lifted('none', rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (5, 3))
  corrupted = jax.random.normal(jax.random.key(2), (5, 3))
  metric = lambda m, x: jnp.sum(jnp.tanh(m(x)))
  inner = 'block/linear/__call__#1'

  got = nnx.jit(perturbkit.nnx.run_with_cache(metric, grads=True, return_inputs=True))(model, x)
  want = nnx.jit(perturbkit.nnx.run_with_cache(metric, grads=True, return_inputs=True))(twin, x)
  assert set(flat(got[1].outputs)) == {
      'inp/__call__', 'block/linear/__call__', 'block/norm/__call__', inner, 'block/__call__',
      'out/__call__'}
  chex.assert_trees_all_close(got, want, **TOL)
  hand = nnx.clone(twin)                # by hand, outside perturbkit (its statistics change)
  h = hand.block.norm(hand.block.linear(hand.inp(x)))
  chex.assert_trees_all_close(got[1].outputs['block']['linear']['__call__#1'],
                              hand.block.linear(h), **TOL)
  assert float(jnp.abs(got[1].grads['block']['linear']['__call__#1']).max()) > 1e-3

  edits = {inner: interpret.add(jnp.ones(4)),
           'block/__call__': interpret.scale(2.0, positions=[1], axis=0)}
  run = lambda m, x: m(x)
  chex.assert_trees_all_close(perturbkit.nnx.run_with_edits(run)(model, edits, x),
                              nnx.jit(perturbkit.nnx.run_with_edits(run))(twin, edits, x),
                              **TOL)
  for name in ('activation_patching', 'attribution_patching'):
    got = nnx.jit(getattr(perturbkit.nnx, name)(metric, axis=0))(model, x, corrupted)
    want = nnx.jit(getattr(perturbkit.nnx, name)(metric, axis=0))(twin, x, corrupted)
    assert got.paths == want.paths and inner in got.paths
    chex.assert_trees_all_close(got, want, **TOL)
  assert float(jnp.abs(want.effects).max()) > 1e-3

  options = dict(return_activations=True, return_inputs=True)
  chex.assert_trees_all_close(
      perturbkit.nnx.value_and_grad(metric, **options)(model, x),
      nnx.jit(perturbkit.nnx.value_and_grad(metric, **options))(twin, x), **TOL)
  chex.assert_trees_all_close(nnx.state(model, nnx.BatchStat), nnx.state(twin, nnx.BatchStat),
                              **TOL)
  assert not np.allclose(model.block.norm.mean[...], 0.0)


def test_calls_inside_mapping_transforms_are_points_per_member_or_named_errors():
  """``nn.vmap`` mapping every collection, perturbkit's included, runs a call once per member:
  the cache stacks its outputs like its gradient, and an edit addresses one member
  (``'dense/__call__[1]'``), against the members computed by hand. (``nn.scan`` and
  ``nnx.scan``: tests/test_interpret_scan.py.) ``nnx.vmap`` with the module's state broadcast
  but its perturbations mapped cannot carry a per-example value out at all: a named error
  with the function, the call and the fix."""
  mapped = models.MappedDense()
  x = jax.random.normal(jax.random.key(1), (5, 2, 3))
  variables = jax.jit(mapped.init)(jax.random.key(0), x)
  dense = variables['params']['dense']
  by_hand = jnp.einsum('mbi,mio->mbo', x, dense['kernel']) + dense['bias'][:, None]
  metric = lambda v, x: jnp.sum(mapped.apply(v, x) ** 2)

  @jax.jit
  def everything(variables, x):
    """The four functions below, compiled together (one compile)."""
    return {'value_and_grad': perturbkit.value_and_grad(metric, return_activations=True)(
                variables, x),
            'cache': perturbkit.run_with_cache(metric, grads=True)(variables, x),
            'edited': perturbkit.run_with_edits(mapped.apply)(
                variables, {'dense/__call__[1]': interpret.scale(3.0, positions=[0], axis=1)},
                x),
            'attribution': perturbkit.attribution_patching(metric)(variables, x, -x)}

  got = everything(variables, x)
  _, grads, acts = got['value_and_grad']
  chex.assert_trees_all_close(acts['dense']['__call__'], by_hand, **TOL)
  chex.assert_trees_all_close(grads['perturbations']['dense']['__call__'], 2 * by_hand, **TOL)
  _, cache = got['cache']
  chex.assert_trees_all_close(cache.outputs['dense']['__call__'], by_hand, **TOL)
  chex.assert_trees_all_close(cache.grads['dense']['__call__'], 2 * by_hand, **TOL)
  chex.assert_trees_all_close(got['edited'], by_hand.at[1, :, 0].multiply(3.0), **TOL)
  result = got['attribution']
  assert result.paths == tuple(f'dense/__call__[{m}]' for m in range(5))
  corrupted = -by_hand + 2 * dense['bias'][:, None]  # the outputs of -x
  want = jnp.sum((by_hand - corrupted) * 2 * corrupted, axis=(1, 2))  # one sum per member
  np.testing.assert_allclose(result.effects[:, 0], want, **TOL)

  with pytest.raises(perturbkit.ActivationsUnavailableError,
                     match=r'perturbkit.nnx.run_with_cache cannot read.*block.*nnx.vmap.*filter'):
    perturbkit.nnx.run_with_cache(lambda m, x: m(x))(
        nnx_models.VmapBroadcast(mapped=True, rngs=nnx.Rngs(0)), jnp.ones((2, 4)))
  with pytest.raises(perturbkit.ActivationsUnavailableError, match='return_activations'):
    perturbkit.nnx.value_and_grad(lambda m, x: m(x).sum(), return_inputs=True)(
        nnx_models.VmapBroadcast(mapped=True, rngs=nnx.Rngs(0)), jnp.ones((2, 4)))


@pytest.mark.parametrize('switch', [False, True])
def test_cond_with_another_submodule_per_branch_is_a_named_error_and_the_filter_works(switch):
  """The branches of ``nn.cond``/``nn.switch`` make different calls: every function says so,
  naming the transform and the filter that works; with that filter the calls outside the
  branches are cached, equal to the model written by hand."""
  model = models.BranchedDense(switch=switch)
  x = jax.random.normal(jax.random.key(1), (2, 3))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  metric = lambda v, x: model.apply(v, x).mean()
  transform = 'nn.switch' if switch else 'nn.cond'
  calls = [lambda: perturbkit.run_with_cache(model.apply)(variables, x),
           lambda: perturbkit.run_with_edits(model.apply)(variables, {}, x),
           lambda: perturbkit.activation_patching(metric)(variables, x, -x),
           lambda: perturbkit.value_and_grad(metric)(variables, x)]
  for call in calls:
    with pytest.raises(perturbkit.BranchCallsMismatchError,
                       match=rf"{transform}.*a/__call__.*by_path\('a', 'b'\).*jnp.where"):
      call()
  outside = filters.negate(filters.by_path('a', 'b'))
  _, cache = perturbkit.run_with_cache(model.apply, filter=outside)(variables, x)
  params = variables['params']
  dense = lambda name, h: nn.Dense(params[name]['bias'].shape[0]).apply(
      {'params': params[name]}, h)
  h = dense('emb', x)
  chex.assert_trees_all_close(cache.outputs['emb']['__call__'], h, **TOL)
  branch = 'a' if float(x.sum()) > 0 else 'b'
  chex.assert_trees_all_close(cache.outputs['out']['__call__'], dense('out', dense(branch, h)),
                              **TOL)


_INNER = nn.Sequential([nn.Dense(4), jnp.tanh, nn.Dense(4)])
_INNER_VARIABLES = jax.jit(_INNER.init)(jax.random.key(5), jnp.ones((1, 4)))


class _AppliesAnother(nn.Module):
  """Runs another model's ``apply`` on variables it closes over, between two of its own calls."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(1, name='post')(_INNER.apply(_INNER_VARIABLES, nn.Dense(4, name='pre')(x)))


def test_calls_of_an_apply_nested_on_other_variables_warn_with_that_reason():
  """The inner model's calls get no points (its variables are not the model's): the warning
  says so and lists them, not a lifted transform; the model's own calls are cached as the
  model written out by hand computes them."""
  model, x = _AppliesAnother(), jax.random.normal(jax.random.key(1), (2, 4))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  for run in (lambda: perturbkit.run_with_cache(model.apply)(variables, x),
              lambda: perturbkit.value_and_grad(lambda v, x: model.apply(v, x).sum())(
                  variables, x)):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      run()
    messages = [str(w.message) for w in caught if w.category is perturbkit.UnperturbedCallsWarning]
    assert len(messages) == 1, messages
    assert re.search(r"^2 selected call\(s\) run inside an `apply` made within a call of the "
                     r"model on variables given to it.*\[layers_0/__call__, layers_2/__call__\]",
                     messages[0]), messages[0]
    assert 'lifted' not in messages[0] and 'while_loop' not in messages[0]
  with pytest.warns(perturbkit.UnperturbedCallsWarning):
    _, cache = perturbkit.run_with_cache(model.apply)(variables, x)
  p = variables['params']
  pre = x @ p['pre']['kernel'] + p['pre']['bias'][None]
  assert list(cache.outputs) == ['pre', 'post']
  chex.assert_trees_all_close(cache.outputs['pre']['__call__'], pre, **TOL)
  chex.assert_trees_all_close(cache.outputs['post']['__call__'], model.apply(variables, x), **TOL)


def test_calls_inside_a_while_loop_get_no_point_and_the_others_are_cached():
  """``nn.while_loop`` hands its body the perturbations read-only, one value for every
  iteration: its calls get no point (a warning names them and the fix, not a missing
  perturbation), and the calls around the loop are cached as by hand."""

  class Looped(nn.Module):
    def setup(self):
      self.a, self.out = nn.Dense(3), nn.Dense(1)

    def __call__(self, x):
      body = lambda m, c: (c[0] + 1, jnp.tanh(m.a(c[1])))
      _, h = nn.while_loop(lambda m, c: c[0] < 2, body, self, (0, self.a(x)))
      return self.out(h)

  x = jax.random.normal(jax.random.key(1), (2, 3))
  model = Looped()
  variables = jax.jit(model.init)(jax.random.key(0), x)
  with pytest.warns(perturbkit.UnperturbedCallsWarning,
                    match=r'nn.while_loop, whose iterations.*a/__call__#1.*Python `for` loop'):
    out, cache = perturbkit.run_with_cache(model.apply)(variables, x)
  dense = nn.Dense(3).apply({'params': variables['params']['a']}, x)
  chex.assert_trees_all_close(cache.outputs, {'a': {'__call__': dense},
                                              'out': {'__call__': model.apply(variables, x)}},
                              **TOL)
  chex.assert_trees_all_close(out, model.apply(variables, x), **TOL)


def test_nnx_cond_calls_are_cached_and_nested_kinds_warn_naming_the_fix():
  """A call in both branches of ``nnx.cond`` is one point: the cache holds what the branch
  that ran gave, and the call after it counts on past both. An ``nnx.cond`` nested in an
  ``nnx.switch`` cannot share points (Flax does not say which is inside): the warning
  names them and the fix."""

  class Branched(nnx.Module):
    def __init__(self, nested, rngs):
      self.nested = nested
      self.a, self.out = nnx.Linear(3, 3, rngs=rngs), nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):
      cond = lambda m, h: nnx.cond(h.sum() > 0, lambda m, h: m.a(h), lambda m, h: m.a(2 * h),
                                   m, h)
      if self.nested:
        h = nnx.switch(1, [cond, cond], self, self.a(x))
      else:
        h = cond(self, self.a(x))
      return self.out(self.a(h))

  model, x = Branched(False, nnx.Rngs(0)), jax.random.normal(jax.random.key(1), (2, 3))
  with warnings.catch_warnings():
    warnings.simplefilter('error', perturbkit.UnperturbedCallsWarning)
    _, cache = perturbkit.nnx.run_with_cache(lambda m, x: m(x))(model, x)
  h = model.a(x)
  branch = model.a(h) if h.sum() > 0 else model.a(2 * h)
  chex.assert_trees_all_close(cache.outputs, {
      'a': {'__call__': h, '__call__#1': branch, '__call__#2': model.a(branch)},
      'out': {'__call__': model(x)}}, **TOL)
  with pytest.warns(perturbkit.UnperturbedCallsWarning,
                    match=r'nnx\.cond and an nnx\.switch nested.*a/__call__#1.*same kind'):
    perturbkit.nnx.run_with_cache(lambda m, x: m(x))(Branched(True, nnx.Rngs(0)), x)


def test_nnx_fori_loop_warning_advises_a_python_loop_not_state_axes():
  """``nnx.fori_loop`` carries the module, so its calls get no point; the warning's advice
  must fit a loop that cannot map state (a Python loop), not only ``nnx.scan``'s."""

  class Looped(nnx.Module):
    def __init__(self, rngs):
      self.layer, self.out = nnx.Linear(3, 3, rngs=rngs), nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):
      _, h = nnx.fori_loop(0, 2, lambda i, c: (c[0], jnp.tanh(c[0].layer(c[1]))), (self, x))
      return self.out(h)

  with pytest.warns(perturbkit.UnperturbedCallsWarning,
                    match=r'nnx\.fori_loop.*nnx\.fori_loop and nnx\.while_loop cannot map.*'
                          r'Python `for` loop'):
    perturbkit.nnx.run_with_cache(lambda m, x: m(x).sum())(Looped(nnx.Rngs(0)), jnp.ones((2, 3)))
