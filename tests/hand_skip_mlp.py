"""The 'updated' interleaved step of a three-Dense MLP with a skip, written out by hand.

``Dense -> relu -> Dense -> relu (+ skip) -> Dense`` with a mean squared error: walking
backward, each layer's weight gradient at its old weights, its SGD update, then its input's
cotangent through the UPDATED weights, all with ``jax.vjp`` and no perturbkit code. The
reference of the Linen and the NNX interleaved tests (``SkipMLP`` in each), whose other
hand-written references build on the same ``dense`` and ``sgd_step``.
"""
import jax


def dense(p, x):
  return x @ p['kernel'] + p['bias'].reshape((1,) * (x.ndim - 1) + (-1,))


def sgd_step(w, g, lr):
  return jax.tree.map(lambda a, b: a - lr * b, w, g)


@jax.jit  # one compile, not one per op
def updated_step(p0, p1, p2, x, y, lr):
  """``(new weights, output cotangents, weight gradients)``, each first layer to last."""
  # Forward at the old weights.
  z0 = dense(p0, x)
  h = jax.nn.relu(z0)
  z1 = dense(p1, h)
  h2 = jax.nn.relu(z1) + h
  out = dense(p2, h2)
  g_out = 2 * (out - y) / out.size
  # Each layer: dw at the old weights, update, input cotangent with the NEW weights.
  dw2 = jax.vjp(dense, p2, h2)[1](g_out)[0]
  w2 = sgd_step(p2, dw2, lr)
  g_h2 = jax.vjp(lambda a: dense(w2, a), h2)[1](g_out)[0]
  # Dense_1 sees the cotangent through its relu; h gets the skip part directly.
  g_z1 = g_h2 * (z1 > 0)
  dw1 = jax.vjp(dense, p1, h)[1](g_z1)[0]
  w1 = sgd_step(p1, dw1, lr)
  g_h = g_h2 + jax.vjp(lambda a: dense(w1, a), h)[1](g_z1)[0]
  g_z0 = g_h * (z0 > 0)
  dw0 = jax.vjp(dense, p0, x)[1](g_z0)[0]
  w0 = sgd_step(p0, dw0, lr)
  return (w0, w1, w2), (g_z0, g_z1, g_out), (dw0, dw1, dw2)
