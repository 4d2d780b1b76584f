"""Backward hooks against the MLP's backward pass written out with one ``jax.vjp`` per layer."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
import perturbkit
from perturbkit import filters

TOL = dict(rtol=1e-5, atol=1e-6)


def _dense(p, h):
  return h @ p['kernel'] + p['bias'][None]


def layerwise(params, x, hooks):
  """Hand-coded backward of ``models.MLP`` with ``hooks[name]`` applied to each
  Dense output's cotangent before it goes further down.

  Returns:
    ``(param grads, the cotangent arriving at each Dense output)``.
  """
  hook = lambda name, g: hooks.get(name, lambda g: g)(g)
  a0, back0 = jax.vjp(_dense, params['Dense_0'], x)
  r0 = jax.nn.relu(a0)
  a1, back1 = jax.vjp(_dense, params['Dense_1'], r0)
  h = jax.nn.relu(a1) + r0
  out, back2 = jax.vjp(_dense, params['Dense_2'], h)
  arriving = {'Dense_2': jax.grad(models.scalar)(out)}
  g_p2, g_h = back2(hook('Dense_2', arriving['Dense_2']))
  arriving['Dense_1'] = g_h * (a1 > 0)
  g_p1, g_r0 = back1(hook('Dense_1', arriving['Dense_1']))
  arriving['Dense_0'] = (g_r0 + g_h) * (a0 > 0)
  g_p0, _ = back0(hook('Dense_0', arriving['Dense_0']))
  return {'Dense_0': g_p0, 'Dense_1': g_p1, 'Dense_2': g_p2}, arriving


@pytest.fixture(name='mlp')
def _mlp():
  model = models.MLP()
  x = jax.random.normal(jax.random.key(1), (3, 5))
  return model, model.init(jax.random.key(0), x), x


def test_with_hooks_under_jax_grad_equals_layerwise(mlp):
  model, variables, x = mlp
  double = lambda g: 2.0 * g
  clip = lambda g: jnp.clip(g, -0.05, 0.05)
  hooks = [perturbkit.backward_hook(double, filters.by_path('Dense_1')),
           perturbkit.backward_hook(clip, filters.by_path('Dense_2'))]
  loss = lambda v, x: models.scalar(model.apply(v, x))
  grads = jax.grad(perturbkit.with_hooks(loss, *hooks))(variables, x)
  want, _ = layerwise(variables['params'], x, {'Dense_1': double, 'Dense_2': clip})
  chex.assert_trees_all_close(grads['params'], want, **TOL)
  # The forward value is untouched.
  np.testing.assert_allclose(perturbkit.with_hooks(loss, *hooks)(variables, x),
                             loss(variables, x), **TOL)


def test_value_and_grad_reports_gradient_arriving_before_the_hook(mlp):
  model, variables, x = mlp
  negate = lambda g: -3.0 * g
  hook = perturbkit.backward_hook(negate, filters.by_path('Dense_1'))
  loss = lambda v, x: models.scalar(model.apply(v, x))
  _, grads = perturbkit.value_and_grad(loss, hooks=[hook])(variables, x)
  want_params, arriving = layerwise(variables['params'], x, {'Dense_1': negate})
  chex.assert_trees_all_close(grads['params'], want_params, **TOL)
  for name in ('Dense_0', 'Dense_1', 'Dense_2'):
    np.testing.assert_allclose(grads['perturbations'][name]['__call__'], arriving[name], **TOL)


def test_two_hooks_on_one_call_last_sees_gradient_first(mlp):
  model, variables, x = mlp
  first, second = (lambda g: 2.0 * g), (lambda g: g + 0.1)
  hooks = [perturbkit.backward_hook(first, filters.by_path('Dense_2')),
           perturbkit.backward_hook(second, filters.by_path('Dense_2'))]
  loss = lambda v, x: models.scalar(model.apply(v, x))
  grads = jax.grad(perturbkit.with_hooks(loss, *hooks))(variables, x)
  want, _ = layerwise(variables['params'], x, {'Dense_2': lambda g: first(second(g))})
  chex.assert_trees_all_close(grads['params'], want, **TOL)
  wrong_order, _ = layerwise(variables['params'], x, {'Dense_2': lambda g: second(first(g))})
  assert not np.allclose(grads['params']['Dense_0']['kernel'], wrong_order['Dense_0']['kernel'])


def test_hook_on_pytree_output_gets_none_for_int_leaves():
  model = models.PytreeOutputs()
  x = jax.random.normal(jax.random.key(1), (3, 3))
  variables = model.init(jax.random.key(0), x)
  seen = []

  def scale(g):
    seen.append(jax.tree.structure(g, is_leaf=lambda a: a is None))
    return (3.0 * g[0], g[1])

  hook = perturbkit.backward_hook(scale, filters.by_path('TupleHead_0'))
  loss = lambda v: models.scalar(model.apply(v, x))
  grads = jax.grad(perturbkit.with_hooks(loss, hook))(variables)
  assert seen and all(s == jax.tree.structure((0, None), is_leaf=lambda a: a is None)
                      for s in seen)
  # The reference: the tuple head's float output scaled by 3 in the backward only.
  def scaled_loss(params):
    head = params['TupleHead_0']['Dense_0']
    stop = lambda y: 3.0 * y - 2.0 * jax.lax.stop_gradient(y)
    y = stop(_dense(head, x))
    d = _dense(params['DictHead_0']['Dense_0'], x)
    s = _dense(params['StructHead_0']['Dense_0'], x)
    return models.scalar(jnp.tanh(y) * d + jnp.sin(s))
  chex.assert_trees_all_close(grads['params'], {**jax.grad(scaled_loss)(variables['params']),
                                                'ArgmaxOnly_0': jax.tree.map(
                                                    jnp.zeros_like,
                                                    variables['params']['ArgmaxOnly_0'])},
                              **TOL)


def test_hook_errors():
  with pytest.raises(perturbkit.HookFunctionError, match='must be callable'):
    perturbkit.backward_hook(3.0)
  with pytest.raises(perturbkit.NoHooksError, match='at least one hook'):
    perturbkit.with_hooks(lambda v: v)
  with pytest.raises(perturbkit.NoHooksError, match='perturbkit.nnx.with_hooks'):
    perturbkit.nnx.with_hooks(lambda m: m)
  model = models.MLP()
  x = jnp.ones((2, 5))
  variables = model.init(jax.random.key(0), x)
  bad = perturbkit.backward_hook(lambda g: (g, g), filters.by_path('Dense_2'))
  with pytest.raises(perturbkit.HookFunctionError, match='structure it received'):
    jax.grad(perturbkit.with_hooks(lambda v: models.scalar(model.apply(v, x)), bad))(variables)
