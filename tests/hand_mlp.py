"""``models.MLP`` and ``models.SmoothMLP`` written out by hand, with an edit at each Dense output.

The references of the interpret tests: every Dense call's output passes through
``edit(name, output)``, so a patch, an ablation or a delta to differentiate
against is written into the model explicitly, with no perturbkit code.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp

NAMES = ('Dense_0/__call__', 'Dense_1/__call__', 'Dense_2/__call__')
SHAPE = (2, 5, 3)  # (batch, tokens, features): positions are tokens, axis 1


def by_hand(params, x, edit=lambda name, h: h, *, activation=nn.relu):
  """Dense -> activation -> Dense (+ skip) -> activation -> Dense, ``edit`` at each Dense.

  ``activation=nn.relu`` is ``models.MLP``, ``jnp.tanh`` is ``models.SmoothMLP``.
  """
  dense = lambda name, n, h: edit(f'{name}/__call__', nn.Dense(n).apply(
      {'params': params[name]}, h))
  h = activation(dense('Dense_0', 8, x))
  h = activation(dense('Dense_1', 8, h)) + h
  return dense('Dense_2', 2, h)


def outputs_by_hand(params, x, *, activation=nn.relu) -> dict:
  """Each Dense call's output, by name."""
  outputs = {}
  by_hand(params, x, lambda name, h: outputs.setdefault(name, h), activation=activation)
  return outputs


def metric_of(out):
  """A nonlinear scalar of the output, the metric the tests patch and attribute."""
  return jnp.mean(jnp.tanh(out[..., 0]) + out[..., 1] ** 2)


def problem(model: nn.Module) -> tuple:
  """``(variables, x, other)``: ``model``'s variables (jitted init, key 0) and two inputs of
  ``SHAPE`` (keys 1 and 2), the clean and corrupted (or baseline) inputs of the tests."""
  x = jax.random.normal(jax.random.key(1), SHAPE)
  other = jax.random.normal(jax.random.key(2), SHAPE)
  return jax.jit(model.init)(jax.random.key(0), x), x, other
