"""value_and_grad against hand-written ``self.perturb`` twins, per-layer VJPs and JVPs."""
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from explicit_deltas import at, explicit_deltas, points_of, zeros
import hand_lora
import perturbkit

TOL = dict(rtol=1e-5, atol=1e-6)


@functools.cache
def _setup(name, seed=0):
  """A case, its variables, input and key: made once per module (the tests only read them)."""
  case = models.CASES[name]
  x = jax.random.normal(jax.random.key(100 + seed), case.x_shape)
  return case, models.init(case, case.model, x, seed), x, jax.random.key(7)


@functools.cache
def _kit_value_and_grad(name):
  """perturbkit's jitted ``value_and_grad`` of a case at ``_setup(name)``, once per module."""
  case, variables, x, key = _setup(name)
  vg = perturbkit.value_and_grad(models.loss_fn_for(case, case.model), filter=case.filter,
                                 has_aux=True)
  return jax.jit(vg)(variables, x, key)


@pytest.mark.parametrize('name', sorted(models.CASES))
def test_equals_hand_written_perturb(name):
  case, variables, x, key = _setup(name)
  (loss, updates), grads = _kit_value_and_grad(name)
  (want_loss, want_updates), want = jax.jit(
      lambda v, x, key: models.hand_value_and_grad(case, v, x, key))(variables, x, key)
  chex.assert_trees_all_close(loss, want_loss, **TOL)
  chex.assert_trees_all_close(updates, want_updates, **TOL)
  chex.assert_trees_all_close(grads, want, **TOL)
  # Not vacuous: some activation gradient is far from zero.
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads['perturbations'])) > 1e-2


@pytest.mark.parametrize('name', ['mlp', 'cnn_eval', 'transformer_train', 'scan'])
def test_directional_derivative_matches_jvp(name):
  case, variables, x, key = _setup(name)
  wrapped = perturbkit.wrap(case.model, case.filter)
  loss_fn = models.loss_fn_for(case, wrapped)
  _, grads = _kit_value_and_grad(name)
  zeros = grads['perturbations']
  leaves, treedef = jax.tree.flatten(zeros)
  keys = jax.random.split(jax.random.key(3), len(leaves))
  direction = jax.tree.unflatten(
      treedef, [jax.random.normal(k, g.shape) for k, g in zip(keys, leaves)])

  def along(t):
    eps = jax.tree.map(lambda v: t * v, direction)
    return loss_fn({**variables, 'perturbations': eps}, x, key)[0]

  _, derivative = jax.jit(lambda: jax.jvp(along, (0.0,), (1.0,)))()
  predicted = sum(jnp.vdot(g, v) for g, v in zip(leaves, jax.tree.leaves(direction)))
  np.testing.assert_allclose(derivative, predicted, rtol=1e-4, atol=1e-5)


def _dense(p, h):
  return h @ p['kernel'] + p['bias'][None]


def test_mlp_equals_layerwise_vjp():
  """The MLP's backward pass written by hand, one ``jax.vjp`` per layer."""
  _, variables, x, _ = _setup('mlp')

  @jax.jit
  def layerwise(p, x):
    a0, back0 = jax.vjp(lambda h: _dense(p['Dense_0'], h), x)
    r0, back_relu0 = jax.vjp(jax.nn.relu, a0)
    a1, back1 = jax.vjp(lambda h: _dense(p['Dense_1'], h), r0)
    r1, back_relu1 = jax.vjp(jax.nn.relu, a1)
    h = r1 + r0
    out, back2 = jax.vjp(lambda h: _dense(p['Dense_2'], h), h)
    g_out = jax.grad(models.scalar)(out)
    g_h, = back2(g_out)
    g_a1, = back_relu1(g_h)
    g_r0, = back1(g_a1)
    g_a0, = back_relu0(g_r0 + g_h)
    return g_out, g_a1, g_a0

  g_out, g_a1, g_a0 = layerwise(variables['params'], x)
  _, grads = _kit_value_and_grad('mlp')  # the MLP case has no filter: every call
  got = grads['perturbations']
  np.testing.assert_allclose(got['Dense_2']['__call__'], g_out, **TOL)
  np.testing.assert_allclose(got['Dense_1']['__call__'], g_a1, **TOL)
  np.testing.assert_allclose(got['Dense_0']['__call__'], g_a0, **TOL)


def test_jit_equals_eager_and_traces_once():
  case, variables, x, key = _setup('mlp')
  vg = perturbkit.value_and_grad(models.loss_fn_for(case, case.model), has_aux=True)
  jitted = jax.jit(chex.assert_max_traces(vg, n=1))
  eager = vg(variables, x, key)
  chex.assert_trees_all_close(jitted(variables, x, key), eager, **TOL)
  chex.assert_trees_all_close(jitted(variables, 2 * x, key), vg(variables, 2 * x, key), **TOL)


def test_vmap_per_example_grads_equal_batched_rows():
  """The loss is a sum over examples, so each example's activation gradients are rows."""
  case, variables, x, key = _setup('mlp')
  loss_fn = lambda v, x: models.scalar(case.model.apply(v, x))
  _, batched = jax.jit(perturbkit.value_and_grad(loss_fn))(variables, x)
  _, per_example = jax.jit(jax.vmap(perturbkit.value_and_grad(loss_fn), in_axes=(None, 0)))(
      variables, x[:, None])
  chex.assert_trees_all_close(
      jax.tree.map(lambda g: g[:, 0], per_example['perturbations']),
      batched['perturbations'], **TOL)
  chex.assert_trees_all_close(jax.tree.map(lambda g: g.sum(0), per_example['params']),
                              batched['params'], rtol=1e-5, atol=1e-5)


def test_inside_outer_grad_matches_hand_hessian():
  """d/dx of |dL/d(Dense_1 out)|^2 through perturbkit equals the twin's, and the
  activation gradient's own derivative along a direction equals a Hessian product."""
  case, variables, x, key = _setup('mlp')
  model, hand = case.model, case.hand
  zeros = models.init(case, hand, x)['perturbations']

  def hand_point_grads(x):
    return jax.grad(lambda eps: models.scalar(hand.apply({**variables, 'perturbations': eps}, x)))(
        zeros)

  def kit_point_grads(x):
    return perturbkit.grad(lambda v, x: models.scalar(model.apply(v, x)))(variables, x)[
        'perturbations']

  chex.assert_trees_all_close(
      jax.jit(jax.grad(lambda x: jnp.sum(kit_point_grads(x)['Dense_1']['__call__'] ** 2)))(x),
      jax.jit(jax.grad(lambda x: jnp.sum(hand_point_grads(x)['Dense_1/__call__'] ** 2)))(x),
      **TOL)
  # The Hessian of the loss in the Dense_2 perturbation, from the twin, times a direction.
  direction = jax.random.normal(jax.random.key(5), x.shape)
  tangent = jax.jit(lambda f, x, v: jax.jvp(f, (x,), (v,))[1], static_argnums=0)
  kit_tangent = tangent(kit_point_grads, x, direction)
  hand_tangent = tangent(hand_point_grads, x, direction)
  chex.assert_trees_all_close(kit_tangent, models.nest(hand_tangent), **TOL)
  out_eps = zeros['Dense_2/__call__']
  hessian = jax.jit(jax.hessian(lambda e: models.scalar(hand.apply(
      {**variables, 'perturbations': {**zeros, 'Dense_2/__call__': e}}, x))))(out_eps)
  # Perturbing the input moves the Dense_2 output by J v; the gradient there moves by H J v.
  moved = tangent(lambda x: model.apply(variables, x), x, direction)
  np.testing.assert_allclose(kit_tangent['Dense_2']['__call__'],
                             jnp.einsum('abcd,cd->ab', hessian, moved), **TOL)


def test_shared_module_entries_sum_to_single_perturbation():
  case, variables, x, key = _setup('shared')
  _, grads = jax.jit(perturbkit.value_and_grad(models.loss_fn_for(case, case.model),
                                                has_aux=True))(variables, x, key)
  single = models.SharedDense(hand=True, single=True)
  zeros = models.init(case, single, x)['perturbations']
  want = jax.jit(jax.grad(lambda eps: models.scalar(
      single.apply({**variables, 'perturbations': eps}, x))))(zeros)
  got = grads['perturbations']['shared']
  np.testing.assert_allclose(got['__call__'] + got['__call__#1'], want['shared/__call__'], **TOL)
  # Each entry alone differs from the sum: the two calls really get separate points.
  assert float(jnp.abs(got['__call__#1']).max()) > 1e-2


@pytest.mark.parametrize('name', ['mlp', 'cnn_train', 'transformer_train', 'scan', 'remat'])
def test_a_loss_building_its_own_variables_gets_every_point(name):
  """A loss that hands ``apply`` only the collections it needs (``{'params': v['params'],
  'batch_stats': ...}``), as Flax training code often writes it, drops the perturbations it
  was given: each top-level ``apply`` gets them all the same (a PerturbationsNotAppliedError
  before). Against the hand-written ``self.perturb`` twin."""
  case, variables, x, key = _setup(name)
  plain = models.loss_fn_for(case, case.model)
  own = lambda v, x, key: plain({c: v[c] for c in ('params', *case.mutable)}, x, key)
  (loss, updates), grads = jax.jit(perturbkit.value_and_grad(own, filter=case.filter,
                                                              has_aux=True))(variables, x, key)
  (want_loss, want_updates), want = jax.jit(functools.partial(models.hand_value_and_grad, case))(
      variables, x, key)
  chex.assert_trees_all_close(loss, want_loss, **TOL)
  chex.assert_trees_all_close(updates, want_updates, **TOL)
  chex.assert_trees_all_close(grads, want, **TOL)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads['perturbations'])) > 1e-2


def test_model_run_twice_gets_distinct_points():
  case, variables, x, key = _setup('mlp')
  loss_fn = lambda v, x: (models.scalar(case.model.apply(v, x))
                          + 3.0 * models.scalar(case.model.apply(v, jnp.flip(x, 0))))
  _, grads = jax.jit(perturbkit.value_and_grad(loss_fn))(variables, x)
  zeros = models.init(case, case.hand, x)['perturbations']

  def hand_loss(e1, e2):
    return (models.scalar(case.hand.apply({**variables, 'perturbations': e1}, x))
            + 3.0 * models.scalar(case.hand.apply({**variables, 'perturbations': e2},
                                                  jnp.flip(x, 0))))

  g1, g2 = jax.jit(jax.grad(hand_loss, argnums=(0, 1)))(zeros, zeros)
  got = grads['perturbations']
  for layer in ('Dense_0', 'Dense_1', 'Dense_2'):
    np.testing.assert_allclose(got[layer]['__call__'], g1[f'{layer}/__call__'], **TOL)
    np.testing.assert_allclose(got[layer]['__call__#1'], g2[f'{layer}/__call__'], **TOL)


def test_method_argument():
  case, variables, x, key = _setup('setup_style')
  loss_fn = lambda v, x: models.scalar(case.model.apply(v, x, method='encode'))
  loss, grads = jax.jit(perturbkit.value_and_grad(loss_fn))(variables, x)
  zeros = jax.jit(functools.partial(models.AutoEncoder(hand=True).init, method='encode'))(
      jax.random.key(0), x)['perturbations']
  hand_loss = lambda p, eps: models.scalar(models.AutoEncoder(hand=True).apply(
      {'params': p, 'perturbations': eps}, x, method='encode'))
  want_loss, (g_params, g_points) = jax.jit(jax.value_and_grad(hand_loss, argnums=(0, 1)))(
      variables['params'], zeros)
  np.testing.assert_allclose(loss, want_loss, **TOL)
  chex.assert_trees_all_close(grads, {'params': g_params, 'perturbations': models.nest(g_points)},
                              **TOL)


def test_grad_equals_value_and_grad_and_return_activations():
  case, variables, x, key = _setup('mlp')
  loss_fn = lambda v, x: models.scalar(case.model.apply(v, x))
  loss, grads, acts = jax.jit(perturbkit.value_and_grad(loss_fn, return_activations=True))(
      variables, x)
  chex.assert_trees_all_close(jax.jit(perturbkit.grad(loss_fn))(variables, x), grads, **TOL)
  (want_loss, (_, state)) = jax.jit(lambda v, x: (loss_fn(v, x), case.model.apply(
      v, x, capture_intermediates=True, mutable=['intermediates'])))(variables, x)
  captured = jax.tree.map(lambda t: t[0], state['intermediates'],
                          is_leaf=lambda t: isinstance(t, tuple))
  captured.pop('__call__')
  chex.assert_trees_all_close(acts, captured, **TOL)
  np.testing.assert_allclose(loss, want_loss, **TOL)


def test_scan_per_iteration_grads_equal_unrolled_loop():
  case, variables, x, key = _setup('scan')
  _, grads = jax.jit(perturbkit.value_and_grad(
      lambda v, x: models.scalar(case.model.apply(v, x))))(variables, x)
  got = grads['perturbations']
  zeros = jax.tree.map(jnp.zeros_like, got)
  want_params, want_points = jax.jit(jax.grad(
      lambda p, eps: models.scalar(models.scanned_unrolled(p, x, eps)), argnums=(0, 1)))(
          variables['params'], zeros)
  chex.assert_trees_all_close(got, want_points, **TOL)
  chex.assert_trees_all_close(grads['params'], want_params, **TOL)
  per_iteration = got['scan']['Dense_0']['__call__']
  assert not np.allclose(per_iteration[0], per_iteration[-1], atol=1e-3)

  # Activations and inputs inside the scan come out per iteration too, stacked like the
  # gradients (they leave the scan with the perturbations it maps), against the loop.
  _, same, acts, inputs = jax.jit(perturbkit.value_and_grad(
      lambda v, x: models.scalar(case.model.apply(v, x)), return_activations=True,
      return_inputs=True))(variables, x)
  chex.assert_trees_all_close(same, grads, **TOL)
  p = variables['params']
  h = x @ p['Dense_0']['kernel'] + p['Dense_0']['bias'][None]
  cell, cell_in, cell_out = p['scan']['Dense_0'], [], []
  for i in range(cell['kernel'].shape[0]):
    cell_in.append(h)
    cell_out.append(h @ cell['kernel'][i] + cell['bias'][i][None])
    h = jnp.tanh(cell_out[-1])
  chex.assert_trees_all_close(acts['scan']['Dense_0']['__call__'], jnp.stack(cell_out), **TOL)
  chex.assert_trees_all_close(acts['scan']['__call__'], (jnp.tanh(jnp.stack(cell_out)),) * 2,
                              **TOL)
  chex.assert_trees_all_close(inputs['scan']['Dense_0']['__call__'],
                              ((jnp.stack(cell_in),), {}), **TOL)
  chex.assert_trees_all_close(acts['Dense_1']['__call__'], case.model.apply(variables, x), **TOL)
  # The cache, edits and patching per iteration: tests/test_interpret_scan.py.


def test_scan_without_mapped_perturbations_warns_and_keeps_other_points():
  model = models.Scanned(map_perturbations=False)
  x = jax.random.normal(jax.random.key(1), (3, 3))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  vg = perturbkit.value_and_grad(lambda v, x: models.scalar(model.apply(v, x)))
  with pytest.warns(perturbkit.UnperturbedCallsWarning, match='"perturbations": <axis>'):
    _, grads = jax.jit(vg)(variables, x)
  got = grads['perturbations']
  assert 'scan' not in got
  zeros = models.nest(
      jax.jit(models.Scanned(hand=True).init)(jax.random.key(0), x)['perturbations'])
  want_params, want_points = jax.jit(jax.grad(
      lambda p, eps: models.scalar(models.scanned_unrolled(p, x, eps)), argnums=(0, 1)))(
          variables['params'], zeros)
  chex.assert_trees_all_close(got['Dense_0'], want_points['Dense_0'], **TOL)
  chex.assert_trees_all_close(got['Dense_1'], want_points['Dense_1'], **TOL)
  chex.assert_trees_all_close(grads['params'], want_params, **TOL)


def test_only_calls_in_an_unmapped_scan_names_variable_axes_once_each():
  model = models.Scanned(map_perturbations=False)
  x = jax.random.normal(jax.random.key(1), (3, 3))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  vg = perturbkit.value_and_grad(lambda v, x: models.scalar(model.apply(v, x)),
                                 filter=perturbkit.filters.by_path('scan*'))
  with pytest.warns(perturbkit.UnperturbedCallsWarning):
    with pytest.raises(perturbkit.NoPerturbationPointsError,
                       match='"perturbations": 0` to its `variable_axes`') as error:
      vg(variables, x)
  assert str(error.value).count('scan/__call__') == 1


def test_pytree_outputs_with_int_leaves_pass_through():
  case, variables, x, key = _setup('pytree_outputs')
  loss_fn = lambda v, x: (models.scalar(case.model.apply(v, x)), case.model.apply(v, x)[1])
  (loss, indices), grads = jax.jit(perturbkit.value_and_grad(loss_fn, filter=case.filter,
                                                              has_aux=True))(variables, x)
  _, want_indices = jax.jit(case.model.apply)(variables, x)
  chex.assert_trees_all_equal(indices, want_indices)
  assert all(i.dtype == jnp.int32 for i in jax.tree.leaves(indices))
  points = grads['perturbations']
  assert points['TupleHead_0']['__call__'][1] is None
  # A user's node (here a flax.struct dataclass) is not rebuilt with None for its
  # int leaf: the point holds the tuple of its float leaves.
  assert isinstance(points['StructHead_0']['__call__'], tuple)
  assert len(points['StructHead_0']['__call__']) == 1


@pytest.mark.parametrize('remat', [False, True])
def test_apply_with_every_collection_mutable_returns_only_the_callers_collections(remat):
  """``apply(..., mutable=True)`` in the loss returns every collection of the variables it is
  given; perturbkit's zero perturbations are not among them, so the mutated collections (here
  BatchNorm's statistics and the params) equal those of the loss run without perturbkit and
  can be merged into a train state as they are. Also through ``run_with_cache`` inside
  ``nn.remat``, where the apply is replayed to carry the captures out."""
  model = models.RematNorm(remat=remat)
  x = jax.random.normal(jax.random.key(1), (5, 3))
  variables = jax.jit(model.init)(jax.random.key(0), x)

  def loss_fn(variables, x):
    out, updates = model.apply(variables, x, mutable=True)
    return jnp.sum(out ** 2), updates

  want = jax.jit(loss_fn)(variables, x)
  assert set(want[1]) == {'params', 'batch_stats'}
  got, grads = jax.jit(perturbkit.value_and_grad(loss_fn, has_aux=True))(variables, x)
  chex.assert_trees_all_close(got, want, **TOL)
  assert float(jnp.abs(grads['perturbations']['Dense_0']['__call__']).max()) > 1e-3
  (out, updates), _ = jax.jit(perturbkit.run_with_cache(
      lambda v, x: model.apply(v, x, mutable=True)))(variables, x)
  chex.assert_trees_all_close((out, updates), jax.jit(functools.partial(
      model.apply, mutable=True))(variables, x), **TOL)


class TanhBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.tanh(nn.Dense(4)(x))


class CalledTwice(nn.Module):
  """One block called twice, wrapped in a lifted transform (``None``: unwrapped)."""
  wrap: str | None = None

  @nn.compact
  def __call__(self, x):
    block = {None: TanhBlock, 'remat': nn.remat(TanhBlock), 'jit': nn.jit(TanhBlock),
             'vmap': nn.vmap(TanhBlock, variable_axes={'params': None, 'perturbations': 0},
                             split_rngs={'params': False})}[self.wrap](name='block')
    return block(1.5 * block(x))


@pytest.mark.parametrize('wrap', ['remat', 'jit', 'vmap'])
def test_a_lifted_module_called_twice_gets_a_point_per_call(wrap):
  """As the unwrapped twin with explicit deltas: not one point with both calls' sum (which
  ``nn.jit``, reusing the first call's trace for the second, gave), and an edit of the second
  call's Dense edits that call alone."""
  x = jax.random.normal(jax.random.key(1), (3, 4))
  variables = jax.jit(CalledTwice().init)(jax.random.key(0), x)
  loss_of = lambda model: lambda v, x: jnp.sum(jnp.sin(model.apply(v, x)))
  _, grads = jax.jit(perturbkit.value_and_grad(loss_of(CalledTwice(wrap))))(variables, x)
  shapes = points_of(loss_of(CalledTwice()), variables, x)

  def with_deltas(deltas):
    with explicit_deltas(deltas):
      return loss_of(CalledTwice())(variables, x)
  want = jax.jit(jax.grad(with_deltas))(zeros(shapes))
  assert len(want) == 4  # block and its Dense, each called twice
  for name, (g,) in want.items():
    np.testing.assert_allclose(at(grads['perturbations'], name), g, **TOL)
  first, second = want[('block', '__call__')][0], want[('block', '__call__#1')][0]
  assert float(jnp.abs(first - second).max()) > 1e-2
  if wrap == 'vmap':
    return  # its calls are edited per member ('block/__call__[0]'): test_interpret.py
  delta = jnp.full((3, 4), 0.3)
  edited = jax.jit(perturbkit.run_with_edits(loss_of(CalledTwice(wrap))))(
      variables, {'block/Dense_0/__call__#1': perturbkit.interpret.add(delta)}, x)
  deltas = {**zeros(shapes), ('block', 'Dense_0', '__call__#1'): [delta]}
  np.testing.assert_allclose(edited, jax.jit(with_deltas)(deltas), **TOL)


def test_super_call_inside_a_dense_subclass_is_part_of_its_call():
  """A LoRA ``nn.Dense`` whose ``__call__`` runs ``super().__call__``: one point per layer, its
  output, as NNX gives (the inner call used to be a point ``'__call__#1'`` of its own, and a
  hook on the layer ran twice on it), against a hand-written explicit-delta twin."""
  model = models.LoRANet()
  x = jax.random.normal(jax.random.key(1), (4, 3))
  y = jax.random.normal(jax.random.key(2), (4, 2))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  loss = lambda v, x: jnp.mean((model.apply(v, x) - y) ** 2)
  _, grads = jax.jit(perturbkit.value_and_grad(loss))(variables, x)

  def twin(params, deltas, scale=1.0):
    out_scale = lambda h: h * scale + jax.lax.stop_gradient(h * (1 - scale))  # a 'scale' hook
    h = jnp.tanh(hand_lora.lora(params['hidden'], x) + deltas['hidden'])
    return jnp.mean((out_scale(hand_lora.lora(params['head'], h) + deltas['head']) - y) ** 2)

  deltas = {'hidden': jnp.zeros((4, 6)), 'head': jnp.zeros((4, 2))}
  want = jax.jit(jax.grad(twin, argnums=(0, 1)))(variables['params'], deltas)
  chex.assert_trees_all_close(grads['perturbations'],
                              {k: {'__call__': v} for k, v in want[1].items()}, **TOL)
  chex.assert_trees_all_close(grads['params'], want[0], **TOL)
  double = perturbkit.backward_hook(lambda g: 2 * g, perturbkit.filters.by_path('head'))
  hooked = jax.jit(jax.grad(perturbkit.with_hooks(loss, double)))(variables, x)
  chex.assert_trees_all_close(hooked['params'],
                              jax.jit(jax.grad(twin), static_argnums=2)(variables['params'],
                                                                        deltas, 2.0), **TOL)


@pytest.mark.parametrize('switch,nested,remat', [(False, False, False), (True, True, True)])
def test_calls_in_branches_get_one_point_per_call_of_the_model(switch, nested, remat):
  """A Dense (under ``nn.remat``) called before, in the branches of two ``nn.cond``
  (``nn.switch``) in a row and after them: four points, the branches of one conditional
  sharing one, each equal to the gradient of its explicit delta in the branch that ran (not
  the sum of calls that share a key with one outside, nor a point for the branch function
  itself), and its output there."""
  model = models.BranchesAround(switch=switch, nested=nested, remat=remat)
  x = jax.random.normal(jax.random.key(1), (2, 4))
  deltas = [jnp.zeros((2, 4))] * 4
  variables = jax.jit(model.init)(jax.random.key(0), x, jnp.array(True), deltas)
  params = variables['params']['block'] if nested else variables['params']
  dense = lambda h: nn.Dense(4).apply({'params': params['a']}, h)
  loss = lambda v, x, d, pred: jnp.sum(jnp.sin(model.apply(v, x, pred, d)))
  # The predicate is an argument: one compile of each for both branches.
  kit = jax.jit(perturbkit.value_and_grad(loss, return_activations=True))
  reference = jax.jit(jax.grad(loss, argnums=2))
  for pred in (jnp.array(True), jnp.array(False)):
    _, grads, acts = kit(variables, x, deltas, pred)
    want = reference(variables, x, deltas, pred)
    got = grads['perturbations']['block'] if nested else grads['perturbations']
    assert list(got['a']) == ['__call__', '__call__#1', '__call__#2', '__call__#3']
    assert set(got) == ({'a', '__call__'} if nested else {'a'})  # the block's own call
    plain = bool(pred) != switch  # nn.switch's branch 1 (pred True) doubles
    outputs = [dense(x)]
    h = outputs[0]
    for _ in range(2):
      outputs.append(dense(h if plain else -h))
      h = outputs[-1] if plain else 2.0 * outputs[-1]
    outputs.append(dense(h))
    acts = acts['block'] if nested else acts
    for i, key in enumerate(got['a']):
      np.testing.assert_allclose(got['a'][key], want[i], **TOL)
      np.testing.assert_allclose(acts['a'][key], outputs[i], **TOL)


def test_a_module_closed_over_by_both_branches_gets_a_point_per_branch():
  """A Dense made outside ``nn.cond`` and called by both branches (bound to the module's
  own scope, not the branch's copy) reads the perturbations from outside the conditional:
  each branch's call has its own point, the one that ran its explicit delta's gradient and
  the other exactly zero. Its output inside the branch cannot come out: a named error, not
  a tracer leaked out of the branch."""

  class ClosedOver(nn.Module):
    @nn.compact
    def __call__(self, x, pred, deltas):
      dense = nn.Dense(3, name='d')
      h = dense(x)
      return nn.cond(pred, lambda m, h: dense(h) + deltas[0], lambda m, h: -dense(h), self, h)

  x = jax.random.normal(jax.random.key(1), (2, 3))
  model, zero = ClosedOver(), [jnp.zeros((2, 3))]
  variables = jax.jit(model.init, static_argnums=2)(jax.random.key(0), x, True, zero)
  loss = lambda v, x, d: jnp.sum(jnp.sin(model.apply(v, x, jnp.array(True), d)))
  _, grads = jax.jit(perturbkit.value_and_grad(loss))(variables, x, zero)
  got = grads['perturbations']['d']
  assert list(got) == ['__call__', '__call__#1', '__call__#2']
  np.testing.assert_allclose(got['__call__#1'],
                             jax.jit(jax.grad(loss, argnums=2))(variables, x, zero)[0], **TOL)
  assert float(jnp.abs(got['__call__#1']).max()) > 1e-2
  np.testing.assert_array_equal(got['__call__#2'], 0.0)
  with pytest.raises(perturbkit.ActivationsUnavailableError, match=r'd/__call__#1.*nn.cond'):
    perturbkit.value_and_grad(loss, return_activations=True)(variables, x, zero)


def test_a_switch_right_after_another_with_new_branch_functions_is_a_named_error():
  """Branch functions made anew for each ``nn.switch`` in a loop: nothing tells the second
  switch from more branches of the first, whose points it would share; a named error says
  so. The functions made once, or a call of the model between the two (under ``nn.remat``),
  give each its own points, equal to the explicit-delta twin's gradients."""

  class Looped(nn.Module):
    once: bool = False
    between: bool = False

    def setup(self):
      self.a, self.r = nn.Dense(3), nn.remat(nn.Dense)(3)

    def __call__(self, x, index):
      made = [lambda m, h: m.a(h), lambda m, h: -m.a(h)]
      for _ in range(2):
        branches = made if self.once else [lambda m, h: m.a(h), lambda m, h: -m.a(h)]
        x = nn.switch(index, branches, self, x)
        x = self.r(x) if self.between else x
      return x

  x = jax.random.normal(jax.random.key(1), (2, 3))
  variables = jax.jit(Looped(between=True).init, static_argnums=2)(jax.random.key(0), x, 0)
  loss_of = lambda model: lambda v, x: jnp.sum(jnp.sin(model.apply(v, x, jnp.int32(1))))
  with pytest.raises(perturbkit.BranchesUnseparatedError,
                     match=r"a/__call__.*nn.switch.*same ones to every nn.switch.*by_path\('a'\)"):
    perturbkit.value_and_grad(loss_of(Looped()))(variables, x)
  with pytest.raises(perturbkit.BranchesUnseparatedError):
    perturbkit.wrap(Looped()).init(jax.random.key(0), x, 0)
  dense = lambda name, h: nn.Dense(3).apply({'params': variables['params'][name]}, h)
  for between in (False, True):
    _, grads = jax.jit(perturbkit.value_and_grad(loss_of(Looped(not between, between))))(
        variables, x)

    def twin(deltas, between=between):  # branch 1 twice, a delta after each call of `a`
      h = x
      for delta in deltas:
        h = -(dense('a', h) + delta)
        h = dense('r', h) if between else h
      return jnp.sum(jnp.sin(h))
    want = jax.jit(jax.grad(twin))([jnp.zeros((2, 3))] * 2)
    np.testing.assert_allclose(grads['perturbations']['a']['__call__'], want[0], **TOL)
    np.testing.assert_allclose(grads['perturbations']['a']['__call__#1'], want[1], **TOL)


def test_an_nnx_block_through_the_bridge_is_one_call_with_its_gradient():
  """``nnx.bridge.ToLinen`` runs an NNX block as one Linen call: its point's gradient equals
  ``jax.grad`` at a ``+ delta`` written after the block in a twin of the model, and the params'
  gradients equal ``jax.grad``'s. Flax warns that the block's scope holds a variable the NNX
  block does not have (the point's zero, which ToLinen hands over with every collection)."""
  from flax.nnx import bridge
  from test_interleaved import NNXBlock, WithNNXBlock, mse

  class Twin(nn.Module):
    @nn.compact
    def __call__(self, x, delta):
      h = bridge.ToLinen(NNXBlock, args=(4,))(nn.Dense(4)(x)) + delta
      return nn.Dense(2)(h)

  model = WithNNXBlock()
  x = jax.random.normal(jax.random.key(6), (5, 3))
  y = jax.random.normal(jax.random.key(7), (5, 2))
  v = jax.jit(model.init)(jax.random.key(0), x)

  @jax.jit
  def by_hand(v, x, y):
    loss = lambda p, delta: jnp.mean((Twin().apply({'params': p}, x, delta) - y) ** 2)
    return jax.grad(loss, argnums=(0, 1))(v['params'], jnp.zeros((5, 4)))

  want_params, want_point = by_hand(v, x, y)
  with pytest.warns(UserWarning, match='Found unknown module paths in incoming state'):
    _, grads = jax.jit(perturbkit.value_and_grad(mse(model)))(v, x, y)
  chex.assert_trees_all_close(grads['params'], want_params, **TOL)
  chex.assert_trees_all_close(grads['perturbations']['ToLinen_0']['__call__'], want_point, **TOL)
  assert float(jnp.abs(want_point).max()) > 1e-2
  assert set(grads['perturbations']) == {'Dense_0', 'ToLinen_0', 'Dense_1'}
