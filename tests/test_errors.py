"""Each named error is raised with a message that says how to fix it, and the fix works."""
import chex
import jax
import jax.numpy as jnp
import pytest

import models
import perturbkit
from perturbkit import filters

TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(name='mlp')
def _mlp():
  case = models.CASES['mlp']
  x = jax.random.normal(jax.random.key(1), case.x_shape)
  return case, models.init(case, case.model, x), x


def _reference(case, variables, x):
  return models.hand_value_and_grad(case, variables, x, jax.random.key(0))[1]


def test_non_scalar_loss(mlp):
  case, variables, x = mlp
  with pytest.raises(perturbkit.NonScalarLossError, match='jnp.mean'):
    perturbkit.value_and_grad(lambda v, x: case.model.apply(v, x))(variables, x)
  with pytest.raises(perturbkit.NonScalarLossError, match='dtype int32'):
    perturbkit.value_and_grad(lambda v, x: jnp.argmax(case.model.apply(v, x)))(variables, x)
  # The fix the message suggests.
  _, grads = perturbkit.value_and_grad(
      lambda v, x: jnp.mean(jax.vmap(models.scalar)(case.model.apply(v, x))) * x.shape[0])(
          variables, x)
  chex.assert_trees_all_close(grads, _reference(case, variables, x), **TOL)


def test_no_perturbation_points(mlp):
  case, variables, x = mlp
  loss = lambda v, x: models.scalar(case.model.apply(v, x))
  with pytest.raises(perturbkit.NoPerturbationPointsError, match=r'Dense_0/__call__.*Check the filter'):
    perturbkit.value_and_grad(loss, filter=filters.by_path('Encoder_*'))(variables, x)
  _, grads = perturbkit.value_and_grad(loss, filter=filters.by_path('Dense_*'))(variables, x)
  chex.assert_trees_all_close(grads, _reference(case, variables, x), **TOL)


def test_perturbation_structure(mlp):
  case, variables, x = mlp
  wrapped = perturbkit.wrap(case.model)
  small = wrapped.init(jax.random.key(0), x[:1])
  with pytest.raises(perturbkit.PerturbationStructureError, match=r'wrapped.init\(\.\.\.\)'):
    wrapped.apply(small, x)
  extra = {**small['perturbations'], 'Dense_9': {'__call__': jnp.zeros((1, 2))}}
  with pytest.raises(perturbkit.PerturbationStructureError, match='match no call'):
    wrapped.apply({**small, 'perturbations': extra}, x[:1])
  # The fix: perturbations made for the same inputs.
  chex.assert_trees_all_close(wrapped.apply(wrapped.init(jax.random.key(0), x), x),
                              case.model.apply(variables, x), **TOL)


def test_non_differentiable_output():
  case = models.CASES['pytree_outputs']
  x = jax.random.normal(jax.random.key(1), case.x_shape)
  variables = models.init(case, case.model, x)
  loss = lambda v, x: models.scalar(case.model.apply(v, x))
  with pytest.raises(perturbkit.NonDifferentiableOutputError,
                     match=r'ArgmaxOnly_0/__call__.*Exclude it with the filter'):
    perturbkit.value_and_grad(loss, filter=filters.top_level)(variables, x)
  fixed = filters.all_of(filters.top_level, filters.negate(filters.by_path('ArgmaxOnly_0')))
  _, grads = perturbkit.value_and_grad(loss, filter=fixed)(variables, x)
  want = models.hand_value_and_grad(case, variables, x, jax.random.key(0))[1]
  chex.assert_trees_all_close(grads, want, **TOL)


def test_perturbations_not_applied(mlp):
  """A loss that keeps Python state makes other calls in its second trace (the one that is
  differentiated) than in its first (the one that finds the calls)."""
  case, variables, x = mlp
  runs = iter([2, 1])
  drifting = lambda v, x: sum(models.scalar(case.model.apply(v, x)) for _ in range(next(runs)))
  with pytest.raises(perturbkit.PerturbationsNotAppliedError,
                     match=r'Dense_0/__call__#1.*same calls for the same inputs every time'):
    perturbkit.value_and_grad(drifting)(variables, x)
  steady = lambda v, x: models.scalar(case.model.apply(v, x))
  _, grads = perturbkit.value_and_grad(steady)(variables, x)
  chex.assert_trees_all_close(grads, _reference(case, variables, x), **TOL)


def test_unperturbed_calls_warning_names_the_calls_and_the_fix():
  model = models.Ensemble(map_perturbations=False)
  x = jax.random.normal(jax.random.key(1), (3, 2, 4))
  variables = model.init(jax.random.key(0), x)
  loss = lambda v, x: models.scalar(model.apply(v, x))
  with pytest.warns(perturbkit.UnperturbedCallsWarning,
                    match=r'members/Dense_0/__call__.*variable_axes'):
    _, grads = perturbkit.value_and_grad(loss)(variables, x)
  # The other point is still right: the twin that maps the collection agrees there.
  case = models.CASES['vmap']
  want = models.hand_value_and_grad(case, variables, x, jax.random.key(0))[1]
  chex.assert_trees_all_close(grads['params'], want['params'], **TOL)
  chex.assert_trees_all_close(grads['perturbations']['head'],
                              want['perturbations']['head'], **TOL)
  # Excluding the calls, as the message suggests, silences it.
  _, quiet = perturbkit.value_and_grad(loss, filter=filters.by_path('head'))(variables, x)
  chex.assert_trees_all_close(quiet['perturbations'], {'head': want['perturbations']['head']},
                              **TOL)
