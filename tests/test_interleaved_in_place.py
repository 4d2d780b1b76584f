"""propagate='original' updates the donated params in place: no copy of a weight in the HLO."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

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
