"""optax's per-example DP transformation is refused where it would get batch gradients.

``optax.contrib.differentially_private_aggregate`` takes the first axis of every
gradient leaf for the examples; given the batch gradient of an interleaved segment
or the already private mean of ``dp_sgd`` it would clip rows of the weight gradient.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import optax.contrib
import pytest
from flax import nnx

import perturbkit

X, Y = jnp.ones((4, 3)), jnp.zeros((4, 1))
MODEL = nn.Sequential([nn.Dense(5), nn.relu, nn.Dense(1)])
VARIABLES = MODEL.init(jax.random.key(0), X)


def loss_fn(variables, x, y):
  return jnp.mean((MODEL.apply(variables, x) - y) ** 2)


def _aggregate():
  return optax.contrib.differentially_private_aggregate(1.0, 1.0, key=0)


@pytest.mark.parametrize('optimizer', [
    lambda: optax.chain(_aggregate(), optax.sgd(0.1)),
    lambda: optax.chain(optax.clip(1.0), optax.chain(_aggregate(), optax.adam(0.1)))],
    ids=['chained_aggregate', 'nested_chain'])
def test_dp_sgd_refuses_an_optax_dp_optimizer(optimizer):
  tx = perturbkit.dp_sgd(loss_fn, optimizer(), clip_norm=1.0, noise_multiplier=1.0)
  with pytest.raises(perturbkit.OptaxPrivacyError,
                     match='perturbkit.dp_sgd.*already clipped and noised'):
    tx.init(VARIABLES)
  plain = perturbkit.dp_sgd(loss_fn, optax.sgd(0.1), clip_norm=1.0, noise_multiplier=1.0)
  assert int(plain.init(VARIABLES).step) == 0


def test_interleaved_refuses_an_optax_dp_optimizer_in_any_segment():
  every = perturbkit.interleaved(loss_fn, optax.chain(_aggregate(), optax.sgd(0.1)))
  with pytest.raises(perturbkit.OptaxPrivacyError, match='interleaved.*batch gradient'):
    every.init(VARIABLES, X, Y)
  one = perturbkit.interleaved(
      loss_fn, lambda name: optax.chain(_aggregate(), optax.sgd(0.1)) if name == 'layers_2'
      else optax.sgd(0.1))
  with pytest.raises(perturbkit.OptaxPrivacyError):
    one.init(VARIABLES, X, Y)
  perturbkit.interleaved(loss_fn, optax.sgd(0.1)).init(VARIABLES, X, Y)


def test_nnx_interleaved_refuses_an_optax_dp_optimizer():
  model = nnx.Sequential(nnx.Linear(3, 5, rngs=nnx.Rngs(0)), nnx.relu,
                         nnx.Linear(5, 1, rngs=nnx.Rngs(1)))
  nnx_loss = lambda m, x, y: jnp.mean((m(x) - y) ** 2)
  tx = perturbkit.nnx.interleaved(nnx_loss, optax.chain(_aggregate(), optax.sgd(0.1)))
  with pytest.raises(perturbkit.OptaxPrivacyError, match='interleaved'):
    tx.init(model, X, Y)
