"""NNX per-example norms and DP-SGD where no call of a layer can give them on its own.

Layers called inside ``nnx.scan`` or ``nnx.remat``, the root module's own params, and
a weight read inline inside the model get their per-example gradients from a
per-example replay of the whole model call in the loss (``model(x)``), as Linen's do
from the top-level ``apply``. Checked against ``jax.vmap`` of ``nnx.grad`` on one
example at a time, which shares nothing with that replay; reads that no model call
covers (a penalty in the loss) stay named errors.
"""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_models as M
import perturbkit
from perturbkit.errors import ParamsReadOutsideError, PerExampleError
from test_nnx_per_example import TOL, assert_norms_equal, reference_grads


class RootScale(nnx.Module):
  """A root param scaling the output of a Linear layer."""

  def __init__(self, rngs):
    self.dense = nnx.Linear(4, 2, rngs=rngs)
    self.scale = nnx.Param(jnp.array([1.5, -0.5]))

  def __call__(self, x):
    return self.dense(x) * self.scale[...][None, :]


class InlineTied(nnx.Module):
  """The output logits from the embedding matrix read inline (no ``attend``)."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(9, 4, rngs=rngs)
    self.hidden = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, tokens):
    h = jnp.tanh(self.hidden(self.embed(tokens))).mean(axis=1)
    return h @ self.embed.embedding[...].T


class Outer(nnx.Module):
  """A scanned model as a submodule: the scan runs inside the inner model's call."""

  def __init__(self, rngs):
    self.inner = M.ScanMLP(rngs=rngs)
    self.last = nnx.Linear(2, 2, rngs=rngs)

  def __call__(self, x):
    return self.last(jnp.tanh(self.inner(x)))


class DropoutBlock(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.dropout(jnp.tanh(self.linear(x)))


def remat_scan_with_dropout(rngs):
  """Blocks with dropout stacked with ``nnx.vmap`` and run by ``nnx.scan`` under
  ``nnx.remat``, as Flax's scan-over-layers guide writes them."""
  return M.ScanMLP(width=4, depth=2, rngs=rngs, block=lambda rngs: RematBlock(rngs))


class RematBlock(nnx.Module):
  def __init__(self, rngs):
    self.block = DropoutBlock(rngs)

  def __call__(self, x):
    return nnx.remat(lambda block, x: block(x))(self.block, x)


class PositionsInside(nnx.Module):
  """Token plus position embedding, the positions made inside the model at
  ``jnp.arange(length)[None, :]`` (shared by the examples), as Flax's MiniGPT does."""

  def __init__(self, rngs):
    self.tokens = nnx.Embed(9, 2, rngs=rngs)
    self.positions = nnx.Embed(6, 2, rngs=rngs)

  def __call__(self, tokens):
    return self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1])[None, :])


def squared_error(model, x, reduction='mean'):
  terms = jnp.sum(jnp.sin(model(x)) ** 2, axis=-1)
  return terms.mean() if reduction == 'mean' else terms.sum()


X = jax.random.normal(jax.random.key(0), (5, 4))
TOKENS = jax.random.randint(jax.random.key(1), (5, 6), 0, 9)
MODELS = {
    'scan': (lambda: M.ScanMLP(rngs=nnx.Rngs(0)), X),
    'remat': (lambda: M.RematMLP(rngs=nnx.Rngs(0)), X),
    'root_param': (lambda: RootScale(nnx.Rngs(0)), X),
    'inline_tied': (lambda: InlineTied(nnx.Rngs(0)), TOKENS),
    'scan_in_a_submodule': (lambda: Outer(nnx.Rngs(0)), X),
    'positions_inside': (lambda: PositionsInside(nnx.Rngs(0)), TOKENS),
}


@pytest.mark.parametrize('reduction', ['mean', 'sum'])
@pytest.mark.parametrize('name', list(MODELS))
def test_norms_and_clipped_sum_equal_vmap_of_nnx_grad(name, reduction):
  make, x = MODELS[name]
  model = make()
  loss_fn = functools.partial(squared_error, reduction=reduction)
  per_example = reference_grads(loss_fn, model, x)
  _, norms = jax.jit(perturbkit.nnx.per_example_grad_norms(loss_fn, reduction=reduction))(
      model, x)
  assert_norms_equal(norms, per_example)

  total = norms.total
  clip_norm = float(jnp.median(total))  # about half the examples clipped
  dp = perturbkit.nnx.private_grad(loss_fn, clip_norm=clip_norm, noise_multiplier=0.0,
                                   reduction=reduction)
  grads, metrics = jax.jit(dp)(model, jax.random.key(2), x)
  factors = jnp.minimum(1.0, clip_norm / total)
  want = jax.tree.map(lambda g: jnp.tensordot(factors, g, axes=1) / len(x), per_example)
  chex.assert_trees_all_close(M.pure(grads), M.pure(want), **TOL)
  np.testing.assert_allclose(metrics['per_example_norms'], total, **TOL)


def test_scanned_blocks_take_the_gradient_of_each_iteration():
  """The stacked kernel's per-example gradient holds each iteration's own gradient."""
  model = M.ScanMLP(rngs=nnx.Rngs(0))
  per_example = reference_grads(squared_error, model, X)
  kernel = per_example['blocks']['linear']['kernel']  # (examples, depth, in, out)
  assert kernel.shape == (5, 3, 4, 4)
  _, norms = jax.jit(perturbkit.nnx.per_example_grad_norms(squared_error))(model, X)
  # The whole kernel's norm, and its first iteration's slice alone, in one compiled program.
  whole, first = jax.jit(lambda k: (jnp.sqrt(jnp.sum(k ** 2, axis=(1, 2, 3))),
                                    jnp.sqrt(jnp.sum(k[:, 0] ** 2, axis=(1, 2)))))(kernel)
  np.testing.assert_allclose(norms.by_param['blocks']['linear']['kernel'], whole, **TOL)
  # Every iteration contributes: the first block's slice alone is not the norm.
  assert float(np.min(norms.by_param['blocks']['linear']['kernel'] - first)) > 1e-4


def test_reads_outside_the_model_call_are_still_refused():
  scan = M.ScanMLP(rngs=nnx.Rngs(0))
  penalty = lambda m, x: squared_error(m, x) + 1e-2 * jnp.sum(m.blocks.linear.kernel[...] ** 2)
  with pytest.raises(ParamsReadOutsideError, match='blocks/linear'):
    perturbkit.nnx.per_example_grad_norms(penalty)(scan, X)
  root = RootScale(nnx.Rngs(0))
  scaled = lambda m, x: squared_error(m, x) + jnp.sum(m.scale[...])
  with pytest.raises(ParamsReadOutsideError, match='<root>'):
    perturbkit.nnx.private_grad(scaled, clip_norm=1.0, noise_multiplier=0.0)(
        root, jax.random.key(0), X)


def test_a_scan_in_the_loss_outside_any_model_call_is_refused():
  model = M.ScanMLP(rngs=nnx.Rngs(0))

  def loss_fn(model, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(h, block):
      return block(h)
    return jnp.mean(model.head(body(x, model.blocks)) ** 2)

  with pytest.raises(PerExampleError, match='outside any call of the whole model'):
    perturbkit.nnx.per_example_grad_norms(loss_fn)(model, X)


def test_dropout_in_eval_mode_under_remat_in_scan_is_no_draw():
  """``nnx.remat`` inside ``nnx.scan`` hands the RNG counts back as new values though
  dropout in ``model.eval()`` draws nothing: the model is replayed, not refused; in
  ``model.train()`` the draw is refused, naming the params the model call is replayed for."""
  model = remat_scan_with_dropout(nnx.Rngs(0))
  model.eval()
  _, norms = jax.jit(perturbkit.nnx.per_example_grad_norms(squared_error))(model, X)
  assert_norms_equal(norms, reference_grads(squared_error, model, X))
  model.train()
  with pytest.raises(perturbkit.RandomApplyReplayError,
                     match=r'for the params of blocks/block/linear, .*stream blocks\.block\.dropout'
                     ) as error:  # refused while tracing
    nnx.eval_shape(perturbkit.nnx.per_example_grad_norms(squared_error), model, X)
  # In NNX's words: the model call is replayed, and model.eval() is the fix.
  assert 'whole model call' in str(error.value) and 'model.eval()' in str(error.value)
  assert 'apply' not in str(error.value)
