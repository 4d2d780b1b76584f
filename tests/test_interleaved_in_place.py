"""propagate='original' updates the donated params in place: no copy of a weight in the HLO."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hf_models
import perturbkit
from perturbkit.core._sweep import always_true_after


def test_always_true_after_is_true_for_every_value():
  values = [jnp.array([np.nan, 1.0]), jnp.array([[np.inf]]), jnp.array([-np.inf]),
            jnp.zeros((0,)), jnp.array([3], jnp.int32), jnp.array([2.0], jnp.bfloat16),
            jnp.array([np.nan + 1j], jnp.complex64)]
  for value in values:
    assert bool(jax.jit(always_true_after)([value])), value
  assert bool(jax.jit(always_true_after)(values))
  assert bool(always_true_after([]))


def _matrix_copies(compiled_text: str) -> list[str]:
  """Copies of a float matrix in the entry computation (a kernel copied whole)."""
  entry = compiled_text[compiled_text.index('\nENTRY'):]
  return re.findall(r'= (f32\[\d+,\d+\]\S*) copy\(', entry)


@pytest.mark.parametrize('propagate', ['original', 'updated'])
def test_donated_step_updates_weights_in_place(propagate):
  model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(64), nn.relu, nn.Dense(16)])
  x, y = jnp.ones((8, 32)), jnp.zeros((8, 16))

  def loss_fn(variables, x, y):
    return jnp.mean((model.apply(variables, x) - y) ** 2)

  tx = perturbkit.interleaved(loss_fn, optax.adam(1e-3), propagate=propagate)
  state = tx.init(model.init(jax.random.key(0), x), x, y)
  compiled = jax.jit(tx.step, donate_argnums=0).lower(state, x, y).compile()
  # Each kernel's last read (its input cotangent) comes before its update writes over it.
  assert _matrix_copies(compiled.as_text()) == []


def _ops(compiled_text: str, op: str) -> int:
  """How many ``op`` instructions the optimized HLO holds, in every computation."""
  return len(re.findall(rf'= \S+ {op}\(', compiled_text))


@pytest.mark.filterwarnings(*hf_models.FILTER_DEPRECATION)
@pytest.mark.parametrize('propagate', ['original', 'updated'])
def test_gpt2_step_does_the_standard_steps_matrix_products(propagate):
  """The interleaved step adds no matrix product to a standard donated step's.

  Unmodified Hugging Face Flax GPT-2 (tied LM head, default layer-wise segments) with adam:
  the optimized HLO of the step has as many ``dot`` instructions as ``jax.grad`` followed by
  the optax update, so any extra cost is in the memory-bound ops around them.
  """
  case = hf_models.CASES['gpt2']
  hf = hf_models.hf_model(case.model)
  loss_fn, batch = case.make(hf.module)
  adam = optax.adam(1e-3)

  def standard(params, opt_state, *batch):
    grads = jax.grad(lambda p: loss_fn({'params': p}, *batch))(params)
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  with case.strictness():
    params = hf.variables['params']
    want = jax.jit(standard, donate_argnums=(0, 1)).lower(params, adam.init(params), *batch)
    tx = perturbkit.interleaved(loss_fn, adam, propagate=propagate)
    state = tx.init(hf.variables, *batch)
    got = jax.jit(tx.step, donate_argnums=0).lower(state, *batch)
    want_text, got_text = want.compile().as_text(), got.compile().as_text()
  assert _ops(want_text, 'dot') > 20, _ops(want_text, 'dot')
  assert _ops(got_text, 'dot') == _ops(want_text, 'dot')


@pytest.mark.parametrize('propagate', ['original', 'updated'])
def test_first_layer_computes_no_input_gradient(propagate):
  """The data into the first layer is not differentiated: its input gradient is never computed.

  A three-layer MLP on data: the interleaved step's optimized HLO has the standard step's
  eight matrix products (three forward, three weight gradients, two input gradients), not a
  ninth for the first layer's input, whatever its step waits for.
  """
  model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(64), nn.relu, nn.Dense(16)])
  x, y = jnp.ones((8, 32)), jnp.zeros((8, 16))
  loss_fn = lambda variables, x, y: jnp.mean((model.apply(variables, x) - y) ** 2)
  variables = model.init(jax.random.key(0), x)
  adam = optax.adam(1e-3)

  def standard(params, opt_state, x, y):
    grads = jax.grad(lambda p: loss_fn({'params': p}, x, y))(params)
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = variables['params']
  want = jax.jit(standard, donate_argnums=(0, 1)).lower(params, adam.init(params), x, y)
  tx = perturbkit.interleaved(loss_fn, adam, propagate=propagate)
  got = jax.jit(tx.step, donate_argnums=0).lower(tx.init(variables, x, y), x, y)
  want_dots = _ops(want.compile().as_text(), 'dot')
  assert want_dots == 3 + 3 + 2, want_dots  # forward, weight gradients, input gradients
  assert _ops(got.compile().as_text(), 'dot') == want_dots
