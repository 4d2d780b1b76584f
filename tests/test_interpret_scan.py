"""Caching, edits, activation and attribution patching of calls inside a scan, per iteration.

A call inside ``nn.scan`` (``'perturbations'`` in ``variable_axes``) or ``nnx.scan`` over
stacked modules is one point per iteration for the edits and patching
(``'scan/Dense_0/__call__[1]'``: that call in the second iteration), and one stacked array in
the cache. Each model here is also written out as a Python loop over its stacked params, with
every call's output passed through ``at`` so that a test can record it and edit it by hand:
the edits, each patched run, and the gradients the attributions use come from that loop.
"""
import re
from typing import Any, Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import flax.linen as nn
from flax import nnx

import models
import nnx_models
import perturbkit
from perturbkit import filters, interpret

TOL = dict(rtol=1e-5, atol=1e-5)


class Case(NamedTuple):
  api: Any                       # perturbkit or perturbkit.nnx
  model: Any                     # the variables (Linen) or the module (NNX)
  metric: Callable               # (model, x) -> scalar, on the scanned model
  loop: Callable                 # (x, at) -> output, the model written out
  scanned: Callable              # the filter of the calls inside the scan
  stacked: tuple[str, ...]       # those calls' paths, without the iteration, in point order
  sizes: tuple[int, ...]         # the iterations: (layers,), or (outer, inner) for nested scans
  clean: jax.Array
  corrupted: jax.Array


def _linen() -> Case:
  model = models.Scanned(length=3)
  clean = jax.random.normal(jax.random.key(1), (3, 3))
  variables = jax.jit(model.init)(jax.random.key(0), clean)  # eagerly: a compile per op
  p = variables['params']

  def loop(x, at):
    h = at('Dense_0/__call__', x @ p['Dense_0']['kernel'] + p['Dense_0']['bias'][None])
    cell = p['scan']['Dense_0']
    for i in range(3):
      h = jnp.tanh(at(f'scan/Dense_0/__call__[{i}]', h @ cell['kernel'][i] + cell['bias'][i][None]))
      h = at(f'scan/__call__[{i}]', (h, h))[0]
    return at('Dense_1/__call__', h @ p['Dense_1']['kernel'] + p['Dense_1']['bias'][None])

  return Case(perturbkit, variables, lambda v, x: jnp.sum(model.apply(v, x) ** 2), loop,
              filters.by_path('scan*'), ('scan/__call__', 'scan/Dense_0/__call__'), (3,),
              clean, jax.random.normal(jax.random.key(2), (3, 3)))


def _nnx() -> Case:
  model = nnx_models.ScanMLP(width=4, depth=3, rngs=nnx.Rngs(0))
  graphdef, stacked = nnx.split(model.blocks)

  def loop(x, at):
    h = x
    for i in range(3):
      block = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked))
      h = at(f'blocks/__call__[{i}]',
             jnp.tanh(at(f'blocks/linear/__call__[{i}]', block.linear(h))))
    return at('head/__call__', model.head(h))

  return Case(perturbkit.nnx, model, lambda m, x: jnp.sum(m(x) ** 2), loop,
              filters.by_path('blocks*'), ('blocks/__call__', 'blocks/linear/__call__'), (3,),
              nnx_models.random_batch((2, 4), seed=1), nnx_models.random_batch((2, 4), seed=2))


class _NestedCell(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return jnp.tanh(nn.Dense(4, name='d')(h)), None


class _Outer(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    inner = nn.scan(_NestedCell, variable_axes={'params': 0, 'perturbations': 0},
                    split_rngs={'params': True}, length=2)
    return inner(name='inner')(h, None)[0], None


class _Nested(nn.Module):
  """A scan of 3 steps, each a scan of 2 steps of tanh(Dense)."""

  @nn.compact
  def __call__(self, x):
    outer = nn.scan(_Outer, variable_axes={'params': 0, 'perturbations': 0},
                    split_rngs={'params': True}, length=3)
    return outer(name='outer')(x, None)[0]


def _linen_nested() -> Case:
  model = _Nested()
  clean = jax.random.normal(jax.random.key(1), (3, 4))
  variables = jax.jit(model.init)(jax.random.key(0), clean)  # eagerly: a compile per op
  dense = variables['params']['outer']['inner']['d']

  def loop(x, at):
    h = x
    for i in range(3):
      for j in range(2):
        pre = h @ dense['kernel'][i, j] + dense['bias'][i, j][None]
        h = jnp.tanh(at(f'outer/inner/d/__call__[{i}][{j}]', pre))
        h = at(f'outer/inner/__call__[{i}][{j}]', (h, None))[0]
    return h

  return Case(perturbkit, variables, lambda v, x: jnp.sum(model.apply(v, x) ** 2), loop,
              filters.by_path('outer/inner*'), ('outer/inner/__call__', 'outer/inner/d/__call__'),
              (3, 2), clean, jax.random.normal(jax.random.key(2), (3, 4)))


class _NNXCell(nnx.Module):
  def __init__(self, rngs):
    self.d = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, h):
    return jnp.tanh(self.d(h))


class _NNXNested(nnx.Module):
  """Cells stacked (3, 2) with nested nnx.vmap, run by an nnx.scan inside an nnx.scan."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def outer(rngs):
      @nnx.split_rngs(splits=2)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def inner(rngs):
        return _NNXCell(rngs)
      return inner(rngs)

    self.cells = outer(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def outer(h, cells):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def inner(h, cell):
        return cell(h)
      return inner(h, cells)

    return outer(x, self.cells)


def _nnx_nested() -> Case:
  model = _NNXNested(nnx.Rngs(0))
  graphdef, stacked = nnx.split(model.cells)

  def loop(x, at):
    h = x
    for i in range(3):
      for j in range(2):
        cell = nnx.merge(graphdef, jax.tree.map(lambda a: a[i, j], stacked))
        h = at(f'cells/__call__[{i}][{j}]', jnp.tanh(at(f'cells/d/__call__[{i}][{j}]',
                                                         cell.d(h))))
    return h

  return Case(perturbkit.nnx, model, lambda m, x: jnp.sum(m(x) ** 2), loop,
              filters.by_path('cells*'), ('cells/__call__', 'cells/d/__call__'), (3, 2),
              nnx_models.random_batch((2, 4), seed=1), nnx_models.random_batch((2, 4), seed=2))


CASES = {'linen': _linen, 'nnx': _nnx, 'linen_nested': _linen_nested, 'nnx_nested': _nnx_nested}


@pytest.fixture(params=list(CASES), scope='module')
def case(request) -> Case:
  return CASES[request.param]()


def _run(case: Case, x, edits: dict | None = None):
  """The loop's metric and every call's output (before its edit), with ``edits`` by hand."""
  seen = {}

  def at(name, value):
    seen[name] = value
    return edits[name](value) if edits and name in edits else value

  return jnp.sum(case.loop(x, at) ** 2), seen


def _indices(case: Case) -> list[tuple[int, ...]]:
  """Each iteration's index into the stacked axes, in order (row-major when nested)."""
  return [tuple(int(k) for k in np.unravel_index(i, case.sizes))
          for i in range(int(np.prod(case.sizes)))]


def _at(name: str, index: tuple[int, ...]) -> str:
  """``'scan/Dense_0/__call__[1]'``, ``'outer/inner/d/__call__[1][0]'``."""
  return name + ''.join(f'[{k}]' for k in index)


def _iterations(case: Case) -> list[str]:
  return [_at(name, index) for name in case.stacked for index in _indices(case)]


def _index(tree, i):
  """``tree``'s leaves at index ``i`` (a tuple) of their leading axes, sliced in numpy and put
  back on the device: an eager ``a[i]`` compiles a program per leaf shape and index."""
  return jax.tree.map(lambda a: jax.device_put(np.asarray(a)[i]), tree)


def _leaves(value):
  """The first (carry) leaf of a tuple output; the array itself otherwise."""
  return value[0] if isinstance(value, tuple) else value


def test_the_loop_is_the_model(case):
  np.testing.assert_allclose(case.metric(case.model, case.clean), _run(case, case.clean)[0],
                             **TOL)


def test_edits_at_one_iteration_equal_the_loop_with_the_edit_written_in(case):
  """One iteration of a call edited (at one position, or replaced whole), under jax.jit and
  for a stack of edits under jax.vmap; the other iterations run as they are."""
  name, other = (_at(case.stacked[1], _indices(case)[i]) for i in (1, -1))
  width = _leaves(_run(case, case.clean)[1][name]).shape
  value = jax.random.normal(jax.random.key(5), width)
  edits = {name: interpret.add(0.7, positions=[2], axis=1), other: interpret.replace(value)}
  got = jax.jit(case.api.run_with_edits(case.metric))(case.model, edits, case.clean)
  want, _ = _run(case, case.clean, {name: lambda a: a.at[:, 2].add(0.7), other: lambda a: value})
  np.testing.assert_allclose(got, want, **TOL)
  assert not np.allclose(got, _run(case, case.clean)[0], **TOL)

  deltas = jnp.array([-1.0, 0.5, 2.0])
  # jax.vmap inside one jax.jit: run eagerly, each batched op compiled a program of its own.
  got = jax.jit(lambda deltas: jax.vmap(case.api.run_with_edits(case.metric),
                                        in_axes=(None, 0, None))(
      case.model, jax.vmap(lambda d: {name: interpret.add(d, positions=[0], axis=1)})(deltas),
      case.clean))(deltas)
  for d, g in zip(deltas, got):
    np.testing.assert_allclose(g, _run(case, case.clean, {name: lambda a: a.at[:, 0].add(d)})[0],
                               **TOL)


def test_the_cache_is_stacked_and_patching_it_back_changes_nothing(case):
  """The cache holds a stacked call's outputs stacked over its iterations (two axes in a scan
  inside a scan), each equal to the loop's; patching them all back in is the unedited run."""
  out, cache = case.api.run_with_cache(case.metric)(case.model, case.clean)
  _, seen = _run(case, case.clean)
  flat = models.unnest(cache.outputs)
  patch = {}
  for name in case.stacked:
    stacked = flat[name]
    for i in _indices(case):
      chex.assert_trees_all_close(_index(stacked, i), seen[_at(name, i)], **TOL)
      patch[_at(name, i)] = interpret.replace(_index(stacked, i))
  np.testing.assert_array_equal(
      case.api.run_with_edits(case.metric)(case.model, patch, case.clean), out)
  # value_and_grad returns the same activations, stacked the same way.
  _, _, acts = case.api.value_and_grad(case.metric, return_activations=True)(
      case.model, case.clean)
  for name in case.stacked:
    chex.assert_trees_all_close(models.unnest(acts)[name], flat[name], **TOL)


def test_activation_patching_equals_a_loop_of_hand_patched_runs(case):
  """Each (call, iteration) x position: the corrupted loop with that output's position set to
  its clean value (every leaf of a tuple output), minus the corrupted metric."""
  result = jax.jit(case.api.activation_patching(case.metric, filter=case.scanned, axis=1,
                                                batch_size=5))(
      case.model, case.clean, case.corrupted)
  assert result.paths == tuple(_iterations(case))
  _, clean = _run(case, case.clean)
  base, _ = _run(case, case.corrupted)
  want = np.zeros(result.effects.shape)
  for r, name in enumerate(result.paths):
    for j in range(result.effects.shape[1]):
      patched = lambda a, j=j, name=name: jax.tree.map(
          lambda x, c: x.at[:, j].set(c[:, j]), a, clean[name])
      want[r, j] = _run(case, case.corrupted, {name: patched})[0] - base
  np.testing.assert_allclose(result.effects, want, **TOL)
  assert np.abs(want).max() > 1e-3
  np.testing.assert_allclose(result.corrupted_metric, base, **TOL)


def test_effects_per_example_under_vmap_equal_one_sweep_per_example(case):
  """``jax.vmap`` over examples (the metric of one example) runs the per-iteration sweeps in
  lockstep: each example's effects equal its own sweep, and differ between examples."""
  one = lambda model, x: case.metric(model, x[None])
  sweep = case.api.activation_patching(one, filter=case.scanned, axis=1)
  per_example = jax.jit(jax.vmap(sweep, in_axes=(None, 0, 0)))(
      case.model, case.clean, case.corrupted)
  alone_sweep = jax.jit(sweep)  # one compile for every example
  for e in range(case.clean.shape[0]):
    alone = alone_sweep(case.model, case.clean[e], case.corrupted[e])
    np.testing.assert_allclose(per_example.effects[e], alone.effects, **TOL)
  assert not np.allclose(per_example.effects[0], per_example.effects[1], **TOL)


def test_attribution_patching_equals_the_gradient_of_the_loop(case):
  """``(a_clean - a_corrupted) . d metric / d a`` per iteration and position, with the
  gradient from jax.grad of the loop with an explicit delta added at every call."""
  result = case.api.attribution_patching(case.metric, filter=case.scanned, axis=1)(
      case.model, case.clean, case.corrupted)
  _, clean = _run(case, case.clean)
  _, corrupted = _run(case, case.corrupted)
  names = _iterations(case)
  zeros = {n: jax.tree.map(jnp.zeros_like, corrupted[n]) for n in names}

  def with_deltas(deltas):
    edits = {n: (lambda a, n=n: jax.tree.map(jnp.add, a, deltas[n])) for n in names}
    return _run(case, case.corrupted, edits)[0]

  grads = jax.jit(jax.grad(with_deltas))(zeros)  # one program, not one per op
  for r, name in enumerate(result.paths):
    want = sum(np.sum((np.asarray(c) - np.asarray(a)) * np.asarray(g), axis=0) for c, a, g in zip(
        jax.tree.leaves(clean[name]), jax.tree.leaves(corrupted[name]),
        jax.tree.leaves(grads[name])))
    np.testing.assert_allclose(result.effects[r], want, **TOL)
  assert np.abs(result.effects).max() > 1e-3
  # Gradient x activation at the corrupted input: a . d metric / d a, from the same gradients.
  times = case.api.grad_times_activation(case.metric, filter=case.scanned, axis=1)(
      case.model, case.corrupted)
  assert times.paths == result.paths
  for r, name in enumerate(times.paths):
    want = sum(np.sum(np.asarray(a) * np.asarray(g), axis=0) for a, g in zip(
        jax.tree.leaves(corrupted[name]), jax.tree.leaves(grads[name])))
    np.testing.assert_allclose(times.effects[r], want, **TOL)
  # The cache's gradients are the same gradients, stacked per iteration.
  _, cache = case.api.run_with_cache(case.metric, grads=True)(case.model, case.corrupted)
  flat = models.unnest(cache.grads)
  for name in case.stacked:
    for i in _indices(case):
      chex.assert_trees_all_close(_index(flat[name], i), grads[_at(name, i)], **TOL)


def test_a_steering_vector_at_one_iteration_is_trained_with_optax(case):
  """A learnable intervention at one iteration: its gradient equals the loop's with the vector
  as an explicit parameter."""
  name = _at(case.stacked[1], _indices(case)[0])
  width = _leaves(_run(case, case.clean)[1][name]).shape[-1]
  steer = {'steer': interpret.steering_vector(name, (width,))}
  params = jax.tree.map(lambda z: z + 0.3, interpret.init_interventions(steer))
  fn = case.api.run_with_interventions(case.metric, steer)
  # Compiled once, run at each step below.
  value = jax.jit(lambda q: fn(case.model, q, case.clean))
  grad = jax.jit(jax.grad(lambda q: fn(case.model, q, case.clean)))
  got = grad(params)
  want = jax.jit(jax.grad(
      lambda q: _run(case, case.clean, {name: lambda a: a + q['steer'][None]})[0]))(params)
  chex.assert_trees_all_close(got, want, **TOL)
  assert np.abs(want['steer']).max() > 1e-3
  tx = optax.sgd(0.1)
  state = tx.init(params)
  before = value(params)
  for _ in range(3):
    updates, state = tx.update(grad(params), state)
    params = optax.apply_updates(params, updates)
  assert value(params) < before


def test_unknown_iterations_are_named_with_the_paths_there_are(case):
  name = case.stacked[1]
  last = _at(name, _indices(case)[-1])
  with pytest.raises(perturbkit.errors.UnknownEditPathError,
                     match=rf'{name} runs once per iteration.*{name}\[0\].*{re.escape(last)}'):
    case.api.run_with_edits(case.metric)(case.model, {name: interpret.zero_ablate()},
                                         case.clean)
  first = _at(name, _indices(case)[0])
  with pytest.raises(perturbkit.errors.UnknownEditPathError, match=rf'calls with points.*'
                                                                   rf'{re.escape(first)}'):
    case.api.run_with_edits(case.metric)(
        case.model, {_at(name, case.sizes): interpret.zero_ablate()}, case.clean)


# --- A scanned, rematerialized transformer against the same layers unrolled ---------------

_DEPTH = 2  # two layers: the second one's input is the first one's output


class _LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, deterministic=True,
                                        name='attn')(nn.LayerNorm(name='ln')(x))
    x = x + h
    return x + nn.Dense(8, name='mlp')(nn.gelu(nn.Dense(16, name='up')(x))), None


class _LinenTransformer(nn.Module):
  scan: bool = True

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(11, 8, name='embed')(tokens)
    if self.scan:   # the layout of large Linen models: nn.scan over nn.remat'd layers
      body = nn.scan(nn.remat(_LinenBlock), variable_axes={'params': 0, 'perturbations': 0},
                     split_rngs={'params': True}, length=_DEPTH)
      x, _ = body(name='layers')(x, None)
    else:
      for i in range(_DEPTH):
        x, _ = _LinenBlock(name=f'layers_{i}')(x, None)
    return nn.Dense(11, name='head')(x)


class _NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.ln = nnx.LayerNorm(8, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, 8, qkv_features=8, decode=False, rngs=rngs)
    self.up = nnx.Linear(8, 16, rngs=rngs)
    self.mlp = nnx.Linear(16, 8, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln(x), deterministic=True)
    return x + self.mlp(nnx.gelu(self.up(x)))


class _NNXTransformer(nnx.Module):
  """Layers made with ``nnx.vmap`` and run with ``nnx.scan`` over ``nnx.remat``, the layout of
  the Flax NNX guides; ``unrolled`` holds the same layers as a list."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(11, 8, rngs=rngs)

    @nnx.split_rngs(splits=_DEPTH)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return _NNXBlock(rngs)

    self.layers = create(rngs)
    self.head = nnx.Linear(8, 11, rngs=rngs)

  def __call__(self, tokens):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def body(x, block):
      return block(x)

    return self.head(body(self.embed(tokens), self.layers))


class _NNXUnrolled(nnx.Module):
  def __init__(self, scanned: _NNXTransformer):
    self.embed, self.head = scanned.embed, scanned.head
    self.layers = nnx_models.unstacked(scanned.layers, _DEPTH)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.layers:
      x = block(x)
    return self.head(x)


@pytest.mark.parametrize('api', ['linen', 'nnx'])
def test_scanned_remat_transformer_equals_its_layers_unrolled(api):
  """Activation and attribution patching and layer integrated gradients of each layer's
  attention and block output, per token, on a transformer whose layers run in a scan over
  remat: row ``layers/attn/__call__[i]`` equals row ``layers_i/attn/__call__`` of the same
  layers written as a loop."""
  tokens = jax.random.randint(jax.random.key(0), (2, 4), 0, 11)
  corrupted = tokens.at[:, 1].set((tokens[:, 1] + 1) % 11)

  def metric_of(apply):
    def metric(model, t):
      logits = apply(model, t)
      return jnp.mean(logits[:, -1, 3] - logits[:, -1, 5])
    return metric

  # The models are made, and the plain metrics compared, in jitted programs: run eagerly,
  # each op of the scanned, rematerialized init and apply compiled a program of its own.
  if api == 'linen':
    scanned = _LinenTransformer()
    variables = jax.jit(scanned.init)(jax.random.key(1), tokens)
    params = dict(variables['params'])
    layers = params.pop('layers')
    params.update({f'layers_{i}': jax.tree.map(lambda a, i=i: np.asarray(a)[i], layers)
                   for i in range(_DEPTH)})
    fn, model = perturbkit, variables
    twin, twin_model = _LinenTransformer(scan=False), {'params': params}
    metric, twin_metric = metric_of(scanned.apply), metric_of(twin.apply)
    calls, twin_calls = filters.by_path('layers', 'layers/attn'), filters.by_path(
        'layers_?', 'layers_?/attn')
    unrolled = lambda path, i: path.replace('layers/', f'layers_{i}/', 1)
  else:
    model = nnx.jit(lambda: _NNXTransformer(nnx.Rngs(0)))()
    fn, twin_model = perturbkit.nnx, _NNXUnrolled(model)
    metric = twin_metric = metric_of(lambda m, t: m(t))
    calls = filters.by_path('layers', 'layers/attn')
    twin_calls = filters.by_path('layers/?', 'layers/?/attn')
    unrolled = lambda path, i: path.replace('layers/', f'layers/{i}/', 1)

  plain = nnx.jit(lambda model, twin_model: (metric(model, tokens),
                                               twin_metric(twin_model, tokens)))
  np.testing.assert_allclose(*plain(model, twin_model), **TOL)
  integrated = lambda metric, filter, axis: fn.layer_integrated_gradients(
      metric, filter=filter, axis=axis, steps=4)
  for function, args in ((fn.activation_patching, (tokens, corrupted)),
                         (fn.attribution_patching, (tokens, corrupted)),
                         (integrated, (corrupted,))):
    got = jax.jit(function(metric, filter=calls, axis=1))(model, *args)
    want = jax.jit(function(twin_metric, filter=twin_calls, axis=1))(twin_model, *args)
    assert len(got.paths) == 2 * _DEPTH
    rows = []
    for path in got.paths:
      call, i = path[:-1].split('[')
      rows.append(want.paths.index(unrolled(call, int(i))))
    np.testing.assert_allclose(got.effects, want.effects[np.array(rows)], rtol=1e-4, atol=1e-5)
    assert np.abs(got.effects).max() > 1e-3


class _ScannedAlongAxis1(nn.Module):
  """``models.Scanned`` with the perturbations stacked along axis 1 of each call's output."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4, name='Dense_0')(x)
    scan = nn.scan(models.Cell, variable_axes={'params': 0, 'perturbations': 1},
                   split_rngs={'params': True}, length=3)
    h, _ = scan(name='scan')(h, None)
    return nn.Dense(2, name='Dense_1')(h)


def test_linen_scan_stacking_along_axis_1_of_outputs_as_long_as_the_scan():
  """3 examples, 3 iterations: a ``(3, 4)`` output stacked along axis 1 is ``(3, 3, 4)``,
  as along axis 0. The iterations are read from where the scan stacked (a marker next to
  the point), not from the shapes: an edit of iteration 1 is that of the loop, and the
  cache holds iteration ``i`` at ``[:, i]``."""
  model = _ScannedAlongAxis1()
  x = jax.random.normal(jax.random.key(1), (3, 3))
  variables = jax.jit(model.init)(jax.random.key(0), x)  # eagerly: a compile per op
  p = variables['params']
  value = jnp.full((3, 4), 0.5)

  def loop(x, edit_at=None):
    h, outputs = x @ p['Dense_0']['kernel'] + p['Dense_0']['bias'][None], []
    cell = p['scan']['Dense_0']
    for i in range(3):
      out = value if i == edit_at else h @ cell['kernel'][i] + cell['bias'][i][None]
      outputs.append(out)
      h = jnp.tanh(out)
    return h @ p['Dense_1']['kernel'] + p['Dense_1']['bias'][None], outputs

  fn = lambda v, x: model.apply(v, x)
  np.testing.assert_allclose(fn(variables, x), loop(x)[0], **TOL)
  edited = perturbkit.run_with_edits(fn)(
      variables, {'scan/Dense_0/__call__[1]': interpret.replace(value)}, x)
  np.testing.assert_allclose(edited, loop(x, edit_at=1)[0], **TOL)
  assert np.abs(edited - fn(variables, x)).max() > 1e-3
  _, cache = perturbkit.run_with_cache(fn)(variables, x)
  stacked = cache.outputs['scan']['Dense_0']['__call__']
  for i, want in enumerate(loop(x)[1]):
    np.testing.assert_allclose(stacked[:, i], want, **TOL)


def test_nnx_perturbations_stacked_along_another_axis_than_the_captures_are_refused():
  """An ``nnx.StateAxes`` that stacks ``nnx.Perturbation`` along axis 1 and the rest of the
  blocks' state along axis 0: the values read inside the scan come out along another axis
  than the points, so reading or editing them is refused by name, also where the shapes
  alone would agree (3 examples, 3 iterations)."""
  model = nnx_models.ScanMLP(width=4, depth=3, rngs=nnx.Rngs(0))

  def run(m, x):
    axes = nnx.StateAxes({nnx.Perturbation: 1, ...: 0})
    body = nnx.scan(lambda h, block: block(h), in_axes=(nnx.Carry, axes), out_axes=nnx.Carry)
    return jnp.sum(m.head(body(x, m.blocks)))

  for batch in (3, 2):
    x = nnx_models.random_batch((batch, 4), seed=1)
    for function in (perturbkit.nnx.run_with_cache(run),
                     lambda m, x: perturbkit.nnx.run_with_edits(run)(m, {}, x)):
      with pytest.raises(perturbkit.ActivationsUnavailableError, match='blocks/linear'):
        function(model, x)
