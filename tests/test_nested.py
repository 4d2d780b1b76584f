"""A loss with its own inner gradient step (test-time training).

The inner step fits ``f``'s params to a reconstruction ``x_hat = A(f(x))``; the
outer loss uses the updated params. The activation gradient at the inner ``A``
call is d(outer)/d(x_hat) through the inner step, which the reference gets the
way the JAX answer suggests: an explicit perturbation argument added to x_hat.
"""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import perturbkit

TOL = dict(rtol=1e-5, atol=1e-6)
LR = 0.3


class SelfSupervised(nn.Module):
  def setup(self):
    self.f = nn.Dense(4)
    self.A = nn.Dense(3)

  def reconstruct(self, x):
    return self.A(self.f(x))

  def __call__(self, x):
    return self.f(x)


MODEL = SelfSupervised()


def loss_fn(variables, x):
  def inner(f_params):
    params = {**variables['params'], 'f': f_params}
    x_hat = MODEL.apply({**variables, 'params': params}, x, method='reconstruct')
    return jnp.mean((x_hat - x) ** 2)

  f_params = variables['params']['f']
  step = jax.grad(inner)(f_params)
  updated = jax.tree.map(lambda p, g: p - LR * g, f_params, step)
  z = MODEL.apply({**variables, 'params': {**variables['params'], 'f': updated}}, x)
  return jnp.sum(jnp.sin(z) * z)


def _dense(p, h):
  return h @ p['kernel'] + p['bias'][None]


def explicit(params, x, eps_x_hat, eps_z_hat, eps_z):
  """``loss_fn`` in plain jnp, with perturbation arguments at x_hat, f(x) and the outer f(x)."""
  def inner(f_params):
    x_hat = _dense(params['A'], _dense(f_params, x) + eps_z_hat) + eps_x_hat
    return jnp.mean((x_hat - x) ** 2)

  step = jax.grad(inner)(params['f'])
  updated = jax.tree.map(lambda p, g: p - LR * g, params['f'], step)
  z = _dense(updated, x) + eps_z
  return jnp.sum(jnp.sin(z) * z)


def test_gradient_wrt_inner_reconstruction():
  x = jax.random.normal(jax.random.key(1), (5, 3))
  variables = MODEL.init(jax.random.key(0), x, method='reconstruct')
  loss, grads = perturbkit.value_and_grad(loss_fn)(variables, x)
  zeros = (jnp.zeros((5, 3)), jnp.zeros((5, 4)), jnp.zeros((5, 4)))
  want_loss, (g_params, g_x_hat, g_z_hat, g_z) = jax.value_and_grad(
      explicit, argnums=(0, 2, 3, 4))(variables['params'], x, *zeros)
  np.testing.assert_allclose(loss, want_loss, **TOL)
  points = grads['perturbations']
  np.testing.assert_allclose(points['A']['__call__'], g_x_hat, **TOL)
  np.testing.assert_allclose(points['f']['__call__'], g_z_hat, **TOL)
  np.testing.assert_allclose(points['f']['__call__#1'], g_z, **TOL)
  chex.assert_trees_all_close(grads['params'], g_params, **TOL)
  # The inner step matters: without it the outer loss would not depend on x_hat.
  assert float(jnp.abs(g_x_hat).max()) > 1e-3


def test_nested_under_jit_equals_eager():
  x = jax.random.normal(jax.random.key(1), (5, 3))
  variables = MODEL.init(jax.random.key(0), x, method='reconstruct')
  vg = perturbkit.value_and_grad(loss_fn)
  chex.assert_trees_all_close(jax.jit(vg)(variables, x), vg(variables, x), **TOL)
