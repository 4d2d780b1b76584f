"""A LoRA-style dense layer (``x @ kernel + bias + x @ lora_a @ lora_b``) written out by hand.

The reference of the interleaved tests on layers that subclass ``nn.Dense`` /
``nnx.Linear`` and call ``super().__call__`` (``models.LoRADense``,
``nnx_models.LoRALinear``): the forward pass, its gradients by the chain rule (no
``jax.vjp``), and the ``propagate='updated'`` SGD step of the 2-layer net
``head(tanh(hidden(x)))`` under the mean squared error, layer by layer.
"""
import jax
import jax.numpy as jnp


def lora(p, x):
  """``x @ kernel + bias + (x @ lora_a) @ lora_b`` for a batch ``x`` of shape ``(n, din)``."""
  return x @ p['kernel'] + p['bias'][None] + (x @ p['lora_a']) @ p['lora_b']


def lora_backward(p, x, g):
  """``(dparams, dx)`` of ``sum(lora(p, x) * g)``, by the chain rule."""
  g_low = g @ p['lora_b'].T
  grads = {'kernel': x.T @ g, 'bias': g.sum(0), 'lora_a': x.T @ g_low,
           'lora_b': (x @ p['lora_a']).T @ g}
  return grads, g @ p['kernel'].T + g_low @ p['lora_a'].T


def sgd(p, grads, lr):
  return jax.tree.map(lambda w, g: w - lr * g, p, grads)


def updated_sgd_step(params, x, y, lr):
  """One interleaved ``'updated'`` SGD step of ``mean((head(tanh(hidden(x))) - y) ** 2)``:
  the head's gradient at its old weights, its step, then the cotangent below at its NEW
  weights, and the hidden layer's step from it."""
  z = lora(params['hidden'], x)
  h = jnp.tanh(z)
  out = lora(params['head'], h)
  g_out = 2 * (out - y) / out.size
  d_head, _ = lora_backward(params['head'], h, g_out)
  head = sgd(params['head'], d_head, lr)
  _, g_h = lora_backward(head, h, g_out)
  d_hidden, _ = lora_backward(params['hidden'], x, g_h * (1 - h ** 2))
  return {'hidden': sgd(params['hidden'], d_hidden, lr), 'head': head}
