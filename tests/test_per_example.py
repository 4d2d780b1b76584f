"""Per-example gradient norms and DP-SGD against per-example gradients from ``jax.vmap(jax.grad)``.

The reference runs the ordinary loss on each example alone (a batch of one) and
differentiates it with plain ``jax.grad``: it shares nothing with perturbkit's
rules (ghost norms, patches, replayed VJPs), so agreement to float tolerance
checks every rule and the mean-loss scaling. DP-SGD under ``jax.shard_map`` on 4 of
the test process's host CPU devices is checked against one device.
"""
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import models
import nnx_models
import perturbkit
from host_devices import data_mesh

TOL = dict(rtol=2e-4, atol=1e-5)
TOL64 = dict(rtol=1e-9, atol=1e-12)  # float64


def cross_entropy(logits, labels):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def classification_loss(model, reduction='mean'):
  def loss_fn(variables, x, y):
    terms = optax.softmax_cross_entropy_with_integer_labels(model.apply(variables, x), y)
    return terms.mean() if reduction == 'mean' else terms.sum()
  return loss_fn


def per_example_grads(loss_fn, variables, *args):
  """Each example's params gradient: the loss of that example alone, by ``jax.grad``."""
  def one(*example):
    batch = [a[None] for a in example]
    return jax.grad(lambda p: loss_fn({**variables, 'params': p}, *batch))(variables['params'])
  return jax.vmap(one)(*args)


def reference_grads(loss_fn, variables, *args):
  """:func:`per_example_grads`, jitted."""
  return jax.jit(functools.partial(per_example_grads, loss_fn))(variables, *args)


@jax.jit  # one compile per tree instead of one op-by-op compile per leaf shape
def norms_of(per_example):
  """``(examples,)`` norms of each leaf, and the total, of per-example gradients."""
  sq = jax.tree.map(lambda g: jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1), per_example)
  return jax.tree.map(jnp.sqrt, sq), jnp.sqrt(sum(jax.tree.leaves(sq)))


def assert_norms_equal(norms, per_example, tol):
  """``norms`` (by param, in total, and each layer's from its own params) equal those of the
  reference per-example gradients ``per_example``."""
  by_param, total = norms_of(per_example)
  chex.assert_trees_all_close(norms.by_param, by_param, **tol)
  np.testing.assert_allclose(norms.total, total, **tol)
  for name, layer in norms.by_layer.items():
    node = by_param
    for key in name.split('/') if name else ():
      node = node[key]
    own = [v for v in node.values() if not isinstance(v, dict)]
    np.testing.assert_allclose(layer, jnp.sqrt(sum(v ** 2 for v in own)), **tol)
  return by_param


def assert_norms_match(loss_fn, variables, *args, tol=None, **options):
  @jax.jit  # one compile for both sides and the loss
  def both(variables, *args):
    loss, norms = perturbkit.per_example_grad_norms(loss_fn, **options)(variables, *args)
    return loss, norms, norms_of(per_example_grads(loss_fn, variables, *args)), loss_fn(
        variables, *args)

  loss, norms, reference_norms, want_loss = both(variables, *args)
  return assert_loss_and_norms_equal(loss, norms, reference_norms, want_loss, tol)


def assert_loss_and_norms_equal(loss, norms, reference_norms, want_loss, tol=None):
  """``norms`` (by param and in total) equal ``reference_norms`` (:func:`norms_of` the
  reference per-example gradients) and ``loss`` the loss itself, to ``tol`` (default
  ``TOL``); returns ``norms``."""
  tol = tol or TOL
  by_param, total = reference_norms
  chex.assert_trees_all_close(norms.by_param, by_param, **tol)
  np.testing.assert_allclose(norms.total, total, **tol)
  np.testing.assert_allclose(loss, want_loss, rtol=min(1e-5, tol['rtol']))
  return norms


def norms_by_method(loss_fn, variables, methods, *args):
  """``per_example_grad_norms``' ``(loss, norms)`` for each ``dense_method`` in ``methods``,
  the reference's norms ``(by_param, total)`` and the loss: jitted together, one compile for
  every method and the reference."""
  @jax.jit
  def run(variables, *args):
    return ({method: perturbkit.per_example_grad_norms(loss_fn, dense_method=method)(
        variables, *args) for method in methods},
            norms_of(per_example_grads(loss_fn, variables, *args)), loss_fn(variables, *args))
  return run(variables, *args)


def assert_method_matches(results, method):
  """``method``'s norms and loss in :func:`norms_by_method`'s ``results`` equal the
  reference's, as :func:`assert_norms_match` checks them."""
  by_method, reference_norms, want_loss = results
  return assert_loss_and_norms_equal(*by_method[method], reference_norms, want_loss)


# -- models ------------------------------------------------------------------------------


class ConvNet(nn.Module):
  """Strided SAME conv, dilated VALID conv without bias, explicit padding, Dense head."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(4, (3, 3), strides=2, padding='SAME')(x))
    x = nn.relu(nn.Conv(3, (2, 2), kernel_dilation=2, padding='VALID', use_bias=False)(x))
    x = nn.Conv(2, (1, 2), padding=((1, 0), (0, 1)))(x)
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


class ConvKinds(nn.Module):
  """Direct conv kernels of each kind: kept per example (the kernel is smaller than the
XX
  conv module called twice, whose uses add up per kernel offset."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(4, (3, 3), strides=(2, 1), padding=((1, 1), (0, 2)))(x))  # kept
    x = nn.relu(nn.Conv(16, (3, 3), padding='SAME')(x))  # squares only
    shared = nn.Conv(16, (2, 2), kernel_dilation=(1, 2), padding='SAME', use_bias=False)
    x = shared(nn.relu(shared(x)))
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


class SeqModel(nn.Module):
  """Embed -> LayerNorm -> attention (DenseGeneral: general path) -> Dense on tokens -> head."""
  vocab: int = 11
  dim: int = 8

  @nn.compact
  def __call__(self, ids):
    h = nn.Embed(self.vocab, self.dim)(ids)
    h = h + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(nn.LayerNorm()(h))
    h = h + nn.Dense(self.dim)(nn.gelu(nn.Dense(16)(nn.RMSNorm()(h))))
    return nn.Dense(3)(h.mean(axis=1))


class Tied(nn.Module):
  """A shared Dense applied twice and an embedding tied to the output (call + attend)."""
  vocab: int = 7

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(self.vocab, 6)
    shared = nn.Dense(6)
    h = embed(ids)
    h = shared(nn.tanh(shared(h)))
    return embed.attend(h.mean(axis=1))


class Gated(nn.Module):
  """A layer with its own params used nonlinearly, and a child Dense: the general path."""

  @nn.compact
  def __call__(self, x):
    gate = self.param('gate', nn.initializers.normal(1.0), (x.shape[-1],))
    return nn.Dense(4)(x * jax.nn.sigmoid(gate[None, :] * x)) + gate[None, :4]


class WithGated(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(nn.relu(Gated()(x)))


class Mix(nn.Module):
  """General path with two inputs: per-example rows ``x`` and a ``table`` shared by all."""

  @nn.compact
  def __call__(self, x, table):
    w = self.param('w', nn.initializers.normal(1.0), (table.shape[-1], x.shape[-1]))
    return x * jnp.tanh(jnp.mean(table @ w, axis=0))[None, :]


class WithTable(nn.Module):
  @nn.compact
  def __call__(self, x, table):
    return nn.Dense(3)(Mix()(nn.Dense(6)(x), table))


class Positions(nn.Module):
  """Learned positions looked up with ``jnp.arange`` (the same for every example), or given."""
  given: bool = False

  @nn.compact
  def __call__(self, x, positions=None):
    embed = nn.Embed(x.shape[1], x.shape[2])
    h = embed(positions) if self.given else embed(jnp.arange(x.shape[1]))[None]
    return nn.Dense(2)(x + h)


class RootParam(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(x) * self.param('scale', nn.initializers.ones, (2,))[None, :]


def _seq_problem(key, batch=5, length=4, vocab=11):
  ids = jax.random.randint(key, (batch, length), 0, vocab)
  return ids, jnp.arange(batch) % 3


# -- norms against vmap(grad) -------------------------------------------------------------


@pytest.fixture(scope='module')
def mlp_norms():
  """For each reduction, the MLP's ``per_example_grad_norms`` ``(loss, norms)`` with that
  reduction, the reference's norms ``(by_param, total)`` and the loss: jitted together, one
  compile for both reductions and their references."""
  model = models.MLP(out=3)
  x = jax.random.normal(jax.random.key(0), (6, 5))
  y = jnp.arange(6) % 3
  variables = jax.jit(model.init)(jax.random.key(1), x)

  @jax.jit
  def run(variables, x, y):
    out = {}
    for reduction in ('mean', 'sum'):
      loss_fn = classification_loss(model, reduction)
      out[reduction] = (
          perturbkit.per_example_grad_norms(loss_fn, reduction=reduction)(variables, x, y),
          norms_of(per_example_grads(loss_fn, variables, x, y)), loss_fn(variables, x, y))
    return out
  return run(variables, x, y)


@pytest.mark.parametrize('reduction', ['mean', 'sum'])
def test_mlp(reduction, mlp_norms):
  (loss, norms), reference_norms, want_loss = mlp_norms[reduction]
  assert_loss_and_norms_equal(loss, norms, reference_norms, want_loss)


def test_mean_loss_scaled_to_each_term(mlp_norms):
  """A mean loss's norms are the terms' norms: the same as the sum loss's, not 1/B of them."""
  (_, mean), _, _ = mlp_norms['mean']
  (_, summed), _, _ = mlp_norms['sum']
  np.testing.assert_allclose(mean.total, summed.total, rtol=1e-5)


@pytest.fixture(scope='module')
def cnn_norms():
  """:func:`norms_by_method` of ``ConvNet`` by the ghost and direct methods."""
  model = ConvNet()
  x = jax.random.normal(jax.random.key(0), (4, 9, 9, 2))
  y = jnp.arange(4) % 3
  variables = jax.jit(model.init)(jax.random.key(1), x)
  return norms_by_method(classification_loss(model), variables, ('ghost', 'direct'), x, y)


@pytest.mark.parametrize('method', ['ghost', 'direct'])
def test_cnn(method, cnn_norms):
  assert_method_matches(cnn_norms, method)


def test_conv_direct_paths():
  model = ConvKinds()
  x = jax.random.normal(jax.random.key(0), (3, 6, 5, 2))
  y = jnp.arange(3) % 3
  variables = jax.jit(model.init)(jax.random.key(1), x)
  loss_fn = classification_loss(model)
  norms_fn = perturbkit.per_example_grad_norms(loss_fn, dense_method='direct')
  # Each step jitted with its reference: one compile for both sides.
  (loss, norms), per_example, want_loss = jax.jit(lambda v, x, y: (
      norms_fn(v, x, y), per_example_grads(loss_fn, v, x, y), loss_fn(v, x, y)))(
          variables, x, y)
  reference_norms = norms_of(per_example)
  assert_loss_and_norms_equal(loss, norms, reference_norms, want_loss)
  _, total = reference_norms
  key = jax.random.key(3)
  clip = float(jnp.median(total))
  dp = perturbkit.private_grad(loss_fn, clip_norm=clip, noise_multiplier=0.5,
                               dense_method='direct')
  grads, (want, _, _) = jax.jit(lambda v, per_example, key, x, y: (
      dp(v, key, x, y)[0], _clipped_noised_mean(per_example, key, clip, 0.5)))(
          variables, per_example, key, x, y)
  chex.assert_trees_all_close(grads, want, **TOL)


@pytest.fixture(scope='module')
def transformer_norms():
  """:func:`norms_by_method` of ``SeqModel`` by each method."""
  model = SeqModel()
  ids, y = _seq_problem(jax.random.key(0))
  variables = jax.jit(model.init)(jax.random.key(1), ids)
  return norms_by_method(classification_loss(model), variables, ('ghost', 'direct', 'auto'),
                         ids, y)


@pytest.mark.parametrize('method', ['ghost', 'direct', 'auto'])
def test_transformer(method, transformer_norms):
  norms = assert_method_matches(transformer_norms, method)
  assert set(norms.by_layer) >= {'Embed_0', 'LayerNorm_0', 'RMSNorm_0', 'Dense_0',
                                 'MultiHeadDotProductAttention_0/query'}


def test_shared_and_tied():
  """Uses of one module add up before the norm (the cross terms between uses count)."""
  model = Tied()
  ids, y = _seq_problem(jax.random.key(2), vocab=7)
  variables = jax.jit(model.init)(jax.random.key(1), ids)
  results = norms_by_method(classification_loss(model), variables, ('ghost', 'direct'), ids, y)
  for method in ('ghost', 'direct'):
    assert_method_matches(results, method)


def test_shared_dense_cross_terms_matter():
  """The norm of the sum of two uses differs from the norms of the uses added in quadrature."""
  model = models.SharedDense()
  x = jax.random.normal(jax.random.key(0), (5, 4))
  variables = jax.jit(model.init)(jax.random.key(1), x)
  loss_fn = lambda v, x: jnp.mean(jnp.sum(model.apply(v, x) ** 2, axis=-1))
  norms = assert_norms_match(loss_fn, variables, x)
  assert not np.allclose(norms.by_layer['shared'], 0.0)


def test_general_path():
  model = WithGated()
  x = jax.random.normal(jax.random.key(0), (5, 6))
  y = jnp.arange(5) % 2
  variables = jax.jit(model.init)(jax.random.key(1), x)
  assert_norms_match(classification_loss(model), variables, x, y)


class Bf16Net(nn.Module):
  """Embed, LayerNorm, Dense and Conv layers computing in bfloat16."""

  @nn.compact
  def __call__(self, ids):
    low = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    x = nn.LayerNorm(**low)(nn.Embed(50, 32, **low)(ids))
    for width in (64, 64, 8):
      x = jnp.tanh(nn.Dense(width, **low)(x))
    return nn.Conv(4, (3,), **low)(x)


def dense_inputs_and_output_grads(model, variables, loss_fn, ids):
  """Each Dense call's input and the loss's gradient at its output (``nn.intercept_methods``)."""
  def loss_with(deltas):
    inputs = {}

    def interceptor(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      if not isinstance(context.module, nn.Dense):
        return out
      inputs[context.module.name] = args[0]
      return out + deltas[context.module.name]

    with nn.intercept_methods(interceptor):
      return loss_fn(variables, ids), inputs

  zeros = {f'Dense_{i}': jnp.zeros(ids.shape + (w,), jnp.bfloat16)
           for i, w in enumerate((64, 64, 8))}
  grads, inputs = jax.grad(loss_with, has_aux=True)(zeros)
  return inputs, grads


@pytest.mark.parametrize('method', ['ghost', 'direct'])
def test_bf16_model_norms_are_summed_in_float32(method):
  """A bfloat16 model's squared norms (sums over thousands of products) are taken in float32,
  not rounded to bfloat16's 3 digits (0.3% off before), and every norm is float32.

  The Dense kernels' norms equal float64 sums of ``sum_t a_t g_tᵀ`` from the layer's bfloat16
  input and output gradient (``nn.intercept_methods``) to 1e-5. ``vmap(grad)``'s per-example
  gradients, being rounded to bfloat16 entry by entry, bound the agreement of the other params
  to that rounding. Op by op (not jitted), so both sides round the model's values alike."""
  model = Bf16Net()
  ids = jax.random.randint(jax.random.key(0), (8, 16), 0, 50)
  variables = jax.jit(model.init)(jax.random.key(1), ids)
  loss_fn = lambda v, ids: jnp.mean(model.apply(v, ids).astype(jnp.float32) ** 2)
  _, norms = perturbkit.per_example_grad_norms(loss_fn, dense_method=method)(variables, ids)
  assert all(n.dtype == jnp.float32 for n in jax.tree.leaves(norms))

  inputs, grads = dense_inputs_and_output_grads(model, variables, loss_fn, ids)
  for name, a in inputs.items():
    # A mean over 8 examples: each term's gradient is 8 times the batch loss's.
    kernel = np.einsum('bti,bto->bio', np.asarray(a, np.float64),
                       8 * np.asarray(grads[name], np.float64))
    np.testing.assert_allclose(norms.by_param[name]['kernel'],
                               np.sqrt(np.sum(kernel.reshape(8, -1) ** 2, axis=1)), rtol=1e-5)

  one = lambda i: jax.grad(lambda p: loss_fn({'params': p}, i[None]))(variables['params'])
  squares = jax.tree.map(lambda g: np.sum(np.asarray(g, np.float64).reshape(8, -1) ** 2, axis=1),
                         jax.vmap(one)(ids))
  chex.assert_trees_all_close(norms.by_param, jax.tree.map(np.sqrt, squares), rtol=1e-2)
  np.testing.assert_allclose(norms.total, np.sqrt(sum(jax.tree.leaves(squares))), rtol=1e-3)


def test_batch_axes_time_major_labels():
  """Examples on axis 1 of one argument, axis 0 of the other."""
  model = models.MLP(out=3)
  x = jax.random.normal(jax.random.key(0), (6, 5))
  y = jnp.arange(6) % 3
  variables = jax.jit(model.init)(jax.random.key(1), x)
  loss_fn = lambda v, xt, y: classification_loss(model)(v, xt.T, y)
  _, norms = jax.jit(perturbkit.per_example_grad_norms(loss_fn, batch_axes=(1, 0)))(
      variables, x.T, y)
  _, total = norms_of(reference_grads(classification_loss(model), variables, x, y))
  np.testing.assert_allclose(norms.total, total, **TOL)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(depth=st.integers(1, 3), width=st.integers(1, 6), length=st.integers(0, 4),
       bias=st.booleans(), norm=st.sampled_from([None, 'layer', 'rms']),
       conv=st.booleans(), method=st.sampled_from(['auto', 'ghost', 'direct']),
       batch=st.integers(1, 5), seed=st.integers(0, 2 ** 16))
def test_random_architectures(depth, width, length, bias, norm, conv, method, batch, seed):
  """Compared in float64: some drawn models are ill-conditioned in float32 (a LayerNorm over
  2 features after a saturated tanh amplifies rounding past 1e-3 relative, in the reference as
  much as in perturbkit), so float32 would test the rounding, not the rules."""
  class Random(nn.Module):
    @nn.compact
    def __call__(self, x):
      if conv:
        x = nn.Conv(width, (2,), padding='SAME', use_bias=bias)(x)
      for _ in range(depth):
        x = nn.tanh(nn.Dense(width, use_bias=bias)(x))
        if norm == 'layer':
          x = nn.LayerNorm(use_scale=bias)(x)
        elif norm == 'rms':
          x = nn.RMSNorm()(x)
      return nn.Dense(2)(x.reshape(x.shape[0], -1))

  shape = (batch, length, 3) if length else (batch, 3)
  if conv and not length:
    shape = (batch, 2, 3)
  model = Random()
  loss_fn = lambda v, x: jnp.mean(jnp.sum(jnp.sin(model.apply(v, x)), axis=-1))
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float64)
    variables = jax.tree.map(lambda p: p.astype(jnp.float64),
                             jax.jit(model.init)(jax.random.key(seed + 1), x))
    assert_norms_match(loss_fn, variables, x, dense_method=method, tol=TOL64)


# -- DP-SGD ------------------------------------------------------------------------------


def documented_noise(key, shape):
  """The stream ``add_noise`` documents: a leaf of n entries is m rows of n/m draws, where m
  is the largest divisor of n that is at most 16 and leaves rows of at least 2**14."""
  n = int(np.prod(shape))
  rows = max(m for m in range(1, 17) if n % m == 0 and (m == 1 or n // m >= 2 ** 14))
  if rows == 1:
    return jax.random.normal(key, shape)
  draws = [jax.random.normal(k, (n // rows,)) for k in jax.random.split(key, rows)]
  return jnp.concatenate(draws).reshape(shape)


def reference_private_grad(loss_fn, variables, key, clip_norm, noise_multiplier, *args,
                           per_example=None):
  """Clip :func:`reference_grads` (or the given ``per_example``), sum, add the documented noise
  and divide by B: jitted, as the reference gradients are."""
  if per_example is None:
    per_example = reference_grads(loss_fn, variables, *args)
  return _clipped_noised_mean(per_example, key, clip_norm, noise_multiplier)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _clipped_noised_mean(per_example, key, clip_norm, noise_multiplier):
  _, total = norms_of(per_example)
  factors = jnp.minimum(1.0, clip_norm / total)
  summed = jax.tree.map(lambda g: jnp.tensordot(factors, g, axes=1), per_example)
  leaves, treedef = jax.tree.flatten(summed)
  keys = jax.random.split(key, len(leaves))
  noise = [noise_multiplier * clip_norm * documented_noise(k, x.shape)
           for k, x in zip(keys, leaves)]
  batch = total.shape[0]
  return (jax.tree.unflatten(treedef, [(s + n) / batch for s, n in zip(leaves, noise)]),
          total, jnp.mean(total > clip_norm))


@pytest.mark.parametrize('name', ['mlp', 'wide', 'cnn', 'tied'])
def test_private_grad_matches_vmap_grad(name):
  if name == 'mlp':
    model, x = models.MLP(out=3), jax.random.normal(jax.random.key(0), (6, 5))
  elif name == 'wide':  # kernels whose noise is drawn in 2 and 9 rows
    model, x = models.MLP((384, 384), out=3), jax.random.normal(jax.random.key(0), (6, 96))
  elif name == 'cnn':
    model, x = ConvNet(), jax.random.normal(jax.random.key(0), (6, 9, 9, 2))
  else:  # a shared Dense (fast path) and a tied embedding (general path)
    model, (x, _) = Tied(), _seq_problem(jax.random.key(0), batch=6, vocab=7)
  y = jnp.arange(6) % 3
  variables = jax.jit(model.init)(jax.random.key(1), x)
  loss_fn = classification_loss(model)
  key = jax.random.key(7)
  # The reference gradients and the median of their norms: one compile.
  per_example, median = jax.jit(lambda v, x, y: (
      (pe := per_example_grads(loss_fn, v, x, y)), jnp.median(norms_of(pe)[1])))(
          variables, x, y)
  clip = float(median)  # about half the examples are clipped
  dp = perturbkit.private_grad(loss_fn, clip_norm=clip, noise_multiplier=0.7)
  # One compile for both sides.
  (grads, metrics), (want, want_norms, want_clipped) = jax.jit(
      lambda v, per_example, key, x, y: (
          dp(v, key, x, y), _clipped_noised_mean(per_example, key, clip, 0.7)))(
              variables, per_example, key, x, y)
  chex.assert_trees_all_close(grads, want, **TOL)
  np.testing.assert_allclose(metrics['per_example_norms'], want_norms, **TOL)
  np.testing.assert_allclose(metrics['fraction_clipped'], want_clipped)
  assert 0 < float(metrics['fraction_clipped']) < 1


def test_dp_sgd_step_is_optax_on_private_grad():
  model = models.MLP(out=3)
  x = jax.random.normal(jax.random.key(0), (6, 5))
  y = jnp.arange(6) % 3
  variables = jax.jit(model.init)(jax.random.key(1), x)
  loss_fn = classification_loss(model)
  tx = perturbkit.dp_sgd(loss_fn, optax.sgd(0.5), clip_norm=0.3, noise_multiplier=1.0)
  state = tx.init(variables)
  step = jax.jit(chex.assert_max_traces(tx.step, n=1))
  key = jax.random.key(3)
  new_state, metrics = step(state, key, x, y)
  want, _, _ = reference_private_grad(loss_fn, variables, key, 0.3, 1.0, x, y)
  # The SGD step and the loss, jitted: one compile, not one per leaf and op.
  expected, want_loss = jax.jit(lambda v, want, x, y: (
      jax.tree.map(lambda p, g: p - 0.5 * g, v['params'], want), loss_fn(v, x, y)))(
          variables, want, x, y)
  chex.assert_trees_all_close(new_state.variables['params'], expected, **TOL)
  assert int(new_state.step) == 1
  np.testing.assert_allclose(metrics['loss'], want_loss, rtol=1e-6)
  step(new_state, jax.random.key(4), x, y)  # no retrace


def test_noise_has_the_right_scale():
  """With every example clipped to a tiny norm, the gradient is the noise: std σC/B.

  The 96x384 kernel's noise is drawn in two rows; they must be independent draws.
  """
  model = models.MLP(features=(384, 384), out=3)
  x = jax.random.normal(jax.random.key(0), (4, 96))
  y = jnp.arange(4) % 3
  variables = jax.jit(model.init)(jax.random.key(1), x)
  dp = perturbkit.private_grad(classification_loss(model), clip_norm=1e-6, noise_multiplier=2e5)
  grads, _ = jax.jit(dp)(variables, jax.random.key(0), x, y)

  @jax.jit  # the statistics in one compile, not one per op
  def statistics(grads):
    noise = jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads)])
    rows = grads['Dense_0']['kernel'].reshape(2, -1)
    return jnp.std(noise), jnp.mean(noise), jnp.std(rows, axis=1), jnp.corrcoef(rows)[0, 1]
  std, mean, row_std, correlation = statistics(grads)
  np.testing.assert_allclose(std, 2e5 * 1e-6 / 4, rtol=0.02)
  np.testing.assert_allclose(mean, 0.0, atol=0.02 * 2e5 * 1e-6 / 4)
  np.testing.assert_allclose(row_std, 2e5 * 1e-6 / 4, rtol=0.03)
  assert abs(float(correlation)) < 0.03


DP_OPTIONS = dict(clip_norm=0.2, noise_multiplier=1.5)


def on_4_devices(grad_fn):
  """``grad_fn(params, key, x, y)`` jitted under ``jax.shard_map`` on 4 devices: the batch
  split over 'data' (two examples each), the params and key replicated."""
  metric_specs = {'loss': P(), 'per_example_norms': P('data'), 'fraction_clipped': P(),
                  'dropped': P()}
  return jax.jit(jax.shard_map(grad_fn, mesh=data_mesh(4),
                               in_specs=(P(), P(), P('data'), P('data')),
                               out_specs=(P(), metric_specs), check_vma=False))


def dp_batch():
  x = jax.random.normal(jax.random.key(0), (8, 5))
  return x, jnp.arange(8) % 3, jax.random.key(5)


@pytest.mark.parametrize('reduction', ['mean', 'sum'])
def test_shard_map_adds_noise_once(reduction):
  """Four devices with two examples each give the one-device gradient and metrics, noise
  included (the loss the whole batch's: the devices' mean, or for a sum their sum)."""
  model = models.MLP(out=3)
  x, y, key = dp_batch()
  variables = jax.jit(model.init)(jax.random.key(1), x)
  loss_fn = classification_loss(model, reduction)
  single, single_metrics = jax.jit(perturbkit.private_grad(loss_fn, reduction=reduction,
                                                           **DP_OPTIONS))(variables, key, x, y)
  run = on_4_devices(perturbkit.private_grad(loss_fn, reduction=reduction, axis_name='data',
                                             **DP_OPTIONS))
  grads, metrics = run(variables, key, x, y)
  chex.assert_trees_all_close(grads, single, rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(metrics, single_metrics, rtol=1e-5, atol=1e-7)


def test_shard_map_noise_comes_from_the_first_devices_key():
  """A key folded with the device index (as for dropout) draws the first device's noise on
  every device: the replicated gradient is the one device's with that key."""
  model = models.MLP(out=3)
  x, y, key = dp_batch()
  variables = jax.jit(model.init)(jax.random.key(1), x)
  dp = perturbkit.private_grad(classification_loss(model), axis_name='data', **DP_OPTIONS)

  def per_device(v, k, x, y):  # every device's own result, stacked
    grads, _ = dp(v, jax.random.fold_in(k, jax.lax.axis_index('data')), x, y)
    return jax.tree.map(lambda g: g[None], grads)
  grads = jax.jit(jax.shard_map(per_device, mesh=data_mesh(4),
                                in_specs=(P(), P(), P('data'), P('data')),
                                out_specs=P('data'), check_vma=False))(variables, key, x, y)
  single, _ = jax.jit(perturbkit.private_grad(classification_loss(model), **DP_OPTIONS))(
      variables, jax.random.fold_in(key, 0), x, y)
  chex.assert_trees_all_close(grads, jax.tree.map(lambda g: jnp.stack([g] * 4), single),
                              rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('kind', ['mlp', 'scanned'])
def test_nnx_shard_map_adds_noise_once(kind):
  """The NNX front end, the model going in as ``(graphdef, state)`` merged on each device:
  four devices with two examples each give the one-device gradient and metrics, noise
  included; the scanned model takes the per-example replay of its model call on each device."""
  x, y, key = dp_batch()
  if kind == 'mlp':
    model, labels = nnx_models.MLP(din=5, dout=3, rngs=nnx.Rngs(0)), y
  else:
    model, labels = nnx_models.ScanMLP(width=5, rngs=nnx.Rngs(0)), y % 2
  graphdef, state = nnx.split(model)
  nnx_loss = lambda m, x, y: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

  def nnx_grad(state, key, x, y, axis_name=None):
    dp = perturbkit.nnx.private_grad(nnx_loss, axis_name=axis_name, **DP_OPTIONS)
    return dp(nnx.merge(graphdef, state), key, x, y)

  single, single_metrics = jax.jit(nnx_grad)(state, key, x, labels)
  grads, metrics = on_4_devices(functools.partial(nnx_grad, axis_name='data'))(
      state, key, x, labels)
  chex.assert_trees_all_close(nnx.to_pure_dict(grads), nnx.to_pure_dict(single),
                              rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(metrics, single_metrics, rtol=1e-5, atol=1e-7)


# -- bad input ---------------------------------------------------------------------------


def test_batchnorm_in_training_mode_is_rejected():
  model = models.CNN(train=True)
  x = jax.random.normal(jax.random.key(0), (4, 6, 6, 2))
  variables = jax.jit(model.init)(jax.random.key(1), x)

  def loss_fn(v, x):
    out, _ = model.apply(v, x, mutable=['batch_stats'])
    return jnp.mean(out ** 2)
  with pytest.raises(perturbkit.ExamplesMixedError, match='BatchNorm_0'):
    jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn), variables, x)
  with pytest.raises(perturbkit.ExamplesMixedError):
    jax.eval_shape(perturbkit.private_grad(loss_fn, clip_norm=1.0, noise_multiplier=1.0),
                   variables, jax.random.key(0), x)
  with pytest.raises(perturbkit.ExamplesMixedError):
    perturbkit.check_per_example(loss_fn, variables, x)


def test_batchnorm_with_running_averages_is_per_example():
  model = models.CNN(train=False)
  x = jax.random.normal(jax.random.key(0), (4, 6, 6, 2))
  variables = jax.jit(model.init)(jax.random.key(1), x)
  loss_fn = lambda v, x: jnp.mean(jnp.sum(model.apply(v, x) ** 2, axis=-1))
  perturbkit.check_per_example(loss_fn, variables, x)
  assert_norms_match(loss_fn, variables, x)


def test_loss_over_batch_statistics_fails_the_value_check():
  model = models.MLP(out=3)
  x = jax.random.normal(jax.random.key(0), (6, 5))
  variables = jax.jit(model.init)(jax.random.key(1), x)
  centred = lambda v, x: jnp.mean((model.apply(v, x) - model.apply(v, x).mean(axis=0, keepdims=True)) ** 2)
  with pytest.raises(perturbkit.ExamplesMixedError, match='alone'):
    perturbkit.check_per_example(centred, variables, x)
  perturbkit.check_per_example(lambda v, x: jnp.mean(model.apply(v, x) ** 2), variables, x)
  perturbkit.check_per_example(lambda v, x: jnp.sum(model.apply(v, x) ** 2), variables, x,
                               reduction='sum')



def test_check_per_example_names_the_other_reduction_and_a_missing_axis():
  """A sum loss checked with the default reduction='mean' was reported as mixing its
  examples (as BatchNorm would), and batch_axes past an argument's axes failed inside
  jax.vmap."""
  model = models.MLP(out=3)
  x = jax.random.normal(jax.random.key(0), (6, 5))
  variables = jax.jit(model.init)(jax.random.key(1), x)
  mean = lambda v, x: jnp.mean(model.apply(v, x) ** 2)
  total = lambda v, x: jnp.sum(model.apply(v, x) ** 2)
  with pytest.raises(perturbkit.ReductionMismatchError,
                     match=r"reduction='mean' was given, but the loss is a sum.*reduction='sum'"):
    perturbkit.check_per_example(total, variables, x)
  with pytest.raises(perturbkit.ReductionMismatchError, match=r"Pass reduction='mean'"):
    perturbkit.check_per_example(mean, variables, x, reduction='sum')
  with pytest.raises(perturbkit.ExamplesAxisError, match=r'shape \(6, 5\), with no axis 2'):
    perturbkit.check_per_example(mean, variables, x, batch_axes=2)

def test_examples_axis_errors():
  model = models.MLP(out=3)
  x = jax.random.normal(jax.random.key(0), (6, 5))
  variables = jax.jit(model.init)(jax.random.key(1), x)
  loss_fn = classification_loss(model)
  norms = perturbkit.per_example_grad_norms(loss_fn)
  with pytest.raises(perturbkit.ExamplesAxisError, match='disagree'):
    jax.eval_shape(norms, variables, x, jnp.zeros((5,), jnp.int32))
  with pytest.raises(perturbkit.ExamplesAxisError, match='one entry per positional'):
    jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn, batch_axes=(0,)), variables, x,
                   x[:, 0])

  wrapped = nn.Sequential([nn.Dense(3)])
  features_first = lambda v, x: jnp.mean(wrapped.apply(v, x.T) ** 2)  # examples not on axis 0
  v = jax.jit(wrapped.init)(jax.random.key(0), x.T)
  with pytest.raises(perturbkit.ExamplesAxisError, match='axis 0'):
    jax.eval_shape(perturbkit.per_example_grad_norms(features_first), v, x)


def test_a_batch_of_nested_python_lists_is_refused_and_its_array_works():
  """A batch written as nested lists of numbers has no examples axis: a named error that says
  to pass it as an array, from the Linen and NNX functions and DP-SGD, called as they are or
  under jax.jit (which makes each number a 0-d array); the array it suggests gives the
  per-example norms of vmap(grad)."""
  model = nn.Dense(3)
  x = np.linspace(-1, 1, 10, dtype=np.float32).reshape(2, 5)
  variables = jax.jit(model.init)(jax.random.key(0), x)
  loss_fn = lambda v, x: jnp.mean(model.apply(v, jnp.asarray(x)) ** 2)
  linear = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
  nnx_loss = lambda m, x: jnp.mean(m(jnp.asarray(x)) ** 2)
  refused = [lambda b: perturbkit.per_example_grad_norms(loss_fn)(variables, b),
             lambda b: perturbkit.check_per_example(loss_fn, variables, b),
             lambda b: perturbkit.nnx.per_example_grad_norms(nnx_loss)(linear, b),
             lambda b: perturbkit.nnx.private_grad(nnx_loss, clip_norm=1.0, noise_multiplier=0.0)(
                 linear, jax.random.key(0), b),
             lambda b: jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn), variables, b)]
  for run in refused:
    for batch in (x.tolist(), tuple(map(tuple, x.tolist()))):
      with pytest.raises(perturbkit.BatchNotArrayError,
                         match=r'argument 0 of the loss is a Python (list|tuple) of numbers.*'
                               r'np\.asarray\(batch\)'):
        run(batch)
  _, norms = jax.jit(perturbkit.per_example_grad_norms(loss_fn))(variables,
                                                                 np.asarray(x.tolist()))
  np.testing.assert_allclose(norms.total, norms_of(reference_grads(loss_fn, variables, x))[1],
                             **TOL)


def test_inputs_are_per_example_by_where_they_come_from_not_by_shape():
  """A shared table with as many rows as examples is passed whole, never split by example."""
  batch = 4
  model = WithTable()
  x = jax.random.normal(jax.random.key(0), (batch, 3))
  table = jax.random.normal(jax.random.key(1), (batch, 5))  # rows == examples, shared
  y = jnp.arange(batch) % 3
  variables = jax.jit(model.init)(jax.random.key(2), x, table)

  def loss_fn(v, x, table, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(v, x, table), y).mean()

  @jax.jit
  def reference(table):
    one = lambda xi, yi: jax.grad(lambda p: loss_fn({'params': p}, xi[None], table, yi[None]))(
        variables['params'])
    return norms_of(jax.vmap(one)(x, y))

  _, norms = jax.jit(perturbkit.per_example_grad_norms(loss_fn, batch_axes=(0, None, 0)))(
      variables, x, table, y)
  by_param, total = reference(table)
  chex.assert_trees_all_close(norms.by_param, by_param, **TOL)
  np.testing.assert_allclose(norms.total, total, **TOL)

  # The same table closed over is a constant: with as many rows as examples, it is ambiguous.
  closed = lambda v, x, y: loss_fn(v, x, table, y)
  with pytest.raises(perturbkit.AmbiguousInputError, match='Input 1 of the call Mix_0'):
    jax.eval_shape(perturbkit.per_example_grad_norms(closed), variables, x, y)
  # With another number of rows it can only be shared.
  longer = jax.random.normal(jax.random.key(3), (batch + 1, 5))
  _, norms = jax.jit(perturbkit.per_example_grad_norms(
      lambda v, x, y: loss_fn(v, x, longer, y)))(variables, x, y)
  np.testing.assert_allclose(norms.total, reference(longer)[1], **TOL)


def test_keyword_arguments_are_shared_and_flags_stay_static():
  model = models.MLP(out=3)
  x = jax.random.normal(jax.random.key(0), (6, 5))
  y = jnp.arange(6) % 3
  variables = jax.jit(model.init)(jax.random.key(1), x)
  weight = jnp.array([1.0, 2.0, 0.5])

  def loss_fn(v, x, y, *, weight, sharpen):
    logits = model.apply(v, x) * (3.0 if sharpen else 1.0)  # a Python flag: must stay static
    return optax.softmax_cross_entropy_with_integer_labels(logits * weight[None], y).mean()

  _, norms = jax.jit(perturbkit.per_example_grad_norms(loss_fn), static_argnames='sharpen')(
      variables, x, y, weight=weight, sharpen=True)
  fixed = lambda v, x, y: loss_fn(v, x, y, weight=weight, sharpen=True)
  np.testing.assert_allclose(norms.total, norms_of(reference_grads(fixed, variables, x, y))[1],
                             **TOL)


@pytest.mark.parametrize('length', [3, 4])
def test_calls_without_per_example_inputs_replay_their_apply(length):
  """Positions from ``jnp.arange`` inside the model (shared by all examples, or as many as the
  examples): the Embed's per-example gradients come from a per-example replay of the apply."""
  model = Positions()
  x = jax.random.normal(jax.random.key(0), (4, length, 2))
  variables = jax.jit(model.init)(jax.random.key(1), x)
  assert_norms_match(lambda v, x: jnp.mean(model.apply(v, x) ** 2), variables, x)
  # Passed as a batched argument of the loss, the positions are per-example.
  given = Positions(given=True)
  positions = jnp.broadcast_to(jnp.arange(length), (4, length))
  variables = jax.jit(given.init)(jax.random.key(1), x, positions)
  assert_norms_match(lambda v, x, p: jnp.mean(given.apply(v, x, p) ** 2), variables, x,
                     positions)


def test_root_params_replay_the_apply():
  """Params of the root module, read by its own code, from a per-example replay of the apply."""
  model = RootParam()
  x = jax.random.normal(jax.random.key(0), (3, 4))
  variables = jax.jit(model.init)(jax.random.key(1), x)
  variables = {'params': {**variables['params'], 'scale': jnp.array([0.5, -2.0])}}
  loss_fn = lambda v, x: jnp.mean(jnp.tanh(model.apply(v, x)) ** 2)
  assert_norms_match(loss_fn, variables, x)
  grads, _ = jax.jit(perturbkit.private_grad(loss_fn, clip_norm=1e6, noise_multiplier=0.0))(
      variables, jax.random.key(0), x)
  chex.assert_trees_all_close(grads, jax.jit(jax.grad(lambda p: loss_fn({'params': p}, x)))(
      variables['params']), **TOL)


class RootBias(nn.Module):
  @nn.compact
  def __call__(self, x, weights):
    return nn.Dense(2)(x) * weights + self.param('bias', nn.initializers.ones, (2,))[None, :]


def test_root_params_of_an_apply_given_a_constant_name_the_input():
  """The root's own params come from a per-example replay of the apply; an apply given a
  constant with a row per example (positions made in the loss, as for BART's root
  ``final_logits_bias``) cannot be replayed, and the error names that input and what to pass.
  (It was UncoveredParamsError, saying to leave out params the model uses.)"""
  model = RootBias()
  x = jax.random.normal(jax.random.key(0), (3, 4))
  variables = jax.jit(model.init)(jax.random.key(1), x, jnp.ones((3, 2)))
  loss_fn = lambda v, x: jnp.mean(model.apply(v, x, jnp.ones((3, 2))) ** 2)
  with pytest.raises(perturbkit.AmbiguousInputError,
                     match=r'Input 1 of the call RootBias.__call__ \(the model.apply'):
    jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn), variables, x)


def test_params_of_a_module_never_called_are_rejected():
  model = models.MLP(out=3)
  x = jnp.ones((3, 5))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  variables = {'params': {**variables['params'], 'Unused': {'kernel': jnp.ones((2, 2))}}}
  with pytest.raises(perturbkit.UncoveredParamsError, match='Unused'):
    jax.eval_shape(perturbkit.per_example_grad_norms(lambda v, x: jnp.mean(model.apply(v, x))),
                   variables, x)


def test_interleaved_and_clipping_do_not_combine():
  model = models.MLP(out=3)
  x = jax.random.normal(jax.random.key(0), (4, 5))
  y = jnp.arange(4) % 3
  variables = jax.jit(model.init)(jax.random.key(1), x)
  loss_fn = classification_loss(model)
  private = perturbkit.dp_sgd(loss_fn, optax.sgd(0.1), clip_norm=1.0, noise_multiplier=1.0)
  with pytest.raises(perturbkit.InterleavedClippingError, match='interleaved'):
    perturbkit.interleaved(loss_fn, private).init(variables, x, y)
  with pytest.raises(perturbkit.InterleavedClippingError, match='interleaved'):
    perturbkit.dp_sgd(loss_fn, perturbkit.interleaved(loss_fn, optax.sgd(0.1)), clip_norm=1.0,
                      noise_multiplier=1.0)
  with pytest.raises(perturbkit.NotAnOptimizerError, match='GradientTransformation') as error:
    perturbkit.dp_sgd(loss_fn, optax.sgd, clip_norm=1.0, noise_multiplier=1.0)
  assert 'segment_name' not in str(error.value)  # dp_sgd takes no optimizer per segment


def test_bad_options():
  model = models.MLP(out=3)
  x = jnp.ones((2, 5))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  loss_fn = lambda v, x: jnp.mean(model.apply(v, x))
  with pytest.raises(perturbkit.InvalidOptionError, match='dense_method'):
    jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn, dense_method='fast'), variables, x)
  with pytest.raises(perturbkit.InvalidOptionError, match="reduction='max'"):
    jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn, reduction='max'), variables, x)
