"""Plausible mistakes on the public entry points raise a named error whose message has the fix.

Each test makes the mistake, checks the error class and that the message says
how to fix it, then applies that fix and checks the result against an
independent reference where there is one.
"""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.nnx import bridge

import models
import nnx_models
import perturbkit

TOL = dict(rtol=1e-5, atol=1e-6)
X = jax.random.normal(jax.random.key(1), (4, 3))


@pytest.fixture(name='linen', scope='module')
def _linen():
  """The MLP and its variables, made once per module (the tests only read them)."""
  model = models.MLP()
  return model, jax.jit(model.init)(jax.random.key(0), X)


@pytest.fixture(name='nnx_model')
def _nnx_model():
  return nnx_models.MLP(rngs=nnx.Rngs(0))


def _linen_loss(model):
  return lambda v, x: jnp.mean(model.apply(v, x) ** 2)


def _linen_aux_loss(model):
  return lambda v, x: (jnp.mean(model.apply(v, x) ** 2), {'mean': jnp.mean(x)})


def _nnx_aux_loss(model, x):
  return jnp.mean(model(x) ** 2), {'mean': jnp.mean(x)}


# --- 1. (loss, aux) returned without has_aux=True ----------------------------------------


@pytest.mark.parametrize('make', [perturbkit.value_and_grad, perturbkit.grad])
def test_linen_aux_without_has_aux(linen, make):
  model, variables = linen
  with pytest.raises(perturbkit.MissingHasAuxError,
                     match=r'returned a tuple of 2\. .*pass `has_aux=True`'):
    make(_linen_aux_loss(model))(variables, X)
  # The fix: has_aux=True gives the gradient of the loss alone.
  (loss, aux), grads = jax.jit(perturbkit.value_and_grad(_linen_aux_loss(model), has_aux=True))(
      variables, X)
  want_loss, want = jax.jit(jax.value_and_grad(_linen_loss(model)))(variables, X)
  chex.assert_trees_all_close((loss, grads['params']), (want_loss, want['params']), **TOL)
  chex.assert_trees_all_close(aux['mean'], jnp.mean(X), **TOL)


def test_missing_has_aux_is_a_non_scalar_loss_error(linen):
  model, variables = linen
  with pytest.raises(perturbkit.NonScalarLossError, match='has_aux=True'):
    perturbkit.value_and_grad(lambda v, x: [_linen_loss(model)(v, x)] * 3)(variables, X)
  with pytest.raises(perturbkit.MissingHasAuxError, match=r"dict with keys \['loss'\]"):
    perturbkit.value_and_grad(lambda v, x: {'loss': _linen_loss(model)(v, x)})(variables, X)


def test_has_aux_without_a_pair(linen):
  model, variables = linen
  with pytest.raises(perturbkit.HasAuxOutputError,
                     match=r'returned an array of shape \(\).*drop has_aux=True'):
    perturbkit.value_and_grad(_linen_loss(model), has_aux=True)(variables, X)


def test_linen_interleaved_aux_without_has_aux(linen):
  model, variables = linen
  trainer = perturbkit.interleaved(_linen_aux_loss(model), optax.sgd(0.1))
  with pytest.raises(perturbkit.MissingHasAuxError, match='pass `has_aux=True`'):
    trainer.step(trainer.init(variables, X), X)
  trainer = perturbkit.interleaved(_linen_aux_loss(model), optax.sgd(0.1), has_aux=True,
                                   propagate='original')
  _, metrics = jax.jit(trainer.step)(trainer.init(variables, X), X)
  chex.assert_trees_all_close(metrics['loss'], jax.jit(_linen_loss(model))(variables, X), **TOL)
  chex.assert_trees_all_close(metrics['aux']['mean'], jnp.mean(X), **TOL)


def test_linen_interleaved_loss_returning_every_collection(linen):
  """``apply(..., mutable=True)`` returns the params too; returned as aux they are read
  outside every call, so no call can be a segment. The message says so and gives the fix,
  which then matches jax.grad + optax."""
  model, variables = linen

  def every_collection(v, x):
    out, updates = model.apply(v, x, mutable=True)
    return jnp.mean(out ** 2), updates

  trainer = perturbkit.interleaved(every_collection, optax.sgd(0.1), has_aux=True)
  with pytest.raises(perturbkit.SegmentationError,
                     match=r"by output\): the loss returns them.*mutable=\['batch_stats'\]"):
    trainer.init(variables, X)

  def changed_collections(v, x):
    out, updates = model.apply(v, x, mutable=['intermediates'])
    return jnp.mean(out ** 2), updates

  trainer = perturbkit.interleaved(changed_collections, optax.sgd(0.1), has_aux=True,
                                   propagate='original')
  state, _ = jax.jit(trainer.step)(trainer.init(variables, X), X)
  grads = jax.jit(jax.grad(_linen_loss(model)))(variables, X)
  want = jax.tree.map(lambda p, g: p - 0.1 * g, variables['params'], grads['params'])
  chex.assert_trees_all_close(state.params, want, **TOL)


def test_nnx_aux_without_has_aux(nnx_model):
  with pytest.raises(perturbkit.MissingHasAuxError, match='pass `has_aux=True`'):
    perturbkit.nnx.value_and_grad(_nnx_aux_loss)(nnx_model, X)
  trainer = perturbkit.nnx.interleaved(_nnx_aux_loss, optax.sgd(0.1))
  with pytest.raises(perturbkit.MissingHasAuxError, match='pass `has_aux=True`'):
    trainer.step(trainer.init(nnx_model, X), X)
  (loss, _), grads = perturbkit.nnx.value_and_grad(_nnx_aux_loss, has_aux=True)(nnx_model, X)
  want_loss, want = nnx.value_and_grad(nnx_models.mse)(nnx_model, X)
  chex.assert_trees_all_close(loss, want_loss, **TOL)
  chex.assert_trees_all_close(nnx_models.pure(grads['params']), nnx_models.pure(want), **TOL)


@pytest.mark.parametrize('name', ['per_example_grad_norms', 'private_grad'])
def test_per_example_aux_loss(linen, name):
  model, variables = linen
  options = {} if name == 'per_example_grad_norms' else dict(clip_norm=1.0, noise_multiplier=0.0)
  make = getattr(perturbkit, name)
  args = (variables, X) if name == 'per_example_grad_norms' else (variables, jax.random.key(0), X)
  with pytest.raises(perturbkit.MissingHasAuxError, match=r'tuple of 2.*return the loss alone'):
    make(_linen_aux_loss(model), **options)(*args)


def test_scalar_loss_helper_without_a_has_aux_option():
  from perturbkit.core._loss import scalar_loss
  with pytest.raises(perturbkit.MissingHasAuxError, match='return the loss alone'):
    scalar_loss((jnp.zeros(()), 1.0), has_aux_option=False)
  with pytest.raises(perturbkit.MissingHasAuxError, match='is a `return` missing'):
    scalar_loss(None)


# --- 2. the other front end's model ----------------------------------------------------


def test_nnx_model_to_linen_functions(nnx_model):
  with pytest.raises(perturbkit.WrongFrontEndError, match='use perturbkit.nnx.value_and_grad'):
    perturbkit.value_and_grad(nnx_models.mse)(nnx_model, X)
  with pytest.raises(perturbkit.WrongFrontEndError, match='use perturbkit.nnx.interleaved'):
    perturbkit.interleaved(nnx_models.mse, optax.sgd(0.1)).init(nnx_model, X)
  with pytest.raises(perturbkit.WrongFrontEndError, match='perturbkit.nnx.value_and_grad'):
    perturbkit.wrap(nnx_model)
  # The fix.
  _, grads = perturbkit.nnx.value_and_grad(nnx_models.mse)(nnx_model, X)
  want = nnx.grad(nnx_models.mse)(nnx_model, X)
  chex.assert_trees_all_close(nnx_models.pure(grads['params']), nnx_models.pure(want), **TOL)


def test_not_a_module_to_nnx_functions():
  """Neither an NNX nor a Linen model (an int, a list holding the model): NotAModuleError."""
  model = nnx_models.MLP(rngs=nnx.Rngs(0))
  for given in (3, [model]):
    with pytest.raises(perturbkit.NotAModuleError, match='nnx.Module as its first argument'):
      perturbkit.nnx.value_and_grad(nnx_models.mse)(given, X)
  with pytest.raises(perturbkit.NotAModuleError, match=r'perturbkit\.nnx\.dp_sgd'):
    perturbkit.nnx.dp_sgd(nnx_models.mse, optax.sgd(0.1), clip_norm=1.0,
                          noise_multiplier=1.0).init(3)


def test_linen_model_to_nnx_functions(linen):
  model, variables = linen
  with pytest.raises(perturbkit.WrongFrontEndError, match='use perturbkit.value_and_grad'):
    perturbkit.nnx.value_and_grad(_linen_loss(model))(variables, X)
  with pytest.raises(perturbkit.WrongFrontEndError, match='use perturbkit.interleaved'):
    perturbkit.nnx.interleaved(_linen_loss(model), optax.sgd(0.1)).init(variables, X)
  with pytest.raises(perturbkit.WrongFrontEndError, match='use perturbkit.value_and_grad'):
    perturbkit.nnx.value_and_grad(_linen_loss(model))(model, X)


def test_linen_model_wrapped_in_the_nnx_bridge_to_nnx_functions():
  """A whole Linen model wrapped in ``nnx.bridge.ToNNX`` is refused by the NNX functions (its
  layers are Linen calls they cannot see), with the Linen function and the variables to give
  it; that fix equals ``nnx.grad`` of the wrapped model."""
  wrapped = bridge.ToNNX(nnx_models.LinenMLP(), rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (4, 4))
  bridge.lazy_init(wrapped, x)
  loss_fn = lambda m, x: jnp.mean(m(x) ** 2)
  for make in (perturbkit.nnx.value_and_grad, perturbkit.nnx.run_with_cache,
               perturbkit.nnx.per_example_grad_norms):
    with pytest.raises(perturbkit.WrongFrontEndError,
                       match=r'LinenMLP\) wrapped in nnx.bridge.ToNNX.*use perturbkit\.'):
      make(loss_fn)(wrapped, x)
  with pytest.raises(perturbkit.WrongFrontEndError, match='perturbkit.interleaved'):
    perturbkit.nnx.InterleavedOptimizer(wrapped, optax.sgd(0.1), loss_fn, x)
  with pytest.raises(perturbkit.WrongFrontEndError, match='perturbkit.kfac_layers'):
    perturbkit.nnx.kfac_layers(wrapped, x)

  variables = {'params': nnx.to_pure_dict(nnx.state(wrapped, nnx.Param))}
  module = wrapped.to_nnx__module
  _, grads = jax.jit(perturbkit.value_and_grad(lambda v, x: jnp.mean(module.apply(v, x) ** 2)))(
      variables, x)
  want = nnx.to_pure_dict(nnx.grad(loss_fn)(wrapped, x))
  chex.assert_trees_all_close(grads['params'], want, **TOL)
  assert set(grads['perturbations']) == {'dense_0', 'dense_1', 'dense_2'}


class _Encoder(nn.Module):
  def setup(self):
    self.encoder = nn.Dense(4)
    self.head = nn.Dense(2)

  def encode(self, x):
    return nn.relu(self.encoder(x))

  def __call__(self, x):
    return self.head(self.encode(x))


def test_submodule_called_outside_a_method_of_the_model():
  """A loss that calls a ``model.bind``-bound module's children, runs ``nn.apply(fn, model)``
  or ``apply(..., method=fn)`` with a function of the module calls them outside any method of
  the model. Activation gradients and the interpretability functions take such calls and
  equal the same chain through ``model.apply`` (and ``jax.grad``, and the gradient at the
  encoder by hand); interleaved training, which replays calls from the model's method calls,
  raises a named error with the fix, a method of the model."""
  model = _Encoder()
  variables = jax.jit(model.init)(jax.random.key(0), X)
  chain = lambda m, x: m.head(m.encode(x))
  fixed = lambda v, x: jnp.sum(model.apply(v, x) ** 2)   # __call__ is the chain
  want = jax.jit(perturbkit.value_and_grad(fixed))(variables, X)
  h = jax.jit(lambda v, x: model.apply(v, x, method=lambda m, x: m.encoder(x)))(variables, X)
  rest = lambda e: jnp.sum(model.apply(variables, nn.relu(e), method=lambda m, h: m.head(h)) ** 2)
  chex.assert_trees_all_close(want[1]['perturbations']['encoder']['__call__'],
                              jax.jit(jax.grad(rest))(h), **TOL)

  def bound(v, x):
    return jnp.sum(chain(model.bind(v), x) ** 2)

  functional = lambda v, x: jnp.sum(nn.apply(chain, model)(v, x) ** 2)
  lambda_method = lambda v, x: jnp.sum(model.apply(v, x, method=chain) ** 2)
  for loss_fn in (bound, functional, lambda_method):
    got = jax.jit(perturbkit.value_and_grad(loss_fn))(variables, X)
    chex.assert_trees_all_close(got, want, **TOL)
    chex.assert_trees_all_close(got[1]['params'],
                                jax.jit(jax.grad(loss_fn))(variables, X)['params'], **TOL)
    with pytest.raises(perturbkit.OutsideApplyError,
                       match=r"head/__call__ ran outside a method.*method='encode'"):
      perturbkit.interleaved(loss_fn, optax.sgd(0.1)).init(variables, X)

  # Two bound trees in one loss are two applies: distinct points, as with two model.apply.
  twice = lambda v, x: functional(v, x) + functional(v, 2 * x)
  chex.assert_trees_all_close(
      jax.jit(perturbkit.value_and_grad(twice))(variables, X),
      jax.jit(perturbkit.value_and_grad(lambda v, x: fixed(v, x) + fixed(v, 2 * x)))(
          variables, X), **TOL)
  metric = lambda run: lambda v, x: jnp.sum(run(v, x))
  chex.assert_trees_all_close(
      jax.jit(perturbkit.attribution_patching(
          metric(lambda v, x: chain(model.bind(v), x)), axis=0))(variables, X, 2 * X),
      jax.jit(perturbkit.attribution_patching(metric(model.apply), axis=0))(
          variables, X, 2 * X), **TOL)
  zero = perturbkit.backward_hook(lambda g: 0 * g, perturbkit.filters.by_path('head'))
  grads = jax.jit(jax.grad(perturbkit.with_hooks(bound, zero)))(variables, X)
  assert float(jnp.abs(grads['params']['encoder']['kernel']).max()) == 0.0


class _Doubled(nn.Module):
  """A Dense whose params are doubled by ``nn.map_variables``, then a head."""
  init_always: bool = True

  @nn.compact
  def __call__(self, x):
    init = True if self.init_always else self.is_initializing()
    dense = nn.map_variables(nn.Dense, 'params', lambda p: jax.tree.map(lambda w: 2.0 * w, p),
                             init=init)
    return nn.Dense(1, name='out')(jnp.tanh(dense(4, name='dense')(x)))


def test_map_variables_initializing_in_every_apply():
  """``nn.map_variables(..., init=True)`` initializes again in an apply with a mutable
  collection, which perturbkit's discovery has: a named error with the fix, whose result
  equals the explicit-delta twin written by hand."""
  variables = jax.jit(_Doubled().init)(jax.random.key(0), X)
  loss_of = lambda model: lambda v, x: jnp.sum(model.apply(v, x) ** 2)
  with pytest.raises(perturbkit.MapVariablesInitError, match=r'init=self.is_initializing\(\)'):
    perturbkit.value_and_grad(loss_of(_Doubled()))(variables, X)
  _, grads = jax.jit(perturbkit.value_and_grad(loss_of(_Doubled(init_always=False))))(
      variables, X)
  params = variables['params']

  def twin(delta):
    h = nn.Dense(4).apply({'params': jax.tree.map(lambda w: 2.0 * w, params['dense'])}, X)
    return jnp.sum(nn.Dense(1).apply({'params': params['out']}, jnp.tanh(h + delta)) ** 2)
  chex.assert_trees_all_close(grads['perturbations']['dense']['__call__'],
                              jax.jit(jax.grad(twin))(jnp.zeros((X.shape[0], 4))), **TOL)


def test_not_variables(linen):
  model, variables = linen
  with pytest.raises(perturbkit.NotVariablesError, match='pass the whole dict'):
    perturbkit.value_and_grad(_linen_loss(model))(variables['params'], X)
  with pytest.raises(perturbkit.NotVariablesError, match=r'model\.init\(key, \*args\)'):
    perturbkit.value_and_grad(_linen_loss(model))(model, X)
  with pytest.raises(perturbkit.NotVariablesError, match='pass the whole dict'):
    perturbkit.interleaved(_linen_loss(model), optax.sgd(0.1)).init(variables['params'], X)


# --- 3. labels the K-FAC categorical loss cannot take ---------------------------------


def test_one_hot_labels_to_categorical_output():
  logits = jax.random.normal(jax.random.key(2), (4, 5))
  labels = jnp.array([0, 3, 1, 4])
  one_hot = jax.nn.one_hot(labels, 5)
  nll = perturbkit.categorical_output().nll
  with pytest.raises(perturbkit.KFACTargetsError, match=r'jnp\.argmax\(one_hot, axis=-1\)'):
    nll(logits, one_hot)
  with pytest.raises(perturbkit.KFACTargetsError, match=r'labels\.astype\(jnp\.int32\)'):
    nll(logits, labels.astype(jnp.float32))
  with pytest.raises(perturbkit.KFACTargetsError, match=r'labels of shape \(4,\)'):
    nll(logits, labels[:3])
  # The fix, against optax's cross-entropy on the one-hot labels.
  chex.assert_trees_all_close(nll(logits, jnp.argmax(one_hot, axis=-1)),
                              optax.softmax_cross_entropy(logits, one_hot), **TOL)


def test_targets_of_another_shape_to_gaussian_output():
  output, targets = jnp.ones((4, 1)), jnp.zeros((4,))
  with pytest.raises(perturbkit.KFACTargetsError, match=r'y\[:, None\]'):
    perturbkit.gaussian_output().nll(output, targets)
  chex.assert_trees_all_close(perturbkit.gaussian_output().nll(output, targets[:, None]),
                              jnp.full((4,), 0.5), **TOL)


def test_one_hot_labels_to_kfac_estimator():
  model = nn.Sequential([nn.Dense(5)])
  variables = jax.jit(model.init)(jax.random.key(0), X)
  predict = lambda v, x: model.apply(v, x)
  layers = perturbkit.kfac_layers(predict, variables, X)
  estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers)
  labels = jnp.array([0, 3, 1, 4])
  with pytest.raises(perturbkit.KFACTargetsError, match='argmax'):
    estimate(variables, X, jax.nn.one_hot(labels, 5), jax.random.key(1))
  loss, _, _ = jax.jit(estimate)(variables, X, labels, jax.random.key(1))
  want = jax.jit(lambda v, x, labels: optax.softmax_cross_entropy_with_integer_labels(
      predict(v, x), labels).mean())(variables, X, labels)
  chex.assert_trees_all_close(loss, want, **TOL)


# --- 4. the variables (or the model) instead of the state ------------------------------


def test_variables_to_linen_step(linen):
  model, variables = linen
  trainer = perturbkit.interleaved(_linen_loss(model), optax.sgd(0.1))
  with pytest.raises(perturbkit.UninitializedStateError,
                     match=r'model variables\?.*state = trainer\.init\(variables, \*args\)'):
    trainer.step(variables, X)
  with pytest.raises(perturbkit.UninitializedStateError, match='trainer.init'):
    jax.jit(trainer.step)(variables, X)
  state, _ = jax.jit(trainer.step)(trainer.init(variables, X), X)
  assert int(state.step) == 1


def test_model_to_nnx_step(nnx_model):
  trainer = perturbkit.nnx.interleaved(nnx_models.mse, optax.sgd(0.1))
  with pytest.raises(perturbkit.UninitializedStateError,
                     match=r'the model itself.*state = trainer\.init\(model, \*args\)'):
    trainer.step(nnx_model, X)
  state, _ = jax.jit(trainer.step)(trainer.init(nnx_model, X), X)
  assert int(state.step) == 1


def test_variables_or_model_to_dp_sgd_step(linen, nnx_model):
  model, variables = linen
  key = jax.random.key(0)
  trainer = perturbkit.dp_sgd(_linen_loss(model), optax.sgd(0.1), clip_norm=1.0,
                              noise_multiplier=0.0)
  with pytest.raises(perturbkit.UninitializedStateError, match=r'trainer\.init\(variables\)'):
    trainer.step(variables, key, X)
  state, _ = jax.jit(trainer.step)(trainer.init(variables), key, X)
  assert int(state.step) == 1
  nnx_trainer = perturbkit.nnx.dp_sgd(nnx_models.mse, optax.sgd(0.1), clip_norm=1.0,
                                      noise_multiplier=0.0)
  with pytest.raises(perturbkit.UninitializedStateError,
                     match=r'the model itself.*trainer\.init\(model\)'):
    nnx_trainer.step(nnx_model, key, X)
  state, _ = jax.jit(nnx_trainer.step)(nnx_trainer.init(nnx_model), key, X)
  assert int(state.step) == 1


def test_nnx_optimizer_to_dp_sgd_points_to_its_transformation(nnx_model):
  with pytest.raises(perturbkit.NotAnOptimizerError, match='was built with .its `tx`.'):
    perturbkit.nnx.dp_sgd(nnx_models.mse, nnx.Optimizer(nnx_model, optax.sgd(0.1), wrt=nnx.Param),
                          clip_norm=1.0, noise_multiplier=0.0)


def test_nnx_interleaved_has_aux_with_a_scalar_loss(nnx_model):
  trainer = perturbkit.nnx.interleaved(nnx_models.mse, optax.sgd(0.1), has_aux=True)
  with pytest.raises(perturbkit.HasAuxOutputError, match=r'\(loss, aux\)'):
    jax.jit(trainer.step)(trainer.init(nnx_model, X), X)


# --- 5. inputs of another shape than at init --------------------------------------------


def test_linen_step_on_inputs_of_another_width(linen):
  model, variables = linen
  trainer = perturbkit.interleaved(_linen_loss(model), optax.sgd(0.1))
  state = trainer.init(variables, X)
  with pytest.raises(perturbkit.InputMismatchError,
                     match=r'argument 0 had shape \(4, 3\) \(float32\) at init, now shape '
                           r'\(4, 5\).*a different batch size is fine'):
    trainer.step(state, jnp.ones((4, 5)))
  # Another batch size is not a mismatch.
  jax.jit(trainer.step)(state, jnp.ones((7, 3)))


def test_nnx_step_on_inputs_of_another_width(nnx_model):
  trainer = perturbkit.nnx.interleaved(nnx_models.mse, optax.sgd(0.1))
  state = trainer.init(nnx_model, X)
  with pytest.raises(perturbkit.InputMismatchError,
                     match=r'argument 0 had shape \(4, 3\) \(float32\) at init, now shape '
                           r'\(4, 5\).*trainer\.init\(model, \*args\)'):
    jax.jit(trainer.step)(state, jnp.ones((4, 5)))
  jax.jit(trainer.step)(state, jnp.ones((7, 3)))


def test_nnx_optimizer_step_on_inputs_of_another_width(nnx_model):
  model = nnx.clone(nnx_model)
  opt = perturbkit.nnx.InterleavedOptimizer(model, optax.sgd(0.1), nnx_models.mse, X)
  with pytest.raises(perturbkit.InputMismatchError,
                     match=r'argument 0 had shape \(4, 3\) \(float32\) at init, now shape '
                           r'\(4, 5\).*InterleavedOptimizer\(model, tx, loss_fn, \*args\)'):
    opt.step(model, jnp.ones((4, 5)))
  before = jax.tree.leaves(nnx.state(model, nnx.Param))
  # Another batch size is not a mismatch (jitted: one compile, not one per op).
  nnx.jit(lambda m, o, x: o.step(m, x))(model, opt, jnp.ones((7, 3)))
  after = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert any(not np.array_equal(a, b) for a, b in zip(before, after))


def test_state_of_another_model_is_still_a_state_mismatch(linen):
  model, variables = linen
  trainer = perturbkit.interleaved(_linen_loss(model), optax.sgd(0.1))
  state = trainer.init(variables, X)
  wide = models.MLP(features=(6, 6))
  with pytest.raises(perturbkit.StateMismatchError, match='Build the state with `init`'):
    perturbkit.interleaved(_linen_loss(wide), optax.sgd(0.1)).step(state, X)


# --- Other arguments of the wrong kind ---------------------------------------------------


def test_loss_function_not_callable(linen):
  model, variables = linen
  value = _linen_loss(model)(variables, X)
  with pytest.raises(perturbkit.LossNotCallableError, match=r'not `perturbkit\.grad\(loss_fn'):
    perturbkit.grad(value)
  with pytest.raises(perturbkit.LossNotCallableError, match='Pass the function'):
    perturbkit.nnx.value_and_grad(value)
  with pytest.raises(perturbkit.LossNotCallableError, match='Pass the function'):
    perturbkit.interleaved(value, optax.sgd(0.1))


FUNCTION_TAKERS = {
    'per_example_grad_norms': lambda f: perturbkit.per_example_grad_norms(f),
    'private_grad': lambda f: perturbkit.private_grad(f, clip_norm=1.0, noise_multiplier=1.0),
    'dp_sgd': lambda f: perturbkit.dp_sgd(f, optax.sgd(0.1), clip_norm=1.0,
                                          noise_multiplier=1.0),
    'check_per_example': lambda f: perturbkit.check_per_example(f, {}, X),
    'nnx.per_example_grad_norms': lambda f: perturbkit.nnx.per_example_grad_norms(f),
    'nnx.private_grad': lambda f: perturbkit.nnx.private_grad(f, clip_norm=1.0,
                                                              noise_multiplier=1.0),
    'nnx.dp_sgd': lambda f: perturbkit.nnx.dp_sgd(f, optax.sgd(0.1), clip_norm=1.0,
                                                  noise_multiplier=1.0),
    'nnx.check_per_example': lambda f: perturbkit.nnx.check_per_example(
        f, nnx.Linear(3, 1, rngs=nnx.Rngs(0)), X),
    'run_with_cache': perturbkit.run_with_cache,
    'nnx.activation_patching': perturbkit.nnx.activation_patching,
    'grad_cam': perturbkit.grad_cam,
    'interpret.run_with_interventions': lambda f: perturbkit.interpret.run_with_interventions(
        f, {}),
    'with_hooks': lambda f: perturbkit.with_hooks(f, perturbkit.backward_hook(lambda g: g)),
    'nnx.with_hooks': lambda f: perturbkit.nnx.with_hooks(
        f, perturbkit.backward_hook(lambda g: g)),
    'kfac_layers': lambda f: perturbkit.kfac_layers(f, {'params': {}}, X),
    'nnx.kfac_layers': lambda f: perturbkit.nnx.kfac_layers(
        nnx.Linear(3, 1, rngs=nnx.Rngs(0)), X, predict=f),
}


@pytest.mark.parametrize('name', sorted(FUNCTION_TAKERS))
def test_a_value_for_a_function_is_refused_where_given(name):
  """A value passed where the loss, metric or prediction function goes failed with
  Python's TypeError when the function ran (dp_sgd's step even said its trainer was used as
  an optimizer)."""
  with pytest.raises(perturbkit.LossNotCallableError,
                     match=r'takes the (loss |prediction )?function itself.*Pass the function'):
    FUNCTION_TAKERS[name](1.5)


def test_filters_of_interpret_functions_are_checked_where_given():
  with pytest.raises(perturbkit.FilterError, match='filter= takes'):
    perturbkit.activation_patching(lambda v, x: 0.0, filter=3)
  with pytest.raises(perturbkit.FilterError, match=r'two arguments \(module, method_name\)'):
    perturbkit.nnx.run_with_cache(lambda m, x: 0.0, filter=lambda module: True)


def test_hook_and_optimizer_functions_of_other_arguments_are_refused_where_given(linen):
  """A hook of two arguments and an optimizer function of none failed with Python's
  TypeError in the backward pass or the first step."""
  with pytest.raises(perturbkit.HookFunctionError, match=r'takes one argument.*takes \(g, h\)'):
    perturbkit.backward_hook(lambda g, h: g)
  with pytest.raises(perturbkit.NotAnOptimizerError, match=r'taking \(\).*one argument'):
    perturbkit.interleaved(_linen_loss(linen[0]), lambda: optax.sgd(0.1))
  perturbkit.backward_hook(lambda *g: g[0])

def test_not_an_optimizer(linen):
  model, _ = linen
  with pytest.raises(perturbkit.NotAnOptimizerError, match=r'optax\.adam\(1e-3\)'):
    perturbkit.interleaved(_linen_loss(model), 0.1)
  with pytest.raises(perturbkit.NotAnOptimizerError, match=r'Call it.*optax\.sgd\(1e-3\)'):
    perturbkit.nnx.interleaved(nnx_models.mse, optax.sgd)
  trainer = perturbkit.interleaved(_linen_loss(model), lambda name: 0.1)
  with pytest.raises(perturbkit.NotAnOptimizerError, match='the function returned 0.1'):
    trainer.init(jax.jit(model.init)(jax.random.key(0), X), X)


def test_multisteps_points_to_its_gradient_transformation(linen):
  """``optax.MultiSteps`` is a wrapper object, not a transformation: the error names
  ``.gradient_transformation()``, and with it two ``'original'`` steps (one accumulated, one
  applied) equal ``jax.grad`` + the same MultiSteps."""
  model, variables = linen
  multi = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
  with pytest.raises(perturbkit.NotAnOptimizerError, match=r'\.gradient_transformation\(\)'):
    perturbkit.interleaved(_linen_loss(model), multi)
  with pytest.raises(perturbkit.NotAnOptimizerError, match=r'\.gradient_transformation\(\)'):
    perturbkit.nnx.interleaved(nnx_models.mse, multi)
  tx = multi.gradient_transformation()
  trainer = perturbkit.interleaved(_linen_loss(model), tx, propagate='original')
  state = trainer.init(variables, X)
  params, opt_state = variables['params'], tx.init(variables['params'])
  for _ in range(2):
    state, _ = jax.jit(trainer.step)(state, X)
    g = jax.grad(lambda p: _linen_loss(model)({'params': p}, X))(params)
    updates, opt_state = tx.update(g, opt_state, params)
    params = optax.apply_updates(params, updates)
  chex.assert_trees_all_close(state.params, params, **TOL)
  assert not np.allclose(params['Dense_0']['kernel'], variables['params']['Dense_0']['kernel'])


def test_multisteps_is_refused_by_dp_sgd(linen, nnx_model):
  """DP-SGD under ``optax.MultiSteps`` would average k separately noised means (√k times the
  noise of one step on the k-times larger batch): both spellings are refused, on both front
  ends."""
  model, variables = linen
  multi = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
  options = dict(clip_norm=1.0, noise_multiplier=1.0)
  with pytest.raises(perturbkit.PrivateAccumulationError, match=r'√k times'):
    perturbkit.dp_sgd(_linen_loss(model), multi, **options)
  with pytest.raises(perturbkit.PrivateAccumulationError, match='perturbkit.nnx.dp_sgd'):
    perturbkit.nnx.dp_sgd(nnx_models.mse, multi, **options)
  chained = optax.chain(optax.clip(1.0), multi.gradient_transformation())
  with pytest.raises(perturbkit.PrivateAccumulationError, match='private_grad'):
    perturbkit.dp_sgd(_linen_loss(model), chained, **options).init(variables)
  with pytest.raises(perturbkit.PrivateAccumulationError, match='private_grad'):
    perturbkit.nnx.dp_sgd(nnx_models.mse, chained, **options).init(nnx_model)


def test_a_model_with_a_hard_coded_batch_size_fails_the_reduction_check_by_name():
  """The reduction check runs the loss on 1 and 2 examples; a reshape to a fixed batch size
  fails there with ``ReductionCheckError``; taking the size from the input, as the message
  says, gives the per-example norms of ``jax.vmap`` over ``jax.grad``."""
  class Reshaping(nn.Module):
    batch: int | None

    @nn.compact
    def __call__(self, x):
      rows = x.shape[0] if self.batch is None else self.batch
      return nn.Dense(1)(nn.Dense(6)(x).reshape(rows, 2, 3).reshape(rows, 6))

  x = X
  variables = jax.jit(Reshaping(None).init)(jax.random.key(0), x)
  loss_for = lambda model: lambda v, x: jnp.mean(model.apply(v, x) ** 2)
  with pytest.raises(perturbkit.ReductionCheckError, match='hard-codes the batch size'):
    perturbkit.per_example_grad_norms(loss_for(Reshaping(x.shape[0])))(variables, x)
  loss_fn = loss_for(Reshaping(None))
  _, norms = jax.jit(perturbkit.per_example_grad_norms(loss_fn))(variables, x)

  @jax.jit
  def reference(variables, x):
    grads = jax.vmap(jax.grad(lambda v, xi: loss_fn(v, xi[None])), (None, 0))(variables, x)
    return jnp.sqrt(sum(jnp.sum(g.reshape(len(x), -1) ** 2, 1) for g in jax.tree.leaves(grads)))
  expected = reference(variables, x)
  np.testing.assert_allclose(norms.total, expected, **TOL)


def test_model_apply_jitted_once_outside_the_loss_is_explained(linen):
  """JAX reuses the trace of a jitted function made once: on the second run no call is seen,
  and the error says why and what to do."""
  model, variables = linen
  apply = jax.jit(model.apply)
  loss = lambda v, x: jnp.sum(apply(v, x))
  perturbkit.value_and_grad(loss)(variables, X)
  with pytest.raises(perturbkit.NoPerturbationPointsError,
                     match=r'Calls seen: \[none\].*not traced again.*call the model directly'):
    perturbkit.value_and_grad(loss)(variables, X)
  direct = lambda v, x: jnp.sum(model.apply(v, x))
  _, grads = jax.jit(perturbkit.value_and_grad(direct))(variables, X)
  chex.assert_trees_all_close(grads['params'], jax.grad(direct)(variables, X)['params'], **TOL)


def test_flags_that_are_no_bools_are_refused_where_given(linen, nnx_model):
  """``return_activations='no'`` was read as true (and returned a third value)."""
  model, variables = linen
  for front, loss in ((perturbkit, _linen_loss(model)), (perturbkit.nnx, nnx_models.mse)):
    for name, value in (('return_activations', 'no'), ('return_inputs', 1), ('has_aux', None),
                        ('strict', 'yes')):
      with pytest.raises(perturbkit.InvalidOptionError, match=f'{name}={value!r} .*True or False'):
        front.value_and_grad(loss, **{name: value})
  value, grads = jax.jit(perturbkit.value_and_grad(_linen_loss(model), return_activations=False,
                                                   strict=None))(variables, X)
  chex.assert_trees_all_close(grads['params'],
                              jax.jit(jax.grad(_linen_loss(model)))(variables, X)['params'], **TOL)


def test_lookahead_is_refused_by_the_trainers_holding_the_models_params(linen, nnx_model):
  """``optax.lookahead`` reads ``params.fast`` and ``params.slow``: the trainers hand it the
  model's params tree, and their step failed inside the trace with optax's ``AttributeError``.
  Each trainer's ``init`` names it and says how to keep the slow weights."""
  model, variables = linen
  lookahead = optax.chain(optax.clip(1.0), optax.lookahead(optax.adam(1e-2), 2, 0.5))
  options = dict(clip_norm=1.0, noise_multiplier=1.0)
  with pytest.raises(perturbkit.LookaheadParamsError, match='slow_step_size'):
    perturbkit.interleaved(_linen_loss(model), lookahead).init(variables, X)
  with pytest.raises(perturbkit.LookaheadParamsError, match='`perturbkit.dp_sgd`'):
    perturbkit.dp_sgd(_linen_loss(model), lookahead, **options).init(variables)
  with pytest.raises(perturbkit.LookaheadParamsError, match='perturbkit.nnx.dp_sgd'):
    perturbkit.nnx.dp_sgd(nnx_models.mse, lookahead, **options).init(nnx_model)
