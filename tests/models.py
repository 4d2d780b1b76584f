"""Small test models shared by the test files, each with a hand-perturbed twin.

Every model takes ``hand: bool``. With ``hand=False`` it is an ordinary Linen
model. With ``hand=True`` it computes exactly the same thing with the same
params, but adds Flax's own ``self.perturb`` at the output of each submodule
call, named ``'<module path>/<point key>'`` relative to the module that adds it.
That twin is the independent reference for perturbkit: ``nest`` turns its
``'perturbations'`` collection into perturbkit's layout.
"""
from typing import Any, Callable, NamedTuple, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp


def perturb(module: nn.Module, name: str, value: Any) -> Any:
  """``module.perturb(name, value)`` when the module is a hand-perturbed twin."""
  return module.perturb(name, value) if module.hand else value


def nest(tree: Any) -> Any:
  """Splits ``'a/b/__call__'`` keys into nested dicts: the hand layout to perturbkit's."""
  if not isinstance(tree, (dict, flax.core.FrozenDict)):
    return tree
  out: dict = {}
  for key, value in tree.items():
    node = out
    *parents, last = key.split('/')
    for name in parents:
      node = node.setdefault(name, {})
    node[last] = nest(value)
  return out


def unnest(tree: Any, prefix: str = '') -> dict:
  """Joins a nested perturbkit tree into flat ``'a/b/__call__'`` keys (root-level twins)."""
  out = {}
  for key, value in tree.items():
    name = f'{prefix}/{key}' if prefix else key
    if isinstance(value, (dict, flax.core.FrozenDict)):
      out.update(unnest(value, name))
    else:
      out[name] = value
  return out


class MLP(nn.Module):
  """Dense -> relu -> Dense (+ skip) -> relu -> Dense."""
  features: Sequence[int] = (8, 8)
  out: int = 2
  hand: bool = False

  @nn.compact
  def __call__(self, x):
    h = perturb(self, 'Dense_0/__call__', nn.Dense(self.features[0], name='Dense_0')(x))
    h = nn.relu(h)
    h2 = perturb(self, 'Dense_1/__call__', nn.Dense(self.features[1], name='Dense_1')(h))
    h = nn.relu(h2) + h
    return perturb(self, 'Dense_2/__call__', nn.Dense(self.out, name='Dense_2')(h))


class SmoothMLP(nn.Module):
  """Dense -> tanh -> Dense (+ skip) -> tanh -> Dense: smooth in every call's output."""
  hand: bool = False

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(perturb(self, 'Dense_0/__call__', nn.Dense(8, name='Dense_0')(x)))
    h2 = perturb(self, 'Dense_1/__call__', nn.Dense(8, name='Dense_1')(h))
    h = jnp.tanh(h2) + h
    return perturb(self, 'Dense_2/__call__', nn.Dense(2, name='Dense_2')(h))


class CNN(nn.Module):
  """Conv -> BatchNorm -> relu -> mean pool -> Dense."""
  train: bool = True
  hand: bool = False

  @nn.compact
  def __call__(self, x):
    h = perturb(self, 'Conv_0/__call__', nn.Conv(4, (3, 3), name='Conv_0')(x))
    h = perturb(self, 'BatchNorm_0/__call__', nn.BatchNorm(
        use_running_average=not self.train, momentum=0.9, name='BatchNorm_0')(h))
    h = jnp.mean(nn.relu(h), axis=(1, 2))
    return perturb(self, 'Dense_0/__call__', nn.Dense(3, name='Dense_0')(h))


class TransformerBlock(nn.Module):
  """Pre-norm attention + MLP block with dropout; its top-level calls are the points."""
  train: bool = True
  hand: bool = False

  @nn.compact
  def __call__(self, x):
    p = lambda name, y: perturb(self, f'{name}/__call__', y)
    h = p('LayerNorm_0', nn.LayerNorm(name='LayerNorm_0')(x))
    h = p('MultiHeadDotProductAttention_0', nn.MultiHeadDotProductAttention(
        num_heads=2, qkv_features=8, dropout_rate=0.2, deterministic=not self.train,
        name='MultiHeadDotProductAttention_0')(h, h))
    h = p('Dropout_0', nn.Dropout(0.3, deterministic=not self.train, name='Dropout_0')(h))
    x = x + h
    h = p('LayerNorm_1', nn.LayerNorm(name='LayerNorm_1')(x))
    h = p('Dense_0', nn.Dense(16, name='Dense_0')(h))
    h = p('Dense_1', nn.Dense(x.shape[-1], name='Dense_1')(nn.gelu(h)))
    h = p('Dropout_1', nn.Dropout(0.3, deterministic=not self.train, name='Dropout_1')(h))
    return x + h


class Codec(nn.Module):
  """Setup-style submodule with two methods, ``encode`` and ``decode``, and no ``__call__``."""
  latent: int = 4

  def setup(self):
    self.inner = nn.Dense(self.latent)
    self.outer = nn.Dense(3)

  def encode(self, x):
    return self.inner(x)

  def decode(self, z):
    return self.outer(z)


class AutoEncoder(nn.Module):
  """Setup-style: the parent calls the methods of its ``codec``; it has ``encode`` too.

  Points: ``codec/encode`` and ``codec/decode`` (method calls) and the Dense calls
  inside them, ``codec/inner/__call__`` and ``codec/outer/__call__``.
  """
  hand: bool = False

  def setup(self):
    self.codec = Codec()

  def _encode(self, x):
    z = perturb(self, 'codec/inner/__call__', self.codec.encode(x))
    return perturb(self, 'codec/encode', z)

  def encode(self, x):
    return self._encode(x)

  def __call__(self, x):
    z = self._encode(x)
    y = perturb(self, 'codec/outer/__call__', self.codec.decode(jnp.tanh(z)))
    return perturb(self, 'codec/decode', y)


class SharedDense(nn.Module):
  """One Dense applied twice (shared weights), then a head.

  ``single=True`` (with ``hand=True``) adds one shared perturbation to both
  outputs: its gradient is the sum of the two per-call gradients.
  """
  width: int = 4
  hand: bool = False
  single: bool = False

  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(self.width, name='shared')
    first = 'shared/__call__'
    second = first if self.single else 'shared/__call__#1'
    h = jnp.tanh(perturb(self, first, dense(x)))
    h = jnp.tanh(perturb(self, second, dense(h)))
    return perturb(self, 'head/__call__', nn.Dense(2, name='head')(h))


@flax.struct.dataclass
class Scored:
  value: jax.Array
  index: jax.Array


class TupleHead(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.Dense(3)(x)
    return y, jnp.argmax(y, axis=-1)


class DictHead(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.Dense(3)(x)
    return {'value': y, 'index': jnp.argmax(y, axis=-1)}


class StructHead(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.Dense(3)(x)
    return Scored(y, jnp.argmax(y, axis=-1))


class ArgmaxOnly(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.argmax(nn.Dense(3)(x), axis=-1)


class PytreeOutputs(nn.Module):
  """Submodules returning a tuple, a dict and a struct dataclass with int leaves.

  The point of each head holds its float leaf only (``None`` in place of the int).
  """

  @nn.compact
  def __call__(self, x):
    t = TupleHead(name='TupleHead_0')(x)
    d = DictHead(name='DictHead_0')(x)
    s = StructHead(name='StructHead_0')(x)
    index = ArgmaxOnly(name='ArgmaxOnly_0')(x)
    value = jnp.tanh(t[0]) * d['value'] + jnp.sin(s.value)
    return value, (t[1], d['index'], s.index, index)


def float_part(tree):
  """A plain container with its int leaves replaced by ``None``, as perturbkit's points are."""
  return jax.tree.map(lambda a: a if jnp.issubdtype(a.dtype, jnp.inexact) else None, tree)


class HandPytreeOutputs(nn.Module):
  """``PytreeOutputs`` with a hand-written perturbation on each head's float leaf."""

  @nn.compact
  def __call__(self, x):
    t = TupleHead(name='TupleHead_0')(x)
    d = DictHead(name='DictHead_0')(x)
    s = StructHead(name='StructHead_0')(x)
    t = self.perturb('TupleHead_0/__call__', float_part(t))[0], t[1]
    dv = self.perturb('DictHead_0/__call__', float_part(d))['value']
    d = {'value': dv, 'index': d['index']}
    # A user's node with an int leaf is never rebuilt with None: its point is
    # the tuple of its float leaves.
    s = s.replace(value=self.perturb('StructHead_0/__call__', (s.value,))[0])
    index = ArgmaxOnly(name='ArgmaxOnly_0')(x)
    value = jnp.tanh(t[0]) * d['value'] + jnp.sin(s.value)
    return value, (t[1], d['index'], s.index, index)


def sequential():
  """``nn.Sequential`` of Dense / activation layers; its Dense calls are the points."""
  return nn.Sequential([nn.Dense(6), nn.relu, nn.Dense(6), jnp.tanh, nn.Dense(2)])


class HandSequential(nn.Module):
  """``sequential()`` written out, with a hand perturbation after each Dense."""

  @nn.compact
  def __call__(self, x):
    h = self.perturb('layers_0/__call__', nn.Dense(6, name='layers_0')(x))
    h = self.perturb('layers_2/__call__', nn.Dense(6, name='layers_2')(nn.relu(h)))
    return self.perturb('layers_4/__call__', nn.Dense(2, name='layers_4')(jnp.tanh(h)))


class Block(nn.Module):
  """Dense -> tanh, with a residual; the unit of the lifted-transform models."""
  hand: bool = False

  @nn.compact
  def __call__(self, x):
    h = x + jnp.tanh(perturb(self, 'Dense_0/__call__', nn.Dense(x.shape[-1])(x)))
    # Its own output is perturbed from inside, so that the point lands where the
    # lifted version (nn.vmap) puts it: per member, at this module's path.
    return perturb(self, '__call__', h)


class Lifted(nn.Module):
  """Dense -> lifted Block -> Dense, with ``nn.remat`` or ``nn.jit`` around Block (or, with
  ``transform='none'``, the same model without a transform)."""
  transform: str = 'remat'
  hand: bool = False

  @nn.compact
  def __call__(self, x):
    h = perturb(self, 'Dense_0/__call__', nn.Dense(4, name='Dense_0')(x))
    # The hand twin uses the plain Block: the lifted one computes the same thing.
    transform = {'remat': nn.remat, 'jit': nn.jit, 'none': lambda block: block}[self.transform]
    block = Block if self.hand else transform(Block)
    h = block(hand=self.hand, name='block')(h)
    return perturb(self, 'Dense_1/__call__', nn.Dense(2, name='Dense_1')(h))


class NormBlock(nn.Module):
  """Dense -> BatchNorm (batch statistics, updating its running averages) -> relu."""

  @nn.compact
  def __call__(self, x):
    return nn.relu(nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x)))


class RematNorm(nn.Module):
  """Dense -> ``nn.remat(NormBlock)`` -> Dense (``remat=False``: the same without the transform);
  applied with ``mutable=['batch_stats']``."""
  remat: bool = True

  @nn.compact
  def __call__(self, x):
    block = nn.remat(NormBlock) if self.remat else NormBlock
    return nn.Dense(2)(block(name='block')(nn.Dense(3)(x)))


class MappedDense(nn.Module):
  """A Dense per member under ``nn.vmap`` with every collection in ``variable_axes``."""

  @nn.compact
  def __call__(self, x):
    dense = nn.vmap(nn.Dense, variable_axes={True: 0}, split_rngs={'params': True})
    return dense(4, name='dense')(x)


class BranchedDense(nn.Module):
  """``nn.cond`` (or ``nn.switch``) between two Dense submodules on the sign of ``x.sum()``."""
  switch: bool = False

  def setup(self):
    self.emb, self.a, self.b, self.out = nn.Dense(4), nn.Dense(4), nn.Dense(4), nn.Dense(1)

  def __call__(self, x):
    h = self.emb(x)
    if self.is_initializing():  # both branches' params, as Flax's cond requires
      self.a(h), self.b(h)
    branches = [lambda m, h: m.a(h), lambda m, h: m.b(h)]
    if self.switch:
      h = nn.switch((x.sum() > 0).astype(jnp.int32), branches[::-1], self, h)
    else:
      h = nn.cond(x.sum() > 0, *branches, self, h)
    return self.out(h)


def _plain_branch(module, h, delta):
  return module.a(h) + delta


def _doubled_branch(module, h, delta):
  return 2.0 * (module.a(-h) + delta)


class BranchesAround(nn.Module):
  """Dense ``a`` called before, inside the branches of two ``nn.cond`` (``nn.switch``) in a
  row, and after them; ``deltas[i]`` is added after a's i-th call (both branches of a
  conditional share one), so the model is its own explicit-delta twin. The branches are
  named functions of the module, passed the delta; under a parent with ``nested``, ``a``
  under ``nn.remat`` with ``remat``."""
  switch: bool = False
  nested: bool = False
  remat: bool = False
  features: int = 4

  def setup(self):
    if self.nested:
      self.block = BranchesAround(self.switch, remat=self.remat, features=self.features)
    else:
      self.a = (nn.remat(nn.Dense) if self.remat else nn.Dense)(self.features)

  def __call__(self, x, pred, deltas):
    if self.nested:
      return self.block(x, pred, deltas)
    branches = (_plain_branch, _doubled_branch)
    h = self.a(x) + deltas[0]
    for delta in deltas[1:3]:
      if self.switch:
        h = nn.switch(pred.astype(jnp.int32), branches, self, h, delta)
      else:
        h = nn.cond(pred, *branches, self, h, delta)
    return self.a(h) + deltas[3]


class Cell(nn.Module):
  """A scan body: carry -> tanh(Dense(carry)), also emitted as the step's output.

  Its own output is a point too, one per iteration inside the scan.
  """
  hand: bool = False

  @nn.compact
  def __call__(self, carry, _):
    h = jnp.tanh(perturb(self, 'Dense_0/__call__', nn.Dense(carry.shape[-1])(carry)))
    return perturb(self, '__call__', (h, h))


class Scanned(nn.Module):
  """Dense -> nn.scan(Cell) x ``length`` -> Dense on the last carry.

  ``map_perturbations`` puts ``'perturbations'`` in the scan's ``variable_axes``,
  which gives each iteration its own point.
  """
  length: int = 3
  map_perturbations: bool = True
  hand: bool = False

  @nn.compact
  def __call__(self, x):
    h = perturb(self, 'Dense_0/__call__', nn.Dense(4, name='Dense_0')(x))
    axes = {'params': 0}
    if self.map_perturbations:
      axes['perturbations'] = 0
    scan = nn.scan(Cell, variable_axes=axes, split_rngs={'params': True},
                   length=self.length)
    h, _ = scan(hand=self.hand, name='scan')(h, None)
    return perturb(self, 'Dense_1/__call__', nn.Dense(2, name='Dense_1')(h))


def scanned_unrolled(params, x, eps):
  """``Scanned`` as a Python loop over its stacked params, plus ``eps`` at every point.

  ``eps`` is in perturbkit's layout; the cell's second output is unused, so its
  entry has no effect.
  """
  h = x @ params['Dense_0']['kernel'] + params['Dense_0']['bias'][None] + eps['Dense_0']['__call__']
  cell, cell_eps = params['scan']['Dense_0'], eps['scan']
  for i in range(cell['kernel'].shape[0]):
    pre = h @ cell['kernel'][i] + cell['bias'][i][None] + cell_eps['Dense_0']['__call__'][i]
    h = jnp.tanh(pre) + cell_eps['__call__'][0][i]
  return h @ params['Dense_1']['kernel'] + params['Dense_1']['bias'][None] + eps['Dense_1']['__call__']


class Ensemble(nn.Module):
  """nn.vmap of a Dense over a leading member axis, each member its own params."""
  members: int = 3
  map_perturbations: bool = True
  hand: bool = False

  @nn.compact
  def __call__(self, x):
    axes = {'params': 0}
    if self.map_perturbations:
      axes['perturbations'] = 0
    ensemble = nn.vmap(Block, variable_axes=axes, split_rngs={'params': True},
                       in_axes=0, out_axes=0, axis_size=self.members)
    h = ensemble(hand=self.hand, name='members')(x)
    return perturb(self, 'head/__call__', nn.Dense(1, name='head')(jnp.mean(h, axis=0)))


# One registry of (model, hand twin) cases, reused by the tests of wrap and value_and_grad.


class Case(NamedTuple):
  """A model, its hand-perturbed twin, and how to call them.

  Attributes:
    model: The unmodified model.
    hand: The twin with a ``self.perturb`` at each point the filter selects.
    x_shape: The input's shape.
    filter: The perturbkit filter matching the twin's points (``None``: all calls).
    mutable: Collections the call updates (``()``: none).
    dropout: Whether the call takes a ``'dropout'`` rng.
  """
  model: nn.Module
  hand: nn.Module
  x_shape: tuple
  filter: Any = None
  mutable: tuple = ()
  dropout: bool = False


def _top_level(module, method_name):
  return len(module.path) == 1


def _float_heads(module, method_name):
  return len(module.path) == 1 and module.name != 'ArgmaxOnly_0'


CASES = {
    'mlp': Case(MLP(), MLP(hand=True), (3, 5)),
    'cnn_train': Case(CNN(), CNN(hand=True), (2, 5, 5, 2), mutable=('batch_stats',)),
    'cnn_eval': Case(CNN(train=False), CNN(train=False, hand=True), (2, 5, 5, 2)),
    'transformer_train': Case(TransformerBlock(), TransformerBlock(hand=True), (2, 4, 6),
                              filter=_top_level, dropout=True),
    'transformer_eval': Case(TransformerBlock(train=False),
                             TransformerBlock(train=False, hand=True), (2, 4, 6),
                             filter=_top_level),
    'setup_style': Case(AutoEncoder(), AutoEncoder(hand=True), (3, 3)),
    'shared': Case(SharedDense(), SharedDense(hand=True), (3, 4)),
    'pytree_outputs': Case(PytreeOutputs(), HandPytreeOutputs(), (3, 3), filter=_float_heads),
    'sequential': Case(sequential(), HandSequential(), (3, 4)),
    'remat': Case(Lifted('remat'), Lifted('remat', hand=True), (3, 3)),
    'jit': Case(Lifted('jit'), Lifted('jit', hand=True), (3, 3)),
    'scan': Case(Scanned(), Scanned(hand=True), (3, 3)),
    'vmap': Case(Ensemble(), Ensemble(hand=True), (3, 2, 4)),
}


def scalar(tree: Any) -> jax.Array:
  """A nonlinear scalar of every float leaf of ``tree`` (int leaves are skipped)."""
  leaves = [a for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.inexact)]
  return sum(jnp.sum(jnp.sin(2.0 * a) + 0.5 * a ** 2) for a in leaves)


def rngs(case: Case, key: jax.Array) -> dict:
  return {'dropout': key} if case.dropout else {}


def loss_fn_for(case: Case, model: nn.Module):
  """``(variables, x, key) -> (loss, updated collections)`` calling ``model.apply``."""
  def loss_fn(variables, x, key):
    if case.mutable:
      out, updates = model.apply(variables, x, mutable=list(case.mutable), rngs=rngs(case, key))
      return scalar(out), updates
    return scalar(model.apply(variables, x, rngs=rngs(case, key))), {}
  return loss_fn


def init(case: Case, module: nn.Module, x: jax.Array, seed: int = 0) -> dict:
  """``module``'s variables, initialized under ``jax.jit``: one compile, not one per
  initializer and op."""
  keys = {'params': jax.random.key(seed), 'dropout': jax.random.key(seed + 1)}
  return dict(jax.jit(module.init)(keys, x))


def hand_value_and_grad(case: Case, variables: dict, x: jax.Array, key: jax.Array):
  """The reference: ``jax.value_and_grad`` of the twin at its zero perturbations.

  Returns:
    ``((loss, updates), {'params': ..., 'perturbations': ...})``, the
    perturbations in perturbkit's layout.
  """
  zeros = init(case, case.hand, x)['perturbations']
  loss_fn = loss_fn_for(case, case.hand)

  def f(params, perturbations):
    return loss_fn({**variables, 'params': params, 'perturbations': perturbations}, x, key)

  value, (g_params, g_points) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
      variables['params'], zeros)
  return value, {'params': g_params, 'perturbations': nest(g_points)}


class RandomNet(nn.Module):
  """An architecture drawn by the property tests; its top-level calls are the points.

  Attributes:
    widths: One Dense (or, where ``pairs[i]``, a ``TupleHead``-like layer
      returning ``(y, argmax y)``) per entry.
    skips: Where true and the widths agree, the layer's input is added back.
    shared: Apply one extra Dense twice (shared weights) at the end.
    pairs: Which layers return a tuple with an int leaf.
  """
  widths: Sequence[int]
  skips: Sequence[bool]
  shared: bool
  pairs: Sequence[bool]
  hand: bool = False

  @nn.compact
  def __call__(self, x):
    h = x
    for i, (width, skip, pair) in enumerate(zip(self.widths, self.skips, self.pairs)):
      if pair:
        y, index = Pair(width, name=f'Pair_{i}')(h)
        y = perturb(self, f'Pair_{i}/__call__', (y, None))[0] if self.hand else y
        y = y + 0.01 * index.astype(y.dtype)[..., None]  # the int leaf is used, but is constant
      else:
        y = perturb(self, f'Dense_{i}/__call__', nn.Dense(width, name=f'Dense_{i}')(h))
      y = jnp.tanh(y)
      h = y + h if skip and h.shape == y.shape else y
    if self.shared:
      dense = nn.Dense(h.shape[-1], name='shared')
      h = jnp.tanh(perturb(self, 'shared/__call__', dense(h)))
      h = jnp.tanh(perturb(self, 'shared/__call__#1', dense(h)))
    return h


class Pair(nn.Module):
  """Dense returning ``(y, argmax(y))``."""
  width: int

  @nn.compact
  def __call__(self, x):
    y = nn.Dense(self.width)(x)
    return y, jnp.argmax(y, axis=-1)


class LoRADense(nn.Dense):
  """``nn.Dense`` plus a low-rank update; its call runs ``nn.Dense``'s through ``super()``."""
  rank: int = 2

  @nn.compact
  def __call__(self, x):
    a = self.param('lora_a', nn.initializers.normal(0.3), (x.shape[-1], self.rank))
    b = self.param('lora_b', nn.initializers.normal(0.3), (self.rank, self.features))
    return super().__call__(x) + x @ a @ b


class LoRANet(nn.Module):
  """``head(tanh(hidden(x)))`` of two ``LoRADense`` (``hand_lora.updated_sgd_step``)."""
  width: int = 6
  out: int = 2

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(LoRADense(self.width, name='hidden')(x))
    return LoRADense(self.out, name='head')(h)


class SplitMerge(nn.Module):
  """Calls helper methods of its own inside ``__call__``, as Hugging Face's attention does
  (``_split_heads``, ``_merge_heads``); ``merged`` is applied to ``_merge``'s output."""
  merged: Callable[[jax.Array], jax.Array] = lambda h: h

  def setup(self):
    self.qkv = nn.Dense(6)
    self.out = nn.Dense(3)

  def _split(self, h):
    return h.reshape(h.shape[:-1] + (2, h.shape[-1] // 2))

  def _merge(self, h):
    return h.reshape(h.shape[:-2] + (-1,))

  def __call__(self, x):
    heads = jnp.tanh(self._split(self.qkv(x)))
    return self.out(self.merged(self._merge(heads * self._split(x @ jnp.ones((3, 6))))))


class WithHelpers(nn.Module):
  """``head(sin(attn(inp(x))))`` with ``attn`` a :class:`SplitMerge`; a twin gives ``after``
  (applied to attn's output) or ``merged`` (passed on to attn)."""
  after: Callable[[jax.Array], jax.Array] = lambda h: h
  merged: Callable[[jax.Array], jax.Array] = lambda h: h

  @nn.compact
  def __call__(self, x):
    h = SplitMerge(self.merged, name='attn')(nn.Dense(3, name='inp')(x))
    return nn.Dense(2, name='head')(jnp.sin(self.after(h)))
