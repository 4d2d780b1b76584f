"""The data and model of the demo: scikit-learn's bundled 8x8 digits and a small CNN.

Nothing here is downloaded: ``load_digits`` ships with scikit-learn.
"""
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

NUM_CLASSES = 10


class Digits(NamedTuple):
  """A fixed train/test split of the digits, images shaped ``(N, 8, 8, 1)`` in ``[0, 1]``."""
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray


def load_digits(test_fraction: float = 0.25, seed: int = 0) -> Digits:
  """Loads the 1,797 digits, scales pixels to ``[0, 1]`` and splits them (stratified).

  Args:
    test_fraction: The share of images held out for testing.
    seed: Seed of the split; the same seed gives the same split.

  Returns:
    A :class:`Digits` of float32 images and int32 labels.

  Example:
    >>> data = load_digits()
    >>> data.x_train.shape[1:], data.x_train.dtype, int(data.x_train.max())
    ((8, 8, 1), dtype('float32'), 1)
  """
  from sklearn.datasets import load_digits as sklearn_digits
  from sklearn.model_selection import train_test_split

  bunch = sklearn_digits()
  # The pixels are integer intensities 0..16.
  images = (bunch.images / 16.0).astype(np.float32)[..., None]
  labels = bunch.target.astype(np.int32)
  x_train, x_test, y_train, y_test = train_test_split(
      images, labels, test_size=test_fraction, random_state=seed, stratify=labels)
  return Digits(x_train, y_train, x_test, y_test)


class SmallCNN(nn.Module):
  """Two convolutions and two dense layers; relu and pooling are glue in ``__call__``.

  Its top-level submodule calls, ``Conv_0``, ``Conv_1``, ``Dense_0`` and
  ``Dense_1``, are the default segments of ``perturbkit.interleaved``.

  Attributes:
    features: Channels of the two convolutions.
    hidden: Width of the hidden dense layer.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> model = SmallCNN()
    >>> variables = model.init(jax.random.key(0), jnp.zeros((2, 8, 8, 1)))
    >>> list(variables['params'])
    ['Conv_0', 'Conv_1', 'Dense_0', 'Dense_1']
    >>> model.apply(variables, jnp.zeros((2, 8, 8, 1))).shape
    (2, 10)
  """
  features: tuple[int, int] = (16, 32)
  hidden: int = 64

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.relu(nn.Conv(self.features[0], (3, 3))(x))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = nn.relu(nn.Conv(self.features[1], (3, 3))(x))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(NUM_CLASSES)(x)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy of integer labels.

  Example:
    >>> import jax.numpy as jnp
    >>> round(float(cross_entropy(jnp.zeros((3, 10)), jnp.array([0, 1, 2]))), 4)
    2.3026
  """
  log_probs = jax.nn.log_softmax(logits)
  picked = jnp.take_along_axis(log_probs, labels[:, None], axis=1)
  return -jnp.mean(picked)


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """The fraction of rows whose largest logit is the label.

  Example:
    >>> import jax.numpy as jnp
    >>> float(accuracy(jnp.eye(3), jnp.array([0, 1, 1])))
    0.666...
  """
  return jnp.mean(jnp.argmax(logits, axis=-1) == labels)
