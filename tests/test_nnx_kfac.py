"""K-FAC on Flax NNX models: the inputs next to the output gradients, the layers, the
factors and the preconditioned steps, against inputs captured by hand and the Linen twin."""
import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import nnx_models as M
import perturbkit

TOL = dict(rtol=1e-5, atol=1e-6)


# --- return_inputs ---------------------------------------------------------------------


def test_return_inputs_equal_inputs_captured_by_hand():
  """Each call's ``(args, kwargs)`` at the path and key of its activation gradient, the
  shared module's two calls apart, eagerly and under ``nnx.jit``."""
  model, x = M.MLP(rngs=nnx.Rngs(0)), M.random_batch((4, 3))
  h0 = nnx.relu(model.dense_0(x))
  h1 = nnx.relu(model.dense_1(h0)) + h0
  h2 = jnp.tanh(model.dense_1(h1))
  want = {'dense_0': {'__call__': ((x,), {})},
          'dense_1': {'__call__': ((h0,), {}), '__call__#1': ((h1,), {})},
          'dense_2': {'__call__': ((h2,), {})}}
  vg = perturbkit.nnx.value_and_grad(M.mse, return_inputs=True)
  for run in (vg, nnx.jit(vg)):
    loss, grads, inputs = run(model, x)
    chex.assert_trees_all_close(inputs, want, **TOL)
    assert jax.tree.structure(grads['perturbations']) == jax.tree.structure(
        {path: {key: 0 for key in calls} for path, calls in want.items()})
  _, _, acts, inputs = perturbkit.nnx.value_and_grad(
      M.mse, return_activations=True, return_inputs=True)(model, x)
  chex.assert_trees_all_close(inputs, want, **TOL)
  chex.assert_trees_all_close(acts['dense_2']['__call__'], model(x), **TOL)


def test_return_inputs_keyword_and_non_array_arguments():
  """Keyword inputs are kept by name; a Python flag or ``None`` becomes ``None``."""

  class Scaled(nnx.Module):
    def __init__(self, rngs):
      self.inner = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x, *, scale, flag=True):
      return self.inner(x) * scale if flag else self.inner(x)

  class Outer(nnx.Module):
    def __init__(self, rngs):
      self.scaled = Scaled(rngs)

    def __call__(self, x):
      return self.scaled(x, scale=jnp.asarray(2.0), flag=True)

  model, x = Outer(nnx.Rngs(0)), M.random_batch((2, 3))
  _, _, inputs = perturbkit.nnx.value_and_grad(
      lambda m, x: jnp.sum(m(x)), return_inputs=True)(model, x)
  args, kwargs = inputs['scaled']['__call__']
  chex.assert_trees_all_close(args, (x,), **TOL)
  assert kwargs['flag'] is None
  chex.assert_trees_all_close(kwargs['scale'], jnp.asarray(2.0), **TOL)
  chex.assert_trees_all_close(inputs['scaled']['inner']['__call__'], ((x,), {}), **TOL)


def test_return_inputs_inside_an_nnx_transform_is_refused():
  with pytest.raises(perturbkit.ActivationsUnavailableError):
    perturbkit.nnx.value_and_grad(M.mse, return_inputs=True)(
        M.ScanMLP(rngs=nnx.Rngs(0)), M.random_batch((2, 4)))
