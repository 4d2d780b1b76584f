"""Arguments that are no arrays (a flag given positionally, a string naming a mode) reach the
loss as they are, as under ``jax.grad``: they were traced as arrays, so ``if train:`` failed
and a string raised JAX's own error."""
import chex
import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import perturbkit

TOL = dict(rtol=1e-5, atol=1e-6)
X = jax.random.normal(jax.random.key(1), (3, 3))
Y = jax.random.normal(jax.random.key(2), (3, 2))


class Linen(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    h = nn.relu(nn.Dense(4)(x))
    return nn.Dense(2)(h * 1.5 if train else h)


class NNX(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(3, 4, rngs=rngs)
    self.b = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x, train):
    h = nnx.relu(self.a(x))
    return self.b(h * 1.5 if train else h)


def _reduce(r, mode):
  return jnp.sum(r) if mode == 'sum' else jnp.mean(r)


MODEL = Linen()
VARIABLES = jax.jit(MODEL.init, static_argnums=2)(jax.random.key(0), X, False)  # one compile


def linen_loss(variables, x, y, train, mode):
  return _reduce((MODEL.apply(variables, x, train) - y) ** 2, mode)


def nnx_loss(model, x, y, train, mode):
  return _reduce((model(x, train) - y) ** 2, mode)


def test_linen_value_and_grad_and_interleaved():
  args = (X, Y, True, 'sum')
  want_loss, want = jax.jit(lambda v: jax.value_and_grad(linen_loss)(v, *args))(VARIABLES)
  loss, grads = perturbkit.value_and_grad(linen_loss)(VARIABLES, *args)
  chex.assert_trees_all_close((loss, grads['params']), (want_loss, want['params']), **TOL)
  tx = perturbkit.interleaved(linen_loss, optax.sgd(0.1), propagate='original')
  state, _ = tx.step(tx.init(VARIABLES, *args), *args)
  chex.assert_trees_all_close(
      state.params, jax.tree.map(lambda p, g: p - 0.1 * g, VARIABLES['params'], want['params']),
      **TOL)


def test_nnx_value_and_grad_and_interleaved():
  model, reference = NNX(nnx.Rngs(0)), NNX(nnx.Rngs(0))
  want_loss, want = nnx.value_and_grad(nnx_loss)(reference, X, Y, True, 'sum')
  loss, grads = perturbkit.nnx.value_and_grad(nnx_loss)(model, X, Y, True, mode='sum')
  chex.assert_trees_all_close((loss, grads['params']), (want_loss, want), **TOL)
  opt = perturbkit.nnx.InterleavedOptimizer(model, optax.sgd(0.1), nnx_loss, X, Y, True, 'sum',
                                            propagate='original')
  opt.step(model, X, Y, True, 'sum')
  chex.assert_trees_all_close(
      nnx.state(model, nnx.Param),
      jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(reference, nnx.Param), want), **TOL)


def test_per_example_norms_linen_and_nnx():
  def norms_of(grads):
    return jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads)))

  one = lambda i: (X[i:i + 1], Y[i:i + 1], True, 'sum')
  want = jax.jit(lambda v: jnp.stack([norms_of(jax.grad(linen_loss)(v, *one(i))['params'])
                                      for i in range(3)]))(VARIABLES)  # one compile
  _, norms = perturbkit.per_example_grad_norms(linen_loss, reduction='sum')(
      VARIABLES, X, Y, True, 'sum')
  chex.assert_trees_all_close(norms.total, want, **TOL)
  model = NNX(nnx.Rngs(0))
  want = nnx.jit(lambda m: jnp.stack([norms_of(nnx.grad(nnx_loss)(m, *one(i)))
                                      for i in range(3)]))(model)  # one compile
  _, norms = perturbkit.nnx.per_example_grad_norms(nnx_loss, reduction='sum')(
      model, X, Y, True, 'sum')
  chex.assert_trees_all_close(norms.total, want, **TOL)


def test_run_with_cache_linen_and_nnx_with_a_flag_and_a_slice_bound():
  """An int used as a slice bound stays an int (a traced one raised JAX's IndexError)."""
  fn = lambda v, x, train, count: MODEL.apply(v, x[:, :count], train)
  out, cache = perturbkit.run_with_cache(fn)(VARIABLES, X, True, 3)
  chex.assert_trees_all_close(out, MODEL.apply(VARIABLES, X, True), **TOL)
  chex.assert_trees_all_close(cache.outputs['Dense_1']['__call__'], out, **TOL)
  model = NNX(nnx.Rngs(0))
  out, cache = perturbkit.nnx.run_with_cache(lambda m, x, t, n: m(x[:, :n], t))(model, X, True, 3)
  chex.assert_trees_all_close(out, model(X, True), **TOL)
  chex.assert_trees_all_close(cache.outputs['b']['__call__'], out, **TOL)


def _sgd(params, grads):
  return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def test_linen_interleaved_keyword_arguments():
  """``init``/``step``/``segments`` hand keyword arguments to the loss, as ``jax.grad`` does
  (they raised a raw TypeError): a flag and a mode string as they are, an array traced."""
  kwargs = dict(y=Y, train=True, mode='sum')
  want = jax.jit(lambda v: jax.grad(linen_loss)(v, X, **kwargs))(VARIABLES)['params']
  tx = perturbkit.interleaved(linen_loss, optax.sgd(0.1), propagate='original')
  assert tx.segments(VARIABLES, X, **kwargs).segments == ('Dense_0', 'Dense_1')
  state, _ = tx.step(tx.init(VARIABLES, X, **kwargs), X, **kwargs)
  chex.assert_trees_all_close(state.params, _sgd(VARIABLES['params'], want), **TOL)


def test_nnx_interleaved_keyword_arguments():
  model, reference = NNX(nnx.Rngs(0)), NNX(nnx.Rngs(0))
  want = _sgd(nnx.state(reference, nnx.Param),
              nnx.grad(lambda m, x: nnx_loss(m, x, Y, train=True, mode='sum'))(reference, X))
  tx = perturbkit.nnx.interleaved(nnx_loss, optax.sgd(0.1), propagate='original')
  state, _ = tx.step(tx.init(model, X, Y, train=True, mode='sum'), X, Y, train=True,
                     mode='sum')
  chex.assert_trees_all_close(nnx.state(state.model(), nnx.Param), want, **TOL)
  opt = perturbkit.nnx.InterleavedOptimizer(model, optax.sgd(0.1), nnx_loss, X, Y,
                                            propagate='original', train=True, mode='sum')
  assert opt.segments(model, X, Y, train=True, mode='sum').segments == ('a', 'b')
  opt.step(model, X, y=Y, train=True, mode='sum')
  chex.assert_trees_all_close(nnx.state(model, nnx.Param), want, **TOL)


def test_nnx_interleaved_hooks_with_a_flag_and_a_mode():
  """``init``'s check of ``hooks=`` runs the loss with a flag and a string as they are (it
  traced them, so ``init`` raised JAX's TypeError)."""
  model, reference = NNX(nnx.Rngs(0)), NNX(nnx.Rngs(0))
  grads = nnx.grad(nnx_loss)(reference, X, Y, True, 'sum')
  twice = perturbkit.backward_hook(lambda g: 2 * g, perturbkit.nnx.filters.by_path('b'))
  tx = perturbkit.nnx.interleaved(nnx_loss, optax.sgd(0.1), propagate='original', hooks=twice)
  state, _ = tx.step(tx.init(model, X, Y, True, 'sum'), X, Y, True, 'sum')
  chex.assert_trees_all_close(
      nnx.state(state.model(), nnx.Param),
      _sgd(nnx.state(reference, nnx.Param), jax.tree.map(lambda g: 2 * g, grads)), **TOL)


class _LinenScaled(nn.Module):
  """A root owning a param (its per-example gradients come from replaying the root call)."""

  @nn.compact
  def __call__(self, x, weights):
    scale = self.param('scale', nn.initializers.constant(1.5), (1, 3))
    return nn.Dense(2)(x * scale) * weights[:, None]


class _NnxScaled(nnx.Module):
  def __init__(self, rngs):
    self.scale = nnx.Param(jnp.full((1, 3), 1.5))
    self.dense = nnx.Linear(3, 2, rngs=rngs)

  def __call__(self, x, weights):
    return self.dense(x * self.scale) * weights[:, None]


def test_numpy_batches_give_the_per_example_results_of_vmap_grad():
  """A batch as a NumPy array (before a JAX array) reaches replayed calls as an array: it
  raised a raw ValueError there, and a dropped example's NumPy rows were not cleared."""
  x = np.array(jax.random.normal(jax.random.key(3), (4, 3)))
  x[1, 0] = np.inf  # example 1 is dropped by private_grad
  weights = jnp.array([1., 2., -1., .5])
  clip = 1.0
  linen = _LinenScaled()
  variables = jax.jit(linen.init)(jax.random.key(0), x, weights)
  linen_fn = lambda v, x, w: jnp.sum((linen.apply(v, x, w) - 1.) ** 2)
  nnx_model = _NnxScaled(nnx.Rngs(0))
  nnx_fn = lambda m, x, w: jnp.sum((m(x, w) - 1.) ** 2)
  kept = (0, 2, 3)

  def reference(grad_of):
    """The kept examples' gradients, each of its example alone, and their norms (jitted
    below: one compile)."""
    grads = [grad_of(x[i:i + 1], weights[i:i + 1]) for i in kept]
    return grads, [optax.tree.norm(g) for g in grads]

  cases = (
      (linen_fn, variables, perturbkit, jax.jit(lambda v: reference(
          lambda *example: jax.grad(linen_fn)(v, *example)['params']))),
      (nnx_fn, nnx_model, perturbkit.nnx, nnx.jit(lambda m: reference(
          lambda *example: nnx.grad(nnx_fn)(m, *example)))),
  )
  for loss_fn, model, front_end, reference_of in cases:
    grads, norms = jax.device_get(reference_of(model))  # NumPy: the clipped sum runs no op
    _, got = front_end.per_example_grad_norms(loss_fn, reduction='sum')(model, x, weights)
    chex.assert_trees_all_close(np.asarray(got.total)[list(kept)], np.stack(norms), **TOL)
    summed, metrics = front_end.private_grad(
        loss_fn, clip_norm=clip, noise_multiplier=0., reduction='sum')(
            model, jax.random.key(0), x, weights)
    want = jax.tree.map(lambda *g: sum(gi * min(1., clip / float(n)) for gi, n in zip(g, norms)),
                        *grads)
    want = jax.tree.map(lambda g: g / 4, want)  # the batch size, dropped examples counted
    assert int(metrics['dropped']) == 1
    chex.assert_trees_all_close(jax.tree.map(jnp.asarray, summed), want, **TOL)


class _LinenTied(nn.Module):
  """With ``tied``, ``d0``'s kernel is also read outside ``d0``'s call: no segment then."""

  @nn.compact
  def __call__(self, x, tied):
    d0 = nn.Dense(3, name='d0')
    h = nn.tanh(d0(x))
    out = nn.Dense(3, name='d1')(h)
    return out + h @ d0.variables['params']['kernel'] if tied else out


class _NnxTied(nnx.Module):
  def __init__(self, rngs):
    self.d0 = nnx.Linear(3, 3, rngs=rngs)
    self.d1 = nnx.Linear(3, 3, rngs=rngs)

  def __call__(self, x, tied):
    h = nnx.tanh(self.d0(x))
    out = self.d1(h)
    return out + h @ self.d0.kernel[...] if tied else out


def test_numpy_scalar_flags_are_values_for_the_segment_checks():
  """A ``np.bool_`` flag reaches the loss as it is, like a Python bool, so a step whose flag
  differs from ``init``'s checks its segments again: the segments were taken as checked (the
  flag counted as an array of the same type) and ``d0`` was updated from a wrong gradient."""
  linen = _LinenTied()
  variables = linen.init(jax.random.key(0), X, True)
  linen_fn = lambda v, x, tied: jnp.sum(linen.apply(v, x, tied) ** 2)
  nnx_fn = lambda m, x, tied: jnp.sum(m(x, tied) ** 2)
  for flags in ((False, True), (np.bool_(False), np.bool_(True))):
    tx = perturbkit.interleaved(linen_fn, optax.sgd(0.1), propagate='original')
    state = tx.init(variables, X, flags[0])
    with pytest.raises(perturbkit.SharedSegmentError, match="'d0'"):
      tx.step(state, X, flags[1])
    model = _NnxTied(nnx.Rngs(0))
    tx = perturbkit.nnx.interleaved(nnx_fn, optax.sgd(0.1), propagate='original')
    state = tx.init(model, X, flags[0])
    with pytest.raises(perturbkit.SharedSegmentError, match="'d0'"):
      tx.step(state, X, flags[1])


class _LinenExtra(nn.Module):
  @nn.compact
  def __call__(self, x, extra):
    h = nn.tanh(nn.Dense(3)(x))
    return nn.Dense(2, name='out')(nn.tanh(nn.Dense(3, name='extra')(h)) if extra else h)


def test_numpy_scalar_flags_of_clean_and_corrupted_inputs_are_compared_by_value():
  """Patching reuses the clean inputs' trace for corrupted ones only when a trace of them
  makes the same calls: ``np.bool_`` flags that differ counted as inputs of one type, so the
  clean calls were patched into a run that does not make them (a PerturbationsNotAppliedError
  about the loss, not the inputs)."""
  model = _LinenExtra()
  variables = model.init(jax.random.key(0), X, True)
  metric = lambda v, inputs: model.apply(v, *inputs)[:, 0].sum()
  for clean, corrupted in ((True, False), (np.bool_(True), np.bool_(False))):
    with pytest.raises(perturbkit.CallStructureMismatchError, match='extra/__call__'):
      perturbkit.activation_patching(metric)(variables, (X, clean), (X * 0, corrupted))


def test_interleaved_steps_take_optimizer_states_restored_as_numpy():
  """A state restored from a checkpoint holds NumPy arrays (``flax.serialization``): its
  optimizer state's floats were not counted as the step's own, and the step raised JAX's raw
  custom-VJP TypeError. Two Adam steps, the second from the restored state, are those of
  ``jax.grad`` and optax."""
  adam = optax.adam(0.1)

  @jax.jit  # the reference's two steps in one compile
  def linen_reference(want):
    opt_state = adam.init(want)
    for _ in range(2):
      updates, opt_state = adam.update(jax.grad(linen_loss)(
          {'params': want}, X, Y, True, 'sum')['params'], opt_state)
      want = optax.apply_updates(want, updates)
    return want

  want = linen_reference(VARIABLES['params'])
  tx = perturbkit.interleaved(linen_loss, adam, propagate='original')
  state, _ = tx.step(tx.init(VARIABLES, X, Y, True, 'sum'), X, Y, True, 'sum')
  restored = flax.serialization.from_bytes(state, flax.serialization.to_bytes(state))
  assert isinstance(jax.tree.leaves(restored.opt_state)[1], np.ndarray)
  state, _ = tx.step(restored, X, Y, True, 'sum')
  chex.assert_trees_all_close(state.params, want, **TOL)
  model, reference = NNX(nnx.Rngs(0)), NNX(nnx.Rngs(0))
  reference_opt = nnx.Optimizer(reference, adam, wrt=nnx.Param)

  @nnx.jit  # the reference's two steps in one compile
  def reference_steps(reference, reference_opt):
    for _ in range(2):
      reference_opt.update(reference, nnx.grad(nnx_loss)(reference, X, Y, True, 'sum'))

  reference_steps(reference, reference_opt)
  tx = perturbkit.nnx.interleaved(nnx_loss, adam, propagate='original')
  state, _ = tx.step(tx.init(model, X, Y, True, 'sum'), X, Y, True, 'sum')
  state, _ = tx.step(state._replace(opt_state=jax.tree.map(np.asarray, state.opt_state)),
                     X, Y, True, 'sum')
  chex.assert_trees_all_close(nnx.state(state.model(), nnx.Param),
                              nnx.state(reference, nnx.Param), **TOL)


def test_an_interleaved_step_takes_a_learning_rate_set_by_hand_as_a_python_float():
  """``state.hyperparams['learning_rate'] = 0.05`` (``optax.inject_hyperparams``) between
  steps, run without ``jax.jit``: the float was not counted among the state's floating-point
  arrays, which the update returns as one, and the step raised JAX's raw custom-VJP
  TypeError. Equals ``jax.grad`` and optax with the same learning rates."""
  adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=0.1, weight_decay=0.01)
  want, opt_state = VARIABLES['params'], adamw.init(VARIABLES['params'])
  tx = perturbkit.interleaved(linen_loss, adamw, propagate='original')
  state = tx.init(VARIABLES, X, Y, True, 'sum')

  @jax.jit  # one compile for both of the reference's steps
  def reference_step(want, opt_state):
    updates, opt_state = adamw.update(jax.grad(linen_loss)(
        {'params': want}, X, Y, True, 'sum')['params'], opt_state, want)
    return optax.apply_updates(want, updates), opt_state

  for rate in (0.1, 0.05):
    opt_state.hyperparams['learning_rate'] = rate
    want, opt_state = reference_step(want, opt_state)
    for segment_state in state.opt_state.values():
      segment_state.hyperparams['learning_rate'] = rate
    state, _ = tx.step(state, X, Y, True, 'sum')
  chex.assert_trees_all_close(state.params, want, **TOL)
