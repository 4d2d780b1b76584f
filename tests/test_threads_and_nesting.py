"""Interception state is per thread, nested perturbkit calls compose, failures leave nothing behind."""
import concurrent.futures
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import perturbkit
from perturbkit.linen import _interceptor


class MLP(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = jnp.tanh(nn.Dense(self.width)(x))
    return nn.Dense(1)(x)


WIDTHS = (4, 6)
X = jax.random.normal(jax.random.key(1), (5, 3))
Y = jnp.cos(X[:, :1])


@functools.cache
def _init(width):
  """``MLP(width)``'s variables, initialized once (one compile) for every test and thread."""
  return jax.jit(MLP(width).init)(jax.random.key(width), X)


def _problem(width):
  model = MLP(width)
  variables = _init(width)
  loss_fn = lambda v, x, y: jnp.mean((model.apply(v, x) - y) ** 2)
  return model, variables, loss_fn


def _one_step(tx, variables):
  """``tx``'s first step from ``variables``, jitted (one compile instead of one per op)."""
  return jax.jit(lambda v: tx.step(tx.init(v, X, Y), X, Y))(variables)


def _run_all(width):
  """Every entry point, traced afresh (no jit cache shared between threads): each under a
  ``jax.jit`` of its own, made here (one compile each instead of one per eager op)."""
  model, variables, loss_fn = _problem(width)
  hook = perturbkit.backward_hook(lambda g: 0.5 * g, perturbkit.filters.by_path('Dense_1'))
  out = {}
  out['value_and_grad'] = jax.jit(perturbkit.value_and_grad(loss_fn, hooks=[hook]))(
      variables, X, Y)
  out['with_hooks'] = jax.jit(jax.grad(perturbkit.with_hooks(loss_fn, hook)))(variables, X, Y)
  wrapped = perturbkit.wrap(model)
  wv = jax.jit(wrapped.init)(jax.random.key(width), X)
  out['wrap'] = jax.jit(jax.grad(lambda v: jnp.sum(wrapped.apply(v, X) ** 2)))(wv)
  tx = perturbkit.interleaved(loss_fn, optax.sgd(0.1))
  out['interleaved'] = _one_step(tx, variables)
  return out


def test_threads_give_the_single_threaded_results_bit_for_bit():
  want = {w: _run_all(w) for w in WIDTHS}
  jobs = [WIDTHS[i % len(WIDTHS)] for i in range(4)]  # different and identical models at once
  with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
    got = list(pool.map(_run_all, jobs))
  for width, result in zip(jobs, got):
    chex.assert_trees_all_equal(result, want[width])


def test_value_and_grad_inside_value_and_grad():
  """Each level sees its own calls: the inner step's points are the inner call's."""
  model, variables, loss_fn = _problem(4)

  def outer(v, x, y):
    (inner_loss, inner_grads) = perturbkit.value_and_grad(loss_fn)(v, x, y)
    stepped = jax.tree.map(lambda w, g: w - 0.1 * g, v['params'], inner_grads['params'])
    return loss_fn({**v, 'params': stepped}, x, y) + 0.0 * inner_loss

  loss, grads = jax.jit(perturbkit.value_and_grad(outer))(variables, X, Y)  # one compile
  # Reference: the same loss with jax.grad for the inner step, and explicit
  # perturbation arguments on the outer call only.
  def reference(params, eps):
    inner = jax.grad(lambda p: loss_fn({'params': p}, X, Y))(params)
    stepped = jax.tree.map(lambda w, g: w - 0.1 * g, params, inner)
    wrapped = perturbkit.wrap(model)
    return jnp.mean((wrapped.apply({'params': stepped, 'perturbations': eps}, X) - Y) ** 2)

  eps = jax.jit(perturbkit.wrap(model).init)(jax.random.key(0), X)['perturbations']
  want_params, want_eps = jax.jit(jax.grad(reference, argnums=(0, 1)))(variables['params'], eps)
  chex.assert_trees_all_close(grads['params'], want_params, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(grads['perturbations'], want_eps, rtol=1e-5, atol=1e-6)
  assert sorted(grads['perturbations']) == ['Dense_0', 'Dense_1', 'Dense_2', 'Dense_3']
  assert list(grads['perturbations']['Dense_0']) == ['__call__']


def test_hooks_inside_an_interleaved_loss_apply():
  model, variables, loss_fn = _problem(4)
  zero = perturbkit.backward_hook(lambda g: 0 * g, perturbkit.filters.by_path('Dense_1'))
  tx = perturbkit.interleaved(perturbkit.with_hooks(loss_fn, zero), optax.sgd(0.1),
                              propagate='original')
  state, _ = _one_step(tx, variables)
  # Nothing flows below Dense_1, so Dense_0 keeps its weights; the rest moves.
  chex.assert_trees_all_equal(state.params['Dense_0'], variables['params']['Dense_0'])
  hooked = perturbkit.with_hooks(loss_fn, zero)
  grads = jax.jit(jax.grad(lambda p: hooked({'params': p}, X, Y)))(variables['params'])
  want = jax.tree.map(lambda w, g: w - 0.1 * g, variables['params'], grads)
  chex.assert_trees_all_close(state.params, want, rtol=1e-5, atol=1e-6)


def test_interleaved_step_inside_jax_grad_of_the_loss_after_it():
  """A meta-gradient through one 'original' step equals the same through an optax step."""
  _, variables, loss_fn = _problem(4)
  tx = perturbkit.interleaved(loss_fn, optax.sgd(0.1), propagate='original')
  state = tx.init(variables, X, Y)

  def after_step(x):
    new, _ = tx.step(state, x, Y)
    return loss_fn(new.variables, X, Y)

  def reference(x):
    g = jax.grad(lambda p: loss_fn({'params': p}, x, Y))(variables['params'])
    return loss_fn({'params': jax.tree.map(lambda w, d: w - 0.1 * d, variables['params'], g)},
                   X, Y)

  # Both sides under one jax.jit: one compile (run eagerly, every op compiled its own).
  got, want = jax.jit(lambda x: (jax.grad(after_step)(x), jax.grad(reference)(x)))(X)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


class _Boom(Exception):
  pass


def test_an_exception_in_the_loss_leaves_no_state_behind():
  _, variables, loss_fn = _problem(6)
  want = jax.jit(perturbkit.value_and_grad(loss_fn))(variables, X, Y)  # one compile
  calls = {'n': 0}

  def failing(v, x, y):
    calls['n'] += 1
    if calls['n'] == 2:  # in the differentiated run, after discovery succeeded
      raise _Boom()
    return loss_fn(v, x, y)

  with pytest.raises(_Boom):
    perturbkit.value_and_grad(failing)(variables, X, Y)
  calls['n'] = 0
  with pytest.raises(_Boom):  # the same while tracing under jit
    jax.jit(perturbkit.value_and_grad(failing))(variables, X, Y)
  assert _interceptor._LOCAL.states == []
  # Traced afresh after the failures (jitted: one compile each instead of one per op).
  chex.assert_trees_all_equal(jax.jit(perturbkit.value_and_grad(loss_fn))(variables, X, Y),
                              want)
  _one_step(perturbkit.interleaved(loss_fn, optax.sgd(0.1)), variables)


class _Interrupting(nn.Module):
  @nn.compact
  def __call__(self, x):
    nn.Dense(2)(x)
    raise KeyboardInterrupt


def test_an_interrupt_during_discovery_leaves_no_state_behind():
  model, variables, loss_fn = _problem(8)
  want = jax.jit(perturbkit.value_and_grad(loss_fn))(variables, X, Y)  # one compile
  bad = _Interrupting()
  bad_params = {'params': {'Dense_0': {'kernel': jnp.ones((3, 2)), 'bias': jnp.zeros(2)}}}
  with pytest.raises(KeyboardInterrupt):
    perturbkit.value_and_grad(lambda v, x: jnp.sum(bad.apply(v, x)))(bad_params, X)
  assert _interceptor._LOCAL.states == []
  # Traced afresh after the interrupt (jitted: one compile each instead of one per op).
  chex.assert_trees_all_equal(jax.jit(perturbkit.value_and_grad(loss_fn))(variables, X, Y),
                              want)
  chex.assert_trees_all_equal(jax.jit(jax.grad(loss_fn))(variables, X, Y)['params'],
                              want[1]['params'])


def test_nested_hooks_on_a_segment_apply_in_the_order_of_a_plain_call():
  """Two hook blocks on one segment call: the replayed call gets them as jax.grad does."""
  _, variables, loss_fn = _problem(4)
  on_dense_1 = perturbkit.filters.by_path('Dense_1')
  plus = perturbkit.backward_hook(lambda g: g + 1.0, on_dense_1)
  times = perturbkit.backward_hook(lambda g: 3.0 * g, on_dense_1)
  hooked = perturbkit.with_hooks(perturbkit.with_hooks(loss_fn, plus), times)
  tx = perturbkit.interleaved(hooked, optax.sgd(0.1), propagate='original')
  state, _ = _one_step(tx, variables)
  grads = jax.jit(jax.grad(lambda p: hooked({'params': p}, X, Y)))(variables['params'])
  want = jax.tree.map(lambda w, g: w - 0.1 * g, variables['params'], grads)
  chex.assert_trees_all_close(state.params, want, rtol=1e-5, atol=1e-6)


class _Inner(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(4)(x))
    return nn.Dense(4)(h)


class _Outer(nn.Module):
  """``Dense_0`` at the top and ``Blk_0/Dense_0`` inside a block: one name, two paths."""

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(4)(x))
    h = _Inner(name='Blk_0')(h)
    return nn.Dense(1)(h)


def _hook_on(fn, x):
  """An identity whose VJP applies ``fn`` to the cotangent, written apart from perturbkit."""
  identity = jax.custom_vjp(lambda x: x)
  identity.defvjp(lambda x: (x, None), lambda _, g: (fn(g),))
  return identity(x)


_OUTER_HOOK = lambda g: 3.0 * g
_INNER_HOOK = lambda g: jnp.sin(5.0 * g) + 0.1 * g


# Which hooks a test inserts: on the top-level `Dense_0` (before the fix it also
# hit `Blk_0/Dense_0`, silently) and on `Blk_0/Dense_0` (before: unmatched).
_HOOK_SETS = {
    'outer': {'Dense_0': _OUTER_HOOK},
    'both': {'Dense_0': _OUTER_HOOK, 'Blk_0/Dense_0': _INNER_HOOK},
}


def _outer_problem(hooks):
  model = _Outer()
  variables = jax.jit(model.init)(jax.random.key(2), X)
  loss_fn = lambda v, x, y: jnp.mean((model.apply(v, x) - y) ** 2)
  hook_list = [perturbkit.backward_hook(fn, perturbkit.filters.by_path(path))
               for path, fn in hooks.items()]
  return variables, perturbkit.with_hooks(loss_fn, *hook_list), loss_fn, hook_list


@pytest.mark.parametrize('hooks', list(_HOOK_SETS))
def test_hooks_by_path_inside_a_segment_see_full_paths_with_original(hooks):
  variables, hooked, _, _ = _outer_problem(_HOOK_SETS[hooks])
  tx = perturbkit.interleaved(hooked, optax.sgd(0.1), segments=1, propagate='original')
  state, _ = _one_step(tx, variables)
  grads = jax.jit(jax.grad(lambda p: hooked({'params': p}, X, Y)))(variables['params'])
  want = jax.tree.map(lambda w, g: w - 0.1 * g, variables['params'], grads)
  chex.assert_trees_all_close(state.params, want, rtol=1e-5, atol=1e-6)


def _dense(p, x):
  return x @ p['kernel'] + p['bias'][None, :]


def _updated_step(params, lr, hooks):
  """One ``propagate='updated'`` sgd step walked back by hand, one segment at a time."""
  def sgd(w, dw):
    return jax.tree.map(lambda w, d: w - lr * d, w, dw)

  def segment(fn, w, x, g):
    """dw at the old weights, the step, the input cotangent at the new weights."""
    dw = jax.vjp(fn, w, x)[1](g)[0]
    new = sgd(w, dw)
    return new, jax.vjp(fn, new, x)[1](g)[1]

  def hooked(path, a):
    return _hook_on(hooks[path], a) if path in hooks else a

  def block(p, h):
    return _dense(p['Dense_1'], jnp.tanh(hooked('Blk_0/Dense_0', _dense(p['Dense_0'], h))))

  a0 = _dense(params['Dense_0'], X)
  h0 = jnp.tanh(a0)
  b = block(params['Blk_0'], h0)
  out = _dense(params['Dense_1'], b)
  g_out = jax.grad(lambda o: jnp.mean((o - Y) ** 2))(out)
  new = {}
  new['Dense_1'], g_b = segment(_dense, params['Dense_1'], b, g_out)
  new['Blk_0'], g_h0 = segment(block, params['Blk_0'], h0, g_b)
  g_a0 = hooks['Dense_0'](g_h0 * (1 - h0 ** 2))
  new['Dense_0'], _ = segment(_dense, params['Dense_0'], X, g_a0)
  return new


@pytest.mark.parametrize('route', ['with_hooks', 'hooks='])
@pytest.mark.parametrize('hooks', list(_HOOK_SETS))
def test_hooks_by_path_inside_a_segment_see_full_paths_with_updated(hooks, route):
  variables, hooked, loss_fn, hook_list = _outer_problem(_HOOK_SETS[hooks])
  if route == 'with_hooks':
    tx = perturbkit.interleaved(hooked, optax.sgd(0.1), segments=1, propagate='updated')
  else:
    tx = perturbkit.interleaved(loss_fn, optax.sgd(0.1), segments=1, propagate='updated',
                                hooks=hook_list)
  state, _ = _one_step(tx, variables)
  want = jax.jit(lambda p: _updated_step(p, 0.1, _HOOK_SETS[hooks]))(variables['params'])
  chex.assert_trees_all_close(state.params, want, rtol=1e-5, atol=1e-6)
