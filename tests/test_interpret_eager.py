"""The sweeps called outside any JAX transform compile themselves once and reuse the program.

Each test counts the traces of the metric (a Python counter in it runs once per trace) and
compares the eager results with the same function under the caller's ``jax.jit``, and with
the patches written by hand (``hand_mlp``).
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hand_mlp
import models
import perturbkit
from hand_mlp import NAMES, SHAPE, metric_of


@pytest.fixture(scope='module', name='mlp')
def _mlp():
  model = models.MLP()
  return (model, *hand_mlp.problem(model))


@jax.jit
def patches_by_hand(params, clean, corrupted):
  """``(calls, tokens)``: the metric with one Dense call's output at one token taken from the
  clean run, minus the corrupted metric, the MLP written out (``hand_mlp``)."""
  outputs = hand_mlp.outputs_by_hand(params, clean)
  base = metric_of(hand_mlp.by_hand(params, corrupted))

  def patched(name, token):
    edit = lambda n, h: h.at[:, token].set(outputs[n][:, token]) if n == name else h
    return metric_of(hand_mlp.by_hand(params, corrupted, edit)) - base
  return jnp.array([[patched(n, t) for t in range(SHAPE[1])] for n in NAMES])


def counted(model):
  """``(metric, traces)``: the MLP's metric, and a list that grows by one per run of its Python."""
  traces = []

  def metric(v, x):
    traces.append(1)
    return metric_of(model.apply(v, x))
  return metric, traces


def test_eager_calls_trace_once_and_equal_the_callers_jit(mlp):
  """The second eager call of each sweep traces nothing; the results are those of the same
  function under ``jax.jit``, and activation patching's those of each patch by hand."""
  model, variables, clean, corrupted = mlp
  for make, args in [
      (lambda m: perturbkit.activation_patching(m, axis=1), (variables, clean, corrupted)),
      (lambda m: perturbkit.attribution_patching(m, axis=1), (variables, clean, corrupted)),
      (lambda m: perturbkit.grad_times_activation(m, axis=1), (variables, corrupted)),
      (lambda m: perturbkit.layer_integrated_gradients(m, steps=4), (variables, corrupted)),
  ]:
    metric, traces = counted(model)
    sweep = make(metric)
    first = sweep(*args)
    traced = len(traces)
    assert traced > 0
    second = sweep(*args)
    assert len(traces) == traced, sweep
    chex.assert_trees_all_equal(first, second)
    chex.assert_trees_all_close(first, jax.jit(make(metric))(*args), rtol=1e-6, atol=1e-7)

  patched = perturbkit.activation_patching(counted(model)[0], axis=1)(variables, clean, corrupted)
  chex.assert_trees_all_close(patched.effects, patches_by_hand(variables['params'], clean,
                                                               corrupted), rtol=1e-5, atol=1e-6)


def test_python_values_among_the_inputs_are_fixed_per_value_and_type(mlp):
  """A Python or NumPy number in the inputs is a constant of the program: another value, or the
  same value of another type, traces again; an unhashable one runs op by op, with the same
  result."""
  model, variables, clean, corrupted = mlp
  traces, seen = [], []

  def metric(v, inputs):
    x, scale = inputs
    traces.append(1)
    seen.append(type(scale))
    return metric_of(model.apply(v, x)) * scale

  sweep = perturbkit.grad_times_activation(metric, axis=1)
  two = sweep(variables, (corrupted, 2))
  traced = len(traces)
  chex.assert_trees_all_equal(sweep(variables, (corrupted, 2)), two)
  assert len(traces) == traced
  two_float = sweep(variables, (corrupted, 2.0))
  assert len(traces) > traced and seen[-1] is float
  chex.assert_trees_all_close(two_float.effects, two.effects, rtol=1e-6)
  one = sweep(variables, (corrupted, 1))
  np.testing.assert_allclose(2 * one.effects, two.effects, rtol=1e-5, atol=1e-7)
  traced = len(traces)
  chex.assert_trees_all_close(sweep(variables, (corrupted, np.float32(2))).effects, two.effects,
                              rtol=1e-6)
  assert len(traces) > traced and seen[-1] is np.float32  # a NumPy scalar is fixed too

  class Unhashable:
    __hash__ = None

    def __init__(self, value):
      self.value = value

  def metric_of_object(v, inputs):
    x, scale = inputs
    return metric_of(model.apply(v, x)) * scale.value

  by_value = perturbkit.grad_times_activation(metric_of_object, axis=1)(
      variables, (corrupted, Unhashable(2)))
  chex.assert_trees_all_close(by_value.effects, two.effects, rtol=1e-6, atol=1e-7)


def test_nnx_model_is_split_into_the_program_and_left_unchanged():
  """An NNX model's state is the program's input: the second call traces nothing, a model of
  other weights gives its own effects from the same program, and the model does not change."""
  model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu,
                         nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
  clean, corrupted = jnp.ones((2, 3)), jnp.zeros((2, 3))
  traces = []

  def metric(m, x):
    traces.append(1)
    return m(x).sum()

  sweep = perturbkit.nnx.activation_patching(metric)
  before = nnx.state(model)
  first = sweep(model, clean, corrupted)
  traced = len(traces)
  chex.assert_trees_all_equal(sweep(model, clean, corrupted), first)
  assert len(traces) == traced
  chex.assert_trees_all_equal(nnx.state(model), before)
  chex.assert_trees_all_close(first, nnx.jit(perturbkit.nnx.activation_patching(metric))(
      model, clean, corrupted), rtol=1e-6, atol=1e-7)

  other = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(2)), nnx.relu,
                         nnx.Linear(4, 2, rngs=nnx.Rngs(3)))
  traced = len(traces)  # the jitted twin above traced the metric too
  got = sweep(other, clean, corrupted)
  assert len(traces) == traced
  want = other(clean).sum() - other(corrupted).sum()   # patching the last call: the clean run
  np.testing.assert_allclose(got.effects[-1, 0], want, rtol=1e-5)


def test_under_a_transform_the_sweep_is_part_of_the_callers_trace(mlp):
  """Called with tracers (under ``jax.vmap`` here), the sweep runs inside the caller's
  computation: one example's effects equal the sweep of that example alone."""
  model, variables, clean, corrupted = mlp
  metric, _ = counted(model)
  sweep = perturbkit.attribution_patching(metric, axis=1)
  stacked = jax.vmap(sweep, in_axes=(None, 0, 0))(variables, clean[:, None], corrupted[:, None])
  alone = sweep(variables, clean[:1], corrupted[:1])
  chex.assert_trees_all_close(stacked.effects[0], alone.effects, rtol=1e-5, atol=1e-7)
