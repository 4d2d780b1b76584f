"""Models as users write them: validating pytree outputs, hand-placed points, rough edges."""
import dataclasses

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import perturbkit

TOL = dict(rtol=1e-5, atol=1e-6)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Validated:
  """A frozen dataclass whose constructor rejects anything but arrays (like HF ModelOutput)."""
  hidden: jax.Array
  scores: jax.Array

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if not hasattr(value, 'shape'):
        raise TypeError(f'{f.name} must be an array, got {type(value).__name__}')


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WithIndex:
  value: jax.Array
  index: jax.Array

  def __post_init__(self):
    if not hasattr(self.index, 'shape'):
      raise TypeError('index must be an array')


class Encoder(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4)(x)
    return Validated(jnp.tanh(h), nn.Dense(2)(h))


class Indexed(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.Dense(3)(x)
    return WithIndex(y, jnp.argmax(y, axis=-1))


class UserModel(nn.Module):
  """Pytree outputs of user node types, and a hand-placed point on an intermediate."""

  @nn.compact
  def __call__(self, x):
    enc = Encoder()(x)
    ind = Indexed()(x)
    x_hat = self.perturb('x_hat', enc.hidden * 2.0)  # not a submodule output
    return jnp.sum(x_hat) + jnp.sum(enc.scores ** 2) + jnp.sum(jnp.sin(ind.value))


X = jax.random.normal(jax.random.key(1), (3, 5))


def _reference(variables):
  """Explicit perturbation arguments at every float leaf of every call output."""
  model = UserModel()

  def with_deltas(params, deltas):
    def interceptor(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      name = '/'.join(context.module.path)
      if name not in deltas or context.method_name != '__call__':
        return out
      leaves, treedef = jax.tree.flatten(out)
      new = iter(deltas[name])
      return jax.tree.unflatten(treedef, [
          leaf + next(new) if jnp.issubdtype(leaf.dtype, jnp.inexact) else leaf
          for leaf in leaves])

    with nn.intercept_methods(interceptor):
      return model.apply({'params': params, 'perturbations': {'x_hat': deltas['x_hat']}}, X)

  zeros = {'Encoder_0': [jnp.zeros((3, 4)), jnp.zeros((3, 2))],
           'Indexed_0': [jnp.zeros((3, 3))], 'Encoder_0/Dense_0': [jnp.zeros((3, 4))],
           'Encoder_0/Dense_1': [jnp.zeros((3, 2))], 'Indexed_0/Dense_0': [jnp.zeros((3, 3))],
           'x_hat': jnp.zeros((3, 4))}
  return jax.grad(with_deltas, argnums=(0, 1))(variables['params'], zeros)


@pytest.mark.parametrize('with_collection', [True, False], ids=['init-collection', 'params-only'])
def test_user_node_outputs_and_hand_placed_points(with_collection):
  model = UserModel()
  variables = model.init(jax.random.key(0), X)
  assert 'x_hat' in variables['perturbations']  # Flax's own init makes the hand point
  if not with_collection:
    variables = {'params': variables['params']}
  loss, grads = jax.jit(perturbkit.value_and_grad(lambda v: model.apply(v, X)))(variables)
  want_params, want = _reference(variables)
  chex.assert_trees_all_close(grads['params'], want_params, **TOL)
  points = grads['perturbations']
  # An all-float user node is kept as it is; one with an int leaf becomes its float leaves.
  assert isinstance(points['Encoder_0']['__call__'], Validated)
  chex.assert_trees_all_close(list(jax.tree.leaves(points['Encoder_0']['__call__'])),
                              want['Encoder_0'], **TOL)
  assert isinstance(points['Indexed_0']['__call__'], tuple)
  chex.assert_trees_all_close(list(points['Indexed_0']['__call__']), want['Indexed_0'], **TOL)
  for name in ('Encoder_0/Dense_0', 'Encoder_0/Dense_1', 'Indexed_0/Dense_0'):
    module, sub = name.split('/')
    chex.assert_trees_all_close(points[module][sub]['__call__'], want[name][0], **TOL)
  chex.assert_trees_all_close(points['x_hat'], want['x_hat'], **TOL)


def test_flax_guide_foo_verbatim():
  """The Flax guide's example, unchanged, under perturbkit.value_and_grad."""
  class Foo(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(3)(x)
      x = self.perturb('dense3', x)
      return nn.Dense(2)(x)

  def loss(variables, inputs, targets):
    preds = model.apply(variables, inputs)
    return jnp.square(preds - targets).mean()

  x = jnp.ones((2, 9))
  y = jnp.ones((2, 2))
  model = Foo()
  variables = model.init(jax.random.key(0), x)
  intm_grads = jax.grad(loss, argnums=0)(variables, x, y)
  value, grads = perturbkit.value_and_grad(loss)(variables, x, y)
  chex.assert_trees_all_close(grads['perturbations']['dense3'],
                              intm_grads['perturbations']['dense3'], **TOL)
  # The automatic point after Dense_0 sees the same gradient as the hand point
  # right after it; Dense_1's is the direct output gradient.
  chex.assert_trees_all_close(grads['perturbations']['Dense_0']['__call__'],
                              intm_grads['perturbations']['dense3'], **TOL)
  preds = model.apply(variables, x)
  chex.assert_trees_all_close(grads['perturbations']['Dense_1']['__call__'],
                              2 * (preds - y) / preds.size, **TOL)
  tx = perturbkit.interleaved(loss, optax.sgd(0.1), propagate='original')
  state, _ = tx.step(tx.init(variables, x, y), x, y)
  want = jax.tree.map(lambda w, g: w - 0.1 * g, variables['params'], intm_grads['params'])
  chex.assert_trees_all_close(state.params, want, **TOL)


def test_interleaved_accepts_frozen_dict():
  model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)])
  variables = flax.core.freeze(model.init(jax.random.key(0), X))
  loss_fn = lambda v, x: jnp.mean(model.apply(v, x) ** 2)
  tx = perturbkit.interleaved(loss_fn, optax.adam(1e-2))
  state, metrics = jax.jit(tx.step)(tx.init(variables, X), X)
  plain = jax.jit(tx.step)(tx.init(flax.core.unfreeze(variables), X), X)
  chex.assert_trees_all_equal((state, metrics), plain)


def test_filters_matching_nothing_are_named_errors():
  model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)])
  variables = model.init(jax.random.key(0), X)
  loss_fn = lambda v: jnp.mean(model.apply(v, X) ** 2)
  typo = perturbkit.filters.by_path('layer_0')
  hook = perturbkit.backward_hook(lambda g: g, typo)
  with pytest.raises(perturbkit.UnmatchedFilterError, match='layers_0/__call__'):
    jax.grad(perturbkit.with_hooks(loss_fn, hook))(variables)
  with pytest.raises(perturbkit.UnmatchedFilterError, match='layers_2/__call__'):
    perturbkit.value_and_grad(loss_fn, hooks=[hook])(variables)
  with pytest.raises(perturbkit.UnmatchedFilterError, match='layers_0/__call__'):
    perturbkit.wrap(model, typo).init(jax.random.key(0), X)
  with pytest.raises(perturbkit.NoPerturbationPointsError, match='layers_0/__call__'):
    perturbkit.value_and_grad(loss_fn, filter=typo)(variables)
  with pytest.raises(perturbkit.SegmentationError, match='layers_0'):
    perturbkit.interleaved(lambda v, x: loss_fn(v), optax.sgd(0.1), segments=typo).init(
        variables, X)


def test_skip_nonfinite_false_applies_and_reports():
  model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)])
  variables = model.init(jax.random.key(0), X)
  loss_fn = lambda v, y: jnp.mean((model.apply(v, X) - y) ** 2)
  bad = jnp.full((3, 1), jnp.nan)
  tx = perturbkit.interleaved(loss_fn, optax.sgd(0.1), skip_nonfinite=False)
  new, metrics = tx.step(tx.init(variables, bad), bad)
  assert not bool(metrics['skipped'])
  assert bool(metrics['nonfinite']['layers_2'])
  assert not bool(jnp.all(jnp.isfinite(new.params['layers_2']['kernel'])))


def test_state_of_another_model_and_mismatched_optimizer_state():
  small = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(1)])
  big = nn.Sequential([nn.Dense(6), nn.relu, nn.Dense(1)])
  loss_of = lambda m: lambda v, x: jnp.mean(m.apply(v, x) ** 2)
  v_small = small.init(jax.random.key(0), X)
  state = perturbkit.interleaved(loss_of(small), optax.sgd(0.1)).init(v_small, X)
  with pytest.raises(perturbkit.StateMismatchError, match='does not match the model'):
    perturbkit.interleaved(loss_of(big), optax.sgd(0.1)).step(state, X)
  with pytest.raises(perturbkit.OptimizerStateError, match=r"'layers_0'.*\[0\]"):
    perturbkit.interleaved(loss_of(small), optax.adam(0.1)).step(state, X)


class _SharingEncoder(nn.Module):
  embed: nn.Module

  @nn.compact
  def __call__(self, ids):
    return nn.Dense(4)(jnp.tanh(self.embed(ids)))


class _SharedEmbedding(nn.Module):
  """An encoder that holds the root's embedding, reached through a getter, as Hugging Face's
  encoder-decoders are (``module._get_encoder_module()`` in ``model.encode``)."""

  def setup(self):
    self.shared = nn.Embed(10, 4)
    self.encoder = _SharingEncoder(self.shared)

  def __call__(self, ids):
    return self.encoder(ids)

  def get_encoder(self):
    return self.encoder


@pytest.mark.parametrize('own_variables', [False, True])
def test_a_submodule_returned_by_a_root_method_runs_on_the_callers_variables(own_variables):
  """Also where the apply gets variables the metric builds, ``{'params': ...}``, as Hugging
  Face's ``model.encode(ids, params=...)`` builds them."""
  model = _SharedEmbedding()
  ids = jnp.array([[1, 2, 3]])
  variables = model.init(jax.random.key(0), ids)

  def metric(variables, ids):
    given = {'params': variables['params']} if own_variables else variables
    return jnp.sin(model.apply(given, ids, method=lambda m, ids: m.get_encoder()(ids))).sum()

  def by_hand(delta):  # the same run with an explicit delta at the encoder's Dense
    def interceptor(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      return out + delta if context.module.path == ('encoder', 'Dense_0') else out
    with nn.intercept_methods(interceptor):
      return metric(variables, ids)

  delta = jnp.zeros((1, 3, 4))
  value, grads = perturbkit.value_and_grad(metric)(variables, ids)
  chex.assert_trees_all_close(value, by_hand(delta), **TOL)
  chex.assert_trees_all_close(grads['perturbations']['encoder']['Dense_0']['__call__'],
                              jax.grad(by_hand)(delta), **TOL)
  chex.assert_trees_all_close(grads['params'], jax.grad(metric)(variables, ids)['params'],
                              **TOL)
  edits = {'encoder/Dense_0/__call__': perturbkit.interpret.add(0.5)}
  chex.assert_trees_all_close(perturbkit.run_with_edits(metric)(variables, edits, ids),
                              by_hand(delta + 0.5), **TOL)


def test_remat_in_a_submodule_called_outside_every_method_is_a_named_error():
  """A submodule reached by attribute in the function given to ``apply`` runs outside every
  method of the model; the outputs inside its ``nn.remat`` cannot come out: a named error
  whose message says to call it through a method, which then caches it."""
  class Encoder(nn.Module):
    def setup(self):
      self.layer = nn.remat(_SharingEncoder)(nn.Embed(10, 4))

    def __call__(self, ids):
      return self.layer(ids)

  class Model(nn.Module):
    def setup(self):
      self.encoder = Encoder()

    def __call__(self, ids):
      return self.encoder(ids)

    def get_encoder(self):
      return self.encoder

  model = Model()
  ids = jnp.array([[1, 2, 3]])
  variables = model.init(jax.random.key(0), ids)
  by_attribute = lambda v, ids: model.apply(v, ids, method=lambda m, ids: m.encoder(ids)).sum()
  by_method = lambda v, ids: model.apply(v, ids, method=lambda m, ids: m.get_encoder()(ids)).sum()
  for function in (perturbkit.run_with_cache(by_attribute),
                   lambda v, ids: perturbkit.run_with_edits(by_attribute)(v, {}, ids)):
    with pytest.raises(perturbkit.CaptureOutsideMethodCallError,
                       match='encoder/layer/embed/__call__.*through a method of the model'):
      function(variables, ids)
  _, state = model.apply(variables, ids, capture_intermediates=True, mutable=['intermediates'])
  _, cache = perturbkit.run_with_cache(by_method)(variables, ids)
  chex.assert_trees_all_close(
      cache.outputs['encoder']['layer']['Dense_0']['__call__'],
      state['intermediates']['encoder']['layer']['Dense_0']['__call__'][0], **TOL)


def test_cache_of_a_submodule_of_a_model_bound_inside_the_function():
  """``model.bind(v).encoder(ids)``: Flax holds a module's parent weakly, so the bound copy
  of the model is gone while its encoder runs. The encoder's calls are the model's own,
  outside every transform: cached as ``capture_intermediates`` sees them."""
  class Model(nn.Module):
    def setup(self):
      self.encoder = _SharingEncoder(nn.Embed(10, 4))

    def __call__(self, ids):
      return self.encoder(ids)

  model = Model()
  ids = jnp.array([[1, 2, 3]])
  variables = model.init(jax.random.key(0), ids)
  metric = lambda v, ids: jnp.sin(model.bind(v).encoder(ids)).sum()
  _, state = model.apply(variables, ids, capture_intermediates=True, mutable=['intermediates'])
  want = state['intermediates']['encoder']
  out, cache = perturbkit.run_with_cache(metric)(variables, ids)
  chex.assert_trees_all_close(out, metric(variables, ids), **TOL)
  chex.assert_trees_all_close(cache.outputs['encoder']['Dense_0']['__call__'],
                              want['Dense_0']['__call__'][0], **TOL)
  chex.assert_trees_all_close(cache.outputs['encoder']['__call__'], want['__call__'][0], **TOL)
