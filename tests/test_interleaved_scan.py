"""Interleaved training through blocks stacked in ``nn.scan`` / ``nnx.scan``: each iteration
is a segment.

A scan with ``variable_axes={'params': 0}`` (NNX: ``nnx.scan`` over modules made with
``nnx.vmap``) hands each iteration a slice of params stacked ``(L, ...)``. Walking backward through the scan, each iteration's layers take their step on their
slice before the gradient goes on to the iteration below, exactly as for the same blocks
unrolled: the reference is the unrolled twin (each block its own module, given its slice of the
params), trained by the same schedule, whose steps are checked against a hand-coded backward in
``tests/test_interleaved.py``. ``propagate='original'`` is also checked against ``jax.grad`` and
optax on the scanned model itself.
"""
import chex
import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import nnx_models
import perturbkit

L = 2  # two iterations: enough to tell the iterations' order and slices apart
TOL = dict(rtol=2e-5, atol=2e-6)


class Block(nn.Module):
  """Pre-norm residual block; a scan body when ``scanned`` (carry, nothing per iteration)."""
  dropout: float = 0.0
  batch_norm: bool = False

  @nn.compact
  def __call__(self, h, _=None, train: bool = False):
    if self.batch_norm:
      u = nn.BatchNorm(use_running_average=not train, name='norm')(h)
    else:
      u = nn.LayerNorm(name='norm')(h)
    u = jnp.tanh(nn.Dense(8, name='up')(u))
    u = nn.Dropout(self.dropout, deterministic=not train)(u)
    return h + nn.Dense(6, name='down')(u), None


class Net(nn.Module):
  """Embedding Dense, L blocks (in ``nn.scan``, or unrolled as ``block0``...), head Dense."""
  scan: bool = True
  remat: bool = False
  dropout: float = 0.0
  batch_norm: bool = False

  @nn.compact
  def __call__(self, x, train: bool = False):
    h = nn.Dense(6, name='embed')(x)
    block = nn.remat(Block, static_argnums=(3,)) if self.remat else Block
    if self.scan:
      stack = nn.scan(block, variable_axes={'params': 0, 'batch_stats': 0, 'perturbations': 0},
                      split_rngs={'params': True, 'dropout': True}, length=L,
                      in_axes=(nn.broadcast, nn.broadcast))
      h, _ = stack(self.dropout, self.batch_norm, name='blocks')(h, None, train)
    else:
      for i in range(L):
        h, _ = block(self.dropout, self.batch_norm, name=f'block{i}')(h, None, train)
    return nn.Dense(2, name='head')(h)


X = jax.random.normal(jax.random.key(0), (8, 5))
Y = jax.random.normal(jax.random.key(1), (8, 2))


def _slice(tree, i):
  """``tree``'s leaves at index ``i`` of their leading axis, sliced in numpy (an eager
  ``a[i]`` compiles a program per leaf shape) and put back on the device."""
  return jax.tree.map(lambda a: jax.device_put(np.asarray(a)[i]), tree)


def _max_abs_diff(a, b):
  """``max |a - b|`` per leaf, in numpy."""
  return jax.tree.map(lambda x, y: np.max(np.abs(np.asarray(x) - np.asarray(y))), a, b)


def unrolled(tree):
  """The scanned model's params (or any tree shaped like them) for the unrolled twin."""
  tree = dict(tree)
  blocks = tree.pop('blocks')
  return {**tree, **{f'block{i}': _slice(blocks, i) for i in range(L)}}


def mse(model, **kwargs):
  return lambda v, x, y: jnp.mean((model.apply(v, x, **kwargs) - y) ** 2)


@pytest.fixture(scope='module', name='variables')
def _variables():
  return Net().init(jax.random.key(2), X)


def kfac_optimizer(layers):
  """Per segment: K-FAC then SGD for a K-FAC layer's segment, SGD for the others."""
  def optimizer(name):
    if name not in layers.layers:
      return optax.sgd(0.05)
    return optax.chain(perturbkit.kfac_segment(layers.layers[name], damping=0.1,
                                               inverse_every=2), optax.sgd(0.05))
  return optimizer


def _train(tx, variables, steps=3):
  state = tx.init(variables, X, Y)
  step = jax.jit(tx.step)
  for _ in range(steps):
    state, metrics = step(state, X, Y)
  return state, metrics


OPTIMIZERS = {
    'sgd': lambda: optax.sgd(0.02),
    'clip_adamw': lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2)),
}


# 'original' is checked against jax.grad and optax below; adam is the second half of clip_adamw.
# Both sides clip each segment by its own norm (the warning says so), which is what is compared.
@pytest.mark.filterwarnings('ignore::perturbkit.PerSegmentTransformWarning')
@pytest.mark.parametrize('propagate, optimizer', [('updated', 'sgd'), ('updated', 'clip_adamw')])
def test_each_iteration_steps_as_its_unrolled_block(variables, propagate, optimizer):
  scanned = perturbkit.interleaved(mse(Net()), OPTIMIZERS[optimizer](), propagate=propagate)
  twin = perturbkit.interleaved(mse(Net(scan=False)), OPTIMIZERS[optimizer](),
                                propagate=propagate)
  listing = scanned.segments(variables, X, Y)
  assert listing.segments == ('embed', 'blocks/norm', 'blocks/up', 'blocks/down', 'head')
  assert dict(listing.iterations) == {'blocks/norm': L, 'blocks/up': L, 'blocks/down': L}
  assert listing.rest == {}
  state, metrics = _train(scanned, variables)
  twin_state, twin_metrics = _train(twin, {'params': unrolled(variables['params'])})
  chex.assert_trees_all_close(unrolled(state.params), twin_state.params, **TOL)
  for path, leaf in jax.tree_util.tree_leaves_with_path(
      _max_abs_diff(state.params, variables['params'])):
    assert leaf > 1e-3, jax.tree_util.keystr(path)  # every leaf moved
  for layer in ('norm', 'up', 'down'):
    # One optimizer state per iteration, equal to each unrolled block's own.
    for i in range(L):
      chex.assert_trees_all_close(_slice(state.opt_state[f'blocks/{layer}'], i),
                                  twin_state.opt_state[f'block{i}/{layer}'], **TOL)
    np.testing.assert_allclose(
        metrics['activation_grad_norm'][f'blocks/{layer}'],
        [twin_metrics['activation_grad_norm'][f'block{i}/{layer}'] for i in range(L)], rtol=1e-4)
  np.testing.assert_allclose(metrics['loss'], twin_metrics['loss'], rtol=1e-5)


def test_original_equals_jax_grad_and_optax_on_the_scanned_model(variables):
  tx = perturbkit.interleaved(mse(Net()), optax.adam(1e-2), propagate='original')
  state = tx.init(variables, X, Y)
  params, opt = variables['params'], optax.adam(1e-2).init(variables['params'])

  @jax.jit
  def standard_step(params, opt):
    grads = jax.grad(lambda p: mse(Net())({'params': p}, X, Y))(params)
    updates, opt = optax.adam(1e-2).update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  for _ in range(3):
    state, _ = jax.jit(tx.step)(state, X, Y)
    params, opt = standard_step(params, opt)
  chex.assert_trees_all_close(state.params, params, **TOL)
  updated, _ = _train(perturbkit.interleaved(mse(Net()), optax.adam(1e-2)), variables)
  # The updated weights' propagation changes the steps of the layers below the last block.
  assert not np.allclose(updated.params['embed']['kernel'], params['embed']['kernel'],
                         atol=1e-5)


@pytest.fixture(scope='module')
def whole_blocks(variables):
  """``(tx, state, metrics)``: the scanned model with ``segments=1``, Adam, after 3 steps
  (one compile, shared by the two tests below)."""
  tx = perturbkit.interleaved(mse(Net()), optax.adam(1e-2), segments=1)
  return (tx, *_train(tx, variables))


def test_whole_blocks_as_segments_step_iteration_by_iteration(variables, whole_blocks):
  """``segments=1``: the scan module's call is each iteration's whole block."""
  scanned, state, metrics = whole_blocks
  twin = perturbkit.interleaved(mse(Net(scan=False)), optax.adam(1e-2), segments=1)
  listing = scanned.segments(variables, X, Y)
  assert listing.segments == ('embed', 'blocks', 'head')
  assert dict(listing.iterations) == {'blocks': L}
  twin_state, twin_metrics = _train(twin, {'params': unrolled(variables['params'])})
  chex.assert_trees_all_close(unrolled(state.params), twin_state.params, **TOL)
  np.testing.assert_allclose(metrics['activation_grad_norm']['blocks'],
                             [twin_metrics['activation_grad_norm'][f'block{i}']
                              for i in range(L)], rtol=1e-4)


class MaskedBlock(nn.Module):
  """A residual block that zeroes the update at padded positions of an integer mask."""

  @nn.compact
  def __call__(self, h, mask):
    return h + jnp.tanh(nn.Dense(h.shape[-1])(h)) * (mask[..., None] > 0), None


class MaskedNet(nn.Module):
  @nn.compact
  def __call__(self, x, mask):
    stack = nn.scan(MaskedBlock, variable_axes={'params': 0}, split_rngs={'params': True},
                    in_axes=nn.broadcast, length=L)
    return stack(name='blocks')(x, mask)[0]


MASK_X = jax.random.normal(jax.random.key(3), (2, 5, 4))
MASK = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], jnp.int32)


def masked_loss(out):
  return jnp.mean(jnp.sin(3 * out))


@jax.jit
def masked_reference(dense):
  """One update-then-propagate SGD step (lr 0.5) of ``L`` masked blocks, written out with one
  ``jax.vjp`` per block; ``dense`` holds the blocks' kernels and biases stacked ``(L, ...)``."""
  def block(w, h):
    return h + jnp.tanh(h @ w['kernel'] + w['bias'][None, None]) * (MASK[..., None] > 0)

  ws = [jax.tree.map(lambda a, i=i: a[i], dense) for i in range(L)]
  inputs = [MASK_X]
  for w in ws:
    inputs.append(block(w, inputs[-1]))
  loss, g = jax.value_and_grad(masked_loss)(inputs.pop())
  for i in reversed(range(L)):
    dw = jax.vjp(block, ws[i], inputs[i])[1](g)[0]
    ws[i] = jax.tree.map(lambda a, b: a - 0.5 * b, ws[i], dw)
    g = jax.vjp(lambda h, w=ws[i]: block(w, h), inputs[i])[1](g)[0]
  return loss, jax.tree.map(lambda *a: jnp.stack(a), *ws)


def test_whole_blocks_taking_an_integer_mask_step_as_a_hand_coded_backward():
  """A scanned block given an integer array (an attention mask) as a segment: its replays
  take the mask as an input (they closed over the scan body's tracer, and the step failed)."""
  model = MaskedNet()
  variables = model.init(jax.random.key(4), MASK_X, MASK)
  loss_fn = lambda v, x, mask: masked_loss(model.apply(v, x, mask))
  tx = perturbkit.interleaved(loss_fn, optax.sgd(0.5), segments=1)
  assert dict(tx.segments(variables, MASK_X, MASK).iterations) == {'blocks': L}
  state, metrics = jax.jit(tx.step)(tx.init(variables, MASK_X, MASK), MASK_X, MASK)
  loss, dense = masked_reference(variables['params']['blocks']['Dense_0'])
  np.testing.assert_allclose(metrics['loss'], loss, rtol=1e-6)
  chex.assert_trees_all_close(state.params, {'blocks': {'Dense_0': dense}}, **TOL)
  assert not np.allclose(dense['kernel'], variables['params']['blocks']['Dense_0']['kernel'],
                         atol=1e-3)


def test_dropout_and_batch_norm_inside_a_scan_over_remat_step_as_the_model_runs():
  """Dropout masks split per iteration and BatchNorm statistics stacked per iteration: with
  ``propagate='original'`` the step is ``jax.grad`` and optax of the model as it runs (the
  replays draw the same masks and see the same statistics), and the statistics are the ones
  the model's own ``apply(..., mutable=['batch_stats'])`` returns. The blocks run in
  ``nn.remat`` inside the scan, so each replay also runs inside the rematerialized body."""
  remat = True
  model = Net(remat=remat, dropout=0.3, batch_norm=True)
  variables = model.init(jax.random.key(2), X)
  key = jax.random.key(7)

  def loss_fn(v, x, y):
    out, mutated = model.apply(v, x, True, rngs={'dropout': key}, mutable=['batch_stats'])
    return jnp.mean((out - y) ** 2), mutated

  tx = perturbkit.interleaved(lambda v, x, y: loss_fn(v, x, y)[0], optax.sgd(0.1),
                              propagate='original')
  assert dict(tx.segments(variables, X, Y).iterations) == {
      'blocks/norm': L, 'blocks/up': L, 'blocks/down': L}
  state, _ = jax.jit(tx.step)(tx.init(variables, X, Y), X, Y)

  @jax.jit
  def sgd_step(params):  # jax.grad and the SGD step in one program
    grads, mutated = jax.grad(lambda p: loss_fn({**variables, 'params': p}, X, Y),
                              has_aux=True)(params)
    return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), grads, mutated

  want, grads, mutated = sgd_step(variables['params'])
  chex.assert_trees_all_close(state.params, want, **TOL)
  chex.assert_trees_all_close(state.variables['batch_stats'], mutated['batch_stats'], **TOL)
  assert not np.allclose(mutated['batch_stats']['blocks']['norm']['mean'],
                         variables['batch_stats']['blocks']['norm']['mean'])
  # The masks matter: without dropout the gradient is another.
  plain = jax.jit(jax.grad(lambda p: jnp.mean((Net(remat=remat, batch_norm=True).apply(
      {**variables, 'params': p}, X, True, mutable=['batch_stats'])[0] - Y) ** 2)))(
          variables['params'])
  assert not np.allclose(plain['blocks']['up']['kernel'], grads['blocks']['up']['kernel'])
  # 'updated' runs too, and moves every iteration's params.
  updated = perturbkit.interleaved(lambda v, x, y: loss_fn(v, x, y)[0], optax.sgd(0.1))
  state, metrics = jax.jit(updated.step)(updated.init(variables, X, Y), X, Y)
  assert metrics['activation_grad_norm']['blocks/up'].shape == (L,)
  assert np.all(np.abs(np.asarray(state.params['blocks']['up']['kernel'])
                       - np.asarray(variables['params']['blocks']['up']['kernel'])).max(
                           axis=(1, 2)) > 0)


def test_an_optimizer_state_not_made_per_iteration_is_refused(variables):
  tx = perturbkit.interleaved(mse(Net()), optax.adam(1e-2))
  state = tx.init(variables, X, Y)
  assert state.opt_state['blocks/up'][0].mu['kernel'].shape == (L, 6, 8)
  assert state.opt_state['blocks/up'][0].count.shape == (L,)
  one = optax.adam(1e-2).init(variables['params']['blocks']['up'])  # the stacked params' state
  broken = state._replace(opt_state={**state.opt_state, 'blocks/up': one})
  with pytest.raises(perturbkit.OptimizerStateError, match="'blocks/up' does not match"):
    tx.step(broken, X, Y)


def test_kfac_segments_precondition_each_iteration_as_its_unrolled_block(variables):
  """``kfac_segment`` of a layer stacked in the scan: one K-FAC state per iteration, each
  formed from its iteration's inputs and output gradients, as for the unrolled blocks' layers
  (whose K-FAC segments are checked against the whole-model preconditioner in
  ``tests/test_kfac_segment.py``)."""
  def train(model, variables):
    layers = perturbkit.kfac_layers(lambda v, x: model.apply(v, x), variables, X)
    assert not layers.skipped
    return _train(perturbkit.interleaved(mse(model), kfac_optimizer(layers)), variables)[0]

  state = train(Net(), variables)
  twin_state = train(Net(scan=False), {'params': unrolled(variables['params'])})
  chex.assert_trees_all_close(unrolled(state.params), twin_state.params, **TOL)
  factors = state.opt_state['blocks/up'][0].factors['segment']
  assert factors.a.shape == (L, 7, 7) and factors.g.shape == (L, 8, 8)
  for i in range(L):
    np.testing.assert_allclose(np.asarray(factors.a)[i],
                               twin_state.opt_state[f'block{i}/up'][0].factors['segment'].a,
                               rtol=1e-4, atol=1e-7)


def test_backward_hooks_inside_the_scan_act_as_on_the_unrolled_blocks(variables, whole_blocks):
  """A hook on every ``up`` Dense halves the gradient it passes down, in the forward replay of
  each block segment and in the replay at the updated weights (inside the scan's backward
  pass); without the hook (the same model's 3 steps as above) the params are others. (Hooks
  on layer segments outside a scan: ``tests/test_interleaved.py``.)"""
  segments = 1
  hook = perturbkit.backward_hook(lambda g: 0.5 * g,
                                  lambda module, method: module.name == 'up')
  scanned = perturbkit.interleaved(mse(Net()), optax.adam(1e-2), segments=segments,
                                   hooks=[hook])
  twin = perturbkit.interleaved(mse(Net(scan=False)), optax.adam(1e-2), segments=segments,
                                hooks=[hook])
  state, _ = _train(scanned, variables)
  twin_state, _ = _train(twin, {'params': unrolled(variables['params'])})
  chex.assert_trees_all_close(unrolled(state.params), twin_state.params, **TOL)
  _, unhooked, _ = whole_blocks
  assert not np.allclose(unhooked.params['blocks']['norm']['scale'],
                         state.params['blocks']['norm']['scale'], atol=1e-6)


def test_an_ensemble_in_nn_vmap_steps_each_member_as_its_own_model():
  """``nn.vmap`` over params stacked along axis 0 (an ensemble): a segment per member."""
  class Member(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(2, name='out')(jnp.tanh(nn.Dense(6, name='hidden')(x)))

  class Ensemble(nn.Module):
    mapped: bool = True

    @nn.compact
    def __call__(self, x):
      if self.mapped:
        ys = nn.vmap(Member, variable_axes={'params': 0}, split_rngs={'params': True},
                     in_axes=None, out_axes=0, axis_size=L)(name='members')(x)
      else:
        ys = jnp.stack([Member(name=f'member{i}')(x) for i in range(L)])
      return ys.mean(0)

  variables = Ensemble().init(jax.random.key(2), X)
  members = {f'member{i}': _slice(variables['params']['members'], i) for i in range(L)}
  mapped = perturbkit.interleaved(mse(Ensemble()), optax.adam(1e-2))
  assert dict(mapped.segments(variables, X, Y).iterations) == {
      'members/hidden': L, 'members/out': L}
  state, _ = _train(mapped, variables)
  twin_state, _ = _train(perturbkit.interleaved(mse(Ensemble(mapped=False)), optax.adam(1e-2)),
                         {'params': members})
  got = {f'member{i}': _slice(state.params['members'], i) for i in range(L)}
  chex.assert_trees_all_close(got, twin_state.params, **TOL)


# ----------------------------------------------------------------------- NNX


class NNXBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(6, rngs=rngs)
    self.up = nnx.Linear(6, 8, rngs=rngs)
    self.down = nnx.Linear(8, 6, rngs=rngs)

  def __call__(self, h):
    return h + self.down(jnp.tanh(self.up(self.norm(h))))


class NNXNet(nnx.Module):
  """Embedding Linear, L blocks made with ``nnx.vmap`` and run by ``nnx.scan``, head Linear."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Linear(5, 6, rngs=rngs)

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return NNXBlock(rngs)

    self.blocks = create(rngs)
    self.head = nnx.Linear(6, 2, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(h, block):
      return block(h)

    return self.head(body(self.embed(x), self.blocks))


class NNXUnrolled(nnx.Module):
  """The same blocks as a list, each given its slice of the stacked state."""

  def __init__(self, scanned: NNXNet):
    self.embed, self.head = scanned.embed, scanned.head
    self.blocks = nnx_models.unstacked(scanned.blocks, L)

  def __call__(self, x):
    h = self.embed(x)
    for block in self.blocks:
      h = block(h)
    return self.head(h)


def nnx_mse(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def nnx_unrolled(state):
  """The scanned model's ``nnx.Param`` state as the unrolled twin's."""
  pure = nnx.to_pure_dict(state)
  blocks = pure.pop('blocks')
  return {**pure, 'blocks': {i: _slice(blocks, i) for i in range(L)}}


# 'original' on a scanned NNX model is checked against nnx.grad and optax in
# tests/test_nnx_interleaved.py (scanned blocks inside a submodule).
@pytest.mark.filterwarnings('ignore::perturbkit.PerSegmentTransformWarning')
@pytest.mark.parametrize('propagate, optimizer', [('updated', 'clip_adamw')])
def test_nnx_each_iteration_steps_as_its_unrolled_block(propagate, optimizer):
  model = NNXNet(nnx.Rngs(0))
  twin = NNXUnrolled(nnx.clone(model))
  scanned = perturbkit.nnx.interleaved(nnx_mse, OPTIMIZERS[optimizer](), propagate=propagate)
  unrolled = perturbkit.nnx.interleaved(nnx_mse, OPTIMIZERS[optimizer](), propagate=propagate)
  listing = scanned.segments(model, X, Y)
  assert listing.segments == ('embed', 'blocks/norm', 'blocks/up', 'blocks/down', 'head')
  assert dict(listing.iterations) == {'blocks/norm': L, 'blocks/up': L, 'blocks/down': L}
  state, twin_state = scanned.init(model, X, Y), unrolled.init(twin, X, Y)
  for _ in range(3):
    state, metrics = jax.jit(scanned.step)(state, X, Y)
    twin_state, twin_metrics = jax.jit(unrolled.step)(twin_state, X, Y)
  got = nnx_unrolled(nnx.state(state.model(), nnx.Param))
  chex.assert_trees_all_close(got, nnx.to_pure_dict(nnx.state(twin_state.model(), nnx.Param)),
                              **TOL)
  moved = _max_abs_diff(nnx.state(state.model(), nnx.Param), nnx.state(model, nnx.Param))
  assert min(jax.tree.leaves(moved)) > 1e-3
  np.testing.assert_allclose(metrics['activation_grad_norm']['blocks/up'],
                             [twin_metrics['activation_grad_norm'][f'blocks/{i}/up']
                              for i in range(L)], rtol=1e-4)


def test_nnx_interleaved_optimizer_steps_each_iteration_in_place():
  """``InterleavedOptimizer`` (state in the object, ``nnx.jit``) on the scanned model gives the
  pure trainer's params, and those of the unrolled twin; the per-iteration optimizer states
  stay out of the model (its graphdef is unchanged, one trace)."""
  model = NNXNet(nnx.Rngs(0))
  twin = NNXUnrolled(nnx.clone(model))
  graphdef = nnx.graphdef(model)
  opt = perturbkit.nnx.InterleavedOptimizer(model, optax.adam(1e-2), nnx_mse, X, Y)
  twin_opt = perturbkit.nnx.InterleavedOptimizer(twin, optax.adam(1e-2), nnx_mse, X, Y)
  traces = []

  @nnx.jit
  def train_step(model, opt, x, y):
    traces.append(1)
    return opt.step(model, x, y)

  for _ in range(2):
    metrics = train_step(model, opt, X, Y)
    train_step(twin, twin_opt, X, Y)
  assert metrics['activation_grad_norm']['blocks/down'].shape == (L,)
  assert nnx.graphdef(model) == graphdef and len(traces) == 2  # one per model
  chex.assert_trees_all_close(nnx_unrolled(nnx.state(model, nnx.Param)),
                              nnx.to_pure_dict(nnx.state(twin, nnx.Param)), **TOL)


def test_nnx_kfac_segments_precondition_each_iteration_as_its_unrolled_block():
  def train(model):
    layers = perturbkit.nnx.kfac_layers(model, X)
    assert not layers.skipped
    tx = perturbkit.nnx.interleaved(nnx_mse, kfac_optimizer(layers))
    state = tx.init(model, X, Y)
    for _ in range(3):
      state, _ = jax.jit(tx.step)(state, X, Y)
    return state

  model = NNXNet(nnx.Rngs(0))
  state, twin_state = train(model), train(NNXUnrolled(nnx.clone(model)))
  chex.assert_trees_all_close(nnx_unrolled(nnx.state(state.model(), nnx.Param)),
                              nnx.to_pure_dict(nnx.state(twin_state.model(), nnx.Param)), **TOL)
  assert state.opt_state['blocks/up'][0].factors['segment'].a.shape == (L, 7, 7)


class NNXMaskedBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.lin = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, h, mask):
    return h + jnp.tanh(self.lin(h)) * (mask[..., None] > 0)


class NNXMaskedNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return NNXMaskedBlock(rngs)

    self.blocks = create(rngs)

  def __call__(self, x, mask):
    @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
    def body(h, block, mask):
      return block(h, mask)

    return body(x, self.blocks, mask)


def test_nnx_whole_blocks_taking_an_integer_mask_step_as_a_hand_coded_backward():
  """As the Linen test above, for ``nnx.scan``: the replays take the mask as an input."""
  model = NNXMaskedNet(nnx.Rngs(4))
  tx = perturbkit.nnx.interleaved(lambda m, x, mask: masked_loss(m(x, mask)), optax.sgd(0.5),
                                  segments=perturbkit.nnx.filters.by_type(NNXMaskedBlock))
  assert dict(tx.segments(model, MASK_X, MASK).iterations) == {'blocks': L}
  state, metrics = jax.jit(tx.step)(tx.init(model, MASK_X, MASK), MASK_X, MASK)
  loss, dense = masked_reference(nnx.to_pure_dict(nnx.state(model, nnx.Param))['blocks']['lin'])
  np.testing.assert_allclose(metrics['loss'], loss, rtol=1e-6)
  got = nnx.to_pure_dict(nnx.state(state.model(), nnx.Param))
  chex.assert_trees_all_close(got, {'blocks': {'lin': dense}}, **TOL)


class _Recurrent(nn.Module):
  """Flax's ``nn.RNN`` of a GRU cell: a scan that broadcasts the cell's params to every step."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.RNN(nn.GRUCell(6))(x).mean(axis=1))


def test_layers_in_a_scan_broadcasting_their_params_go_to_the_rest_with_the_reason():
  """Each step of the scan runs the cell with the same params: no step can update them on its
  own, and the cell is not a call outside the scan. The rest names the broadcast (it said the
  cell's layers were called twice, the scan's two traces); the step is ``jax.grad`` + SGD."""
  model, x = _Recurrent(), jax.random.normal(jax.random.key(1), (2, 7, 4))
  variables = model.init(jax.random.key(0), x)
  loss_fn = lambda v, x: jnp.sum(jnp.tanh(model.apply(v, x)) ** 2)
  tx = perturbkit.interleaved(loss_fn, optax.sgd(0.1), propagate='original')
  segmentation = tx.segments(variables, x)
  assert segmentation.segments == ('Dense_0',)
  assert set(segmentation.rest) == {f'GRUCell_0/{n}' for n in ('hn', 'hr', 'hz', 'in', 'ir', 'iz')}
  assert all('broadcast to every iteration' in r for r in segmentation.rest.values())
  state, _ = jax.jit(tx.step)(tx.init(variables, x), x)
  want = jax.jit(lambda v: jax.tree.map(lambda p, g: p - 0.1 * g, v['params'],
                                        jax.grad(loss_fn)(v, x)['params']))(variables)
  chex.assert_trees_all_close(state.variables['params'], want, **TOL)
