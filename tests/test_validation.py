"""Numeric options are checked where they are given; DP-SGD keys must be JAX keys.

Every public function with a numeric option raises ``InvalidOptionError`` (a
``ValueError``) when it is called with a value outside the option's range, naming
the option, the value and the range, before anything is traced. NumPy and 0-d
JAX scalars are accepted; a traced option (computed under ``jax.jit``) passes.
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
import perturbkit

BAD_POSITIVE = [0.0, -1.0, math.nan, math.inf, True, 'one', jnp.ones(2)]
BAD_NON_NEGATIVE = [-1.0, -1e-9, math.nan, math.inf, False]
BAD_FRACTION = [1.0, 1.5, -0.1, math.nan]
BAD_COUNT = [0, -3, 2.0, 2.5, True, math.nan]


@pytest.fixture(scope='module')
def mlp():
  model = models.MLP(out=3)
  x = jax.random.normal(jax.random.key(0), (4, 5))
  y = jnp.arange(4) % 3
  variables = model.init(jax.random.key(1), x)
  loss_fn = lambda v, x, y: optax.softmax_cross_entropy_with_integer_labels(
      model.apply(v, x), y).mean()
  return model, variables, loss_fn, x, y


@pytest.fixture(scope='module')
def layers():
  model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(3)])
  x = jnp.ones((4, 5))
  variables = model.init(jax.random.key(0), x)
  return perturbkit.kfac_layers(lambda v, x: model.apply(v, x), variables, x)


@pytest.fixture(scope='module')
def nnx_layers():
  model = nnx.Sequential(nnx.Linear(5, 4, rngs=nnx.Rngs(0)), nnx.relu,
                         nnx.Linear(4, 3, rngs=nnx.Rngs(1)))
  return perturbkit.nnx.kfac_layers(model, jnp.ones((4, 5)))


def raises_invalid(name, value):
  shown = repr(value) if isinstance(value, (float, int, str)) else ''
  return pytest.raises(perturbkit.InvalidOptionError, match=f'{name}={shown}')


@pytest.mark.parametrize('value', BAD_POSITIVE)
def test_clip_norm(mlp, value):
  loss_fn = mlp[2]
  with raises_invalid('clip_norm', value):
    perturbkit.private_grad(loss_fn, clip_norm=value, noise_multiplier=1.0)
  with raises_invalid('clip_norm', value):
    perturbkit.dp_sgd(loss_fn, optax.sgd(0.1), clip_norm=value, noise_multiplier=1.0)


@pytest.mark.parametrize('value', BAD_NON_NEGATIVE)
def test_noise_multiplier(mlp, value):
  loss_fn = mlp[2]
  with raises_invalid('noise_multiplier', value):
    perturbkit.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=value)
  with raises_invalid('noise_multiplier', value):
    perturbkit.dp_sgd(loss_fn, optax.sgd(0.1), clip_norm=1.0, noise_multiplier=value)


def test_the_message_names_the_range(mlp):
  with pytest.raises(ValueError, match=r'clip_norm=-1\.0 .* must be a finite number > 0'):
    perturbkit.private_grad(mlp[2], clip_norm=-1.0, noise_multiplier=1.0)


def test_numpy_jax_and_traced_scalars_are_accepted(mlp):
  _, variables, loss_fn, x, y = mlp
  key = jax.random.key(3)
  want, _ = jax.jit(perturbkit.private_grad(loss_fn, clip_norm=0.5, noise_multiplier=0.0))(
      variables, key, x, y)
  for clip in (np.float32(0.5), jnp.asarray(0.5), np.float64(0.5)):
    grads, _ = jax.jit(perturbkit.private_grad(loss_fn, clip_norm=clip,
                                               noise_multiplier=np.int32(0)))(
        variables, key, x, y)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 grads, want)

  @jax.jit
  def traced(clip):  # a clip norm computed under jit cannot be checked, and is not refused
    return perturbkit.private_grad(loss_fn, clip_norm=clip, noise_multiplier=0.0)(
        variables, key, x, y)[0]

  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               traced(0.5), want)


@pytest.mark.parametrize('name', ['damping', 'norm_constraint'])
@pytest.mark.parametrize('value', BAD_POSITIVE)
def test_positive_preconditioner_options(layers, nnx_layers, name, value):
  with raises_invalid(name, value):
    perturbkit.kfac_preconditioner(layers, **{name: value})
  with raises_invalid(name, value):
    perturbkit.nnx.kfac_preconditioner(nnx_layers, **{name: value})


@pytest.mark.parametrize('value', BAD_POSITIVE)
def test_damping(layers, value):
  with raises_invalid('damping', value):
    perturbkit.kfac_segment(layers.layers['layers_0'], damping=value)
  if not isinstance(value, str):
    with raises_invalid('damping', value):
      perturbkit.damped_inverse(jnp.eye(2), value)


@pytest.mark.parametrize('value', BAD_POSITIVE)
def test_gaussian_variance(value):
  with raises_invalid('variance', value):
    perturbkit.gaussian_output(value)


def test_gaussian_variance_in_range_is_the_scaled_squared_error():
  nll = perturbkit.gaussian_output(np.float32(0.25)).nll(jnp.array([[1.0, 3.0]]), jnp.zeros((1, 2)))
  np.testing.assert_allclose(nll, [(1.0 + 9.0) / (2 * 0.25)], rtol=1e-6)


def test_damped_inverse_takes_a_traced_damping():
  factor = jnp.diag(jnp.array([1.0, 3.0]))
  got = jax.jit(perturbkit.damped_inverse)(factor, 1.0)
  np.testing.assert_allclose(jnp.diagonal(got), [0.5, 0.25], rtol=1e-6)
  # A nested list failed with AttributeError (it has no .ndim).
  np.testing.assert_allclose(perturbkit.damped_inverse([[1.0, 0.0], [0.0, 3.0]], np.float32(1.0)),
                             got, rtol=1e-6)


def test_damped_inverse_keeps_the_factors_dtype_whatever_the_dampings():
  """With jax_enable_x64 a NumPy float64 damping promoted a float32 factor's inverse to
  float64; integer factors (a nested list of ints) are inverted in the default float dtype.
  The reference is numpy's inverse."""
  factor = np.array([[2.0, 1.0], [1.0, 3.0]])
  with jax.enable_x64(True):
    for dtype in (np.float32, np.float64):
      for damping in (np.float64(0.5), np.float32(0.5), 0.5, jnp.asarray(0.5, jnp.float64)):
        got = perturbkit.damped_inverse(jnp.asarray(factor, dtype), damping)
        assert got.dtype == dtype, (dtype, type(damping), got.dtype)
        np.testing.assert_allclose(got, np.linalg.inv(factor + 0.5 * np.eye(2)), rtol=1e-6)
      vector = perturbkit.damped_inverse(jnp.asarray([1.0, 3.0], dtype), np.float64(1.0))
      assert vector.dtype == dtype
  got = perturbkit.damped_inverse([[2, 1], [1, 3]], 0.5)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, np.linalg.inv(factor + 0.5 * np.eye(2)), rtol=1e-6)


def test_damped_inverse_of_a_factor_rounded_below_minus_the_damping_is_finite():
  """A PSD factor of rank 7 in 8 dimensions with entries ~1e4 (the ``G`` of a layer whose
  output is L2-normalized, such as a dual encoder's projection), formed in float32: its
  rounding (~eps·|F| > damping) makes ``F + λI`` indefinite, and Cholesky gave NaN. The
  inverse is now that of F with its eigenvalues clamped at 0: finite, symmetric, at most
  ``1/λ``; on a diagonal factor with one such eigenvalue, numpy's inverse of the clamped one."""
  rng = np.random.default_rng(0)
  m = jnp.asarray(100 * rng.standard_normal((8, 7)), jnp.float32)
  got = np.asarray(jax.jit(perturbkit.damped_inverse)(m @ m.T, 1e-3), np.float64)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, got.T, rtol=0, atol=0)
  values = np.linalg.eigvalsh(got)
  assert values.max() <= 1e3 * (1 + 1e-4) and values.min() > -1e-3 * values.max()
  diagonal = jnp.diag(jnp.array([4e4, 1e2, -1e-2], jnp.float32))
  np.testing.assert_allclose(jax.jit(perturbkit.damped_inverse)(diagonal, 1e-3),
                             np.linalg.inv(np.diag([4e4, 1e2, 0.0]) + 1e-3 * np.eye(3)),
                             rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize('value', BAD_FRACTION)
def test_decay(layers, nnx_layers, value):
  with raises_invalid('decay', value):
    perturbkit.kfac_preconditioner(layers, decay=value)
  with raises_invalid('decay', value):
    perturbkit.nnx.kfac_preconditioner(nnx_layers, decay=value)
  with raises_invalid('decay', value):
    perturbkit.kfac_segment(layers.layers['layers_0'], decay=value)


@pytest.mark.parametrize('name', ['inverse_every', 'stats_every'])
@pytest.mark.parametrize('value', BAD_COUNT)
def test_counts(layers, nnx_layers, name, value):
  with raises_invalid(name, value):
    perturbkit.kfac_preconditioner(layers, **{name: value})
  with raises_invalid(name, value):
    perturbkit.nnx.kfac_preconditioner(nnx_layers, **{name: value})
  with raises_invalid(name, value):
    perturbkit.kfac_segment(layers.layers['layers_0'], **{name: value})


def test_kfac_options_in_range_are_accepted(layers):
  perturbkit.kfac_preconditioner(layers, damping=np.float32(1e-3), decay=0.0,
                                 inverse_every=np.int64(3), stats_every=1,
                                 norm_constraint=np.float32(1e-2))


@pytest.mark.parametrize('value', BAD_POSITIVE)
def test_clip_global_norm(mlp, value):
  loss_fn = mlp[2]
  with raises_invalid('clip_global_norm', value):
    perturbkit.interleaved(loss_fn, optax.sgd(0.1), clip_global_norm=value)
  nnx_loss = lambda model, x: jnp.mean(model(x) ** 2)
  with raises_invalid('clip_global_norm', value):
    perturbkit.nnx.interleaved(nnx_loss, optax.sgd(0.1), clip_global_norm=value)
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  with raises_invalid('clip_global_norm', value):
    perturbkit.nnx.InterleavedOptimizer(model, optax.sgd(0.1), nnx_loss, jnp.ones((3, 2)),
                                        clip_global_norm=value)


@pytest.mark.parametrize('value', [0, -1, 1.5, 2.0])
def test_segments_depth(mlp, value):
  with raises_invalid('segments', value):
    perturbkit.interleaved(mlp[2], optax.sgd(0.1), segments=value)
  with raises_invalid('segments', value):
    perturbkit.nnx.interleaved(lambda m, x: jnp.mean(m(x)), optax.sgd(0.1), segments=value)


@pytest.mark.parametrize('option,value', [
    *(('propagate', v) for v in ['new', None, 1]),
    *(('segments', v) for v in ['Dense_0', ['Dense_0'], True, jnp.asarray(2)]),
])
def test_interleaved_options_are_checked_by_every_factory(mlp, option, value):
  """propagate, and segments that are neither a depth nor a filter, in the three factories."""
  nnx_loss = lambda model, x: jnp.mean(model(x) ** 2)
  with raises_invalid(option, value):
    perturbkit.interleaved(mlp[2], optax.sgd(0.1), **{option: value})
  with raises_invalid(option, value):
    perturbkit.nnx.interleaved(nnx_loss, optax.sgd(0.1), **{option: value})
  with raises_invalid(option, value):
    perturbkit.nnx.InterleavedOptimizer(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), optax.sgd(0.1),
                                        nnx_loss, jnp.ones((3, 2)), **{option: value})


def test_a_numpy_depth_is_the_int_depth(mlp):
  _, variables, loss_fn, x, y = mlp
  want = perturbkit.interleaved(loss_fn, optax.sgd(0.1), segments=1).segments(variables, x, y)
  got = perturbkit.interleaved(loss_fn, optax.sgd(0.1), segments=np.int64(1)).segments(
      variables, x, y)
  assert got == want and want.segments


@pytest.mark.parametrize('name', ['rtol', 'atol'])
def test_check_per_example_tolerances(name):
  with raises_invalid(name, -1.0):
    perturbkit.check_per_example(lambda v, x: jnp.mean(v * x), 1.0, jnp.ones(3),
                                 **{name: -1.0})


@pytest.mark.parametrize('key', [3, np.int32(3), jnp.int32(3), jnp.zeros(2, jnp.int32)])
def test_integer_key_is_refused(mlp, key):
  model, variables, loss_fn, x, y = mlp
  dp = perturbkit.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=1.0)
  with pytest.raises(perturbkit.PRNGKeyError, match=r'jax\.random\.key\(seed\)'):
    dp(variables, key, x, y)
  with pytest.raises(perturbkit.PRNGKeyError, match=r'jax\.random\.key\(seed\)'):
    jax.jit(dp)(variables, key, x, y)
  tx = perturbkit.dp_sgd(loss_fn, optax.sgd(0.1), clip_norm=1.0, noise_multiplier=1.0)
  with pytest.raises(perturbkit.PRNGKeyError):
    tx.step(tx.init(variables), key, x, y)


def test_typed_and_raw_keys_draw_the_same_noise(mlp):
  _, variables, loss_fn, x, y = mlp
  dp = jax.jit(perturbkit.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=1.0))
  typed, _ = dp(variables, jax.random.key(5), x, y)
  raw, _ = dp(variables, jax.random.PRNGKey(5), x, y)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), typed, raw)


BAD_STATIC_COUNT = [0, -3, 2.0, True, np.bool_(True), jnp.asarray(3), 'x']


@pytest.mark.parametrize('value', BAD_STATIC_COUNT)
def test_sizes_and_steps_are_python_ints(value):
  """A bool is no batch size (True was taken for 1), a JAX array no number of steps (a traced
  one failed deep in the quadrature): both are refused where they are given."""
  fn = lambda v, x: 0.0
  for function in (perturbkit.activation_patching, perturbkit.layer_integrated_gradients,
                   perturbkit.nnx.activation_patching):
    with raises_invalid('batch_size', value):
      function(fn, batch_size=value)
  with raises_invalid('steps', value):
    perturbkit.layer_integrated_gradients(fn, steps=value)
  with raises_invalid('max_depth', value):
    perturbkit.filters.by_depth(value)
  with raises_invalid('min_depth', value):
    perturbkit.nnx.filters.by_depth(3, min_depth=value)


def test_traced_steps_are_refused_where_given():
  with pytest.raises(perturbkit.InvalidOptionError, match='a Python int >= 1'):
    jax.jit(lambda s: perturbkit.layer_integrated_gradients(lambda v, x: 0.0, steps=s))(3)
  perturbkit.layer_integrated_gradients(lambda v, x: 0.0, steps=np.int64(3), batch_size=None)


@pytest.mark.parametrize('value', [1.5, True, 'x', jnp.asarray(1)])
def test_edit_axes_are_ints(value):
  for make in (perturbkit.interpret.replace, perturbkit.interpret.add,
               perturbkit.interpret.scale):
    with raises_invalid('axis', value):
      make(jnp.zeros(3), positions=[0], axis=value)
  with raises_invalid('axis', value):
    perturbkit.interpret.zero_ablate(positions=[0], axis=value)
  with raises_invalid('axis', value):
    perturbkit.interpret.gates('Dense_0/__call__', (3,), positions=[0], axis=value)
  with raises_invalid('over', value):
    perturbkit.interpret.mean_ablate(jnp.zeros((2, 3)), over=value)
  with raises_invalid('over', (0, value)):
    perturbkit.interpret.mean_ablate(jnp.zeros((2, 3)), over=(0, value))


def test_edit_axes_in_range_are_accepted():
  edit = perturbkit.interpret.replace(jnp.zeros(2), positions=[-1], axis=np.int64(-2))
  got = perturbkit.interpret.apply_edit(edit, jnp.ones((1, 3, 2)))
  np.testing.assert_array_equal(got, [[[1, 1], [1, 1], [0, 0]]])
  perturbkit.interpret.mean_ablate(jnp.zeros((2, 3)), over=(0, np.int32(1)))


@pytest.mark.parametrize('value', [['a'], 'a'])
def test_edit_positions_that_are_strings(value):
  with raises_invalid('positions', value):
    perturbkit.interpret.replace(jnp.zeros(3), positions=value, axis=1)


@pytest.mark.parametrize('value', [math.nan, math.inf, -math.inf, True, 'x', jnp.ones(2)])
def test_gate_init_logit(value):
  with raises_invalid('init_logit', value):
    perturbkit.interpret.gates('Dense_0/__call__', (3,), init_logit=value)


PER_EXAMPLE_FACTORIES = {
    'per_example_grad_norms': lambda loss_fn, **o: perturbkit.per_example_grad_norms(loss_fn, **o),
    'private_grad': lambda loss_fn, **o: perturbkit.private_grad(
        loss_fn, clip_norm=1.0, noise_multiplier=1.0, **o),
    'dp_sgd': lambda loss_fn, **o: perturbkit.dp_sgd(
        loss_fn, optax.sgd(0.1), clip_norm=1.0, noise_multiplier=1.0, **o),
    'nnx.per_example_grad_norms': lambda loss_fn, **o: perturbkit.nnx.per_example_grad_norms(
        loss_fn, **o),
    'nnx.dp_sgd': lambda loss_fn, **o: perturbkit.nnx.dp_sgd(
        loss_fn, optax.sgd(0.1), clip_norm=1.0, noise_multiplier=1.0, **o),
    'check_per_example': lambda loss_fn, **o: perturbkit.check_per_example(
        loss_fn, 1.0, jnp.ones(3), **o),
}


@pytest.mark.parametrize('option,value', [
    *(('batch_axes', v) for v in [1.5, True, 'x', (0, 1.5), (0, False), jnp.asarray(0)]),
    *(('dense_method', v) for v in ['fast', None, 0]),
])
def test_per_example_options_are_checked_where_given(option, value):
  """Every per-example factory checks batch_axes and dense_method when it is made (where it
  takes them: check_per_example has no dense_method)."""
  loss_fn = lambda v, x: jnp.mean(v * x)
  for name, factory in PER_EXAMPLE_FACTORIES.items():
    if option == 'dense_method' and name == 'check_per_example':
      continue
    with raises_invalid(option, value):
      factory(loss_fn, **{option: value})


@pytest.mark.parametrize('value', ['max', None])
def test_check_per_example_reduction(value):
  """An unknown reduction was only looked at after the check ran (a per-example loss was then
  reported as mixing its examples)."""
  with raises_invalid('reduction', value):
    perturbkit.check_per_example(lambda v, x: jnp.mean(v * x), 1.0, jnp.ones(3),
                                 reduction=value)
  with raises_invalid('reduction', value):
    perturbkit.nnx.check_per_example(lambda m, x: jnp.mean(m(x)),
                                     nnx.Linear(1, 1, rngs=nnx.Rngs(0)), jnp.ones((3, 1)),
                                     reduction=value)


FLAG_FACTORIES = {
    'interleaved': lambda **o: perturbkit.interleaved(lambda v, x: 0.0, optax.sgd(0.1), **o),
    'nnx.interleaved': lambda **o: perturbkit.nnx.interleaved(
        lambda m, x: jnp.mean(m(x)), optax.sgd(0.1), **o),
    'nnx.InterleavedOptimizer': lambda **o: perturbkit.nnx.InterleavedOptimizer(
        nnx.Linear(2, 1, rngs=nnx.Rngs(0)), optax.sgd(0.1), lambda m, x: jnp.mean(m(x)),
        jnp.ones((3, 2)), **o),
}


@pytest.mark.parametrize('name', sorted(FLAG_FACTORIES))
@pytest.mark.parametrize('option', ['has_aux', 'skip_nonfinite'])
@pytest.mark.parametrize('value', ['no', None])
def test_interleaved_flags_are_bools(name, option, value):
  """``skip_nonfinite='no'`` was read as true (non-finite updates were still skipped), and
  ``has_aux='no'`` failed only in the step, saying the loss returned no pair."""
  with raises_invalid(option, value):
    FLAG_FACTORIES[name](**{option: value})


def test_other_flags_are_bools(layers, nnx_layers):
  """``grads='no'`` computed the gradients, ``return_inputs='no'`` cached the inputs,
  ``strict='no'`` was strict and K-FAC's ``has_aux='no'`` failed only in the estimate."""
  metric = lambda v, x: jnp.sum(x)
  for front in (perturbkit, perturbkit.nnx):
    for option in ('grads', 'return_inputs'):
      with raises_invalid(option, 'no'):
        front.run_with_cache(metric, **{option: 'no'})
  with raises_invalid('has_aux', 'no'):
    perturbkit.kfac_estimator(lambda v, x: x, perturbkit.categorical_output(), layers,
                              has_aux='no')
  with raises_invalid('has_aux', 'no'):
    perturbkit.nnx.kfac_estimator(perturbkit.categorical_output(), nnx_layers, has_aux='no')
  with raises_invalid('strict', 'no'):
    perturbkit.wrap(nn.Dense(2), strict='no')


@pytest.mark.parametrize('value', [(-1,), 3, (2.0,), (True,)])
def test_intervention_shapes(value):
  """A negative or float size failed inside jnp.zeros with JAX's TypeError."""
  interpret = perturbkit.interpret
  for make in (interpret.gates, interpret.steering_vector):
    with raises_invalid('shape', value):
      make('Dense_0/__call__', value)


def test_intervention_options_and_edits_are_checked_where_given():
  """A dtype that is no floating dtype, a path that is no string, an intervention whose
  functions take other arguments, a list for the dict, a mask that is no array, repeated axes
  and an apply_edit of something that is no edit failed with raw errors (some only in the
  run)."""
  interpret = perturbkit.interpret
  for dtype in (jnp.int32, 'floot'):
    with raises_invalid('dtype', dtype):
      interpret.steering_vector('Dense_0/__call__', (3,), dtype=dtype)
  with raises_invalid('path', 3):
    interpret.gates(3, (3,))
  one_argument = interpret.Intervention('Dense_0/__call__', lambda: 0.0, lambda output: output)
  with pytest.raises(perturbkit.NotInterventionsError, match=r"apply of 'a' .*\(params, output\)"):
    interpret.run_with_interventions(lambda v, x: x, {'a': one_argument})
  with pytest.raises(perturbkit.NotInterventionsError, match='dict of named interventions'):
    interpret.init_interventions([interpret.gates('Dense_0/__call__', (3,))])
  with raises_invalid('where', 'x'):
    interpret.mean_ablate(jnp.ones((4, 3)), where='x')
  for over in ((0, 0), (0, -2)):
    with raises_invalid('over', over):
      interpret.mean_ablate(jnp.ones((4, 3)), over=over)
  with pytest.raises(perturbkit.NotEditsError, match='Got a float for the edit'):
    interpret.apply_edit(1.0, jnp.ones(3))
  with pytest.raises(perturbkit.InvalidOptionError, match=r'view=\(2\.0, 3\) is not'):
    interpret.replace(jnp.zeros(3), view=(2.0, 3))  # the message showed view=None
  vector = interpret.steering_vector('Dense_0/__call__', (np.int64(3),), dtype='float32')
  np.testing.assert_array_equal(vector.init(), np.zeros(3, np.float32))


def test_hand_built_edits_and_gate_penalty_are_checked_where_given(mlp):
  """An Edit built by hand was used as given: positions without an axis, a float axis or a
  string scale raised raw TypeErrors where applied, ``active='no'`` edited, a vector of active
  flags edited the features it happened to broadcast to, and a list of positions failed in
  JAX indexing. gate_penalty of a string or integers failed in JAX, of nothing it was 0."""
  interpret = perturbkit.interpret
  Edit, output = interpret.Edit, jnp.arange(6.0).reshape(2, 3)
  for name, value, edit in [('axis', None, Edit(0.0, 0.0, jnp.array([0]))),
                            ('axis', 1, Edit(0.0, 0.0, axis=1)),
                            ('axis', 1.0, Edit(0.0, 0.0, jnp.array([0]), axis=1.0)),
                            ('positions', None, Edit(0.0, 0.0, jnp.array([0.5]), axis=1)),
                            ('positions', None, Edit(0.0, 0.0, jnp.array([True, False]), axis=0)),
                            ('scale', 'x', Edit('x', 0.0)),
                            ('shift', None, Edit(1.0, None)),
                            ('active', 'no', Edit(0.0, 0.0, active='no')),
                            ('active', None, Edit(0.0, 0.0, active=jnp.array([True, False, True]))),
                            ('view', 'ab', Edit(0.0, 0.0, view='ab'))]:
    with raises_invalid(name, value):
      interpret.apply_edit(edit, output)
  model, variables, _, x, _ = mlp
  with raises_invalid('active', 'no'):
    perturbkit.run_with_edits(model.apply)(variables, {'Dense_0/__call__': Edit(
        0.0, 0.0, active='no')}, x)
  np.testing.assert_array_equal(interpret.apply_edit(Edit(0.0, 0.0, [1], True, 1), output),
                                [[0.0, 0.0, 2.0], [3.0, 0.0, 5.0]])
  for logits in ('x', jnp.arange(3), None, {}, jnp.array([1j])):
    with raises_invalid('logits', logits if isinstance(logits, str) else None):
      interpret.gate_penalty(logits)
  logits = {'a': [0.0], 'b': jnp.array([100.0, -100.0])}
  np.testing.assert_allclose(interpret.gate_penalty(logits), 1.5, rtol=1e-6)


def test_complex_edit_values_for_a_real_output_are_refused():
  """A complex value added to or replacing a real output lost its imaginary part (a
  DeprecationWarning from the cast only); a complex output takes it."""
  interpret = perturbkit.interpret
  for name, edit in (('shift', interpret.add(jnp.array([1j, 0]))),
                     ('scale', interpret.scale(1j))):
    with pytest.raises(perturbkit.InvalidOptionError, match=f'{name}=.*complex64.*imaginary'):
      interpret.apply_edit(edit, jnp.ones((1, 2)))
  np.testing.assert_array_equal(
      interpret.apply_edit(interpret.add(jnp.array([1j, 0])), jnp.ones((1, 2), jnp.complex64)),
      [[1 + 1j, 1]])


@pytest.mark.parametrize('value', [3, 1.5])
def test_nnx_wrt_is_a_variable_filter(value):
  """``wrt=3`` failed in Flax with a ValueError from formatting its own message."""
  loss = lambda m, x: jnp.mean(m(x))
  with raises_invalid('wrt', value):
    perturbkit.nnx.interleaved(loss, optax.sgd(0.1), wrt=value)
  with raises_invalid('wrt', value):
    perturbkit.nnx.InterleavedOptimizer(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), optax.sgd(0.1), loss,
                                        jnp.ones((3, 2)), wrt=value)
  perturbkit.nnx.interleaved(loss, optax.sgd(0.1), wrt=(nnx.Param,))


def test_traced_positions_in_a_list():
  """An edit's positions may be traced (documented), but ``positions=[p]`` with ``p`` traced
  failed in NumPy with TracerArrayConversionError; patching's positions label the result,
  so a traced one is refused by name there."""
  interpret = perturbkit.interpret
  output = jnp.arange(12.0).reshape(1, 3, 4)
  edit_at = lambda p: interpret.apply_edit(interpret.zero_ablate(positions=[p], axis=1), output)
  np.testing.assert_array_equal(jax.jit(edit_at)(jnp.asarray(1)), edit_at(1))
  with pytest.raises(perturbkit.InvalidOptionError, match='positions=.* not values traced'):
    jax.jit(lambda p: perturbkit.attribution_patching(lambda v, x: 0.0, axis=1,
                                                      positions=[p]))(1)


def test_numpy_batch_axes_are_the_int_axes(mlp):
  """``batch_axes=np.int64(0)`` (an axis read off a NumPy shape) was refused as no int."""
  _, variables, loss_fn, x, y = mlp
  _, want = perturbkit.per_example_grad_norms(loss_fn, batch_axes=(0, 0))(variables, x, y)
  for axes in (np.int64(0), (np.int32(0), 0), [0, np.int64(0)]):
    _, got = perturbkit.per_example_grad_norms(loss_fn, batch_axes=axes)(variables, x, y)
    np.testing.assert_allclose(got.total, want.total, rtol=1e-6)
  perturbkit.check_per_example(loss_fn, variables, x, y, batch_axes=np.int64(0))
