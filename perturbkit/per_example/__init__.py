"""Per-example gradient norms and DP-SGD from the one ordinary backward pass.

The pair a layer call sees (its input ``a`` and the gradient ``g`` at its output)
is all that per-example gradient norms need, so
``per_example_grad_norms(loss_fn, reduction='mean', batch_axes=0,
dense_method='auto')`` gets them from the one ordinary backward pass, without a
batch of per-example gradients in memory (``jax.vmap(jax.grad)``). It returns
``(loss, PerExampleNorms(total, by_layer, by_param))``, each of shape
``(batch,)``: ``norms.total``, ``norms.by_layer['Dense_0']``,
``norms.by_param['Dense_0']['kernel']``. ``private_grad`` and ``dp_sgd`` build
DP-SGD on the same pass, and ``check_per_example`` tests a loss for mixing. The
names here are also in ``perturbkit``.

The loss and the examples axis
------------------------------
The loss must be a sum or a mean (``reduction='mean'``, the default) of one term
per example. For a mean, the gradient at example i's activations is 1/B of its
own term's gradient; it is multiplied by B, so the norms are ``‖∇ term_i‖``. The
reduction is checked on the first call (or trace): a loss that is a sum while
``reduction='mean'`` (or the other way round) raises ``ReductionMismatchError``;
pass ``reduction='sum'`` for a sum loss. The check runs the loss on one example
and on two, so a model that hard-codes the batch size raises
``ReductionCheckError``: take the batch size from the input instead. Examples are on axis 0 of every array
argument (``batch_axes=`` takes vmap-style ``in_axes``, e.g. ``(1, 0)``) and on
axis 0 of every layer's input and output.

How each layer is computed
--------------------------
* Dense with any leading axes: the ghost norm ``Σ_{t,s}(a_t·a_s)(g_t·g_s)`` or
  the direct per-example outer product, chosen by size as book-keeping does
  (ghost when ``2T² < d_in·d_out``); ``dense_method='ghost'|'direct'`` forces one.
* Conv: ghost on the input patches (strided slices of the padded input), or
  direct as one batched matmul per kernel offset of a strided window of the
  input, the offsets in a ``lax.scan``, so the patches are never formed.
* Embed: ``Σ_{t,s}[id_t = id_s] g_t·g_s``.
* LayerNorm and RMSNorm scale and bias, and the Dense and Conv biases, have
  rules of their own.
* The norms are float32 (float64 for a float64 model): a bfloat16 or float16
  model's Gram matrices, per-example kernel and bias gradients and squared
  norms are accumulated in float32, and the per-example gradients kept for the
  clipped sum are stored in the model's dtype (in float32 for a float16 model:
  an example's gradient can exceed float16's range where the batch's does not).
* Any other module that owns params is replayed per example: a vmap of its own
  call's VJP, given its recorded inputs and output gradient (transient memory of
  that layer only). A module that also has children gets only its own params
  this way.
* Modules inside ``nn.remat`` / ``nn.checkpoint`` / ``nn.scan`` are supported:
  the top-level ``apply`` they run in is replayed per example for them.
* Where a rule forms per-example gradients (direct Dense/Conv, general path) and
  they are no larger than the call's input and output gradient, DP-SGD's clipped
  sum is their weighted sum instead of one more VJP of the call.

Which inputs are per-example
----------------------------
Read off the traced loss, not guessed from shapes: an input of a call computed
from the batched arguments is split by example (its axis 0 must be the
examples); one computed only from the variables, keyword arguments or arguments
with ``batch_axes`` ``None`` is shared and passed whole, whatever its shape. An
input computed from nothing (a ``jnp.arange``, a closed-over array) with as many
rows as examples is ambiguous and raises ``AmbiguousInputError`` (pass it as an
argument of the loss, batched or with ``batch_axes`` ``None``); a param-owning
call with no per-example input (positions looked up with ``jnp.arange`` and
broadcast later) raises ``SharedCallError``, since the gradient at its output is
already summed over the examples. Both happen only where the whole ``model.apply``
cannot be replayed per example either (see "Replaying the whole apply").

Replaying the whole apply
-------------------------
Some params of models whose examples do not mix cannot get per-example gradients
from their module's own calls: the root module's own params (BART's
``final_logits_bias``), params read outside their module's calls inside the model
(DistilBERT passes its word embedding to the vocabulary projector as an
argument), calls that see the examples merged with another axis (OPT's
feed-forward layers on ``(examples * positions, features)``) or off axis 0, and
calls with no per-example input or a constant with as many rows as examples made
inside the model (Whisper's encoder positions, DistilBERT's). These owners, and
modules run inside ``nn.remat``, ``nn.checkpoint`` or ``nn.scan``, get their
per-example gradients from a per-example replay of the top-level ``model.apply``
they run in: the cost of ``jax.vmap(jax.grad)`` of that apply, computed once for
all of them, and only for models that have such owners (the others keep the
per-call fast paths). For ``nn.scan`` the per-example gradient of a scanned
layer is that of its stacked per-iteration params. Ids the model accepts as
arguments (``position_ids``), passed batched to the loss, keep the fast paths.

Shared modules and tied weights
-------------------------------
The per-example gradient is the sum over the module's uses, then the norm. For
the fast paths the uses' tokens are concatenated, so the ghost norm includes the
cross terms between uses. A nested ``module.apply`` whose params are computed
from the model's is found while tracing. When it is an output head tied to an
embedding (a Dense layer given ``embedding.T``, as GPT-2's LM head on ``wte``,
or ``embed.attend``), the embedding's norm over its lookups and the head, cross
terms included, is a ghost norm: ``T²`` per example, never the ``batch × vocab
× width`` per-example gradients; DP-SGD's clipped sum is then one weighted VJP
of the head, the same matmul as the ordinary backward pass
(``dense_method='direct'`` forms the gradients instead). Any other nested
apply is replayed per example, and its per-example gradients are pulled back
to the layer they come from and added before the norm; such a layer keeps its
full per-example gradients in memory, which DP-SGD also uses for the clipped
sum. A nested apply run inside its owner's own call is counted once, as part
of that call.

Hugging Face models
-------------------
Tested on GPT-2, BERT, ViT, Llama, ResNet in eval mode, ALBERT, RoBERTa,
Mistral, Gemma, GPT-Neo, DINOv2 and RegNet in eval mode, and on BART, DistilBERT,
OPT, Whisper and Wav2Vec2 (through the apply's replay, above) against
``jax.vmap(jax.grad)``, and DP-SGD steps against a ``vmap(grad)`` reference
(``tests/test_real_models_per_example.py``, ``tests/test_per_example_lifted.py``).
Pass ``position_ids`` as batched loss arguments to keep the fast paths; ids made
inside the loss (not the model) from ``jnp.arange``/``zeros_like`` raise
``AmbiguousInputError`` with what to pass. The model may be called through its
Linen module or as Hugging Face's scripts call it, ``model(ids,
params=variables['params'], dropout_rng=key, train=True)`` (tested on GPT-2
with dropout). BatchNorm in train mode (ResNet)
raises ``ExamplesMixedError``, and so does Hugging Face's CLIP contrastive loss
(below).

What is refused, and why
------------------------
* ``ExamplesMixedError``: a model or loss that mixes examples, found while
  tracing: BatchNorm in training mode, and any mixing on the loss's
  differentiable path, read off the jaxpr by following each value's examples
  axis and whether it depends on the params: two arrays computed from the params
  paired example by example (a contrastive ``a @ b.T`` over the batch, as in
  Hugging Face's CLIP loss), a sum over the examples of such an array combined
  with each example again (a batch statistic, named with the module it happens
  in) or put through a nonlinear function (``sqrt(mean(...))``), a maximum, sort
  or cumulative sum over the examples; each example combined with another's
  values (``h + h[:1]``, ``h * h[perm]``, negatives from ``jnp.roll(z, 1, 0)``,
  ``h.at[0].add(h[1])``). Mixing among values without params is
  allowed and gives the per-example gradients with that batch quantity fixed:
  inputs normalized by their batch, ``sum(loss · mask) / sum(mask)``, a
  ``stop_gradient``-ed statistic (``tests/test_per_example_mixing.py``); DP-SGD
  refuses these too (``ExamplesCoupledError``, below). Rows of
  the examples axis picked by per-example indices stay that example's (CLIP's
  text pooling). The walk follows axes that merge the examples with another
  (``(B, T, V) -> (B*T, V)`` before a cross-entropy) as rows grouped by example,
  slices, splits, reversals and concatenations along the examples axis (rows put
  back in order are the examples again), and ``lax.scan`` bodies; what it does
  not follow (``while`` loops, ``cond``, scatters with computed indices) it
  leaves alone;
  ``check_per_example(loss_fn, variables, *args)`` compares the batch loss with
  the mean of each example's loss alone (one extra forward) and catches mixing
  there.
* ``ExamplesCoupledError`` (DP-SGD only, a subclass of ``ExamplesMixedError``):
  an example's term computed from other examples' data, even where no gradient
  flows: a token mean over the whole batch (``sum(loss · mask) / sum(mask)``),
  inputs normalized by their batch, a ``stop_gradient``-ed batch statistic.
  Removing one example would then change every other example's gradient, so
  clipping would not bound its effect and the noise would not give the privacy
  it is set for. Average each example's tokens by its own count
  (``jnp.mean(jnp.sum(l * mask, 1) / jnp.maximum(jnp.sum(mask, 1), 1))``) or
  divide by a fixed number.
* ``ExamplesAxisError``: the arguments disagree on the number of examples, or a
  layer's activations (or an input computed from the batch) do not carry them on
  axis 0, or carry them in another order (rows reversed, rolled or shifted
  along the examples axis before the layer).
* ``BatchNotArrayError`` (a subclass of ``ExamplesAxisError``): a batched argument
  is a Python list or tuple of numbers (a batch written as nested lists), which has
  no examples axis; pass it as an array (``np.asarray(batch)``).
* ``AmbiguousInputError``, ``SharedCallError``: see "Which inputs are
  per-example".
* ``UncoveredParamsError``: params that no call and no apply in the loss uses.
* ``ParamsReadOutsideError``: a layer's params are also read in the loss outside
  every ``model.apply`` (a weight penalty, ``h @ variables['params']['embed']
  ['embedding'].T`` written in the loss), so part of their gradient would be
  missing from the norms; it names the layer and the reading primitives, and is
  checked once per compile while tracing. Put weight penalties outside the
  per-example loss (or use ``optax.add_decayed_weights``) and other uses of a
  weight inside the model. Weights tied or reused inside the model are covered
  (a call of their module, a nested apply, or the apply's replay). A read that
  reaches the loss only through ``jax.lax.stop_gradient`` adds nothing to the
  gradient and is not refused (``tests/test_stop_gradient_reads.py``).
* ``ReductionMismatchError``: see "The loss and the examples axis".
* ``RandomCallError``: see "Dropout and random numbers".

Dropout and random numbers
--------------------------
Dropout applied between layers is part of the recorded forward pass: norms and
clipped sums are those of the batched pass's own masks
(``tests/test_per_example_random.py`` compares them with the rows of
``jax.jacrev`` of the per-example losses; ``vmap(grad)`` would draw other masks;
so does ``tests/test_real_models_per_example.py`` for GPT-2 trained with its
dropout on). A param-owning call without a fast rule is replayed per example,
and a replay cannot redraw the batched pass's random numbers: one that draws
them (Flax RNG streams, a typed PRNG key among its arguments) raises
``RandomCallError``, naming the call. A raw ``uint32`` key cannot be told from
data. Layers run inside ``nn.remat``, ``nn.checkpoint`` or ``nn.scan`` (Hugging
Face's ``gradient_checkpointing=True``) are covered by a replay of the whole
apply ("Replaying the whole apply"), so dropout (or any draw from a Flax RNG
stream) anywhere in that apply raises ``RandomApplyReplayError``, a
``RandomCallError``; without gradient checkpointing, dropout between layers is
recorded as above. On NNX, a draw from an ``nnx.Rngs`` stream that the replayed
call's output is not computed from (read off its trace: ``nnx.RNN``'s key for a
zero initial carry, the key ``nnx.bridge.ToNNX`` hands to its Linen module) changes
nothing, and the replay goes ahead (``tests/test_nnx_per_example.py``).

DP-SGD from one backward pass
-----------------------------
``private_grad(loss_fn, clip_norm, noise_multiplier, reduction='mean',
batch_axes=0, axis_name=None, dense_method='auto')`` is the privatized gradient
``(variables, key, *args) -> (grads, metrics)`` to feed any optimizer;
``dp_sgd(loss_fn, optimizer, ...)`` is the ``init(variables)`` /
``step(state, key, *args) -> (state, metrics)`` pair
(``metrics['per_example_norms']``, ``metrics['fraction_clipped']``,
``metrics['dropped']``, and ``metrics['skipped']`` from ``dp_sgd``). The key must
be a JAX random key, ``jax.random.key(seed)`` (raw ``uint32`` key data from
``jax.random.PRNGKey`` is accepted too); an integer random seed, or an array of
several keys (keys split per device and sharded by ``shard_map``: give every device
the same key, ``P()``), raises ``PRNGKeyError``. Use a new key each step, e.g. ``jax.random.fold_in(key,
step)``. The loss and examples-axis conventions are those of
``per_example_grad_norms``, and so are its refusals.

With ``c_i = min(1, C/‖∇term_i‖)``, the clipped sum ``Σ_i c_i ∇term_i`` is one
VJP of each layer call with its output gradient scaled by ``c_i`` (for Dense
exactly ``Σ_i c_i a_iᵀ g_i``, one matmul; other layers replay only their own
call, or weigh their kept per-example gradients). Then Gaussian noise ``σC·ξ``
and the division by the number of examples. The noise of a large leaf is drawn
in up to 16 rows of at least 2¹⁴ entries, each added in place, so the random
bits of the whole leaf (several param-sized buffers with JAX's threefry) are
never in memory at once.

Non-finite values: an example whose gradient norm is not finite (a NaN or an
infinity in its input or its loss term) is dropped: its clip factor is 0, and
``metrics['dropped']`` counts such examples. The denominator stays the batch
size ``B`` (a dropped example counts as a zero gradient), so it does not depend
on the data's values. The privacy accounting is unchanged: dropping an example
only lowers the sum's sensitivity, which stays at most ``C``, so the noise
``σC`` stays calibrated. The count itself is a function of the private data
and is not privatized (nor is ``'per_example_norms'``): do not release it. If
the noised gradient is still not finite, ``dp_sgd`` skips the step (params and
optimizer state kept, ``metrics['skipped']`` true; ``state.step`` still counts
it).

Data parallel: with ``axis_name``, each device clips its own examples, the
clipped sums and example counts are ``psum``-ed, and the noise is drawn after the
psum from ``key``, which should be the same on every device (``in_specs=P()`` for
it; the first device's key is used on every device, so a key folded with the
device index does not make the replicas drift apart): every device draws the
same ξ, so the noise is added once, not once per device (``tests/test_per_example.py``, 4 host devices = 1 device). Under
``jax.shard_map`` this needs ``check_vma=False`` (with JAX's default
``check_vma=True`` it raises ``CheckedShardMapError``). Without ``axis_name``,
inside ``shard_map(check_vma=True)`` JAX sums the clipped gradients over the
devices, as it sums ``jax.grad``'s there, while the example count stays the
device's own: the result is that sum, noised once, divided by the device's
count (``tests/test_shard_map_checked.py``). Pass ``axis_name`` for the
privatized mean of the whole batch.

Combinations that are refused:

* Interleaved training is not combined with clipping: the clip factor needs
  each example's norm over all layers before any layer is updated, while the
  interleaved sweep updates the top segments before the lower segments'
  gradients exist. A ``dp_sgd`` trainer given to ``interleaved`` as its
  optimizer, or an ``interleaved`` trainer given to ``dp_sgd``, raises
  ``InterleavedClippingError``.
* optax's own DP transformation (``optax.contrib.differentially_private_aggregate``,
  and ``optax.contrib.dpsgd`` built on it) clips per-example gradients, taking
  the first axis of every leaf for the examples. Given to ``dp_sgd`` (which has
  already clipped and noised) or to ``interleaved`` (Linen or NNX; batch
  gradients) it would clip rows of the weight gradients; ``init`` raises
  ``OptaxPrivacyError`` (``tests/test_optax_privacy.py``).
* Gradient accumulation, ``optax.MultiSteps`` (the object or its
  ``gradient_transformation()``), as ``dp_sgd``'s optimizer: each step clips and
  noises its own batch's mean, so the update applied every ``k`` steps averages
  ``k`` independently noised means, with ``√k`` times the noise of one DP-SGD
  step on the ``k``-times larger batch that accumulation stands for (the
  accounting of ``k`` steps still holds; the training is not what it looks
  like). ``dp_sgd`` raises ``PrivateAccumulationError``, whose message says how to
  accumulate with ``private_grad`` and add the noise once.

Privacy accounting (ε) is not part of perturbkit.
``notebooks/07_private_training.ipynb`` reports ε at δ = 10⁻⁵ with
``dp-accounting``'s RDP accountant (a test dependency, pinned with ``attrs``
23.2.0, the newest it allows).

Flax NNX
--------
``perturbkit.nnx.per_example_grad_norms``, ``private_grad``, ``dp_sgd`` and
``check_per_example``: the same functions with ``loss_fn(model, *args)`` and the
model in place of the variables, gradients as the ``nnx.State`` of ``nnx.grad``.
An NNX front end records the same calls (``_nnx_pass``), so the rules, the norms
and the DP step above are shared; ``nnx.Linear`` has Dense's rules. What Linen
covers by replaying the whole ``apply`` (the root module's own params, a weight
read outside its module's calls inside the model, modules inside
``nnx.scan``/``nnx.remat``) NNX covers by replaying the whole model call in the
loss (``model(x)``) per example; a read outside every model call (a penalty in
the loss) is refused with a named error, as on Linen.

Example:
  >>> from perturbkit import per_example
  >>> import perturbkit
  >>> per_example.dp_sgd is perturbkit.dp_sgd
  True
"""
from perturbkit.per_example._check import check_per_example
from perturbkit.per_example._dp import dp_sgd
from perturbkit.per_example._norms import per_example_grad_norms
from perturbkit.per_example._norms import PerExampleNorms
from perturbkit.per_example._dp import private_grad
from perturbkit.per_example._dp import PrivateState
from perturbkit.per_example._dp import PrivateTraining

__all__ = [
    'check_per_example',
    'dp_sgd',
    'per_example_grad_norms',
    'PerExampleNorms',
    'private_grad',
    'PrivateState',
    'PrivateTraining',
]
