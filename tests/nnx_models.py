"""Small NNX test models, their Linen twins, and hand-perturbed references.

Every NNX model takes ``hand: bool``. With ``hand=False`` it is an ordinary NNX
model. With ``hand=True`` it computes exactly the same thing, but adds Flax's
own ``perturb`` at the output of each submodule call, on the called submodule,
named by the point key (``self.dense_1.perturb('__call__#1', h)``): Flax's own
``nnx.capture`` then lays the points out the way perturbkit reports them, which
makes the twin an independent reference (:func:`hand_value_and_grad`).

Each NNX model's attributes carry the names of the Linen twin's submodules, so
``linen_variables`` copies the weights across unchanged.
"""
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import bridge


def point(module: nnx.Module, owner: nnx.Module, key: str, value: Any) -> Any:
  """``module.perturb(key, value)`` when ``owner`` is a hand-perturbed twin."""
  return module.perturb(key, value) if owner.hand else value


def hand_value_and_grad(loss_fn, model: nnx.Module, *args):
  """Flax's documented perturbation workflow on a ``hand=True`` model.

  ``nnx.capture(..., nnx.Perturbation)`` creates the zeros (on a clone, so the
  model's state does not move), ``nnx.capture(..., init=...)`` feeds them in,
  and ``nnx.value_and_grad`` over ``(model, perturbations)`` gives both
  gradients. Returns ``(loss, param_grads, perturbation_grads as nested dict)``.
  """
  _, zeros = nnx.capture(loss_fn, nnx.Perturbation)(nnx.clone(model), *args)

  def with_points(model, perturbations, *args):
    return nnx.capture(loss_fn, init=perturbations)(model, *args)

  loss, (g_params, g_points) = nnx.value_and_grad(with_points, argnums=(0, 1))(
      model, zeros, *args)
  return loss, g_params, nnx.to_pure_dict(g_points)


def linen_variables(model: nnx.Module) -> dict:
  """The NNX model's params (and batch stats) as a Linen variables dict."""
  variables = {'params': nnx.to_pure_dict(nnx.state(model, nnx.Param))}
  stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
  if stats:
    variables['batch_stats'] = stats
  return variables


def pure(tree: Any) -> Any:
  """An ``nnx.State`` (or anything) as nested dicts of numeric arrays, for comparisons.

  RNG keys become their key data.
  """
  tree = nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree
  is_key = lambda a: hasattr(a, 'dtype') and jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
  return jax.tree.map(lambda a: jax.random.key_data(a) if is_key(a) else a, tree)


# --- MLP with a skip connection and a module called twice -----------------------------


class MLP(nnx.Module):
  """Linear -> relu -> Linear (+ skip) -> the same Linear again -> Linear."""

  def __init__(self, din: int = 3, width: int = 6, dout: int = 2, *, hand: bool = False,
               rngs: nnx.Rngs):
    self.hand = hand
    self.dense_0 = nnx.Linear(din, width, rngs=rngs)
    self.dense_1 = nnx.Linear(width, width, rngs=rngs)
    self.dense_2 = nnx.Linear(width, dout, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(point(self.dense_0, self, '__call__', self.dense_0(x)))
    h = nnx.relu(point(self.dense_1, self, '__call__', self.dense_1(h))) + h
    h = jnp.tanh(point(self.dense_1, self, '__call__#1', self.dense_1(h)))
    return point(self.dense_2, self, '__call__', self.dense_2(h))


def mlp_explicit(model: MLP, x, d: dict):
  """The MLP's forward pass with the perturbations as an explicit argument."""
  h = nnx.relu(model.dense_0(x) + d['dense_0']['__call__'])
  h = nnx.relu(model.dense_1(h) + d['dense_1']['__call__']) + h
  h = jnp.tanh(model.dense_1(h) + d['dense_1']['__call__#1'])
  return model.dense_2(h) + d['dense_2']['__call__']


class LinenMLP(nn.Module):
  width: int = 6
  dout: int = 2

  def setup(self):
    self.dense_0 = nn.Dense(self.width)
    self.dense_1 = nn.Dense(self.width)
    self.dense_2 = nn.Dense(self.dout)

  def __call__(self, x):
    h = nn.relu(self.dense_0(x))
    h = nn.relu(self.dense_1(h)) + h
    h = jnp.tanh(self.dense_1(h))
    return self.dense_2(h)


# --- CNN with BatchNorm and Dropout (train mode) ---------------------------------------


class CNN(nnx.Module):
  """Conv -> BatchNorm -> relu -> Dropout -> mean pool -> Linear.

  ``dropout_key`` (optional) replaces the model's own dropout stream, so that
  the Linen twin can draw the same mask.
  """

  def __init__(self, channels: int = 1, *, hand: bool = False, rngs: nnx.Rngs):
    self.hand = hand
    self.conv = nnx.Conv(channels, 4, (3, 3), rngs=rngs)
    self.norm = nnx.BatchNorm(4, momentum=0.9, rngs=rngs)
    self.dropout = nnx.Dropout(0.3, rngs=rngs)
    self.head = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x, dropout_key=None):
    h = point(self.conv, self, '__call__', self.conv(x))
    h = nnx.relu(point(self.norm, self, '__call__', self.norm(h)))
    h = point(self.dropout, self, '__call__', self.dropout(h, rngs=dropout_key))
    return point(self.head, self, '__call__', self.head(jnp.mean(h, axis=(1, 2))))


class LinenCNN(nn.Module):
  def setup(self):
    self.conv = nn.Conv(4, (3, 3))
    self.norm = nn.BatchNorm(use_running_average=False, momentum=0.9)
    self.dropout = nn.Dropout(0.3, deterministic=False)
    self.head = nn.Dense(3)

  def __call__(self, x, dropout_key):
    h = nn.relu(self.norm(self.conv(x)))
    h = self.dropout(h, rng=dropout_key)
    return self.head(jnp.mean(h, axis=(1, 2)))


# --- Conv -> relu -> mean pool -> Linear (no state besides params) --------------------


class ConvNet(nnx.Module):
  """Conv -> relu -> mean pool -> Linear."""

  def __init__(self, channels: int = 1, *, hand: bool = False, rngs: nnx.Rngs):
    self.hand = hand
    self.conv = nnx.Conv(channels, 4, (3, 3), rngs=rngs)
    self.head = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(point(self.conv, self, '__call__', self.conv(x)))
    return point(self.head, self, '__call__', self.head(jnp.mean(h, axis=(1, 2))))


class LinenConvNet(nn.Module):
  def setup(self):
    self.conv = nn.Conv(4, (3, 3))
    self.head = nn.Dense(3)

  def __call__(self, x):
    return self.head(jnp.mean(nn.relu(self.conv(x)), axis=(1, 2)))


# --- Transformer block with nnx.MultiHeadAttention -----------------------------------


class TransformerBlock(nnx.Module):
  """Pre-norm self-attention + MLP block, residual connections."""

  def __init__(self, dim: int = 8, heads: int = 2, hidden: int = 16, *, hand: bool = False,
               rngs: nnx.Rngs):
    self.hand = hand
    self.norm_0 = nnx.LayerNorm(dim, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
    self.norm_1 = nnx.LayerNorm(dim, rngs=rngs)
    self.dense_0 = nnx.Linear(dim, hidden, rngs=rngs)
    self.dense_1 = nnx.Linear(hidden, dim, rngs=rngs)

  def __call__(self, x):
    h = point(self.norm_0, self, '__call__', self.norm_0(x))
    x = x + point(self.attention, self, '__call__', self.attention(h))
    h = point(self.norm_1, self, '__call__', self.norm_1(x))
    h = nnx.gelu(point(self.dense_0, self, '__call__', self.dense_0(h)))
    return x + point(self.dense_1, self, '__call__', self.dense_1(h))


class LinenTransformerBlock(nn.Module):
  dim: int = 8
  heads: int = 2
  hidden: int = 16

  def setup(self):
    self.norm_0 = nn.LayerNorm()
    self.attention = nn.MultiHeadDotProductAttention(num_heads=self.heads)
    self.norm_1 = nn.LayerNorm()
    self.dense_0 = nn.Dense(self.hidden)
    self.dense_1 = nn.Dense(self.dim)

  def __call__(self, x):
    h = self.norm_0(x)
    x = x + self.attention(h, h)
    h = self.norm_1(x)
    return x + self.dense_1(nn.gelu(self.dense_0(h)))


# --- Stacked blocks under nnx.scan and a block under nnx.remat ----------------------


class Block(nnx.Module):
  def __init__(self, width: int, *, hand: bool = False, rngs: nnx.Rngs):
    self.hand = hand
    self.linear = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(point(self.linear, self, '__call__', self.linear(x)))


def unstacked(stacked: nnx.Module, count: int) -> nnx.List:
  """The ``count`` modules of a stack made with ``nnx.vmap``, each holding its slice of the
  stacked state: the blocks of the stack's unrolled twin."""
  graphdef, state = nnx.split(stacked)
  return nnx.List([nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
                   for i in range(count)])


class ScanMLP(nnx.Module):
  """``depth`` stacked blocks applied with ``nnx.scan``, then a Linear head to ``classes``;
  ``block(rngs)`` makes one block (default: :class:`Block` of ``width``)."""

  def __init__(self, width: int = 4, depth: int = 3, *, classes: int = 2,
               block: Callable[[nnx.Rngs], nnx.Module] | None = None, rngs: nnx.Rngs):
    block = block or (lambda rngs: Block(width, rngs=rngs))

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return block(rngs)

    self.depth = depth
    self.blocks = create(rngs)
    self.head = nnx.Linear(width, classes, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
      return block(x)

    return self.head(body(x, self.blocks))


class RematMLP(nnx.Module):
  def __init__(self, width: int = 4, *, rngs: nnx.Rngs):
    self.block = Block(width, rngs=rngs)
    self.head = nnx.Linear(width, 2, rngs=rngs)

  def __call__(self, x):
    h = nnx.remat(lambda block, x: block(x))(self.block, x)
    return self.head(h)


class LiftedBlock(nnx.Module):
  """Linear -> BatchNorm (batch statistics) -> the same Linear again -> tanh."""

  def __init__(self, width: int, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(width, width, rngs=rngs)
    self.norm = nnx.BatchNorm(width, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.linear(self.norm(self.linear(x))))


class Lifted(nnx.Module):
  """Linear -> LiftedBlock under ``nnx.remat`` or ``nnx.jit`` -> Linear (``transform='none'``:
  the same model without a transform, with the same state from the same ``rngs``)."""

  def __init__(self, transform: str = 'remat', width: int = 4, *, rngs: nnx.Rngs):
    self.transform = transform
    self.inp = nnx.Linear(3, width, rngs=rngs)
    self.block = LiftedBlock(width, rngs=rngs)
    self.out = nnx.Linear(width, 2, rngs=rngs)

  def __call__(self, x):
    lift = {'remat': nnx.remat, 'jit': nnx.jit, 'none': lambda f: f}[self.transform]
    return self.out(lift(lambda block, h: block(h))(self.block, self.inp(x)))


class Bridged(nnx.Module):
  """An NNX model with a Linen MLP inside, through Flax's ``nnx.bridge.ToNNX``."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.linen = bridge.ToNNX(LinenMLP(dout=5), rngs=rngs)
    self.head = nnx.Linear(5, 2, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.linen(x)))


class Recurrent(nnx.Module):
  """Linear -> Flax's ``nnx.RNN`` of an ``nnx.LSTMCell`` (the cell is carried by ``nnx.scan``
  from step to step) -> Linear."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.embed = nnx.Linear(3, 4, rngs=rngs)
    self.rnn = nnx.RNN(nnx.LSTMCell(4, 4, rngs=rngs))
    self.head = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.head(self.rnn(self.embed(x)))


class BiRecurrent(nnx.Module):
  """Linear -> Flax's ``nnx.Bidirectional`` of an LSTM and a GRU ``nnx.RNN`` -> Linear."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.embed = nnx.Linear(3, 4, rngs=rngs)
    self.rnn = nnx.Bidirectional(nnx.RNN(nnx.LSTMCell(4, 4, rngs=rngs)),
                                 nnx.RNN(nnx.GRUCell(4, 4, rngs=rngs)))
    self.head = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.head(self.rnn(self.embed(x)))


class VmapBroadcast(nnx.Module):
  """A block under ``nnx.vmap`` over examples, its state broadcast."""

  def __init__(self, width: int = 4, *, mapped: bool = False, rngs: nnx.Rngs):
    self.mapped = mapped
    self.block = Block(width, rngs=rngs)
    self.head = nnx.Linear(width, 2, rngs=rngs)

  def __call__(self, x):
    axes = nnx.StateAxes({nnx.Perturbation: 0, ...: None}) if self.mapped else None
    h = nnx.vmap(lambda block, x: block(x), in_axes=(axes, 0))(self.block, x)
    return self.head(h)


# --- Random architectures for property tests -----------------------------------------


class RandomNet(nnx.Module):
  """A stack of Linear layers with optional skips and one layer used twice.

  ``widths[i]`` is the output width of layer ``i``; ``skips[i]`` adds the
  layer's input to its output where the widths agree; ``shared`` (an index or
  ``None``) applies that layer a second time right after its first use, where
  its input and output widths agree. The layers live in an ``nnx.List``.
  """

  def __init__(self, din: int, widths: Sequence[int], skips: Sequence[bool],
               shared: int | None, *, hand: bool = False, rngs: nnx.Rngs):
    self.hand = hand
    dims = [din, *widths]
    self.layers = nnx.List([nnx.Linear(dims[i], dims[i + 1], rngs=rngs)
                            for i in range(len(widths))])
    self.skips = tuple(skips)
    self.shared = shared

  def __call__(self, x):
    for i, layer in enumerate(self.layers):
      h = jnp.tanh(point(layer, self, '__call__', layer(x)))
      if self.shared == i and h.shape == x.shape:
        h = jnp.tanh(point(layer, self, '__call__#1', layer(h)))
      x = h + x if self.skips[i] and h.shape == x.shape else h
    return x


def mse(model, x, y=None):
  """Mean squared output: a loss for any model above."""
  del y
  return jnp.mean(model(x) ** 2)


def random_batch(shape, seed: int = 0):
  return jax.random.normal(jax.random.key(seed), shape)


class LoRALinear(nnx.Linear):
  """``nnx.Linear`` plus a low-rank update; its call runs ``nnx.Linear``'s through a method of
  its own, ``base``, which calls ``super().__call__``."""

  def __init__(self, din: int, dout: int, *, rank: int = 2, rngs: nnx.Rngs):
    super().__init__(din, dout, rngs=rngs)
    self.lora_a = nnx.Param(0.3 * jax.random.normal(rngs.params(), (din, rank)))
    self.lora_b = nnx.Param(0.3 * jax.random.normal(rngs.params(), (rank, dout)))

  def __call__(self, x):
    return self.base(x) + x @ self.lora_a[...] @ self.lora_b[...]

  def base(self, x):
    return super().__call__(x)


class LoRANet(nnx.Module):
  """``head(tanh(hidden(x)))`` of two ``LoRALinear`` (``hand_lora.updated_sgd_step``)."""

  def __init__(self, din: int = 3, width: int = 6, dout: int = 2, *, rngs: nnx.Rngs):
    self.hidden = LoRALinear(din, width, rngs=rngs)
    self.head = LoRALinear(width, dout, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.hidden(x)))


class SplitMerge(nnx.Module):
  """Calls public helper methods of its own inside ``__call__`` (NNX calls are those of
  ``__call__`` and the public methods)."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.qkv = nnx.Linear(3, 6, rngs=rngs)
    self.out = nnx.Linear(6, 3, rngs=rngs)

  def split(self, h):
    return h.reshape(h.shape[:-1] + (2, h.shape[-1] // 2))

  def merge(self, h):
    return h.reshape(h.shape[:-2] + (-1,))

  def __call__(self, x):
    return self.out(self.merge(jnp.tanh(self.split(self.qkv(x)))))


class WithHelpers(nnx.Module):
  """``head(sin(attn(inp(x))))`` with ``attn`` a :class:`SplitMerge`."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.inp = nnx.Linear(3, 3, rngs=rngs)
    self.attn = SplitMerge(rngs=rngs)
    self.head = nnx.Linear(3, 2, rngs=rngs)

  def __call__(self, x, after=lambda h: h):
    """``after``: a twin's function on attn's output."""
    return self.head(jnp.sin(after(self.attn(self.inp(x)))))


class SharedKernel(nnx.Module):
  """``head(tanh(b(tanh(a(x)))))`` with ``b`` holding ``a``'s kernel Variable and its own bias.

  ``nnx.state(model, nnx.Param)`` lists the shared kernel once, as ``a/kernel``.
  """

  def __init__(self, width: int = 4, *, rngs: nnx.Rngs):
    self.a = nnx.Linear(width, width, rngs=rngs)
    self.b = nnx.Linear(width, width, bias_init=nnx.initializers.normal(0.5), rngs=rngs)
    self.b.kernel = self.a.kernel
    self.head = nnx.Linear(width, 2, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.b(jnp.tanh(self.a(x)))))


class BiasedTiedHead(nnx.Module):
  """Logits ``h @ w.T + bias`` from an embedding Variable ``w`` it holds, and its own bias."""

  def __init__(self, w: nnx.Param, vocab: int):
    self.w = w
    self.bias = nnx.Param(jnp.linspace(-0.3, 0.3, vocab))

  def __call__(self, h):
    return h @ self.w[...].T + self.bias[...].reshape((1,) * (h.ndim - 1) + (-1,))


class BiasedTiedLM(nnx.Module):
  """Token embedding, a hidden layer, and a head holding the embedding's Variable."""

  def __init__(self, vocab: int = 7, dim: int = 4, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.mid = nnx.Linear(dim, dim, rngs=rngs)
    self.head = BiasedTiedHead(self.embed.embedding, vocab)

  def __call__(self, tokens):
    return self.head(jnp.tanh(self.mid(self.embed(tokens))))
