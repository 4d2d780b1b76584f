"""``PatchingResult``'s helpers: ``normalized()``, ``top()`` and ``plot()``.

``normalized`` is checked on a chain of layers, where patching any call's whole output with its
clean value gives the clean metric (so every fraction is 1, whatever the numbers), and against
the division by hand; ``top`` against a sort written in plain Python; ``plot`` against the
numbers and labels it was given.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest

import perturbkit

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402  (after the backend)


class Chain(nn.Module):
  """Dense -> tanh -> Dense -> tanh -> Dense on ``(batch, tokens, features)``: nothing skips."""

  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Dense(6)(x))
    x = jnp.tanh(nn.Dense(6)(x))
    return nn.Dense(1)(x)[..., 0]


@pytest.fixture(scope='module', name='chain')
def _chain():
  model = Chain()
  clean = jax.random.normal(jax.random.key(1), (3, 5, 4))
  corrupted = jax.random.normal(jax.random.key(2), (3, 5, 4))
  variables = model.init(jax.random.key(0), clean)
  return model, variables, clean, corrupted


def _result(effects, clean=3.0, corrupted=1.0, positions=(0, 1, 2)):
  effects = jnp.asarray(effects, jnp.float32)
  return perturbkit.PatchingResult(tuple(f'layer/{i}/__call__' for i in range(len(effects))),
                                   positions, effects, jnp.asarray(clean), jnp.asarray(corrupted))


def test_normalized_whole_outputs_of_a_chain_are_all_recovered(chain):
  model, variables, clean, corrupted = chain
  metric = lambda v, x: jnp.mean(model.apply(v, x))
  result = jax.jit(perturbkit.activation_patching(metric))(variables, clean, corrupted)
  assert abs(float(result.clean_metric - result.corrupted_metric)) > 1e-3
  normalized = result.normalized()
  # Each call's whole clean output gives the clean run downstream: the whole gap, a fraction 1.
  np.testing.assert_allclose(normalized.effects, 1.0, rtol=1e-5)
  assert normalized.paths == result.paths and normalized.positions is None
  assert normalized.clean_metric == result.clean_metric


def test_normalized_is_the_division_by_hand_also_jitted_and_per_example(chain):
  model, variables, clean, corrupted = chain
  metric = lambda v, x: jnp.mean(model.apply(v, x))
  attribute = perturbkit.attribution_patching(metric, axis=1)
  result = jax.jit(attribute)(variables, clean, corrupted)
  by_hand = np.asarray(result.effects) / (float(result.clean_metric)
                                          - float(result.corrupted_metric))
  np.testing.assert_allclose(result.normalized().effects, by_hand, rtol=1e-6)
  jitted = jax.jit(lambda *a: attribute(*a).normalized())(variables, clean, corrupted)
  np.testing.assert_allclose(jitted.effects, by_hand, rtol=1e-5)
  # One example at a time, as a batch of one each: normalized by each example's own gap.
  batched = jax.vmap(lambda c, d: attribute(variables, c[None], d[None]))(clean, corrupted)
  alone = jax.jit(lambda c, d: attribute(variables, c, d).normalized())
  for i in range(len(clean)):
    np.testing.assert_allclose(batched.normalized().effects[i],
                               alone(clean[i:i + 1], corrupted[i:i + 1]).effects,
                               rtol=1e-5, atol=1e-6)


def test_normalized_with_equal_metrics_is_an_error_or_nan_under_jit(chain):
  model, variables, clean, _ = chain
  metric = lambda v, x: jnp.mean(model.apply(v, x))
  gxa = perturbkit.grad_times_activation(metric, axis=1)
  with pytest.raises(perturbkit.MetricGapError, match='no gap'):
    gxa(variables, clean).normalized()
  assert np.all(np.isnan(jax.jit(lambda *a: gxa(*a).normalized())(variables, clean).effects))


def test_top_equals_a_python_sort():
  effects = np.array([[0.5, -3.0, 0.1], [2.0, 0.0, -0.5], [1.0, 3.0, -2.5]])
  result = _result(effects, positions=(4, 6, 8))
  entries = [(f'layer/{r}/__call__', (4, 6, 8)[c], float(np.float32(effects[r, c])))
             for r in range(3) for c in range(3)]
  want = sorted(entries, key=lambda e: -abs(e[2]))  # stable: call order, then position
  assert result.top(4) == want[:4]
  assert result.top(4)[:2] == [('layer/0/__call__', 6, -3.0), ('layer/2/__call__', 6, 3.0)]
  assert result.top(100) == want
  whole = _result(effects[:, :1], positions=None)
  assert whole.top(1) == [('layer/1/__call__', None, 2.0)]


def test_top_and_plot_refuse_traced_or_batched_values_and_bad_options():
  result = _result([[1.0, 2.0, 3.0]])
  for k in (0, -1, 1.5, True):
    with pytest.raises(perturbkit.InvalidOptionError, match='k='):
      result.top(k)
  with pytest.raises(perturbkit.ResultValuesError, match='traced'):
    jax.jit(lambda r: r.top())(result)
  batched = jax.tree.map(lambda x: jnp.stack([x, x]), result)
  with pytest.raises(perturbkit.ResultValuesError, match=r'x\[i\]'):
    batched.top()
  with pytest.raises(perturbkit.ResultValuesError):
    batched.plot()
  assert jax.tree.map(lambda x: x[1], batched).top(1) == [('layer/0/__call__', 2, 3.0)]
  with pytest.raises(perturbkit.InvalidOptionError, match='limit='):
    result.plot(limit=-1.0)


def test_plot_draws_the_effects_with_their_labels_on_a_symmetric_scale():
  effects = np.array([[0.5, -3.0, 0.1], [2.0, 0.0, -0.5]], np.float32)
  result = _result(effects, positions=(4, 6, 8))
  fig, ax = plt.subplots()
  image = result.plot(ax)
  np.testing.assert_array_equal(image.get_array(), effects)
  assert image.get_clim() == (-3.0, 3.0)
  assert [t.get_text() for t in ax.get_yticklabels()] == ['layer/0', 'layer/1']
  assert [t.get_text() for t in ax.get_xticklabels()] == ['4', '6', '8']
  assert len(fig.axes) == 2  # and the colour bar
  # A shared scale for two maps, and a wide map labels every n-th column.
  wide = _result(np.ones((1, 70)), positions=tuple(range(70)))
  fig, ax = plt.subplots()
  image = wide.plot(ax, limit=5.0, colorbar=False)
  assert image.get_clim() == (-5.0, 5.0) and len(fig.axes) == 1
  assert [t.get_text() for t in ax.get_xticklabels()] == [str(c) for c in range(0, 70, 3)]
  plt.close('all')
