"""The demo's three runs with Flax NNX (``python -m perturbkit.demo --api nnx``).

The NNX twin of the demo's ``SmallCNN`` starts from the Linen model's initial
weights (same attribute names), so the table can be compared with the Linen
one. The runs are written the NNX way: the standard one with ``nnx.Optimizer``
inside ``nnx.jit``, the interleaved ones with
``perturbkit.nnx.InterleavedOptimizer``, both updating the model in place.
"""
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import perturbkit
from perturbkit.demo._digits import NUM_CLASSES, cross_entropy


class NNXSmallCNN(nnx.Module):
  """The NNX twin of ``SmallCNN``: two convolutions, two linear layers.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> NNXSmallCNN(rngs=nnx.Rngs(0))(jnp.zeros((2, 8, 8, 1))).shape
    (2, 10)
  """

  def __init__(self, features: tuple[int, int] = (16, 32), hidden: int = 64, *,
               rngs: nnx.Rngs):
    # Linen's automatic names, so the weights and the plot labels carry over.
    self.Conv_0 = nnx.Conv(1, features[0], (3, 3), rngs=rngs)
    self.Conv_1 = nnx.Conv(features[0], features[1], (3, 3), rngs=rngs)
    self.Dense_0 = nnx.Linear(features[1] * 2 * 2, hidden, rngs=rngs)
    self.Dense_1 = nnx.Linear(hidden, NUM_CLASSES, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.avg_pool(nnx.relu(self.Conv_0(x)), (2, 2), strides=(2, 2))
    x = nnx.avg_pool(nnx.relu(self.Conv_1(x)), (2, 2), strides=(2, 2))
    x = nnx.relu(self.Dense_0(x.reshape((x.shape[0], -1))))
    return self.Dense_1(x)


def from_linen(params: dict) -> NNXSmallCNN:
  """An ``NNXSmallCNN`` holding the Linen ``SmallCNN``'s ``params``."""
  model = NNXSmallCNN(rngs=nnx.Rngs(0))
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
  nnx.update(model, state)
  return model


def loss_fn(model: NNXSmallCNN, x: jax.Array, y: jax.Array) -> jax.Array:
  """The ordinary NNX loss on the unmodified model."""
  return cross_entropy(model(x), y)


class ModelState:
  """A run's model and optimizer objects, seen by the demo's ``train`` loop as a state."""

  def __init__(self, model: nnx.Module, optimizer: Any):
    self.model, self.optimizer = model, optimizer

  @property
  def variables(self) -> nnx.State:
    return nnx.state(self.model)


class Evaluator:
  """``apply(variables, x)`` on the NNX model, the one method the demo's ``evaluate`` calls."""

  def __init__(self, model: nnx.Module):
    self.graphdef = nnx.graphdef(model)
    self._apply = jax.jit(lambda variables, x: nnx.merge(self.graphdef, variables)(x))

  def apply(self, variables: nnx.State, x: jax.Array) -> jax.Array:
    return self._apply(variables, x)


def standard_step(state: ModelState, x, y):
  """``nnx.value_and_grad`` + ``nnx.Optimizer.update``: the usual NNX training step."""
  return state, _standard(state.model, state.optimizer, x, y)


@nnx.jit
def _standard(model, optimizer, x, y):
  loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
  optimizer.update(model, grads)
  return {'loss': loss}


def interleaved_step(state: ModelState, x, y):
  """``perturbkit.nnx.InterleavedOptimizer.step`` inside ``nnx.jit``."""
  return state, _interleaved(state.model, state.optimizer, x, y)


@nnx.jit
def _interleaved(model, optimizer, x, y):
  return optimizer.step(model, x, y)


def make_probe(graphdef: Any) -> Callable[..., dict]:
  """A jitted ``(variables, x, y) -> {layer: norm}`` from ``perturbkit.nnx.value_and_grad``."""
  value_and_grad = perturbkit.nnx.value_and_grad(loss_fn)

  @jax.jit
  def probe(variables, x, y):
    _, grads = value_and_grad(nnx.merge(graphdef, variables), x, y)
    return {name: jnp.linalg.norm(point['__call__'])
            for name, point in grads['perturbations'].items()}
  return probe


def runs(params: dict, optimizer: optax.GradientTransformation, example: tuple,
         names: tuple[str, str, str]) -> dict:
  """``{run name: (step, state, evaluator, probe)}`` for the standard and the two interleaved runs."""
  model = from_linen(params)
  out = {names[0]: (standard_step,
                    ModelState(model, nnx.Optimizer(model, optimizer, wrt=nnx.Param)),
                    Evaluator(model), make_probe(nnx.graphdef(model)))}
  for name, propagate in zip(names[1:], ('updated', 'original')):
    model = from_linen(params)
    opt = perturbkit.nnx.InterleavedOptimizer(model, optimizer, loss_fn, *example,
                                              propagate=propagate)
    out[name] = (interleaved_step, ModelState(model, opt), Evaluator(model), None)
  return out
