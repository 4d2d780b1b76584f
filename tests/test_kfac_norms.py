"""K-FAC's LayerNorm and RMSNorm layers: the exact diagonal of their Fisher block.

The references use no perturbkit: per-example gradients of the norms' params from
``jax.vmap(jax.grad)`` of one example's loss (the empirical Fisher: their mean square),
and per-example Jacobians of the logits with the softmax's Hessian between them (the
exact Fisher: ``diag(Jᵀ H J)``, averaged over examples). The models normalise over the
last axis of ``(batch, tokens, features)`` activations, call one RMSNorm twice (its
per-example gradient is the sum over both calls before squaring) and have a LayerNorm
with a bias only; the NNX twin, given the same weights, gets the same factors.
"""
import functools

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import perturbkit

NORMS = ('ln', 'rms', 'shift')
TOL = dict(rtol=2e-4, atol=1e-7)


class NormNet(nn.Module):
  @nn.compact
  def __call__(self, x):                                     # (N, T, 3)
    h = nn.LayerNorm(name='ln')(nn.Dense(4, name='embed')(x))
    h = jnp.tanh(nn.Dense(4, name='mix')(h))
    rms = nn.RMSNorm(name='rms')
    h = rms(h) + 0.5 * rms(jnp.sin(2.0 * h))                 # one module, two calls
    h = nn.LayerNorm(use_scale=False, name='shift')(h)       # a bias alone
    return nn.Dense(3, name='head')(h.mean(axis=1))


class NNXNormNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Linear(3, 4, rngs=rngs)
    self.ln = nnx.LayerNorm(4, rngs=rngs)
    self.mix = nnx.Linear(4, 4, rngs=rngs)
    self.rms = nnx.RMSNorm(4, rngs=rngs)
    self.shift = nnx.LayerNorm(4, use_scale=False, rngs=rngs)
    self.head = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    h = self.ln(self.embed(x))
    h = jnp.tanh(self.mix(h))
    h = self.rms(h) + 0.5 * self.rms(jnp.sin(2.0 * h))
    return self.head(self.shift(h).mean(axis=1))


@pytest.fixture(scope='module')
def problem():
  x = jax.random.normal(jax.random.key(0), (6, 5, 3))
  y = jnp.arange(6) % 3
  @jax.jit
  def initial(x):
    variables = NormNet().init(jax.random.key(1), x)
    # Scales and biases away from their initial 1 and 0, so that both parts of
    # x̂ ⊙ scale + bias matter.
    leaves, treedef = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    return jax.tree.unflatten(treedef, [
        leaf + 0.3 * jax.random.normal(k, leaf.shape) for leaf, k in zip(leaves, keys)])

  variables = initial(x)
  predict = lambda v, x: NormNet().apply(v, x)
  return variables, predict, x, y


@pytest.fixture(scope='module')
def layers(problem):
  """The K-FAC layers ``kfac_layers`` finds in ``NormNet``: traced once for the tests."""
  variables, predict, x, _ = problem
  return perturbkit.kfac_layers(predict, variables, x)


@pytest.fixture(scope='module')
def empirical(problem, layers):
  """``(loss, grads, stats)`` of the jitted empirical-Fisher estimator: compiled once."""
  variables, predict, x, y = problem
  return jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                           fisher='empirical'))(variables, x, y)


@pytest.fixture(scope='module')
def norm_grads(problem):
  """The reference's per-example gradients of the norms' params: compiled once."""
  return per_example_norm_grads(*problem)


def per_example_norm_grads(variables, predict, x, y):
  """``{norm: {param: (N, d)}}``: each example's gradient of its own loss."""
  def loss(params, xi, yi):
    logits = predict({'params': params}, xi[None])
    return optax.softmax_cross_entropy_with_integer_labels(logits, yi[None])[0]

  grads = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))(variables['params'], x, y)
  return {name: grads[name] for name in NORMS}


def mean_square(g):
  """The mean over the examples (axis 0) of the square, in numpy float64."""
  g = np.asarray(g, np.float64)
  return np.mean(g * g, axis=0)


def exact_fisher_diagonals(variables, predict, x):
  """``{norm: {param: (d,)}}``: ``mean_n diag(J_nᵀ H_n J_n)`` with ``H = diag(p) - p pᵀ``."""
  params = variables['params']

  def one(xi):
    logits_of = lambda p: predict({'params': p}, xi[None])[0]
    jac = jax.jacrev(logits_of)(params)
    p = jax.nn.softmax(logits_of(params))
    hessian = jnp.diag(p) - jnp.outer(p, p)
    return jax.tree.map(lambda j: jnp.einsum('i...,ij,j...->...', j, hessian, j), jac)

  diagonals = jax.jit(lambda x: jax.tree.map(lambda d: jnp.mean(d, axis=0), jax.vmap(one)(x)))(x)
  return {name: diagonals[name] for name in NORMS}


def expected_factors(diagonals):
  """The layers' ``(a, g)``: the scale's diagonal and the bias's; the bias alone for 'shift'."""
  return {'ln': (diagonals['ln']['scale'], diagonals['ln']['bias']),
          'rms': (diagonals['rms']['scale'], np.zeros((0,))),
          'shift': (diagonals['shift']['bias'], np.zeros((0,)))}


def assert_factors(stats, expected):
  for name, (a, g) in expected.items():
    np.testing.assert_allclose(stats[name].a, a, **TOL, err_msg=f'{name}.a')
    np.testing.assert_allclose(stats[name].g, g, **TOL, err_msg=f'{name}.g')


def test_the_norms_are_layers_with_their_params(layers):
  assert layers.skipped == {}
  got = {name: (info.kind, info.param, info.kernel_shape, info.use_bias, info.calls)
         for name, info in layers.layers.items() if info.kind == 'norm'}
  assert got == {'ln': ('norm', 'scale', (4,), True, ('__call__',)),
                 'rms': ('norm', 'scale', (4,), False, ('__call__', '__call__#1')),
                 'shift': ('norm', 'bias', (4,), False, ('__call__',))}
  assert layers.layers['ln'].norm.centered and not layers.layers['rms'].norm.centered


@pytest.mark.parametrize('fisher', ['empirical', 'exact'])
def test_factors_are_the_diagonal_fisher(problem, layers, fisher, request):
  variables, predict, x, y = problem
  if fisher == 'empirical':
    _, _, stats = request.getfixturevalue('empirical')
    diagonals = jax.tree.map(mean_square, request.getfixturevalue('norm_grads'))
  else:
    estimate = jax.jit(perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                                 fisher=fisher))
    _, _, stats = estimate(variables, x, y)
    diagonals = exact_fisher_diagonals(variables, predict, x)
  assert_factors(stats, expected_factors(diagonals))


def test_nnx_twin_gets_the_same_factors(problem, layers, norm_grads):
  variables, _, x, y = problem
  model = nnx.jit(lambda: NNXNormNet(nnx.Rngs(0)))()  # one compile, not one per eager op
  params = variables['params']
  for name in ('embed', 'mix', 'head', *NORMS):
    layer = getattr(model, name)
    for leaf, value in params[name].items():
      getattr(layer, leaf).set_value(value)
  nnx_layers = perturbkit.nnx.kfac_layers(model, x)
  assert {n: i.kind for n, i in nnx_layers.layers.items()} == {
      'embed': 'dense', 'ln': 'norm', 'mix': 'dense', 'rms': 'norm', 'shift': 'norm',
      'head': 'dense'}
  for name in NORMS:
    assert nnx_layers.layers[name]._replace(path=()) == layers.layers[name]._replace(path=())
  estimate = perturbkit.nnx.kfac_estimator('softmax_cross_entropy', nnx_layers,
                                           fisher='empirical')
  _, _, stats = nnx.jit(estimate)(model, x, y)
  assert_factors(stats, expected_factors(jax.tree.map(mean_square, norm_grads)))


def test_preconditioned_update_is_the_gradient_over_the_damped_diagonal(problem, layers,
                                                                         empirical):
  variables = problem[0]
  _, grads, stats = empirical
  damping = 0.05
  tx = perturbkit.kfac_preconditioner(layers, damping=damping)
  params = variables['params']
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params, kfac_stats=stats)
  for name, leaf, diagonal in (('ln', 'scale', stats['ln'].a), ('ln', 'bias', stats['ln'].g),
                               ('rms', 'scale', stats['rms'].a),
                               ('shift', 'bias', stats['shift'].a)):
    want = np.asarray(grads[name][leaf], np.float64) / (np.asarray(diagonal) + damping)
    np.testing.assert_allclose(updates[name][leaf], want, rtol=1e-5, err_msg=f'{name}/{leaf}')


# ---------------------------------------------------------------- what has no rule

class Masked(nn.Module):
  masked: bool = True

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4)(x)
    mask = jnp.broadcast_to(jnp.arange(4) < 2, h.shape) if self.masked else None
    return nn.Dense(2)(nn.LayerNorm(name='ln')(h, mask=mask))


class NNXMasked(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Linear(5, 4, rngs=rngs)
    self.ln = nnx.LayerNorm(4, rngs=rngs)
    self.head = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    h = self.embed(x)
    return self.head(self.ln(h, mask=jnp.broadcast_to(jnp.arange(4) < 2, h.shape)))


class OtherAxes(nn.Module):
  @nn.compact
  def __call__(self, x):                                     # (N, T, d)
    h = nn.LayerNorm(reduction_axes=(1, 2), feature_axes=-1, name='ln')(nn.Dense(4)(x))
    return nn.Dense(2)(h.mean(axis=1))


class TokensFirst(nn.Module):
  @nn.compact
  def __call__(self, x):                                     # (N, T, d)
    h = nn.LayerNorm(name='ln')(jnp.swapaxes(nn.Dense(4)(x), 0, 1))   # (T, N, d)
    return nn.Dense(2)(h.mean(axis=0))


def _layers(model, x, shapes_only=False):
  """The model's variables and K-FAC layers; with ``shapes_only`` the variables are
  ``jax.eval_shape``'s (the layers are found by tracing: shapes are all it reads)."""
  init = functools.partial(jax.eval_shape, model.init) if shapes_only else jax.jit(model.init)
  variables = init(jax.random.key(0), x)
  return variables, perturbkit.kfac_layers(lambda v, x: model.apply(v, x), variables, x)


def test_norms_the_rule_does_not_cover_are_skipped_with_the_reason():
  x = jnp.ones((4, 3, 5))
  _, layers = _layers(OtherAxes(), x, shapes_only=True)
  assert 'ln' not in layers.layers
  assert 'only the last axis' in layers.skipped['ln']
  # Tokens first: each example's gradient cannot be told apart on the first axis.
  variables, layers = _layers(TokensFirst(), x, shapes_only=True)
  assert 'ln' not in layers.layers
  assert "does not have the batch's 4 examples on its first axis" in layers.skipped['ln']
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match='first axis'):
    model = TokensFirst()
    perturbkit.kfac_layers(lambda v, x: model.apply(v, x), variables, x,
                           filter=perturbkit.filters.by_type(nn.LayerNorm))


def test_a_norm_called_with_a_mask_is_skipped_or_refused():
  """Its rule normalises over every feature: kfac_layers skips it with the reason, and
  refuses it where a filter selects it, on both front ends."""
  x = jnp.ones((4, 5))
  variables, layers = _layers(Masked(), x, shapes_only=True)
  assert 'ln' not in layers.layers and sorted(layers.layers) == ['Dense_0', 'Dense_1']
  assert 'called with a mask' in layers.skipped['ln']
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match='ln.*called with a mask'):
    perturbkit.kfac_layers(lambda v, x: Masked().apply(v, x), variables, x,
                           filter=perturbkit.filters.by_type(nn.LayerNorm))
  model = nnx.eval_shape(lambda: NNXMasked(nnx.Rngs(0)))
  nnx_layers = perturbkit.nnx.kfac_layers(model, x)
  assert sorted(nnx_layers.layers) == ['embed', 'head']
  assert 'called with a mask' in nnx_layers.skipped['ln']
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match='ln.*called with a mask'):
    perturbkit.nnx.kfac_layers(model, x, filter=perturbkit.nnx.filters.by_type(nnx.LayerNorm))


def test_a_norm_called_with_a_mask_is_refused_by_the_estimator():
  """Layers built for the same model calling its norm without a mask list the norm; the
  estimator checks each call and refuses the masked one."""
  x = jnp.ones((4, 5))
  variables, layers = _layers(Masked(masked=False), x)
  assert layers.layers['ln'].kind == 'norm'
  estimate = perturbkit.kfac_estimator(lambda v, x: Masked().apply(v, x),
                                       'softmax_cross_entropy', layers, fisher='empirical')
  # Refused while tracing: under jax.jit, so that the ops before the refusal compile once.
  with pytest.raises(perturbkit.KFACUnsupportedLayerError, match='ln.*called with a mask'):
    jax.jit(estimate)(variables, x, jnp.zeros((4,), jnp.int32))


def test_kfac_of_a_layer_normed_mlp_lowers_the_loss(problem, layers):
  """Three steps of whole-model K-FAC with every layer preconditioned, the norms included."""
  variables, predict, x, y = problem
  estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                       fisher='empirical')
  tx = optax.chain(perturbkit.kfac_preconditioner(layers, damping=0.1, inverse_every=1),
                   optax.sgd(0.1))

  @jax.jit
  def step(params, state):
    loss, grads, stats = estimate({'params': params}, x, y)
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state, loss

  params, state = variables['params'], tx.init(variables['params'])
  losses = []
  for _ in range(4):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  assert losses[-1] < losses[0], losses
  chex.assert_tree_all_finite(params)


def test_a_norm_layer_built_by_hand_without_its_geometry_is_refused(problem, layers):
  predict = problem[1]
  by_hand = layers._replace(layers={**layers.layers, 'ln': layers.layers['ln']._replace(norm=None)})
  with pytest.raises(perturbkit.KFACLayerInfoError, match="'ln'.*LayerInfo.norm"):
    perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', by_hand, fisher='empirical')
  with pytest.raises(perturbkit.KFACLayerInfoError, match="'ln'.*LayerInfo.norm"):
    perturbkit.kfac_segment(by_hand.layers['ln'])


class NNXNormMLP(nnx.Module):
  """test_kfac_segment's NormMLP in NNX: Dense -> LayerNorm -> tanh -> Dense -> RMSNorm -> Dense."""

  def __init__(self, rngs: nnx.Rngs):
    self.Dense_0 = nnx.Linear(3, 6, rngs=rngs)
    self.LayerNorm_0 = nnx.LayerNorm(6, rngs=rngs)
    self.Dense_1 = nnx.Linear(6, 5, rngs=rngs)
    self.RMSNorm_0 = nnx.RMSNorm(5, rngs=rngs)
    self.Dense_2 = nnx.Linear(5, 4, rngs=rngs)

  def __call__(self, x):
    x = jnp.tanh(self.LayerNorm_0(self.Dense_0(x)))
    return self.Dense_2(self.RMSNorm_0(self.Dense_1(x)))


@pytest.mark.parametrize('propagate', ['updated', 'original'])
def test_nnx_norm_segments_equal_the_linen_twin(propagate):
  """K-FAC segments of an NNX model with a LayerNorm and an RMSNorm (their diagonals formed in
  the sweep) step as the Linen twin's do, from the same weights."""
  import nnx_models
  import test_kfac_segment as seg

  @nnx.jit  # one compile, not one per eager op
  def build():
    model = NNXNormMLP(nnx.Rngs(0))
    # Scales and biases away from 1 and 0, the same in both twins.
    for norm in (model.LayerNorm_0, model.RMSNorm_0):
      norm.scale.set_value(1.0 + 0.3 * jax.random.normal(jax.random.key(5), norm.scale.shape))
    return model

  model = build()
  variables = nnx_models.linen_variables(model)
  predict, loss_fn, _, xs, ys = seg.problem(2, seg.NormMLP())
  layers = perturbkit.nnx.kfac_layers(model, xs[0])
  linen_layers = perturbkit.kfac_layers(predict, variables, xs[0])
  assert layers.layers == linen_layers.layers
  assert {n: i.kind for n, i in layers.layers.items()} == {
      'Dense_0': 'dense', 'LayerNorm_0': 'norm', 'Dense_1': 'dense', 'RMSNorm_0': 'norm',
      'Dense_2': 'dense'}
  s_nnx, s_linen = seg.stepped_twins(model, layers, variables, loss_fn, linen_layers, xs, ys,
                                     propagate, damping=seg.DAMPING, decay=0.5, inverse_every=1)
  for name in ('LayerNorm_0', 'RMSNorm_0'):
    factors = s_linen.opt_state[name][0].factors['segment']
    assert float(jnp.min(factors.a)) > 0, name      # the diagonal was taken
    chex.assert_trees_all_close(s_nnx.opt_state[name][0].factors, s_linen.opt_state[name][0].factors,
                                rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(nnx_models.pure(nnx.state(s_nnx.model(), nnx.Param)),
                              s_linen.params, rtol=1e-5, atol=1e-6)


class Keywords(nn.Module):
  """Dense and LayerNorm given their inputs by name (``inputs=``, ``x=``), or not."""
  by_name: bool

  @nn.compact
  def __call__(self, x):
    call = (lambda f, v, name: f(**{name: v})) if self.by_name else (lambda f, v, _: f(v))
    h = call(nn.Dense(4, name='dense'), x, 'inputs')
    return nn.Dense(3, name='head')(call(nn.LayerNorm(name='ln'), h, 'x'))


def test_inputs_given_by_name_give_the_same_factors():
  x = jax.random.normal(jax.random.key(0), (4, 5))
  y = jnp.arange(4) % 3
  stats = []
  for by_name in (False, True):
    model = Keywords(by_name)
    variables = jax.jit(model.init)(jax.random.key(1), x)
    predict = lambda v, x, model=model: model.apply(v, x)
    layers = perturbkit.kfac_layers(predict, variables, x)
    estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                         fisher='empirical')
    stats.append(jax.jit(estimate)(variables, x, y)[2])
  assert set(stats[1]) == {'dense', 'ln', 'head'}
  chex.assert_trees_all_close(stats[1], stats[0], rtol=1e-6)


# ---------------------------------------------------------------- Hugging Face's RMSNorms

def _hf_causal_lm(family):
  """A tiny unmodified Hugging Face Llama, Mistral or Gemma (built in code), its variables
  with the norms' weights moved away from their initial value, and token ids."""
  import transformers as T
  import hf_models
  config = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
  hf = {'llama': lambda: T.FlaxLlamaForCausalLM(T.LlamaConfig(**config), _do_init=False),
        'mistral': lambda: T.FlaxMistralForCausalLM(T.MistralConfig(**config), _do_init=False),
        'gemma': lambda: T.FlaxGemmaForCausalLM(T.GemmaConfig(**config, head_dim=8),
                                                _do_init=False)}[family]()
  variables = hf_models.filled_variables(hf)
  flat = flax.traverse_util.flatten_dict(variables['params'])

  names = list(flat)

  @jax.jit  # one compile for all the weights, not one per shape
  def moved(values):
    keys = iter(jax.random.split(jax.random.key(3), len(values)))
    return [v + 0.5 * jax.random.normal(next(keys), v.shape) if k[-1] == 'weight' else v
            for k, v in zip(names, values)]

  flat = dict(zip(names, moved([flat[k] for k in names])))
  ids = jax.random.randint(jax.random.key(4), (3, 6), 0, 64)
  return hf.module, {'params': flax.traverse_util.unflatten_dict(flat)}, ids


@pytest.mark.parametrize('family', ['llama', 'mistral', 'gemma'])
def test_hf_rms_norms_get_the_diagonal_of_their_weight(family):
  """Llama's, Mistral's and Gemma's own RMSNorm modules (a scale named ``weight``; Gemma
  multiplies by ``1 + weight``) are norm layers whose factor is the mean square of each
  example's ``weight`` gradient (``jax.vmap(jax.grad)`` of its next-token loss, summed over
  positions: the estimator's convention)."""
  def predict(v, ids):
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return module.apply(v, ids, jnp.ones_like(ids), positions).logits[:, :-1]

  # These models broadcast their norm's weight against its input's rank.
  with jax.numpy_rank_promotion('allow'):
    module, variables, ids = _hf_causal_lm(family)
    layers = perturbkit.kfac_layers(predict, variables, ids)
    norms = {n: i for n, i in layers.layers.items() if i.kind == 'norm'}
    assert set(norms) == {'model/norm'} | {f'model/layers/{i}/{n}' for i in range(2)
                                           for n in ('input_layernorm', 'post_attention_layernorm')}
    assert all(i.param == 'weight' and not i.use_bias for i in norms.values())
    estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers,
                                         fisher='empirical')
    _, _, stats = jax.jit(estimate)(variables, ids, ids[:, 1:])

    def loss(params, one):
      logits = predict({'params': params}, one[None])
      return optax.softmax_cross_entropy_with_integer_labels(logits, one[None, 1:]).sum()

    grads = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(variables['params'], ids)
  for name in ('model/layers/1/input_layernorm', 'model/norm'):
    g = grads
    for k in name.split('/'):
      g = g[k]
    np.testing.assert_allclose(stats[name].a, mean_square(g['weight']), rtol=2e-4,
                               atol=1e-9, err_msg=name)
    assert stats[name].g.shape == (0,)
