"""Backward hooks against the MLP's backward pass written out with one ``jax.vjp`` per layer."""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax import nnx

import hf_models
import models
import nnx_models
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


def test_hook_cotangents_are_those_of_jax_vjp_with_none_for_int_leaves():
  """What a hook gets, as documented in ``backward_hook``: the cotangent ``jax.vjp`` takes
  for the call's output, with ``None`` where it takes a ``float0`` zero (an int leaf); a
  struct dataclass with an int leaf comes as the tuple of its float leaves' cotangents."""
  model = models.PytreeOutputs()
  x = jax.random.normal(jax.random.key(1), (3, 3))
  variables = model.init(jax.random.key(0), x)
  heads = ('TupleHead_0', 'DictHead_0', 'StructHead_0')
  seen = {}

  def record(name):
    def fn(g):
      seen[name] = g
      return g
    return perturbkit.backward_hook(fn, filters.by_path(name))

  loss = lambda v: models.scalar(model.apply(v, x))
  jax.grad(perturbkit.with_hooks(loss, *map(record, heads)))(variables)
  # The reference: jax.vjp of the loss as a function of the three heads' outputs.
  params = variables['params']
  outputs = [head().apply({'params': params[name]}, x)
             for name, head in zip(heads, (models.TupleHead, models.DictHead, models.StructHead))]
  index = jnp.argmax(_dense(params['ArgmaxOnly_0']['Dense_0'], x), axis=-1)
  rest = lambda t, d, s: models.scalar((jnp.tanh(t[0]) * d['value'] + jnp.sin(s.value),
                                        (t[1], d['index'], s.index, index)))
  _, vjp = jax.vjp(rest, *outputs)
  t, d, s = vjp(jnp.ones(()))
  assert t[1].dtype == d['index'].dtype == s.index.dtype == jax.dtypes.float0
  want = {'TupleHead_0': (t[0], None), 'DictHead_0': {'value': d['value'], 'index': None},
          'StructHead_0': (s.value,)}
  none = lambda a: a is None
  for name in heads:
    assert jax.tree.structure(seen[name], is_leaf=none) == jax.tree.structure(
        want[name], is_leaf=none), name
    chex.assert_trees_all_close(seen[name], want[name], **TOL)


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
  with pytest.raises(perturbkit.HookOutputError, match='Dense_2/__call__ returned the structure'):
    jax.grad(perturbkit.with_hooks(lambda v: models.scalar(model.apply(v, x)), bad))(variables)


# --- What a hook returns ---------------------------------------------------------------


def _mlp_loss(mlp):
  model, variables, x = mlp
  return lambda v: models.scalar(model.apply(v, x)), variables


@pytest.mark.parametrize('returned, message', [
    (lambda g: g.astype(jnp.int32), r'int32\[3, (\d+)\] for float32\[3, \1\]'),
    (lambda g: g.mean(0), r'float32\[(\d+)\] for float32\[3, \1\]')], ids=['dtype', 'shape'])
def test_hook_returning_another_dtype_or_shape_names_the_call(mlp, returned, message):
  loss, variables = _mlp_loss(mlp)
  hook = perturbkit.backward_hook(returned, filters.by_path('Dense_0'))
  with pytest.raises(perturbkit.HookOutputError, match=f'Dense_0/__call__ returned {message}'):
    jax.grad(perturbkit.with_hooks(loss, hook))(variables)
  with pytest.raises(perturbkit.HookOutputError, match='floating-point arrays of the same'):
    perturbkit.value_and_grad(loss, hooks=[hook])(variables)
  model, x = nnx_models.MLP(width=4, rngs=nnx.Rngs(0)), jnp.ones((3, 3))
  nnx_hook = perturbkit.backward_hook(returned, perturbkit.nnx.filters.by_path('dense_0'))
  with pytest.raises(perturbkit.HookOutputError, match=f'dense_0/__call__ returned {message}'):
    nnx.grad(perturbkit.nnx.with_hooks(nnx_models.mse, nnx_hook))(model, x)


def test_hook_computing_in_another_precision_keeps_the_gradients_dtypes(mlp):
  """A hook that returns bfloat16 for a float32 gradient (or float32 for bfloat16) is cast
  back: the params' gradients keep their dtype and equal the hand-written layerwise backward
  with the same rounding."""
  model, variables, x = mlp
  loss = lambda v, x: models.scalar(model.apply(v, x))
  rounded = lambda g: (g.astype(jnp.bfloat16) * 2).astype(jnp.float32)
  want, _ = layerwise(variables['params'], x, {'Dense_1': rounded})
  for fn in (lambda g: g.astype(jnp.bfloat16) * 2, lambda g: (g.astype(jnp.bfloat16) * 2
                                                                ).astype(jnp.float32)):
    grads = jax.grad(perturbkit.with_hooks(loss, perturbkit.backward_hook(
        fn, filters.by_path('Dense_1'))))(variables, x)
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    chex.assert_trees_all_close(grads['params'], want, **TOL)


# --- Hooks given where they go -----------------------------------------------------------


def test_hooks_given_as_one_hook_or_a_list_act_as_hooks(mlp):
  model, variables, x = mlp
  double = lambda g: 2.0 * g
  hook = perturbkit.backward_hook(double, filters.by_path('Dense_1'))
  loss = lambda v, x: models.scalar(model.apply(v, x))
  want, _ = layerwise(variables['params'], x, {'Dense_1': double})
  listed = jax.grad(perturbkit.with_hooks(loss, [hook]))(variables, x)
  chex.assert_trees_all_close(listed['params'], want, **TOL)
  _, one = perturbkit.value_and_grad(loss, hooks=hook)(variables, x)
  chex.assert_trees_all_close(one['params'], want, **TOL)


@pytest.mark.parametrize('api', ['linen', 'nnx'])
def test_something_else_than_a_hook_is_refused_where_it_is_given(api):
  front = perturbkit if api == 'linen' else perturbkit.nnx
  loss = lambda v, x: jnp.sum(x)
  double = lambda g: 2.0 * g
  with pytest.raises(perturbkit.NotAHookError, match=r'perturbkit.backward_hook\(fn, filter\)'):
    front.with_hooks(loss, double)
  with pytest.raises(perturbkit.NotAHookError, match='with_hooks takes backward hooks'):
    front.with_hooks(loss, [double])
  for make in (front.value_and_grad, front.grad):
    with pytest.raises(perturbkit.NotAHookError, match='value_and_grad takes backward hooks'):
      make(loss, hooks=double)
    with pytest.raises(perturbkit.NotAHookError, match='a hook with a filter'):
      make(loss, hooks=[double])
  with pytest.raises(perturbkit.NotAHookError, match='interleaved takes backward hooks'):
    front.interleaved(loss, optax.sgd(0.1), hooks=double)


# --- NNX filters that select no call -----------------------------------------------------


def test_nnx_hook_whose_filter_selects_no_call_raises_in_every_entry_point():
  model, x = nnx_models.MLP(rngs=nnx.Rngs(0)), jnp.ones((2, 3))
  typo = perturbkit.backward_hook(lambda g: 0.0 * g, perturbkit.nnx.filters.by_path('dense_9'))
  seen = r'Calls seen: \[dense_0/__call__, dense_1/__call__, dense_1/__call__#1'
  with pytest.raises(perturbkit.UnmatchedFilterError, match=seen):
    nnx.grad(perturbkit.nnx.with_hooks(nnx_models.mse, typo))(model, x)
  for make in (perturbkit.nnx.value_and_grad, perturbkit.nnx.grad):
    with pytest.raises(perturbkit.UnmatchedFilterError, match=seen):
      make(nnx_models.mse, hooks=[typo])(model, x)
  with pytest.raises(perturbkit.UnmatchedFilterError, match=seen):
    perturbkit.nnx.interleaved(nnx_models.mse, optax.sgd(0.1), hooks=[typo]).init(model, x)
  with pytest.raises(perturbkit.UnmatchedFilterError, match=seen):
    perturbkit.nnx.InterleavedOptimizer(model, optax.sgd(0.1), nnx_models.mse, x, hooks=[typo])
  # Control: a filter that selects a call is taken.
  hook = perturbkit.backward_hook(lambda g: 0.0 * g, perturbkit.nnx.filters.by_path('dense_2'))
  perturbkit.nnx.interleaved(nnx_models.mse, optax.sgd(0.1), hooks=[hook]).init(model, x)


# --- Once per module call: helper methods inside a module's own call -------------------------


def _hand_hook(fn):
  """The reference: an identity whose hand-written VJP applies ``fn`` to the cotangent."""
  @jax.custom_vjp
  def identity(h):
    return h
  identity.defvjp(lambda h: (h, None), lambda _, g: (fn(g),))
  return identity


def _squash(g):
  return jnp.clip(3.0 * g, -0.02, 0.02)


@pytest.fixture(name='helpers')
def _helpers():
  x = jax.random.normal(jax.random.key(1), (2, 3))
  return x, models.WithHelpers().init(jax.random.key(0), x)


def _helpers_loss(x, **twin):
  model = models.WithHelpers(**twin)
  return lambda v: jnp.sum(model.apply(v, x) ** 2)


def test_hook_on_a_module_acts_once_on_its_output_not_at_its_helper_methods(helpers):
  x, variables = helpers
  loss = _helpers_loss(x)
  selected = []

  def attn(module, method_name):
    if filters.by_path('attn')(module, method_name):
      selected.append(method_name)
      return True
    return False

  hook = perturbkit.backward_hook(_squash, attn)
  want = jax.grad(_helpers_loss(x, after=_hand_hook(_squash)))(variables)
  got = jax.grad(perturbkit.with_hooks(loss, hook))(variables)
  assert set(selected) == {'__call__', '_split', '_merge'}  # the helpers were selected too
  chex.assert_trees_all_close(got, want, **TOL)
  _, vg = perturbkit.value_and_grad(loss, hooks=[hook])(variables)
  chex.assert_trees_all_close(vg['params'], want['params'], **TOL)
  # The activation gradients reported are as before: those arriving at each call.
  _, plain = perturbkit.value_and_grad(loss)(variables)
  chex.assert_trees_all_close(vg['perturbations']['attn']['__call__'],
                              plain['perturbations']['attn']['__call__'], **TOL)
  assert not np.allclose(want['params']['inp']['kernel'], jax.grad(loss)(variables)['params'][
      'inp']['kernel'])


def test_hook_on_a_helper_method_alone_acts_on_its_output(helpers):
  x, variables = helpers
  loss = _helpers_loss(x)
  hook = perturbkit.backward_hook(_squash, filters.all_of(filters.by_path('attn'),
                                                          filters.by_method('_merge')))
  want = jax.grad(_helpers_loss(x, merged=_hand_hook(_squash)))(variables)
  chex.assert_trees_all_close(jax.grad(perturbkit.with_hooks(loss, hook))(variables), want, **TOL)


def test_nnx_hook_on_a_module_acts_once_on_its_output_not_at_its_public_helpers():
  model, x = nnx_models.WithHelpers(rngs=nnx.Rngs(0)), jax.random.normal(jax.random.key(1), (2, 3))
  loss = lambda m, after=lambda h: h: jnp.sum(m(x, after) ** 2)
  hook = perturbkit.backward_hook(_squash, perturbkit.nnx.filters.by_path('attn'))
  want = nnx.grad(lambda m: loss(m, _hand_hook(_squash)))(model)
  got = nnx.grad(perturbkit.nnx.with_hooks(loss, hook))(model)
  chex.assert_trees_all_close(nnx_models.pure(got), nnx_models.pure(want), **TOL)
  _, vg = perturbkit.nnx.value_and_grad(loss, hooks=[hook])(model)
  chex.assert_trees_all_close(nnx_models.pure(vg['params']), nnx_models.pure(want), **TOL)
  assert 'split' in vg['perturbations']['attn']  # the helpers are calls (and points)


GPT2_ATTN = ('transformer', 'h', '0', 'attn')


def _tiny_gpt2():
  import transformers
  config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
  hf = transformers.FlaxGPT2LMHeadModel(config, _do_init=False)
  ids = jax.random.randint(jax.random.key(2), (2, 8), 0, 32)
  mask, positions = jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(8), (2, 8))

  def loss_fn(variables):
    logits = hf.module.apply(variables, ids, mask, positions).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()
  return hf.module, hf_models.filled_variables(hf), loss_fn


def _hooked_at(path, fn):
  """The reference on the unmodified model: ``fn`` applied once to the cotangent at the
  output of the ``__call__`` of the module at ``path``, by a hand-written custom VJP."""
  identity = _hand_hook(fn)

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.method_name == '__call__' and tuple(context.module.path) == path:
      out = jax.tree.map(lambda a: identity(a) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                         out)
    return out
  return interceptor


@pytest.mark.filterwarnings(*hf_models.FILTER_DEPRECATION[:1])
@pytest.mark.filterwarnings(*hf_models.FILTER_DEPRECATION[1:])
def test_hook_on_hugging_face_gpt2_attention_acts_once_at_its_output():
  with jax.numpy_rank_promotion('allow'):
    _, variables, loss_fn = _tiny_gpt2()
    scale = lambda g: jax.tree.map(lambda a: jnp.clip(4.0 * a, -1e-3, 1e-3), g)
    hook = perturbkit.backward_hook(scale, filters.by_path('/'.join(GPT2_ATTN)))

    def reference(v):
      with nn.intercept_methods(_hooked_at(GPT2_ATTN, scale)):
        return loss_fn(v)
    want, got, (_, vg), plain = jax.jit(lambda v: (  # one compile for all four
        jax.grad(reference)(v), jax.grad(perturbkit.with_hooks(loss_fn, hook))(v),
        perturbkit.value_and_grad(loss_fn, hooks=[hook])(v), jax.grad(loss_fn)(v)))(variables)
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-7)
    chex.assert_trees_all_close(vg['params'], want['params'], rtol=1e-4, atol=1e-7)
    assert not np.allclose(plain['params']['transformer']['wte']['embedding'],
                           want['params']['transformer']['wte']['embedding'])


# --- Differentiation modes ---------------------------------------------------------------


def test_forward_over_reverse_of_a_hooked_loss_equals_the_layerwise_backward(mlp):
  model, variables, x = mlp
  cube = lambda g: g + 40.0 * g ** 3  # not linear: its own derivative enters
  hook = perturbkit.backward_hook(cube, filters.by_path('Dense_1'))
  loss = lambda v: models.scalar(model.apply(v, x))
  tangent = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape),
                         variables)
  _, got = jax.jvp(jax.grad(perturbkit.with_hooks(loss, hook)), (variables,), (tangent,))
  _, want = jax.jvp(lambda p: layerwise(p, x, {'Dense_1': cube})[0],
                    (variables['params'],), (tangent['params'],))
  chex.assert_trees_all_close(got['params'], want, **TOL)
  # Forward mode alone meets the custom VJP, as documented.
  with pytest.raises(TypeError, match='forward-mode'):
    jax.jvp(perturbkit.with_hooks(loss, hook), (variables,), (tangent,))


def test_a_hook_built_by_hand_is_checked_where_given():
  """``Hook(filter, fn)`` built by hand skipped backward_hook's checks and failed with
  Python's TypeError in the run."""
  loss = lambda v, x: 0.0
  with pytest.raises(perturbkit.FilterError, match='filter= takes'):
    perturbkit.value_and_grad(loss, hooks=perturbkit.Hook(3, lambda g: g))
  with pytest.raises(perturbkit.HookFunctionError, match='must be callable'):
    perturbkit.with_hooks(loss, [perturbkit.Hook(perturbkit.filters.all_calls, 3)])
