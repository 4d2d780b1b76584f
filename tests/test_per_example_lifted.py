"""Per-example norms and DP-SGD through nested applies inside a call, ``nn.remat`` and ``nn.scan``.

The reference is ``jax.vmap(jax.grad)`` of the loss of each example alone (``reference_grads``
of ``test_per_example``), and ``jax.grad`` of the mean loss for ``private_grad`` with a clip
norm no example reaches and no noise.

* A weight-normalized layer runs ``self.inner.apply`` on a kernel computed from its own param
  inside its own call (Hugging Face Wav2Vec2's positional conv): the replay of that call
  already carries the nested apply's gradient, which must not be added a second time.
* Modules called inside ``nn.remat`` / ``nn.checkpoint`` / ``nn.scan`` have no inputs outside
  the transform; their per-example gradients come from a per-example replay of the top-level
  ``apply`` they run in, so they equal the reference (for ``nn.scan``, the stacked params'
  gradient of each iteration).
"""
import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_models
import models
import perturbkit
from test_per_example import assert_norms_equal, per_example_grads, reference_grads

pytestmark = [pytest.mark.filterwarnings(f) for f in hf_models.FILTER_DEPRECATION]

TOL = dict(rtol=2e-4, atol=1e-6)


class WeightNormDense(nn.Module):
  """A Dense layer whose kernel is ``v`` normalized per column, run as a nested apply."""

  def setup(self):
    self.inner = nn.Dense(4)
    self.v = self.param('v', nn.initializers.normal(1.0), (3, 4))

  def __call__(self, x):
    kernel = self.v / jnp.linalg.norm(self.v, axis=0, keepdims=True)
    return self.inner.apply({'params': {'kernel': kernel, 'bias': jnp.zeros(4)}}, x)


class WithWeightNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(jnp.tanh(WeightNormDense()(nn.Dense(3)(x))))


class HyperDense(nn.Module):
  """A nested apply inside the module's call on a kernel computed from the example itself."""

  @nn.compact
  def __call__(self, x):
    scale = self.param('scale', nn.initializers.normal(1.0), (3, 4))
    kernel = scale[None] * jnp.tanh(x)[:, :, None]  # (examples, 3, 4)
    one = lambda k, xi: nn.Dense(4, use_bias=False).apply({'params': {'kernel': k}}, xi)
    return jax.vmap(one)(kernel, x)


class WithHyper(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(HyperDense()(nn.Dense(3)(x)))


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(x.shape[-1])(jnp.tanh(nn.LayerNorm()(x)))


class Remat(nn.Module):
  """Two ``nn.remat`` blocks and an ``nn.checkpoint`` one between plain Dense layers."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4)(x)
    x = nn.remat(Block)()(x)
    x = nn.checkpoint(Block)()(nn.remat(Block)()(x))
    return nn.Dense(2)(x)


class OnlyRemat(nn.Module):
  """Every module inside a remat block: no call of the pass has a perturbation point."""

  @nn.compact
  def __call__(self, x):
    return nn.remat(Block)()(x)


class ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return Block()(x), None


class Scan(nn.Module):
  """Three iterations of a block with its own params each (stacked on axis 0)."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4)(x)
    x, _ = nn.scan(ScanBlock, variable_axes={'params': 0}, split_rngs={'params': True},
                   length=3)()(x, None)
    return nn.Dense(2)(x)


class SharedAcross(nn.Module):
  """One Dense called outside a remat block and, as its attribute, inside it."""

  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(4)
    x = jnp.tanh(dense(x))
    x = nn.remat(Wrapped)(dense)(x)
    return nn.Dense(2)(x)


class Wrapped(nn.Module):
  dense: nn.Module

  @nn.compact
  def __call__(self, x):
    return self.dense(nn.LayerNorm()(x))


X = jax.random.normal(jax.random.key(0), (5, 4))


def _loss(model):
  return lambda v, x: jnp.mean(jnp.sum(model.apply(v, x) ** 2, axis=-1))


def assert_matches_vmap_grad(loss_fn, variables, *args):
  """Norms by param, by layer and in total equal ``vmap(grad)``'s; so does DP-SGD unclipped.
  Both of perturbkit's functions and both references are jitted together (one compile)."""
  dp = perturbkit.private_grad(loss_fn, clip_norm=1e6, noise_multiplier=0.0)

  @jax.jit
  def run(variables, key, *args):
    mean_loss = lambda p: loss_fn({**variables, 'params': p}, *args)
    return (perturbkit.per_example_grad_norms(loss_fn)(variables, *args),
            dp(variables, key, *args)[0],
            per_example_grads(loss_fn, variables, *args),
            jax.value_and_grad(mean_loss)(variables['params']))

  (loss, norms), grads, per_example, (want_loss, want_grads) = run(
      variables, jax.random.key(1), *args)
  by_param = assert_norms_equal(norms, per_example, TOL)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  chex.assert_trees_all_close(grads, want_grads, **TOL)
  return norms, by_param


def test_nested_apply_inside_its_owners_call_counts_once():
  model = WithWeightNorm()
  variables = jax.jit(model.init)(jax.random.key(2), X)  # one compile, not one per op
  norms, by_param = assert_matches_vmap_grad(_loss(model), variables, X)
  assert float(jnp.max(by_param['WeightNormDense_0']['v'])) > 1e-3  # not vacuous
  np.testing.assert_allclose(norms.by_layer['WeightNormDense_0'],
                             by_param['WeightNormDense_0']['v'], **TOL)


def test_nested_apply_on_per_example_params_inside_its_owners_call():
  model = WithHyper()
  variables = jax.jit(model.init)(jax.random.key(2), X)  # one compile, not one per op
  assert_matches_vmap_grad(_loss(model), variables, X)


@pytest.mark.parametrize('model', [Remat(), Scan(), SharedAcross(), OnlyRemat()],
                         ids=['remat_and_checkpoint', 'scan', 'shared_across_remat', 'only_remat'])
def test_lifted_transforms_equal_vmap_grad(model):
  variables = jax.jit(model.init)(jax.random.key(2), X)  # one compile, not one per op
  assert_matches_vmap_grad(_loss(model), variables, X)


def test_branches_of_a_cond_on_the_root_are_part_of_its_apply():
  """Flax runs the branches of ``nn.cond`` on a copy of the root, in a root scope of its
  own: part of the model's apply (its calls replayed as lifted ones), not a nested apply
  to replay by the branch function's name, which the module has no method of."""
  model = models.BranchesAround()
  loss = lambda v, x: jnp.mean(jnp.sum(jnp.sin(
      model.apply(v, x, jnp.array(False), [x * 0.0] * 4)), axis=-1))
  variables = jax.jit(model.init)(jax.random.key(2), X, jnp.array(True), [X] * 4)
  _, norms = jax.jit(perturbkit.per_example_grad_norms(loss))(variables, X)  # one compile
  assert_norms_equal(norms, reference_grads(loss, variables, X), TOL)


def test_wav2vec2_weight_norm_positional_conv():
  """Hugging Face Flax Wav2Vec2 (for CTC: its root owns no params), a tiny config built in
  code: the positional conv's ``weight_v``/``weight_g`` are read through a nested apply
  inside the conv's own call."""
  import transformers as T
  # One conv layer in the feature extractor: the check is on the positional conv.
  config = T.Wav2Vec2Config(
      vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
      intermediate_size=32, conv_dim=(8,), conv_stride=(4,), conv_kernel=(8,),
      num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
      do_stable_layer_norm=True, feat_extract_norm='layer')
  with jax.numpy_rank_promotion('allow'):
    hf = T.FlaxWav2Vec2ForCTC(config, input_shape=(1, 200), _do_init=False)
    shapes = flax.traverse_util.flatten_dict(flax.core.unfreeze(hf.params_shape_tree))
    rng = np.random.default_rng(0)
    params = flax.traverse_util.unflatten_dict({
        path: jnp.asarray(rng.normal(0.0, 0.3, leaf.shape).astype(np.float32))
        for path, leaf in sorted(shapes.items())})
    audio = jax.random.normal(jax.random.key(0), (3, 200))

    def loss_fn(variables, audio):
      logits = hf.module.apply(variables, audio)[0]
      return jnp.mean(jnp.mean(jax.nn.log_softmax(logits)[..., 0], axis=1))

    _, by_param = assert_matches_vmap_grad(loss_fn, {'params': params}, audio)
  conv = by_param['wav2vec2']['encoder']['pos_conv_embed']['conv']
  assert float(jnp.min(conv['weight_v'])) > 1e-4  # not vacuous


class _CheckpointedRoot(nn.Module):
  """The root module's own method under ``@nn.checkpoint``."""

  @nn.checkpoint
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(jnp.tanh(nn.Dense(4)(x)))


def test_the_root_method_under_a_lifted_transform_is_refused_by_name():
  """Flax hands over the root's copy inside the transform, whose params are the transform's:
  a named error that says where the decorator can go (it said the params were unused)."""
  model, x = _CheckpointedRoot(), jax.random.normal(jax.random.key(1), (3, 4))
  variables = jax.eval_shape(model.init, jax.random.key(0), x)  # only traced below
  loss_fn = lambda v, x: jnp.mean(jnp.sum(model.apply(v, x) ** 2, axis=-1))
  with pytest.raises(perturbkit.PerExampleError, match=r'Root\.__call__ runs inside a lifted'):
    jax.eval_shape(perturbkit.per_example_grad_norms(loss_fn), variables, x)
