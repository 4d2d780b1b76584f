"""Kronecker factors computed by kfac-jax, saved as a reference for perturbkit's tests.

kfac-jax 0.0.8 (the newest release) does not import with the jax that perturbkit
pins, so this script runs in an environment of its own, without perturbkit or
Flax; ``tests/test_kfac_jax_reference.py`` compares perturbkit's factors on the
same weights and batch with the file it writes:

  python -m venv /tmp/kfac-jax-env && . /tmp/kfac-jax-env/bin/activate
  pip install "jax[cpu]==0.6.2" "kfac-jax==0.0.8"
  python scripts/kfac_jax_reference.py --out tests/data/kfac_jax_reference.npz

Three models written in plain ``jax.numpy``/``lax`` (kfac-jax registers their
layers itself by matching the jaxpr): an MLP (two dense layers with bias), a
CNN (a 3x3 ``SAME`` conv, a 3x3 stride-2 ``VALID`` conv without bias, a dense
head) and a sequence model (a dense layer on ``(batch, T, d)`` inputs, mean-pooled
over ``T``, a dense head), with a softmax cross-entropy registered as the loss. For each, the factors
of one batch (``ema_old=0``, ``ema_new=1``) in kfac-jax's ``fisher_empirical``
(true labels) and ``fisher_exact`` (expectation over labels) modes, together with
each block's ``fixed_scale`` (the number of spatial locations for a conv, 1 for a
dense layer), the weights and the batch.
"""
import argparse

import jax
import jax.numpy as jnp
import kfac_jax
import numpy as np

DIMENSIONS = ('NHWC', 'HWIO', 'NHWC')


def mlp(params, x):
  h = jnp.tanh(x @ params['dense0']['kernel'] + params['dense0']['bias'])
  return h @ params['dense1']['kernel'] + params['dense1']['bias']


def cnn(params, x):
  h = jax.lax.conv_general_dilated(x, params['conv0']['kernel'], (1, 1), 'SAME',
                                   dimension_numbers=DIMENSIONS)
  h = jnp.tanh(h + params['conv0']['bias'])
  h = jnp.tanh(jax.lax.conv_general_dilated(h, params['conv1']['kernel'], (2, 2), 'VALID',
                                            dimension_numbers=DIMENSIONS))
  h = h.reshape(h.shape[0], -1)
  return h @ params['head']['kernel'] + params['head']['bias']


def seq(params, x):
  """A dense layer on ``(batch, T, d)`` inputs (every token), mean-pooled, then a dense head."""
  h = jnp.tanh(x @ params['token']['kernel'] + params['token']['bias'])
  return jnp.mean(h, axis=1) @ params['head']['kernel'] + params['head']['bias']


def make(name, key):
  """``(model, params, x, y)`` with fixed random weights and batch."""
  keys = iter(jax.random.split(key, 8))
  normal = lambda shape, scale: scale * jax.random.normal(next(keys), shape)
  if name == 'mlp':
    params = {'dense0': {'kernel': normal((6, 5), 0.5), 'bias': normal((5,), 0.1)},
              'dense1': {'kernel': normal((5, 3), 0.5), 'bias': normal((3,), 0.1)}}
    x = normal((16, 6), 1.0)
    model = mlp
  elif name == 'seq':
    params = {'token': {'kernel': normal((6, 5), 0.5), 'bias': normal((5,), 0.1)},
              'head': {'kernel': normal((5, 3), 0.5), 'bias': normal((3,), 0.1)}}
    x = normal((8, 4, 6), 1.0)
    model = seq
  else:
    params = {'conv0': {'kernel': normal((3, 3, 2, 3), 0.3), 'bias': normal((3,), 0.1)},
              'conv1': {'kernel': normal((3, 3, 3, 4), 0.3)},
              'head': {'kernel': normal((16, 3), 0.3), 'bias': normal((3,), 0.1)}}
    x = normal((4, 6, 6, 2), 1.0)
    model = cnn
  y = jax.random.randint(next(keys), (x.shape[0],), 0, 3)
  return model, params, x, y


def factors(model, params, x, y, mode):
  """``[(param names, A, G, fixed scale)]`` of every block kfac-jax registers."""
  def loss(params, batch):
    inputs, labels = batch
    logits = model(params, inputs)
    kfac_jax.register_softmax_cross_entropy_loss(logits, labels)
    log_p = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_p, labels[:, None], axis=1))

  estimator = kfac_jax.BlockDiagonalCurvature(func=loss, default_estimation_mode=mode)
  args = (params, (x, y))
  state = estimator.init(jax.random.key(0), args, None, None)
  state = estimator.update_curvature_matrix_estimate(
      state, ema_old=0.0, ema_new=1.0, identity_weight=0.0, batch_size=x.shape[0],
      rng=jax.random.key(1), func_args=args)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  out = []
  for indices, block, block_state in zip(estimator.jaxpr.layer_indices, estimator.blocks,
                                         state.blocks_states):
    owners = sorted({flat[i][0][0].key for i in indices})
    a, g = (np.asarray(f.value) for f in block_state.factors)
    out.append((owners, a, g, float(block.fixed_scale())))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', required=True)
  args = parser.parse_args()
  arrays = {'versions': np.array([jax.__version__, kfac_jax.__version__])}
  for name, seed in (('mlp', 0), ('cnn', 1), ('seq', 2)):
    model, params, x, y = make(name, jax.random.key(seed))
    arrays[f'{name}/x'], arrays[f'{name}/y'] = np.asarray(x), np.asarray(y)
    for (path, leaf) in jax.tree_util.tree_flatten_with_path(params)[0]:
      arrays[f'{name}/params/' + '/'.join(p.key for p in path)] = np.asarray(leaf)
    for mode in ('fisher_empirical', 'fisher_exact'):
      for owners, a, g, scale in factors(model, params, x, y, mode):
        [layer] = owners
        arrays[f'{name}/{mode}/{layer}/a'] = a
        arrays[f'{name}/{mode}/{layer}/g'] = g
        arrays[f'{name}/{mode}/{layer}/fixed_scale'] = np.array(scale)
        print(name, mode, layer, a.shape, g.shape, scale)
  np.savez_compressed(args.out, **arrays)
  print('wrote', args.out)


if __name__ == '__main__':
  main()
