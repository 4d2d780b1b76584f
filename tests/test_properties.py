"""Random architectures: value_and_grad equals the hand twin and predicts JVPs."""
import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np

import models
import perturbkit
from perturbkit import filters


@st.composite
def architectures(draw):
  depth = draw(st.integers(1, 3))
  widths = draw(st.lists(st.integers(2, 4), min_size=depth, max_size=depth))
  skips = draw(st.lists(st.booleans(), min_size=depth, max_size=depth))
  pairs = draw(st.lists(st.booleans(), min_size=depth, max_size=depth))
  shared = draw(st.booleans())
  batch = draw(st.integers(1, 3))
  seed = draw(st.integers(0, 2 ** 16))
  return dict(widths=tuple(widths), skips=tuple(skips), pairs=tuple(pairs), shared=shared), batch, seed


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(architectures())
def test_random_architecture_equals_hand_twin_and_jvp(arch):
  spec, batch, seed = arch
  model, hand = models.RandomNet(**spec), models.RandomNet(**spec, hand=True)
  keys = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(keys[0], (batch, 3))
  loss = lambda v, x: models.scalar(model.apply(v, x))

  @jax.jit  # one compile per example: op-by-op runs compile every op of every new shape
  def both(x):
    variables = model.init(keys[1], x)
    value, grads = perturbkit.value_and_grad(loss, filter=filters.top_level)(variables, x)
    zeros = hand.init(keys[1], x)['perturbations']
    hand_loss = lambda p, eps: models.scalar(hand.apply({'params': p, 'perturbations': eps}, x))
    want = jax.value_and_grad(hand_loss, argnums=(0, 1))(variables['params'], zeros)
    leaves, treedef = jax.tree.flatten(zeros)
    noise = jax.random.split(keys[2], len(leaves))
    direction = jax.tree.unflatten(treedef, [jax.random.normal(k, a.shape)
                                             for k, a in zip(noise, leaves)])
    _, derivative = jax.jvp(lambda eps: hand_loss(variables['params'], eps), (zeros,),
                            (direction,))
    return value, grads, want, derivative, direction

  value, grads, (want_value, (g_params, g_points)), derivative, direction = both(x)
  np.testing.assert_allclose(value, want_value, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(grads, {'params': g_params, 'perturbations': models.nest(g_points)},
                              rtol=1e-5, atol=1e-6)
  predicted = sum(jnp.vdot(g, v) for g, v in zip(
      jax.tree.leaves(grads['perturbations']), jax.tree.leaves(models.nest(direction))))
  np.testing.assert_allclose(derivative, predicted, rtol=1e-4, atol=1e-5)
