"""The named errors of per-example gradients. Each message says what was wrong and how to fix it."""
from perturbkit._errors import PerturbkitError


class PerExampleError(PerturbkitError, ValueError):
  """Per-example gradients are not defined, or not available, for this loss."""


class ExamplesMixedError(PerExampleError):
  """The loss mixes examples, so no example has a gradient of its own."""

  def __init__(self, detail):
    super().__init__(
        f'Per-example gradients are not defined for this loss: {detail}. They exist only '
        'when the loss is a sum or mean of one term per example, each term depending on '
        'its own example alone. BatchNorm in training mode, a loss over batch '
        'statistics or over pairs of examples (a contrastive loss) makes every term '
        'depend on the whole batch. Use a per-example normalization instead '
        '(nn.LayerNorm, nn.GroupNorm), or BatchNorm with `use_running_average=True`; a '
        'pairwise loss has no per-example gradients.')


class ExamplesAxisError(PerExampleError):
  """The examples axis of the inputs or of a layer's activations does not line up."""

  def __init__(self, detail):
    super().__init__(
        f'The examples axis does not line up: {detail}. The loss arguments are split '
        'along `batch_axes` (default: axis 0 of every array argument; `None` for an '
        'argument shared by all examples), and every layer must see the examples on axis '
        '0 of its input and output. Pass `batch_axes=` to match your data layout, or '
        'move the examples axis to the front inside the model.')


class UncoveredParamsError(PerExampleError):
  """Some params are not used by any submodule call, so their per-example gradient is unknown."""

  def __init__(self, names):
    listed = ', '.join(names[:8]) + (' ...' if len(names) > 8 else '')
    super().__init__(
        f'{len(names)} param-owning module(s) are not reached through a submodule call: '
        f'[{listed}]. Per-example gradients are built from each call\'s input and output '
        'gradient, so params must be read inside a call of the module that owns them: the '
        'root module\'s own params and params read by a parent through `.variables` are '
        'not supported. Move such params into a submodule.')


class ParamsReadOutsideError(PerExampleError):
  """A module's params are also read outside its calls, a part of their gradient no call sees."""

  def __init__(self, reads):
    listed = '; '.join(f'{name} (read by {", ".join(sorted(what))})'
                       for name, what in sorted(reads.items()))
    super().__init__(
        f'The params of {listed} are also read outside the calls of the module that owns '
        'them. Per-example gradients are built from each call\'s input and output gradient '
        '(and from nested `module.apply({"params": f(params)}, ...)` calls, such as a tied LM '
        'head), so the part of the gradient flowing through any other read would be missing '
        'from the norms and from the clipping. Such reads are the weights used inline in '
        'another module (`h @ self.embed.variables["params"]["embedding"].T`), a kernel '
        'reused by hand, or a penalty on the weights (L2) inside the loss. Compute a weight '
        'penalty outside the per-example loss (add its gradient to the result, or use '
        '`optax.add_decayed_weights`); use a tied or shared weight through a call of its '
        'module (`embed.attend(h)`, the same `nn.Dense` called twice) or through a nested '
        '`head.apply({"params": {"kernel": w.T}}, h)`.')


class AmbiguousInputError(PerExampleError):
  """A call's input has as many rows as there are examples but is not computed from the batch."""

  def __init__(self, where, index, shape):
    super().__init__(
        f'Input {index} of the call {where} has shape {shape}: as many rows as there are '
        'examples, but it is computed from none of the loss\'s arguments or variables (a '
        'constant such as `jnp.arange`, or an array the loss closes over). perturbkit cannot '
        'tell whether its rows are the examples (positions broadcast to the batch) or it is '
        'shared by all examples and happens to have that many rows, so it does not guess. '
        'Pass the array as an argument of the loss: batched (`batch_axes` 0) if its rows are '
        'the examples, or with `batch_axes` None if it is shared. Arrays made with '
        '`jnp.zeros_like(ids)` or `jnp.ones_like(ids)` are such constants too: they do not '
        'read the values of `ids`. For Hugging Face models this is usually an id array left '
        'to its default or made inside the loss, e.g. `position_ids` (position_embeddings) '
        'or `token_type_ids` (token_type_embeddings): build it outside the loss, e.g. '
        '`jnp.broadcast_to(jnp.arange(length), ids.shape)` or `jnp.zeros_like(ids)`, pass it '
        'to the loss as a batched argument, and from there to the model. (A call run inside a JAX '
        'transform within the loss, such as `jax.checkpoint` or `jax.jit` around '
        '`model.apply`, also shows its inputs this way; per-example gradients need the '
        'calls traced directly.)')


class SharedCallError(PerExampleError):
  """A param-owning call has no per-example input, so its output gradient sums over the examples."""

  def __init__(self, where):
    super().__init__(
        f'The call {where} has no per-example input: none of its inputs is computed from '
        'the batched arguments of the loss (`batch_axes`), so its output is the same for '
        'every example and the gradient at it is already summed over the examples. The '
        'per-example gradients of its params cannot be separated from that sum. Apply the '
        'module to per-example inputs (for a positional embedding, pass the positions as '
        'a batched argument of the loss), and pass the batch to the loss as an argument '
        'rather than closing over it. A layer applied inside the model to positions it '
        'builds itself from a fixed length (Whisper\'s encoder looks up '
        '`jnp.arange(max_source_positions)`) cannot be given per-example inputs; its '
        'per-example gradients are not available. Calls run inside a JAX transform within '
        'the loss (`jax.checkpoint`, `jax.jit` around `model.apply`) are not supported either.')


class RandomCallError(PerExampleError):
  """A call replayed per example draws random numbers (dropout inside a param-owning module)."""

  def __init__(self, where, detail):
    super().__init__(
        f'The call {where} draws random numbers ({detail}) and its params have no fast '
        'per-example rule, so their per-example gradients come from replaying the call on '
        'its own. A replay cannot draw the random numbers the batched forward pass drew '
        '(its dropout mask), so its gradients would not be those of the loss. Make the call '
        'deterministic for the per-example step (e.g. `deterministic=True` for the dropout '
        'inside this module), or draw the randomness outside the module that owns the '
        'params (dropout applied by the parent to the module\'s output, or to its input, '
        'is supported: it is part of the recorded forward pass).')


class OptaxPrivacyError(PerExampleError):
  """optax's per-example DP transformation was given gradients without an examples axis."""

  def __init__(self, where, given):
    super().__init__(
        f'{where} was given an optimizer containing `optax.contrib.'
        'differentially_private_aggregate` (or `optax.contrib.dpsgd`), which clips and '
        'noises per-example gradients: it takes the first axis of every gradient leaf for '
        f'the examples. It would receive {given} and clip rows of the weight gradients '
        'instead. For DP-SGD on an unmodified model use `perturbkit.dp_sgd(loss_fn, '
        'optax_optimizer, clip_norm=..., noise_multiplier=...)` with a plain optax optimizer '
        '(it clips and noises itself), or `perturbkit.private_grad`. The interleaved '
        'schedule does not combine with per-example clipping.')


class InterleavedClippingError(PerExampleError):
  """Per-example clipping (DP-SGD) was combined with the interleaved schedule."""

  def __init__(self, how):
    super().__init__(
        f'{how}. DP-SGD clips each example\'s gradient by its norm over ALL layers, which is '
        'known only when the whole backward pass is done, while the interleaved sweep '
        'updates each segment as soon as its own gradient exists, before the layers below '
        'it are reached; the two cannot be combined. Train privately with '
        '`perturbkit.dp_sgd(loss_fn, optax_optimizer, ...)` (the standard schedule), or use '
        '`perturbkit.interleaved` without per-example clipping (its `clip_global_norm` clips '
        'the batch gradient, which gives no privacy).')
