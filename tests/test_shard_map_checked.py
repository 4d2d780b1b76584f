"""Inside ``jax.shard_map`` with ``check_vma=True`` (JAX's default) on 4 host CPU devices.

There JAX's reverse mode sums over the devices the gradient with respect to a
value that is the same on every device (a replicated param). A call's output
made from the device's own shard of the batch differs per device, so its
activation gradient, cache, patching and attribution effects must be the
device's own: each equals the same function run on one device on that shard,
the reference here (itself checked against independent references in the
single-device tests). The params' gradient is the sum of the shards' gradients,
as ``jax.grad`` gives inside ``shard_map``; DP-SGD without ``axis_name`` likewise gives
the devices' clipped gradients summed, noised once. The families that all-reduce over
``axis_name`` themselves (interleaved training, DP-SGD, the K-FAC
preconditioner) would count the devices twice there, so they refuse it with
``CheckedShardMapError``; without ``axis_name`` interleaved training steps with the
devices' summed gradients, as ``jax.grad``'s are there. The checks run on 4 of the test process's 8 host CPU devices
(``conftest.py``).
"""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import models
import nnx_models
import perturbkit
import test_kfac
from hand_mlp import SHAPE, metric_of
from host_devices import data_mesh

TOL = dict(rtol=1e-5, atol=1e-6)
SHARDS = 4


def stacked(f):
  return lambda *a: jax.tree.map(lambda x: jnp.asarray(x)[None], f(*a))


def on_devices(f, params, *batch, check_vma=True):
  """f on each device's shard of the batch, inside shard_map; one row per device."""
  specs = (P(),) + (P('data'),) * len(batch)
  return jax.jit(jax.shard_map(stacked(f), mesh=data_mesh(SHARDS), in_specs=specs,
                               out_specs=P('data'), check_vma=check_vma))(params, *batch)


def on_shards(f, params, *batch):
  """The reference: f on one device, on each shard in turn; one row per shard."""
  size, one = batch[0].shape[0] // SHARDS, jax.jit(stacked(f))  # compiled once
  rows = [one(params, *(b[i * size:(i + 1) * size] for b in batch)) for i in range(SHARDS)]
  return jax.tree.map(lambda *r: np.concatenate(r), *rows)  # in numpy: nothing to compile


def linen_problem():
  """``(model, variables, metric, x, x_other)``: the MLP and two batches of 8."""
  shape = (8,) + SHAPE[1:]
  x = jax.random.normal(jax.random.key(1), shape)
  x_other = jax.random.normal(jax.random.key(2), shape)
  model = models.MLP()
  variables = jax.jit(model.init)(jax.random.key(0), x)
  return model, variables, lambda v, x: metric_of(model.apply(v, x)), x, x_other


def nnx_problem():
  """``(net, state, merged, metric)``: the NNX MLP, its state, and ``merged(f)``, which takes
  the state where ``f`` takes the model."""
  net = nnx.jit(lambda: nnx_models.MLP(rngs=nnx.Rngs(0)))()  # one compile, not one per op
  graphdef, state = nnx.split(net)
  merged = lambda f: (lambda state, *a: f(nnx.merge(graphdef, state), *a))
  return net, state, merged, lambda m, x: metric_of(m(x))


def dense_problem():
  """``(variables, predict, layers, features, labels)``: a 5-class MLP for K-FAC and DP-SGD."""
  features = jax.random.normal(jax.random.key(3), (8, 5))
  labels = jnp.arange(8) % 5
  variables, predict, layers = test_kfac.setup(models.MLP(out=5), features)
  return variables, predict, layers, features, labels


def cross_entropy_of(predict):
  return lambda v, x, y: optax.softmax_cross_entropy_with_integer_labels(
      predict(v, x), y).mean()


def test_value_and_grad_per_device():
  """Each device's activation gradients are its shard's, the params' gradient the sum over
  the shards (the same on every device); NNX's activation gradients likewise."""
  _, variables, linen_metric, x, _ = linen_problem()
  vg = perturbkit.value_and_grad(linen_metric)
  loss, grads = on_devices(vg, variables, x)
  loss1, grads1 = on_shards(vg, variables, x)
  chex.assert_trees_all_close((loss, grads['perturbations']), (loss1, grads1['perturbations']),
                              **TOL)
  summed = jax.tree.map(lambda g: np.broadcast_to(g.sum(0), g.shape), grads1['params'])
  chex.assert_trees_all_close(grads['params'], summed, **TOL)
  assert float(np.abs(np.asarray(grads['perturbations']['Dense_0']['__call__'])).max()) > 1e-4

  _, state, merged, nnx_metric = nnx_problem()
  nnx_vg = merged(lambda m, x: perturbkit.nnx.value_and_grad(nnx_metric)(m, x)[1]
                  ['perturbations'])
  chex.assert_trees_all_close(on_devices(nnx_vg, state, x), on_shards(nnx_vg, state, x), **TOL)


def interpret_family(api, metric):
  """The interpretability functions of a front end, each with its number of batch inputs.
  (Layer integrated gradients is made of the same sweep and edits as patching.)"""
  return {
      'activation_patching': (api.activation_patching(metric, axis=1, batch_size=3,
                                                      progress=True), 2),
      'attribution_patching': (api.attribution_patching(metric, axis=1), 2),
      **({'run_with_cache': (api.run_with_cache(metric, grads=True), 1)}
         if api is perturbkit else {}),
  }


@pytest.mark.parametrize('front_end', ['linen', 'nnx'])
def test_interpretability_per_device(front_end, capsys):
  """Patching (also with ``check_vma=False``), attribution and the cache on each device equal
  one device on its shard. One progress bar per patching run, each filled once: the 4
  devices' sweeps are not added up (2 runs inside shard_map, check_vma on and off, and 4
  references, one per shard)."""
  _, variables, metric, x, x_other = linen_problem()
  api, params, wrap = perturbkit, variables, lambda f: f
  if front_end == 'nnx':
    _, params, wrap, metric = nnx_problem()
    api = perturbkit.nnx
  capsys.readouterr()
  bars = 0
  for name, (fn, inputs) in interpret_family(api, metric).items():
    batch = (x, x_other)[:inputs]
    want = on_shards(wrap(fn), params, *batch)
    bars += SHARDS * (name == 'activation_patching')  # one per shard, on one device
    for check_vma in (True, False) if name == 'activation_patching' else (True,):
      got = on_devices(wrap(fn), params, *batch, check_vma=check_vma)
      jax.effects_barrier()
      chex.assert_trees_all_close(got, want, **TOL)
      bars += name == 'activation_patching'
    assert float(np.abs(np.asarray(jax.tree.leaves(want)[-1])).max()) > 1e-4, name
  jax.effects_barrier()
  err = capsys.readouterr().err
  assert bars == 6
  assert err.count('activation patching: 100%') == bars, err[-3000:]


def test_kfac_statistics_and_per_example_norms_per_device():
  """K-FAC's statistics (a traced ``with_stats``: a ``lax.cond``) and the per-example norms
  on each device equal one device on its shard."""
  variables, predict, layers, features, labels = dense_problem()
  estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                       fisher='exact')
  stats = lambda v, x, y: estimate(v, x, y, with_stats=jnp.asarray(True))[2]
  chex.assert_trees_all_close(on_devices(stats, variables, features, labels),
                              on_shards(stats, variables, features, labels), **TOL)
  norms = perturbkit.per_example_grad_norms(cross_entropy_of(predict))
  chex.assert_trees_all_close(on_devices(norms, variables, features, labels),
                              on_shards(norms, variables, features, labels), **TOL)


def test_sampled_fisher_draws_each_devices_labels_from_its_own_key():
  """With the key replicated, each device folds its index into it: device i's statistics are
  one device's on its shard with ``fold_in(key, i)``, and devices holding the same examples
  draw other labels."""
  variables, predict, layers, features, labels = dense_problem()
  features = np.tile(features[:2], (SHARDS, 1))  # every device holds the same two examples
  labels = np.tile(labels[:2], SHARDS)
  estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers)
  key = jax.random.key(7)
  stats = lambda v, x, y: estimate(v, x, y, key, with_stats=jnp.asarray(True))[2]
  got = on_devices(stats, variables, features, labels)
  size = len(features) // SHARDS
  one = jax.jit(lambda v, x, y, k: estimate(v, x, y, k, with_stats=jnp.asarray(True))[2])
  want = [one(variables, features[i * size:(i + 1) * size], labels[i * size:(i + 1) * size],
              jax.random.fold_in(key, i)) for i in range(SHARDS)]  # compiled once
  chex.assert_trees_all_close(got, jax.tree.map(lambda *r: np.stack(r), *want), **TOL)
  g = np.asarray(got['Dense_1'].g)
  assert float(np.abs(g[0] - g[1]).max()) > 1e-4


class GroupNormed(nn.Module):
  """A Dense, then a GroupNorm: a layer without a rule, replayed per example."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(5)(nn.GroupNorm(num_groups=2)(nn.Dense(4)(x)))


class TokenDense(nn.Module):
  """Dense layers over 16 tokens, averaged: their per-example gradients (smaller than the
  tokens' arrays) are kept for the clipped sum."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(5)(jnp.tanh(nn.Dense(4)(x.reshape(x.shape[0], 16, -1)))).mean(1)


def private_problem(name):
  """``(variables, loss, features, labels)`` for DP-SGD: the clipped sum through one VJP per
  layer (the MLP), through a layer replayed per example (GroupNorm), or from kept
  per-example gradients (both GroupNorm's and the token Dense layers')."""
  variables, predict, _, features, labels = dense_problem()
  if name != 'mlp':
    features = jax.random.normal(jax.random.key(3), (8, 48))
    model = GroupNormed() if name == 'group_norm' else TokenDense()
    variables, predict = jax.jit(model.init)(jax.random.key(0), features), model.apply
  return variables, cross_entropy_of(predict), features, labels


def test_layers_replayed_per_example_are_each_devices_own_under_check_vma():
  """GroupNorm has no rule: its call is replayed per example, with the params typed to vary
  like the examples, so that each device's norms are its shard's (not summed over the
  devices), under check_vma=True as under check_vma=False."""
  variables, loss, features, labels = private_problem('group_norm')
  norms = perturbkit.per_example_grad_norms(loss)
  want = on_shards(norms, variables, features, labels)
  chex.assert_trees_all_close(on_devices(norms, variables, features, labels), want, **TOL)
  chex.assert_trees_all_close(on_devices(norms, variables, features, labels, check_vma=False),
                              want, **TOL)


@pytest.mark.parametrize('name', ['mlp', 'group_norm', 'token_dense'])
def test_private_grad_without_axis_name_sums_the_devices_and_noises_once(name):
  """DP-SGD without axis_name: JAX sums the clipped gradients over the devices, as it sums
  jax.grad's (and the clipped sums made from kept per-example gradients are summed
  likewise); the noise is added once and the count is the device's own. Every device gets
  the shards' clipped means, scaled back to sums and added, plus one shard's noise, over one
  shard's count."""
  variables, cross_entropy, features, labels = private_problem(name)

  def private(noise_multiplier):
    dp = perturbkit.private_grad(cross_entropy, clip_norm=0.2,
                                 noise_multiplier=noise_multiplier)
    return lambda v, x, y: dp(v, jax.random.key(0), x, y)[0]

  noised = on_devices(private(1.0), variables, features, labels)
  clipped_means = on_shards(private(0.0), variables, features, labels)
  first = lambda t: jax.tree.map(lambda a: np.asarray(a)[0], t)  # numpy from here on
  size = features.shape[0] // SHARDS
  noise = jax.tree.map(lambda a, b: size * (a - b), first(on_shards(
      private(1.0), variables, features, labels)), first(clipped_means))
  want = jax.tree.map(lambda c, n: (size * c.sum(0) + n) / size, clipped_means, noise)
  for device in range(SHARDS):
    chex.assert_trees_all_close(jax.tree.map(lambda a: np.asarray(a)[device], noised), want,
                                rtol=1e-4, atol=1e-6)


def test_keys_split_per_device_are_refused_by_name():
  """DP-SGD draws its noise from one key; keys split per device and sharded reach each
  device as an array of one key, refused by name rather than by ``jax.random``."""
  variables, cross_entropy, features, labels = private_problem('mlp')
  dp = perturbkit.private_grad(cross_entropy, clip_norm=0.2, noise_multiplier=1.0)
  keys = jax.random.split(jax.random.key(0), SHARDS)
  for batch in (keys, jax.random.key_data(keys)):
    with pytest.raises(perturbkit.PRNGKeyError, match=r"one key to every device.*P\(\)"):
      on_devices(lambda v, k, x, y: dp(v, k, x, y)[0], variables, batch, features, labels)


def test_families_that_all_reduce_refuse_check_vma():
  """The families that all-reduce over axis_name refuse check_vma=True, by name."""
  model, variables, _, x, _ = linen_problem()
  net, _, _, _ = nnx_problem()
  dense_variables, predict, layers, features, labels = dense_problem()
  y = jax.random.normal(jax.random.key(4), (8, 2))
  mse = lambda v, x, y: jnp.mean((model.apply(v, x)[:, -1] - y) ** 2)
  tx = perturbkit.interleaved(mse, optax.sgd(0.1), axis_name='data')
  nnx_mse = lambda m, x, y: jnp.mean((m(x)[:, -1] - y) ** 2)
  nnx_tx = perturbkit.nnx.interleaved(nnx_mse, optax.sgd(0.1), axis_name='data')
  private = perturbkit.private_grad(mse, clip_norm=1.0, noise_multiplier=1.0,
                                    axis_name='data')
  estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                       fisher='exact')
  kfac = perturbkit.kfac_preconditioner(layers, axis_name='data')
  kfac_step = lambda params, x, y: kfac.update(
      params, kfac.init(params), params,
      kfac_stats=estimate({'params': params}, x, y, with_stats=True)[2])
  refused = {
      'perturbkit.interleaved': (tx.step, tx.init(variables, x, y), x, y),
      'perturbkit.nnx.interleaved': (nnx_tx.step, nnx_tx.init(net, x, y), x, y),
      'perturbkit.private_grad': (lambda v, x, y: private(v, jax.random.key(0), x, y),
                                  variables, x, y),
      'perturbkit.kfac_preconditioner': (kfac_step, dense_variables['params'], features,
                                         labels),
  }
  for name, (f, params, *batch) in refused.items():
    with pytest.raises(perturbkit.CheckedShardMapError) as error:
      on_devices(f, params, *batch)
    assert name in str(error.value) and 'check_vma=False' in str(error.value), error.value


class TiedHead(nn.Module):
  """A GPT-2-style tied head: the embedding, transposed, as the kernel of a nested apply."""

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(16, 8, name='wte')
    h = jnp.tanh(nn.Dense(8)(embed(ids)))
    head = nn.Dense(16, use_bias=False, parent=None)
    return head.apply({'params': {'kernel': embed.embedding.T}}, h)


class NNXTiedHead(nnx.Module):
  """The same with the embedding read inline by the head."""

  def __init__(self, rngs):
    self.wte = nnx.Embed(16, 8, rngs=rngs)
    self.dense = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, ids):
    return jnp.tanh(self.dense(self.wte(ids))) @ self.wte.embedding[...].T


def next_token_loss(logits, ids):
  return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


@pytest.mark.parametrize('front_end', ['linen', 'nnx'])
def test_per_example_norms_of_a_tied_head_are_each_devices_own_under_check_vma(front_end):
  """The head's output (made from the device's own tokens) varies per device, so the zeros
  that read its gradient must too: else JAX sums that gradient over the devices, and the
  embedding's norms take the other devices' examples in (and DP-SGD clips by them)."""
  ids = jax.random.randint(jax.random.key(1), (8, 4), 0, 16)
  if front_end == 'linen':
    model = TiedHead()
    variables = jax.jit(model.init)(jax.random.key(0), ids)
    norms = perturbkit.per_example_grad_norms(
        lambda v, ids: next_token_loss(model.apply(v, ids), ids))
  else:
    graphdef, variables = nnx.split(nnx.jit(lambda: NNXTiedHead(nnx.Rngs(0)))())
    nnx_norms = perturbkit.nnx.per_example_grad_norms(lambda m, ids: next_token_loss(m(ids), ids))
    norms = lambda state, ids: nnx_norms(nnx.merge(graphdef, state), ids)
  total = lambda v, ids: norms(v, ids)[1].total
  want = on_shards(total, variables, ids)
  assert float(np.min(want)) > 0.1
  chex.assert_trees_all_close(on_devices(total, variables, ids), want, **TOL)
  chex.assert_trees_all_close(on_devices(total, variables, ids, check_vma=False), want, **TOL)


def _summed_over_shards(grad_of_shard, x, y):
  """The sum of each shard's gradient: what jax.grad of a replicated param gives inside
  shard_map with check_vma=True."""
  size, one = x.shape[0] // SHARDS, jax.jit(grad_of_shard)  # compiled once
  grads = [one(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]) for i in range(SHARDS)]
  return jax.tree.map(lambda *g: sum(np.asarray(a) for a in g), *grads)  # numpy: no compile


def _stepped_on_devices(step, state, x, y):
  """``step`` under shard_map with check_vma=True: the state replicated, the metrics (each
  device's own) one row per device."""
  def stepped(state, x, y):
    state, metrics = step(state, x, y)
    return state, jax.tree.map(lambda m: jnp.asarray(m)[None], metrics)

  return jax.jit(jax.shard_map(stepped, mesh=data_mesh(SHARDS),
                               in_specs=(P(), P('data'), P('data')),
                               out_specs=(P(), P('data'))))(state, x, y)


@pytest.mark.parametrize('model', ['mlp', 'scanned'])
def test_interleaved_without_axis_name_steps_with_the_summed_gradient(model):
  """Without axis_name, under check_vma=True, each segment's gradient is summed over the
  devices as jax.grad's is there: propagate='original' equals SGD with the shards' summed
  gradients; the activation gradient norms are each device's own."""
  x = jax.random.normal(jax.random.key(1), (8, 5))
  y = jax.random.normal(jax.random.key(2), (8, 2))
  module = models.MLP() if model == 'mlp' else models.Scanned()
  variables = jax.jit(module.init)(jax.random.key(0), x)
  mse = lambda v, x, y: jnp.mean((module.apply(v, x) - y) ** 2)
  tx = perturbkit.interleaved(mse, optax.sgd(0.1), propagate='original')
  state, metrics = _stepped_on_devices(tx.step, tx.init(variables, x, y), x, y)
  summed = _summed_over_shards(lambda x, y: jax.grad(mse)(variables, x, y), x, y)
  want = jax.tree.map(lambda w, g: np.asarray(w) - 0.1 * g, variables['params'], summed['params'])
  chex.assert_trees_all_close(state.params, want, **TOL)
  own = on_shards(lambda v, x, y: {
      'loss': mse(v, x, y), 'Dense_0': jnp.linalg.norm(perturbkit.grad(mse)(v, x, y)[
          'perturbations']['Dense_0']['__call__'])}, variables, x, y)
  chex.assert_trees_all_close(metrics['loss'], own['loss'], **TOL)
  chex.assert_trees_all_close(metrics['activation_grad_norm']['Dense_0'], own['Dense_0'], **TOL)


def test_interleaved_without_axis_name_propagates_through_the_updated_summed_step():
  """propagate='updated' without axis_name, under check_vma=True, against the MLP's backward
  written by hand: each layer steps with its gradient summed over the devices, and each
  device sends its own gradient on through the updated weights."""
  x = jax.random.normal(jax.random.key(1), (8, 5))
  y = jax.random.normal(jax.random.key(2), (8, 2))
  module = models.MLP()
  variables = jax.jit(module.init)(jax.random.key(0), x)
  mse = lambda v, x, y: jnp.mean((module.apply(v, x) - y) ** 2)
  tx = perturbkit.interleaved(mse, optax.sgd(0.1), propagate='updated')
  state, _ = _stepped_on_devices(tx.step, tx.init(variables, x, y), x, y)

  params = variables['params']

  @jax.jit  # one compile, not one per op
  def by_hand(params, x, y):
    dense = lambda p, h: h @ p['kernel'] + p['bias'][None]
    size = x.shape[0] // SHARDS
    shards = [(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]) for i in range(SHARDS)]
    forwards = []
    for xs, ys in shards:
      h0 = dense(params['Dense_0'], xs)
      h1 = dense(params['Dense_1'], nn.relu(h0))
      out, head = jax.vjp(dense, params['Dense_2'], nn.relu(h1) + nn.relu(h0))
      forwards.append((xs, h0, h1, jax.grad(lambda o: jnp.mean((o - ys) ** 2))(out)))
    new = {}
    step = lambda p, g: jax.tree.map(lambda w, g: w - 0.1 * g, p, g)
    # Dense_2, then the gradient at its input with the updated weights, on each device.
    grads = [jax.vjp(dense, params['Dense_2'], nn.relu(h1) + nn.relu(h0))[1](g)
             for _, h0, h1, g in forwards]
    new['Dense_2'] = step(params['Dense_2'],
                          jax.tree.map(lambda *g: sum(g), *(g[0] for g in grads)))
    below = [jax.vjp(lambda h: dense(new['Dense_2'], h), nn.relu(h1) + nn.relu(h0))[1](g)[0]
             for _, h0, h1, g in forwards]
    at_h1 = [g * (h1 > 0) for (_, _, h1, _), g in zip(forwards, below)]
    grads = [jax.vjp(dense, params['Dense_1'], nn.relu(h0))[1](g) for (_, h0, _, _), g in
             zip(forwards, at_h1)]
    new['Dense_1'] = step(params['Dense_1'],
                          jax.tree.map(lambda *g: sum(g), *(g[0] for g in grads)))
    at_h0 = [(jax.vjp(lambda h: dense(new['Dense_1'], h), nn.relu(h0))[1](g1)[0] + g) * (h0 > 0)
             for (_, h0, _, _), g1, g in zip(forwards, at_h1, below)]
    grads = [jax.vjp(dense, params['Dense_0'], xs)[1](g)[0] for (xs, _, _, _), g in
             zip(forwards, at_h0)]
    new['Dense_0'] = step(params['Dense_0'], jax.tree.map(lambda *g: sum(g), *grads))
    return new

  new = by_hand(params, x, y)
  chex.assert_trees_all_close(state.params, new, **TOL)
  assert float(np.abs(np.asarray(new['Dense_0']['kernel'])
                      - np.asarray(params['Dense_0']['kernel'])).max()) > 1e-3


def test_nnx_interleaved_without_axis_name_steps_with_the_summed_gradient():
  """The same on the NNX front end: SGD with the shards' summed gradients."""
  x = jax.random.normal(jax.random.key(1), (8,) + SHAPE[1:])
  net, _, _, _ = nnx_problem()
  mse = lambda m, x, y: jnp.mean((m(x)[:, -1] - y) ** 2)
  y = jax.random.normal(jax.random.key(4), net(x)[:, -1].shape)
  tx = perturbkit.nnx.interleaved(mse, optax.sgd(0.1), propagate='original')
  state, _ = _stepped_on_devices(tx.step, tx.init(net, x, y), x, y)
  graphdef, params = nnx.split(net, nnx.Param)
  summed = _summed_over_shards(
      lambda x, y: jax.grad(lambda p: mse(nnx.merge(graphdef, p), x, y))(params), x, y)
  want = jax.tree.map(lambda w, g: np.asarray(w) - 0.1 * g, params, summed)
  got = nnx.state(state.model(), nnx.Param)
  chex.assert_trees_all_close(got, want, **TOL)
