"""perturbkit.nnx against Linen twins, Flax's own perturbation workflow, explicit
perturbation arguments, JVPs and hand-written custom VJPs."""
import threading
import warnings

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx import bridge

import nnx_models as M
import perturbkit
from perturbkit.nnx import filters

TOL = dict(rtol=1e-5, atol=1e-6)


def _not_vacuous(tree):
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(tree)) > 1e-3


def _snapshot(model):
  """Everything about the model object that must not change: graphdef, state,
  the class and attribute names of every submodule."""
  graphdef, state = nnx.split(model)
  modules = [(path, type(m), sorted(vars(m))) for path, m in nnx.iter_modules(model)]
  return graphdef, jax.tree.map(np.asarray, M.pure(state)), modules


def _assert_same_snapshot(a, b):
  assert a[0] == b[0]
  chex.assert_trees_all_equal(a[1], b[1])
  assert a[2] == b[2]


# --- NNX model vs its Linen twin with the same weights -------------------------------


def _linen_mlp():
  model = M.MLP(rngs=nnx.Rngs(0))
  x = M.random_batch((4, 3))
  twin = M.LinenMLP()
  linen_loss = lambda v, x: jnp.mean(twin.apply(v, x) ** 2)
  return model, M.mse, linen_loss, (x,)


def _linen_cnn():
  model = M.CNN(rngs=nnx.Rngs(0))
  x, key = M.random_batch((2, 5, 5, 1)), jax.random.key(3)
  twin = M.LinenCNN()
  linen_loss = lambda v, x, k: jnp.mean(
      twin.apply(v, x, k, mutable=['batch_stats'])[0] ** 2)
  return model, lambda m, x, k: jnp.mean(m(x, k) ** 2), linen_loss, (x, key)


def _linen_transformer():
  model = M.TransformerBlock(rngs=nnx.Rngs(0))
  x = M.random_batch((2, 5, 8))
  twin = M.LinenTransformerBlock()
  linen_loss = lambda v, x: jnp.mean(twin.apply(v, x) ** 2)
  return model, M.mse, linen_loss, (x,)


@pytest.mark.parametrize('make', [_linen_mlp, _linen_cnn, _linen_transformer],
                         ids=['mlp', 'cnn_batchnorm_dropout', 'transformer'])
def test_equals_linen_twin(make):
  model, loss_fn, linen_loss, args = make()
  variables = M.linen_variables(model)
  loss, grads = nnx.jit(perturbkit.nnx.value_and_grad(loss_fn))(model, *args)
  want_loss, want = jax.jit(perturbkit.value_and_grad(linen_loss))(variables, *args)
  chex.assert_trees_all_close(loss, want_loss, **TOL)
  chex.assert_trees_all_close(grads['perturbations'], want['perturbations'], **TOL)
  chex.assert_trees_all_close(M.pure(grads['params']), want['params'], **TOL)
  _not_vacuous(grads['perturbations'])
  if 'attention' in grads['perturbations']:  # the attention's own projections are points
    assert set(grads['perturbations']['attention']) == {'__call__', 'query', 'key', 'value',
                                                        'out'}


# --- Independent references: Flax's own workflow, explicit arguments, JVPs ------------


def _hand_cases():
  return {
      'mlp': (lambda hand: M.MLP(hand=hand, rngs=nnx.Rngs(0)), M.mse,
              (M.random_batch((4, 3)),)),
      'cnn': (lambda hand: M.CNN(hand=hand, rngs=nnx.Rngs(0)),
              lambda m, x: jnp.mean(m(x) ** 2), (M.random_batch((2, 5, 5, 1)),)),
      'transformer': (lambda hand: M.TransformerBlock(hand=hand, rngs=nnx.Rngs(0)), M.mse,
                      (M.random_batch((2, 5, 8)),)),
  }


@pytest.mark.parametrize('name', ['mlp', 'cnn', 'transformer'])
def test_equals_hand_placed_perturb_and_nnx_grad(name):
  make, loss_fn, args = _hand_cases()[name]
  filter = filters.top_level  # the hand twins perturb their direct children only
  model, hand, plain = make(False), make(True), make(False)
  loss, grads = perturbkit.nnx.value_and_grad(loss_fn, filter=filter)(model, *args)
  # The references compiled whole (nnx.jit keeps their state updates), not op by op.
  want_loss, want_params, want_points = nnx.jit(
      lambda hand, *args: M.hand_value_and_grad(loss_fn, hand, *args))(hand, *args)
  chex.assert_trees_all_close(loss, want_loss, **TOL)
  chex.assert_trees_all_close(grads['perturbations'], want_points, **TOL)
  chex.assert_trees_all_close(M.pure(grads['params']), M.pure(want_params), **TOL)
  chex.assert_trees_all_close(M.pure(grads['params']),
                              M.pure(nnx.jit(nnx.grad(loss_fn))(plain, *args)), **TOL)
  # The state updates (batch statistics, dropout RNG counts) are the ones
  # nnx.value_and_grad makes.
  chex.assert_trees_all_close(M.pure(nnx.state(model)), M.pure(nnx.state(plain)), **TOL)
  _not_vacuous(grads['perturbations'])


def test_equals_explicit_perturbation_arguments():
  # The batch shape of the other MLP tests (their eager ops are compiled already).
  model, x = M.MLP(rngs=nnx.Rngs(1)), M.random_batch((4, 3), seed=1)
  _, grads = perturbkit.nnx.value_and_grad(M.mse)(model, x)
  zeros = jax.tree.map(jnp.zeros_like, grads['perturbations'])
  want = jax.jit(jax.grad(lambda d: jnp.mean(M.mlp_explicit(model, x, d) ** 2)))(zeros)
  chex.assert_trees_all_close(grads['perturbations'], want, **TOL)
  _not_vacuous(want)


@pytest.mark.parametrize('name', ['mlp', 'transformer'])
def test_directional_derivative_matches_jvp(name):
  make, loss_fn, args = _hand_cases()[name]
  model, hand = make(False), make(True)
  _, grads = perturbkit.nnx.value_and_grad(loss_fn, filter=filters.top_level)(model, *args)
  leaves, treedef = jax.tree.flatten(grads['perturbations'])
  # The direction, the JVP and the prediction each compiled whole, not op by op.
  direction = jax.jit(lambda: [jax.random.normal(k, g.shape) for k, g in zip(
      jax.random.split(jax.random.key(3), len(leaves)), leaves)])()
  _, zeros = nnx.capture(loss_fn, nnx.Perturbation)(nnx.clone(hand), *args)
  graphdef, state = nnx.split(hand)

  def along(t):
    points = jax.tree.unflatten(treedef, [t * v for v in direction])
    init = nnx.State(jax.tree.map(nnx.Perturbation, points))
    assert jax.tree.structure(nnx.to_pure_dict(zeros)) == treedef
    return nnx.capture(loss_fn, init=init)(nnx.merge(graphdef, state), *args)

  _, derivative = jax.jit(lambda: jax.jvp(along, (0.0,), (1.0,)))()
  predicted = jax.jit(lambda: sum(jnp.vdot(g, v) for g, v in zip(leaves, direction)))()
  np.testing.assert_allclose(derivative, predicted, rtol=1e-4, atol=1e-5)


@st.composite
def _architectures(draw):
  depth = draw(st.integers(1, 4))
  widths = draw(st.lists(st.sampled_from([2, 3]), min_size=depth, max_size=depth))
  skips = draw(st.lists(st.booleans(), min_size=depth, max_size=depth))
  shared = draw(st.one_of(st.none(), st.integers(0, depth - 1)))
  din = draw(st.sampled_from([2, 3]))
  return din, widths, skips, shared, draw(st.integers(0, 2 ** 16))


@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(_architectures())
def test_random_architectures_equal_hand_placed_perturb(arch):
  din, widths, skips, shared, seed = arch
  make = lambda hand: M.RandomNet(din, widths, skips, shared, hand=hand, rngs=nnx.Rngs(seed))
  x = M.random_batch((3, din), seed)
  loss, grads = perturbkit.nnx.value_and_grad(M.mse)(make(False), x)
  want_loss, want_params, want_points = M.hand_value_and_grad(M.mse, make(True), x)
  chex.assert_trees_all_close(loss, want_loss, **TOL)
  chex.assert_trees_all_close(grads['perturbations'], want_points, **TOL)
  chex.assert_trees_all_close(M.pure(grads['params']), M.pure(want_params), **TOL)


def test_points_inside_an_inner_gradient_step():
  """Test-time training: the loss takes its own nnx.grad step, then evaluates.

  The points inside the inner step get the derivative of the outer loss through
  that step, as explicit perturbation arguments in both passes give it.
  """
  model, x = M.MLP(rngs=nnx.Rngs(0)), M.random_batch((4, 3))

  def step(model, loss_of):
    grads = nnx.grad(loss_of)(model)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))

  def loss_fn(model, x):
    step(model, lambda m: M.mse(m, x))
    return M.mse(model, x)

  # Everything compiled whole (nnx.jit, jax.jit): the gradient of a gradient step run op by op
  # compiles dozens of small programs.
  _, grads = nnx.jit(perturbkit.nnx.value_and_grad(loss_fn))(nnx.clone(model), x)
  points = grads['perturbations']
  assert set(points['dense_1']) == {'__call__', '__call__#1', '__call__#2', '__call__#3'}

  def explicit(d):
    at = lambda first: {'dense_0': {'__call__': d['dense_0'][f'__call__#{first[0]}']},
                        'dense_1': {'__call__': d['dense_1'][f'__call__#{first[1]}'],
                                    '__call__#1': d['dense_1'][f'__call__#{first[1] + 1}']},
                        'dense_2': {'__call__': d['dense_2'][f'__call__#{first[0]}']}}
    d = {name: {k if '#' in k else k + '#0': v for k, v in calls.items()}
         for name, calls in d.items()}
    m = nnx.clone(model)
    step(m, lambda m: jnp.mean(M.mlp_explicit(m, x, at((0, 0))) ** 2))
    return jnp.mean(M.mlp_explicit(m, x, at((1, 2))) ** 2)

  want = jax.jit(jax.grad(explicit))(jax.tree.map(jnp.zeros_like, points))
  chex.assert_trees_all_close(points, want, **TOL)
  _not_vacuous(points['dense_0']['__call__'])
  chex.assert_trees_all_close(M.pure(grads['params']),
                              M.pure(nnx.jit(nnx.grad(loss_fn))(nnx.clone(model), x)), **TOL)


# --- Transforms inside the model ----------------------------------------------------


def test_scan_gives_per_iteration_gradients_like_an_unrolled_loop():
  model, x = M.ScanMLP(rngs=nnx.Rngs(0)), M.random_batch((2, 4))
  _, grads = perturbkit.nnx.value_and_grad(M.mse)(model, x)
  graphdef, stacked = nnx.split(model.blocks)

  def unrolled(d):
    h = x
    for i in range(model.depth):
      block = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked))
      h = jnp.tanh(block.linear(h) + d['linear'][i]) + d['block'][i]
    return jnp.mean((model.head(h) + d['head']) ** 2)

  points = grads['perturbations']
  zeros = {'linear': jnp.zeros((3, 2, 4)), 'block': jnp.zeros((3, 2, 4)),
           'head': jnp.zeros((2, 2))}
  want = jax.jit(jax.grad(unrolled))(zeros)  # one compile, not one per op of the loop
  chex.assert_trees_all_close(points['blocks']['linear']['__call__'], want['linear'], **TOL)
  chex.assert_trees_all_close(points['blocks']['__call__'], want['block'], **TOL)
  chex.assert_trees_all_close(points['head']['__call__'], want['head'], **TOL)
  _not_vacuous(want['linear'][0])

  # Activations and inputs come out per iteration too, stacked like the gradients.
  _, same, acts, inputs = perturbkit.nnx.value_and_grad(
      M.mse, return_activations=True, return_inputs=True)(model, x)
  chex.assert_trees_all_close(same, grads, **TOL)

  @jax.jit
  def by_hand():
    hidden, linear_in, linear_out = x, [], []
    for i in range(model.depth):
      block = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked))
      linear_in.append(hidden)
      linear_out.append(block.linear(hidden))
      hidden = jnp.tanh(linear_out[-1])
    return jnp.stack(linear_in), jnp.stack(linear_out), model.head(hidden)

  linear_in, linear_out, head_out = by_hand()
  chex.assert_trees_all_close(acts['blocks']['linear']['__call__'], linear_out, **TOL)
  chex.assert_trees_all_close(acts['blocks']['__call__'], jnp.tanh(linear_out), **TOL)
  chex.assert_trees_all_close(inputs['blocks']['linear']['__call__'], ((linear_in,), {}), **TOL)
  chex.assert_trees_all_close(acts['head']['__call__'], head_out, **TOL)
  # The cache, edits and patching per iteration: tests/test_interpret_scan.py.


def test_remat_equals_the_plain_call():
  x = M.random_batch((2, 4))
  remat = M.RematMLP(rngs=nnx.Rngs(0))
  _, grads = perturbkit.nnx.value_and_grad(M.mse)(remat, x)

  def plain(d):
    h = jnp.tanh(remat.block.linear(x) + d['block']['linear']['__call__'])
    h = h + d['block']['__call__']
    return jnp.mean((remat.head(h) + d['head']['__call__']) ** 2)

  want = jax.grad(plain)(jax.tree.map(jnp.zeros_like, grads['perturbations']))
  chex.assert_trees_all_close(grads['perturbations'], want, **TOL)


class _TransformedTwice(nnx.Module):
  """The block called twice through ``transform``: one shared wrapper, or one per call."""

  def __init__(self, transform, shared, *, rngs):
    self.transform, self.shared = transform, shared
    self.block = M.Block(4, rngs=rngs)

  def __call__(self, x):
    call = lambda block, x: block(x)
    first = self.transform(call)
    second = first if self.shared else self.transform(call)
    return second(self.block, first(self.block, x) * 1.5)


@pytest.mark.parametrize('transform', [nnx.remat, nnx.jit])
def test_module_called_twice_through_one_transform(transform):
  x = M.random_batch((2, 4))
  # JAX replays one wrapper's trace for the second call: named, not blamed on the loss.
  with pytest.raises(perturbkit.TransformTracedOnceError, match='its own transform'):
    perturbkit.nnx.value_and_grad(M.mse)(_TransformedTwice(transform, True, rngs=nnx.Rngs(0)), x)
  model = _TransformedTwice(transform, False, rngs=nnx.Rngs(0))
  _, grads = perturbkit.nnx.value_and_grad(M.mse)(model, x)
  linear = model.block.linear

  def explicit(d):
    h = jnp.tanh(linear(x) + d['block']['linear']['__call__']) + d['block']['__call__']
    h = jnp.tanh(linear(h * 1.5) + d['block']['linear']['__call__#1'])
    return M.mse(lambda h: h, h + d['block']['__call__#1'])

  want = jax.grad(explicit)(jax.tree.map(jnp.zeros_like, grads['perturbations']))
  _not_vacuous(want)
  chex.assert_trees_all_close(grads['perturbations'], want, **TOL)


class _Branched(nnx.Module):
  """``a`` called before, in every branch of an ``nnx.cond`` (an ``nnx.switch`` with three
  branches), in both branches of a second ``nnx.cond`` right after it, and after; ``d`` adds an
  explicit delta to each call's output (the twin)."""

  def __init__(self, switch, *, rngs):
    self.switch = switch
    self.a, self.b, self.out = (nnx.Linear(3, 3, rngs=rngs), nnx.Linear(3, 3, rngs=rngs),
                                nnx.Linear(3, 1, rngs=rngs))

  def __call__(self, x, index, d=None, other=False):
    delta = lambda name, key: 0 if d is None else d[name][key]
    a = lambda m, h, key: m.a(h) + delta('a', key)
    h = a(self, x, '__call__')
    branches = [lambda m, h: a(m, h, '__call__#1'),
                lambda m, h: -a(m, jnp.tanh(h), '__call__#1'),
                lambda m, h: a(m, 2 * h, '__call__#1')]
    if other:  # a branch calling another submodule
      branches[1] = lambda m, h: m.b(h)
    if self.switch:
      h = nnx.switch(index, branches, self, h)
    else:
      h = nnx.cond(index > 0, branches[1], branches[0], self, h)
    # A second conditional right after the first, with no call between them.
    h = nnx.cond(index > 1, lambda m, h: a(m, h, '__call__#2'),
                 lambda m, h: a(m, -h, '__call__#2'), self, h)
    return self.out(a(self, h, '__call__#3')) + delta('out', '__call__')


@pytest.mark.parametrize('switch, index', [(False, 0), (False, 1), (True, 2)])
def test_calls_in_branches_get_one_point_per_call_like_explicit_deltas(switch, index):
  """The branches of ``nnx.cond``/``nnx.switch`` share one point per call, holding the
  gradient of the branch that ran (the others add nothing), and the call after counts on
  past them: equal to ``jax.grad`` of the model with explicit deltas added to each call."""
  model, x = _Branched(switch, rngs=nnx.Rngs(0)), M.random_batch((2, 3))
  index = jnp.asarray(index)
  loss = lambda m, x, i: jnp.sum(m(x, i) ** 2)
  with warnings.catch_warnings():
    warnings.simplefilter('error', perturbkit.UnperturbedCallsWarning)
    _, grads = perturbkit.nnx.value_and_grad(loss)(model, x, index)
  zeros = jax.tree.map(jnp.zeros_like, grads['perturbations'])
  # The references compiled whole (nnx.jit), not op by op.
  want = nnx.jit(nnx.grad(lambda m, d: jnp.sum(m(x, index, d) ** 2), argnums=1))(model, zeros)
  assert set(want['a']) == {'__call__', '__call__#1', '__call__#2', '__call__#3'}
  _not_vacuous(want)
  chex.assert_trees_all_close(grads['perturbations'], want, **TOL)
  chex.assert_trees_all_close(grads['params'], nnx.jit(nnx.grad(loss))(model, x, index), **TOL)


def test_branches_calling_different_submodules_are_a_named_error():
  model, x = _Branched(False, rngs=nnx.Rngs(0)), M.random_batch((2, 3))
  with pytest.raises(perturbkit.BranchCallsMismatchError,
                     match=r"nnx\.cond.*a/__call__#1, b/__call__.*by_path\('a', 'b'\).*jnp\.where"):
    perturbkit.nnx.value_and_grad(lambda m, x: m(x, 1, other=True).sum())(model, x)


def test_vmap_with_broadcast_state_is_refused_not_summed():
  model, x = M.VmapBroadcast(rngs=nnx.Rngs(0)), M.random_batch((3, 4))
  with pytest.raises(perturbkit.nnx.UnmappedPerturbationError, match='block/linear/__call__'):
    perturbkit.nnx.value_and_grad(M.mse)(model, x)
  # Excluding the calls inside the vmap is the way out.
  _, grads = perturbkit.nnx.value_and_grad(M.mse, filter=['head'])(model, x)
  assert set(grads['perturbations']) == {'head'}


def test_vmap_with_mapped_perturbations_gives_per_example_gradients():
  model, x = M.VmapBroadcast(mapped=True, rngs=nnx.Rngs(0)), M.random_batch((3, 4))
  _, grads = perturbkit.nnx.value_and_grad(M.mse)(model, x)

  def batched(d):
    h = jnp.tanh(model.block.linear(x) + d['block']['linear']['__call__'])
    h = h + d['block']['__call__']
    return jnp.mean((model.head(h) + d['head']['__call__']) ** 2)

  want = jax.grad(batched)(jax.tree.map(jnp.zeros_like, grads['perturbations']))
  chex.assert_trees_all_close(grads['perturbations'], want, **TOL)


class _SharedScan(nnx.Module):
  def __init__(self, mapped, rngs):
    self.mapped = mapped
    self.block = M.Block(4, rngs=rngs)
    self.head = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    axes = nnx.StateAxes({nnx.Perturbation: 0, ...: None}) if self.mapped else None
    body = nnx.scan(lambda block, x: block(x), in_axes=(axes, nnx.Carry), out_axes=nnx.Carry,
                    length=3)
    return self.head(body(self.block, x))


def test_scan_with_broadcast_block_warns_and_mapped_perturbations_fix_it():
  x = M.random_batch((2, 4))
  with pytest.warns(perturbkit.UnperturbedCallsWarning, match='block/linear/__call__'):
    _, grads = perturbkit.nnx.value_and_grad(M.mse)(_SharedScan(False, nnx.Rngs(0)), x)
  assert set(grads['perturbations']) == {'head'}
  model = _SharedScan(True, nnx.Rngs(0))
  _, grads = perturbkit.nnx.value_and_grad(M.mse)(model, x)

  def unrolled(d):
    h = x
    for i in range(3):
      h = jnp.tanh(model.block.linear(h) + d['linear'][i]) + d['block'][i]
    return jnp.mean(model.head(h) ** 2)

  want = jax.grad(unrolled)({'linear': jnp.zeros((3, 2, 4)), 'block': jnp.zeros((3, 2, 4))})
  chex.assert_trees_all_close(grads['perturbations']['block']['linear']['__call__'],
                              want['linear'], **TOL)
  chex.assert_trees_all_close(grads['perturbations']['block']['__call__'], want['block'], **TOL)


def test_linen_module_through_the_bridge():
  """A Linen MLP inside an NNX model through ``nnx.bridge.ToNNX`` (which turns every
  attribute of the instance into a Linen variable): its call is a point like any other.
  Params equal ``nnx.grad``; the gradient at its output equals ``jax.grad`` of the rest of
  the model at that output; the cache and attribution patching equal the calls made by hand."""
  model, x = M.Bridged(rngs=nnx.Rngs(0)), M.random_batch((3, 4))
  bridge.lazy_init(model, x)
  loss_fn = lambda m, x: jnp.sum(jnp.tanh(m(x)))
  corrupted = 2 * x

  @nnx.jit  # the references by hand, compiled whole
  def by_hand(model, x, corrupted):
    rest = lambda h: jnp.sum(jnp.tanh(model.head(nnx.relu(h))))
    h, h_corrupted = model.linen(x), model.linen(corrupted)
    patched = jnp.sum((h - h_corrupted) * jax.grad(rest)(h_corrupted), axis=1)
    return loss_fn(model, x), nnx.grad(loss_fn)(model, x), h, jax.grad(rest)(h), patched

  want_loss, want_params, h, at_h, want = by_hand(model, x, corrupted)
  loss, grads = nnx.jit(perturbkit.nnx.value_and_grad(loss_fn))(model, x)
  chex.assert_trees_all_close(loss, want_loss, **TOL)
  chex.assert_trees_all_close(grads['params'], want_params, **TOL)
  chex.assert_trees_all_close(grads['perturbations']['linen']['__call__'], at_h, **TOL)
  assert float(jnp.abs(at_h).max()) > 1e-2
  assert not {'_perturbkit_sites', '__captures__'} & set(vars(model.linen))  # left as it was

  _, cache = nnx.jit(perturbkit.nnx.run_with_cache(lambda m, x: m(x)))(model, x)
  chex.assert_trees_all_close(cache.outputs['linen']['__call__'], h, **TOL)
  got = nnx.jit(perturbkit.nnx.attribution_patching(loss_fn, axis=0))(model, x, corrupted)
  chex.assert_trees_all_close(got.effects[got.paths.index('linen/__call__')], want, **TOL)


def test_rnn_cell_calls_are_reported_and_the_rest_equal_jax_grad():
  """Flax's ``nnx.RNN`` carries its cell through ``nnx.scan`` from step to step, so a point
  inside the cell could neither be created (the carry would change structure) nor be one per
  step: the cell's calls are named in an ``UnperturbedCallsWarning`` and get no point. The
  RNN's own call has one, for every step; params equal ``nnx.grad``, the gradients at the RNN
  and the embedding equal the gradients of the rest of the model there, and the cache equals
  the calls made by hand."""
  model, x = M.Recurrent(rngs=nnx.Rngs(0)), M.random_batch((2, 5, 3))
  loss_fn = lambda m, x: jnp.sum(jnp.tanh(m(x)))
  with pytest.warns(perturbkit.UnperturbedCallsWarning,
                    match=r'carries the module from step to step.*rnn/cell/__call__'):
    loss, grads = nnx.jit(perturbkit.nnx.value_and_grad(loss_fn))(model, x)

  @nnx.jit  # the references by hand, compiled whole
  def by_hand(model, x):
    embedded = model.embed(x)
    hidden = model.rnn(embedded)
    after_rnn = lambda h: jnp.sum(jnp.tanh(model.head(h)))
    # The RNN draws its initial carry from the model's RNG streams: nnx.grad keeps that state.
    at_embed = nnx.grad(lambda m, e: after_rnn(m.rnn(e)), argnums=1)(model, embedded)
    return (loss_fn(model, x), nnx.grad(loss_fn)(model, x), hidden, jax.grad(after_rnn)(hidden),
            at_embed)

  want_loss, want_params, hidden, at_rnn, at_embed = by_hand(model, x)
  chex.assert_trees_all_close(loss, want_loss, **TOL)
  chex.assert_trees_all_close(grads['params'], want_params, **TOL)
  assert {'embed', 'rnn', 'head'} <= set(grads['perturbations'])
  assert '__call__' not in grads['perturbations']['rnn'].get('cell', {})
  chex.assert_trees_all_close(grads['perturbations']['rnn']['__call__'], at_rnn, **TOL)
  chex.assert_trees_all_close(grads['perturbations']['embed']['__call__'], at_embed, **TOL)
  assert float(jnp.abs(at_embed).max()) > 1e-3
  with pytest.warns(perturbkit.UnperturbedCallsWarning):
    _, cache = nnx.jit(perturbkit.nnx.run_with_cache(lambda m, x: m(x)))(model, x)
  chex.assert_trees_all_close(cache.outputs['rnn']['__call__'], hidden, **TOL)


def test_bidirectional_rnn_cells_of_both_directions_are_reported():
  """``nnx.Bidirectional`` runs two ``nnx.RNN``, each carrying its cell through ``nnx.scan``:
  the cells of both get no point (one warning counts the 12 calls), and each direction's
  own call has its point. The references: ``nnx.grad``, and the gradient of the rest of the
  model with respect to each direction's output, run by hand."""
  model, x = M.BiRecurrent(rngs=nnx.Rngs(0)), M.random_batch((2, 5, 3))
  loss_fn = lambda m, x: jnp.sum(jnp.tanh(m(x)))
  with pytest.warns(perturbkit.UnperturbedCallsWarning,
                    match=r'^12 selected call\(s\).*rnn/backward_rnn/cell/__call__.*'
                          r'rnn/forward_rnn/cell/__call__'):
    loss, grads = nnx.jit(perturbkit.nnx.value_and_grad(loss_fn))(model, x)

  @nnx.jit  # the references by hand, compiled whole
  def by_hand(model, x):
    embedded = model.embed(x)
    forward = model.rnn.forward_rnn(embedded)
    backward = model.rnn.backward_rnn(embedded, reverse=True, keep_order=True)
    rest = lambda f, b: jnp.sum(jnp.tanh(model.head(jnp.concatenate([f, b], -1))))
    return (loss_fn(model, x), nnx.grad(loss_fn)(model, x), forward, backward,
            model.rnn(embedded), jax.grad(rest, argnums=(0, 1))(forward, backward))

  want_loss, want_params, forward, backward, bidirectional, want = by_hand(model, x)
  chex.assert_trees_all_close(loss, want_loss, **TOL)
  chex.assert_trees_all_close(grads['params'], want_params, **TOL)
  chex.assert_trees_all_close(jnp.concatenate([forward, backward], -1), bidirectional,
                              **TOL)  # what Bidirectional computes, by hand
  points = grads['perturbations']['rnn']
  # Each direction returns (final carry, outputs) to Bidirectional, which keeps the outputs.
  (forward_carry, at_forward), (backward_carry, at_backward) = (
      points['forward_rnn']['__call__'], points['backward_rnn']['__call__'])
  chex.assert_trees_all_close((at_forward, at_backward), want, **TOL)
  assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(
      (forward_carry, backward_carry)))
  chex.assert_trees_all_close(points['__call__'], jnp.concatenate(want, -1), **TOL)
  for direction in ('forward_rnn', 'backward_rnn'):  # the cell's initialize_carry has one
    assert '__call__' not in points[direction].get('cell', {})


def test_containers_sequential_and_list():
  model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu,
                         nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(1)), jnp.tanh),
                         nnx.Linear(4, 1, rngs=nnx.Rngs(2)))
  x = M.random_batch((2, 3))
  _, grads = perturbkit.nnx.value_and_grad(M.mse)(model, x)
  points = grads['perturbations']['layers']
  assert set(points) == {0, 2, 3}
  assert set(points[2]) == {'__call__', 'layers'}

  def explicit(d):
    h = nnx.relu(model.layers[0](x) + d[0])
    h = jnp.tanh(model.layers[2].layers[0](h) + d[1]) + d[2]
    return jnp.mean((model.layers[3](h) + d[3]) ** 2)

  want = jax.grad(explicit)([points[0]['__call__'], points[2]['layers'][0]['__call__'],
                             points[2]['__call__'], points[3]['__call__']])
  want = [jnp.zeros_like(w) for w in want]
  want = jax.grad(explicit)(want)
  got = [points[0]['__call__'], points[2]['layers'][0]['__call__'], points[2]['__call__'],
         points[3]['__call__']]
  chex.assert_trees_all_close(got, want, **TOL)


# --- Pytree outputs, hand-placed points, activations, aux, filters --------------------


class _TwoHeads(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(3, 2, rngs=rngs)
    self.b = nnx.Linear(3, 2, rngs=rngs)

  def __call__(self, x):
    return {'a': self.a(x), 'count': jnp.sum(x > 0), 'b': (self.b(x), None)}


class _PytreeNet(nnx.Module):
  def __init__(self, rngs):
    self.heads = _TwoHeads(rngs)

  def __call__(self, x):
    out = self.heads(x)
    feature = self.perturb('feature', out['a'] * out['b'][0])
    return jnp.sum(jnp.sin(feature)) + out['count'].astype(jnp.float32)


def test_pytree_outputs_and_hand_placed_points():
  model, x = _PytreeNet(nnx.Rngs(0)), M.random_batch((4, 3))
  _, grads = perturbkit.nnx.value_and_grad(lambda m, x: m(x))(model, x)
  point = grads['perturbations']['heads']['__call__']
  assert point['count'] is None and point['b'][1] is None

  def explicit(d):
    a, b = model.heads.a(x) + d['a'], model.heads.b(x) + d['b']
    return jnp.sum(jnp.sin(a * b + d['feature']))

  want = jax.grad(explicit)({k: jnp.zeros((4, 2)) for k in ('a', 'b', 'feature')})
  chex.assert_trees_all_close(point['a'], want['a'], **TOL)
  chex.assert_trees_all_close(point['b'][0], want['b'], **TOL)
  chex.assert_trees_all_close(grads['perturbations']['feature'], want['feature'], **TOL)


def test_return_activations_has_aux_and_kwargs():
  model, x = M.MLP(rngs=nnx.Rngs(0)), M.random_batch((4, 3))

  def loss_fn(model, x, *, scale):
    y = model(x)
    return scale * jnp.mean(y ** 2), y

  (loss, y), grads, acts = perturbkit.nnx.value_and_grad(
      loss_fn, has_aux=True, return_activations=True)(model, x, scale=2.0)
  h0 = model.dense_0(x)
  h1 = model.dense_1(nnx.relu(h0))
  chex.assert_trees_all_close(acts['dense_0']['__call__'], h0, **TOL)
  chex.assert_trees_all_close(acts['dense_1']['__call__'], h1, **TOL)
  chex.assert_trees_all_close(acts['dense_2']['__call__'], y, **TOL)
  chex.assert_trees_all_close(loss, 2.0 * jnp.mean(y ** 2), **TOL)
  g, aux = perturbkit.nnx.grad(loss_fn, has_aux=True)(model, x, scale=2.0)
  chex.assert_trees_all_close(g['perturbations'], grads['perturbations'], **TOL)
  with pytest.raises(perturbkit.ActivationsUnavailableError):
    perturbkit.nnx.value_and_grad(M.mse, return_activations=True)(
        M.VmapBroadcast(mapped=True, rngs=nnx.Rngs(0)), M.random_batch((2, 4)))


class _Codec(nnx.Module):
  def __init__(self, rngs):
    self.inner = nnx.Linear(3, 2, rngs=rngs)
    self.outer = nnx.Linear(2, 3, rngs=rngs)

  def encode(self, x):
    return self.inner(x)

  def decode(self, z):
    return self.outer(z)


class _AutoEncoder(nnx.Module):
  def __init__(self, rngs):
    self.codec = _Codec(rngs)

  def __call__(self, x):
    return self.codec.decode(jnp.tanh(self.codec.encode(x)))


def test_filters_and_methods():
  model, x = _AutoEncoder(nnx.Rngs(0)), M.random_batch((2, 3))
  vg = lambda f: perturbkit.nnx.grad(M.mse, filter=f)(model, x)['perturbations']
  everything = vg(None)['codec']
  assert set(everything) == {'encode', 'decode', 'inner', 'outer'}
  assert set(everything['inner']) == set(everything['outer']) == {'__call__'}
  assert set(vg(filters.by_method('encode'))['codec']) == {'encode'}
  assert set(vg(filters.by_type(nnx.Linear))['codec']) == {'inner', 'outer'}
  assert set(vg(filters.top_level)['codec']) == {'encode', 'decode'}
  assert set(vg(filters.by_depth(2, 2))['codec']) == {'inner', 'outer'}
  assert set(vg(['codec/out*'])['codec']) == {'outer'}
  assert set(vg(filters.negate(filters.by_path('codec')))['codec']) == {'inner', 'outer'}
  # The method gradient is the Linear's own: encode returns inner's output.
  chex.assert_trees_all_close(everything['encode'], everything['inner']['__call__'])
  _not_vacuous(everything)


# --- Tracing: nnx.jit, jax.jit, one trace, the model object untouched --------------------


def test_nnx_jit_traces_once_and_equals_eager():
  model, x = M.CNN(rngs=nnx.Rngs(0)), M.random_batch((2, 5, 5, 1))
  eager_model = nnx.clone(model)
  traces = []

  @nnx.jit
  def step(model, x):
    traces.append(1)
    return perturbkit.nnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))(model, x)

  for i in range(3):
    loss, grads = step(model, x + i)
    want_loss, want = perturbkit.nnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))(
        eager_model, x + i)
    chex.assert_trees_all_close(loss, want_loss, **TOL)
    chex.assert_trees_all_close(grads['perturbations'], want['perturbations'], **TOL)
    chex.assert_trees_all_close(M.pure(grads['params']), M.pure(want['params']), **TOL)
  assert len(traces) == 1
  chex.assert_trees_all_close(M.pure(nnx.state(model)), M.pure(nnx.state(eager_model)), **TOL)


def test_jax_jit_via_split_merge():
  model, x = M.TransformerBlock(rngs=nnx.Rngs(0)), M.random_batch((2, 5, 8))
  graphdef, state = nnx.split(model)

  @chex.assert_max_traces(n=1)
  def step(state, x):
    return perturbkit.nnx.value_and_grad(M.mse)(nnx.merge(graphdef, state), x)

  step = jax.jit(step)
  for i in range(2):
    loss, grads = step(state, x + i)
    want_loss, want = perturbkit.nnx.value_and_grad(M.mse)(model, x + i)
    chex.assert_trees_all_close(grads['perturbations'], want['perturbations'], **TOL)
    chex.assert_trees_all_close(M.pure(grads['params']), M.pure(want['params']), **TOL)


def test_zeros_are_folded_away_under_jit():
  model, x = M.MLP(rngs=nnx.Rngs(0)), M.random_batch((4, 3))
  graphdef, state = nnx.split(model)
  ours = jax.jit(lambda s, x: perturbkit.nnx.value_and_grad(M.mse)(nnx.merge(graphdef, s), x))
  plain = jax.jit(lambda s, x: nnx.value_and_grad(M.mse)(nnx.merge(graphdef, s), x))
  a = ours.lower(state, x).compile().memory_analysis()
  b = plain.lower(state, x).compile().memory_analysis()
  assert a.argument_size_in_bytes == b.argument_size_in_bytes


def test_model_object_unchanged_after_success():
  model, x = M.CNN(rngs=nnx.Rngs(0)), M.random_batch((2, 5, 5, 1))
  plain = nnx.clone(model)
  perturbkit.nnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))(model, x)
  nnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))(plain, x)
  _assert_same_snapshot(_snapshot(model), _snapshot(plain))
  assert type(model.conv) is nnx.Conv


def test_model_object_unchanged_after_exception_in_loss():
  model, x = M.CNN(rngs=nnx.Rngs(0)), M.random_batch((2, 5, 5, 1))
  before = _snapshot(model)
  calls = []

  def failing(model, x):
    y = model(x)
    calls.append(1)
    if len(calls) == 2:  # fail in the differentiated run, after every call ran
      raise RuntimeError('boom')
    return jnp.mean(y ** 2)

  with pytest.raises(RuntimeError, match='boom'):
    perturbkit.nnx.value_and_grad(failing)(model, x)
  _assert_same_snapshot(_snapshot(model), before)
  # ... and the hooks entry point, which swaps the classes of the objects it is given.
  def always_failing(model, x):
    model(x)
    raise RuntimeError('boom')

  hook = perturbkit.backward_hook(lambda g: g)
  with pytest.raises(RuntimeError, match='boom'):
    perturbkit.nnx.with_hooks(always_failing, hook)(model, x)
  # (the model call itself advanced the dropout RNG count, as it would unhooked)
  after = _snapshot(model)
  assert after[0] == before[0] and after[2] == before[2]
  assert not any(hasattr(m, '__captures__') for _, m in nnx.iter_modules(model))


def test_threads_give_the_single_threaded_results_bit_for_bit():
  nets = [(3, [3, 3], [True, False], 0), (2, [3], [False], None), (3, [2, 2, 2], [False] * 3, 1),
          (2, [2, 3, 3], [True] * 3, 2), (3, [3, 2], [True, True], None)]
  cases = [(M.RandomNet(din, w, s, shared, rngs=nnx.Rngs(i)), M.mse,
            (M.random_batch((3, din), i),)) for i, (din, w, s, shared) in enumerate(nets)]
  cases += [
      (M.MLP(rngs=nnx.Rngs(0)), M.mse, (M.random_batch((4, 3)),)),
      (M.CNN(rngs=nnx.Rngs(0)), lambda m, x: jnp.mean(m(x, jax.random.key(1)) ** 2),
       (M.random_batch((2, 5, 5, 1)),)),
      (M.ScanMLP(rngs=nnx.Rngs(0)), M.mse, (M.random_batch((2, 4)),)),
  ]

  def run(model, loss_fn, args):
    step = nnx.jit(lambda model, *args: perturbkit.nnx.value_and_grad(loss_fn)(model, *args))
    loss, grads = step(model, *args)
    return jax.tree.map(np.asarray, (loss, M.pure(grads['params']), grads['perturbations']))

  want = [run(nnx.clone(m), f, a) for m, f, a in cases]
  got = [None] * len(cases)
  barrier = threading.Barrier(len(cases))

  def worker(i):
    barrier.wait()
    got[i] = run(nnx.clone(cases[i][0]), cases[i][1], cases[i][2])

  threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(cases) == 8
  for g, w in zip(got, want):
    chex.assert_trees_all_equal(g, w)


# --- Hooks ----------------------------------------------------------------------------


def _clip(g):
  return jnp.clip(g, -1e-2, 1e-2)


@jax.custom_vjp
def _clipped_identity(h):
  return h


_clipped_identity.defvjp(lambda h: (h, None), lambda _, g: (_clip(g),))


def _mlp_with_clipped_dense_1(model, x):
  h = nnx.relu(model.dense_0(x))
  h = nnx.relu(_clipped_identity(model.dense_1(h))) + h
  h = jnp.tanh(_clipped_identity(model.dense_1(h)))
  return jnp.mean(model.dense_2(h) ** 2)


def test_hook_equals_handwritten_custom_vjp():
  model, x = M.MLP(rngs=nnx.Rngs(0)), M.random_batch((4, 3))
  clip = perturbkit.backward_hook(_clip, filters.by_path('dense_1'))
  want = nnx.grad(_mlp_with_clipped_dense_1)(model, x)
  got = nnx.grad(perturbkit.nnx.with_hooks(M.mse, clip))(model, x)
  chex.assert_trees_all_close(M.pure(got), M.pure(want), **TOL)
  _, got = perturbkit.nnx.value_and_grad(M.mse, hooks=[clip])(model, x)
  chex.assert_trees_all_close(M.pure(got['params']), M.pure(want), **TOL)
  # Not vacuous: the clip changes the gradients below it.
  plain = nnx.grad(M.mse)(model, x)
  assert not np.allclose(plain['dense_0']['kernel'][...], want['dense_0']['kernel'][...])


def test_zeroing_hook_in_value_and_grad():
  model, x = M.MLP(rngs=nnx.Rngs(0)), M.random_batch((4, 3))
  zero = perturbkit.backward_hook(lambda g: 0 * g, filters.by_path('dense_2'))
  _, grads = perturbkit.nnx.value_and_grad(M.mse, hooks=[zero])(model, x)
  # Everything below the hooked output gets zero gradient, the layer's own params too ...
  for name in ('dense_0', 'dense_1', 'dense_2'):
    assert float(jnp.abs(grads['params'][name]['kernel'][...]).sum()) == 0.0
  # ... while the gradient reported at the hooked call is the one arriving at it.
  _, plain = perturbkit.nnx.value_and_grad(M.mse)(model, x)
  chex.assert_trees_all_close(grads['perturbations']['dense_2'], plain['perturbations']['dense_2'])
  _not_vacuous(grads['perturbations']['dense_2'])
  # with_hooks inside value_and_grad composes the same way.
  _, composed = perturbkit.nnx.value_and_grad(perturbkit.nnx.with_hooks(M.mse, zero))(model, x)
  chex.assert_trees_all_close(composed['perturbations'], grads['perturbations'])
  chex.assert_trees_all_close(M.pure(composed['params']), M.pure(grads['params']))


# --- Errors ----------------------------------------------------------------------------


def test_named_errors():
  model, x = M.MLP(rngs=nnx.Rngs(0)), M.random_batch((4, 3))
  with pytest.raises(perturbkit.NonScalarLossError):
    perturbkit.nnx.value_and_grad(lambda m, x: m(x))(model, x)
  with pytest.raises(perturbkit.NoPerturbationPointsError, match='dense_0/__call__'):
    perturbkit.nnx.value_and_grad(M.mse, filter=filters.by_type(nnx.Conv))(model, x)


class _IntOut(nnx.Module):
  def __call__(self, x):
    return jnp.argmax(x, axis=-1)


class _Ints(nnx.Module):
  def __init__(self, rngs):
    self.ints = _IntOut()
    self.linear = nnx.Linear(3, 1, rngs=rngs)

  def __call__(self, x):
    return self.linear(x * self.ints(x)[:, None])


class _Final(nnx.Module):
  def __init_subclass__(cls, **kwargs):
    raise TypeError('no subclasses')

  def __call__(self, x):
    return 2 * x


class _HasFinal(nnx.Module):
  def __init__(self, rngs):
    self.final = _Final()
    self.linear = nnx.Linear(3, 1, rngs=rngs)

  def __call__(self, x):
    return self.linear(self.final(x))


def test_named_errors_nnx():
  x = M.random_batch((4, 3))
  with pytest.raises(perturbkit.NonDifferentiableOutputError, match='ints/__call__'):
    perturbkit.nnx.value_and_grad(M.mse, filter=['ints'])(_Ints(nnx.Rngs(0)), x)
  _, grads = perturbkit.nnx.value_and_grad(M.mse)(_Ints(nnx.Rngs(0)), x)  # not strict
  assert set(grads['perturbations']) == {'linear'}
  model = _HasFinal(nnx.Rngs(0))
  before = _snapshot(model)
  with pytest.raises(perturbkit.nnx.UninstrumentableModuleError, match='final'):
    perturbkit.nnx.value_and_grad(M.mse)(model, x)
  _assert_same_snapshot(_snapshot(model), before)
  # A loss that wraps the model in its own nnx.capture hides the points.
  with pytest.raises(perturbkit.nnx.CaptureConflictError):
    perturbkit.nnx.value_and_grad(
        lambda m, x: jnp.mean(nnx.capture(m, nnx.Intermediate)(x)[0] ** 2))(
            M.MLP(rngs=nnx.Rngs(0)), x)
  with pytest.raises(perturbkit.NotAModuleError, match='nnx.Module'):
    perturbkit.nnx.with_hooks(lambda x: x, perturbkit.backward_hook(lambda g: g))(x)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    perturbkit.nnx.value_and_grad(M.mse)(M.MLP(rngs=nnx.Rngs(0)), x)


@pytest.mark.parametrize('copy', ['clone', 'split_all'])
def test_loss_that_runs_a_copy_of_the_model_is_named(copy):
  def loss(model, x):
    if copy == 'clone':
      return M.mse(nnx.clone(model), x)
    graphdef, state = nnx.split(model)  # the whole state, as an inner step over it would
    return jax.value_and_grad(lambda state: M.mse(nnx.merge(graphdef, state), x))(state)[0]

  with pytest.warns(perturbkit.UnperturbedCallsWarning, match='copy of the model'):
    with pytest.raises(perturbkit.NoPerturbationPointsError, match='nnx.split.model, nnx.Param'):
      perturbkit.nnx.value_and_grad(loss)(M.MLP(rngs=nnx.Rngs(0)), M.random_batch((4, 3)))


def test_shared_type_filters():
  model, x = M.MLP(rngs=nnx.Rngs(0)), M.random_batch((4, 3))
  _, grads = perturbkit.nnx.value_and_grad(M.mse, filter=perturbkit.filters.by_type(nnx.Linear))(
      model, x)
  assert set(grads['perturbations']) == {'dense_0', 'dense_1', 'dense_2'}


def test_benchmark_script_smoke():
  import importlib.util
  import os
  path = os.path.join(os.path.dirname(__file__), '..', 'scripts', 'bench_nnx.py')
  spec = importlib.util.spec_from_file_location('bench_nnx', path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  result = bench.measure_model('mlp', dict(batch=4, features=8, widths=(8,), classes=3), 1)
  assert result['mismatch'] is None and result['argument_bytes_equal']
  assert result['points'] == 2
  trained = bench.measure_interleaved('mlp', dict(batch=4, features=8, widths=(8,), classes=3),
                                      1)
  assert trained['mismatch'] is None and trained['original_equals_standard']
  assert trained['segments'] == ['layers/0', 'head'] and not trained['rest']
  assert set(trained['variants']) == {'standard', 'updated', 'original'}
  assert all(len(v['samples_s']) == 1 for v in trained['variants'].values())
  assert {'updated_time', 'original_time', 'updated_compile'} <= set(trained['ratios'])


class _DropoutGiven(nnx.Module):
  """A Dropout whose RNG stream is passed to the call (``rngs=``), as NNX models do."""

  def __init__(self, rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)
    self.dropout = nnx.Dropout(0.5)

  def __call__(self, x, *, rngs):
    return self.dropout(self.linear(x), rngs=rngs)


def test_returned_inputs_hold_no_nnx_objects_the_call_was_given():
  """``return_inputs``: an ``nnx.Rngs`` passed to a call is ``None`` there (it was the caller's
  own, stateful object); the arrays are the call's inputs."""
  model, x = _DropoutGiven(nnx.Rngs(0)), M.random_batch((2, 4))
  loss = lambda m, x, rngs: jnp.sum(m(x, rngs=rngs) ** 2)
  _, _, inputs = perturbkit.nnx.value_and_grad(loss, return_inputs=True)(
      model, x, nnx.Rngs(dropout=5))
  chex.assert_trees_all_close(inputs['linear']['__call__'], ((x,), {}))
  dropout_args, dropout_kwargs = inputs['dropout']['__call__']
  chex.assert_trees_all_close(dropout_args, (model.linear(x),), **TOL)
  assert dropout_kwargs == {'rngs': None}
