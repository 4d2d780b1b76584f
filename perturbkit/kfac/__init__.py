"""K-FAC from the pairs every layer call sees: its input and the gradient at its output.

K-FAC needs each layer's input ``a`` next to the gradient ``g`` at its output;
``value_and_grad(..., return_inputs=True)`` has both, so the Kronecker factors of
every Dense (any leading axes; Hugging Face's ``FlaxConv1D``, GPT-2's transposed
kernels, too), Conv (patches, Grosse & Martens 2016) and Embed (diagonal ``A``)
call of an unmodified model come from one forward pass, with no model changes
and no loss registration; so does the exact diagonal Fisher of every LayerNorm's
and RMSNorm's scale and bias (kfac-jax's scale-and-shift blocks; Hugging Face's
Llama, Mistral and Gemma RMSNorms and T5's LayerNorm included). The names here are also in
``perturbkit``; ``perturbkit.nnx`` has the NNX ``kfac_layers``,
``kfac_estimator`` and ``kfac_preconditioner``.

* ``kfac_layers(predict_fn, variables, x)`` finds the layers (``layers.layers``,
  name -> ``LayerInfo``) and the ones it skips (``layers.skipped``, name ->
  reason).
* ``kfac_estimator(predict_fn, loss, layers, fisher='sampled'|'empirical'|'exact',
  has_aux=False)`` returns ``estimate(variables, x, y, key, with_stats=...) ->
  (loss, grads, stats)``. ``loss`` is ``'softmax_cross_entropy'`` or an
  ``OutputLoss`` (``categorical_output``, ``gaussian_output``).
* ``kfac_preconditioner(layers, damping=..., inverse_every=..., stats_every=...,
  axis_name=None)`` is an optax transformation; chain it before the step
  (``optax.sgd(lr, momentum=0.9)``); its ``update`` takes ``kfac_stats=stats``.
  Layers it has no factors for go to the fallback transform.
* ``kfac_segment(layer, damping=..., axis_name=None)``: K-FAC for one segment of
  ``perturbkit.interleaved`` (below).

The loss convention
-------------------
The estimator's loss is per example and summed over any axes between the batch
and the classes, then averaged over examples, as kfac-jax registers it: for a
language model's ``(batch, length, vocab)`` logits that is the sequence's loss,
``length`` times the token-mean cross-entropy (and so are its gradients; scale
the learning rate accordingly). The examples are the batch's, the output's
first axis: a layer that runs on ``(examples * tokens, d)`` rows, as OPT's
feed-forward layers do, averages its factors over the batch's examples, not
over its rows.

Which layers are skipped
------------------------
Layers without a rule (BatchNorm, GroupNorm, a grouped or masked Conv, a norm
over other axes than the last or called with a mask, a normalisation module a
model defines itself, other than Hugging Face's Llama, Mistral and Gemma RMSNorms
and T5's LayerNorm, a tied ``attend``, a layer run by ``nn.scan`` whose params
every iteration shares, see below) and layers whose weights are also read outside
their calls (GPT-2's ``wte``, tied to the LM head: factors from its own calls
would miss the head's share of the gradient) are listed in ``layers.skipped``
with the reason and go to the fallback transform; selecting one explicitly raises
``KFACUnsupportedLayerError``. A rule is the math of the library layer's own
``__call__``: a subclass of ``nn.Dense``, ``nn.Conv`` or ``nn.Embed`` (``nnx.Linear``,
``nnx.Conv``, ``nnx.Embed``) that keeps it is preconditioned like the layer, one that
overrides ``__call__`` (a LoRA adapter, an input transform around
``super().__call__``) is skipped, with the reason: make the layer a submodule your
module calls instead, and K-FAC preconditions that submodule while the module's own
params go to the fallback. K-FAC finds its layers among submodule calls, so a model
that is one layer (``nn.Dense(3)`` as the whole model) has none: its params are the
root's, ``layers.skipped['<root>']`` says to wrap it (``nn.Sequential([nn.Dense(3)])``),
and an estimator given no layer raises ``KFACNoLayersError``. So are layers with a call
whose input is not computed from the batch ``inputs``: a position table the model looks
up itself (Whisper's encoder ``jnp.arange``, CLIP's vision ``(1, patches)`` id buffer)
has one output for the whole batch, the gradient at it is summed over the examples, and
factors from it would be ``(Σg)(Σg)ᵀ`` instead of ``Σ g gᵀ``. Whatever the input's
shape: a ``(length, d)`` table on a batch of ``length`` examples, or positions
broadcast to ``(batch, length)`` inside the model, cannot be told apart from rows of
one example each, and K-FAC does not guess (per-example gradients raise
``AmbiguousInputError`` there). To have such a layer preconditioned, pass its input in
the batch: for a Hugging Face model, ``position_ids=jnp.broadcast_to(jnp.arange(length),
ids.shape)`` made outside ``predict_fn`` and passed in ``inputs``. Layers inside ``nn.remat`` and ``nn.jit``
(a Hugging Face model with gradient checkpointing) or ``nnx.remat`` and
``nnx.jit`` are preconditioned like any other: their calls' inputs and gradients
come out of the transform as they are.

Blocks stacked in a scan (``nn.scan`` with ``variable_axes={'params': 0,
'perturbations': 0}``; ``nnx.scan`` over modules made with ``nnx.vmap``) are
preconditioned per layer and per iteration: a layer whose params are stacked
``(L, ...)`` along axis 0 gets factors stacked the same way, ``A`` of shape
``(L, d_in + 1, d_in + 1)``, each iteration's from its own inputs and output
gradients, inverted and applied to its own slice of the gradient, as if the
blocks were unrolled (``LayerInfo.iterations`` is ``L``;
``tests/test_kfac_scan.py``). In interleaved training such a layer is a segment
per iteration, and ``kfac_segment`` preconditions each iteration with its own factors
(``tests/test_interleaved_scan.py``). A scan that does not map the perturbations,
params shared by every iteration (``variable_broadcast='params'``), scans
nested in scans, and a call inside the scan whose input does not have the
batch's examples on its first axis are skipped with the reason. Whether a call's
input is computed from the batch is read off the jaxpr (in Linen also inside
``nn.remat``, ``nn.jit`` and ``nn.scan``, whose calls hand their inputs out as the
estimator takes them; inside an ``nnx.scan`` only the shape of each iteration's
input is checked); positions passed in the batch are per-example rows and keep the
layer (``tests/test_kfac_shared_inputs.py``, ``tests/test_real_models_kfac.py``). A read that reaches the loss only through
``jax.lax.stop_gradient`` does not skip a layer.

Checks
------
Both estimators (Linen and NNX) check the layers they are given against the
model, once per input signature while tracing (``tests/test_kfac_checks.py``): a
weight missing or of another shape, or calls other than the ones the layers
record (a second call would be missing from the factors), raise
``KFACShapeError``; a layer whose params the predict function also reads outside
its calls (layers built by hand, or by ``kfac_layers`` for another predict
function) raises ``KFACUnsupportedLayerError``. A model with BatchNorm in train
mode returns ``(output, updates)`` from ``model.apply(..., mutable=['batch_stats'])``:
pass ``has_aux=True`` and ``estimate`` returns the updates as a fourth value
(without it, ``KFACOutputError`` says so). An unknown loss raises
``KFACLossError``.

Factors, inverses and amortised statistics
------------------------------------------
Factors are running averages, ``pmean``-ed over ``axis_name``, with damped
inverses (``damped_inverse``) refreshed every ``inverse_every`` steps. The
statistics are amortised too: the preconditioner folds a batch's factors in
every ``stats_every`` updates (default ``inverse_every``: the factors only reach
the step through the inverses, which change no more often), its state's
``stats_due`` says when, and ``estimate(..., with_stats=stats_due)`` computes
them only then (a ``lax.cond``; the other steps are a plain
``jax.value_and_grad``). ``stats_every=1`` is the classic every-step average. The
stats of a step without statistics are NaN, so a step that skips them where they
were due (``stats_due`` true) turns the factors NaN at once instead of quietly
folding in zeros.

The factors follow the model's precision: a batch's are formed in the
accumulation dtype of the layer's inputs and output gradients, and the running
factors, their damped inverses and the preconditioned gradient are kept in that
of the layer's params: float32 for a float32, bfloat16 or float16 model, float64
for a float64 one (``jax_enable_x64`` and ``param_dtype=jnp.float64``). A layer with
float32 params run on float64 activations has float64 batch factors, and keeps its
running factors and step in float32, as its gradient is.

On CPU, where XLA runs convolutions inside a ``lax.cond`` slowly, two jitted
steps picked in Python take the conditional away (one boolean read back from the
device per step)::

    import functools

    def kfac_step(params, opt_state, x, y, key, *, with_stats):
      loss, grads, stats = estimate({'params': params}, x, y, key, with_stats=with_stats)
      updates, opt_state = kfac_tx.update(grads, opt_state, params, kfac_stats=stats)
      return optax.apply_updates(params, updates), opt_state, loss

    stats_step = jax.jit(functools.partial(kfac_step, with_stats=True))
    plain_step = jax.jit(functools.partial(kfac_step, with_stats=False))
    params, opt_state = variables['params'], kfac_tx.init(variables['params'])
    for i in range(num_steps):
      step = stats_step if opt_state[0].stats_due else plain_step
      params, opt_state, loss = step(params, opt_state, x, y, jax.random.key(i))

Also on CPU, set ``OPENBLAS_NUM_THREADS=1``: the Cholesky refreshes otherwise
spin against XLA's thread pool.

Per-segment K-FAC inside the interleaved sweep
----------------------------------------------
A segment of ``interleaved`` can precondition itself: a segment optimizer that
is an ``optax.GradientTransformationExtraArgs`` (or a wrapper whose update takes
``**extra_args``, such as ``optax.MultiSteps(...).gradient_transformation()``) receives
the segment's inputs and the cotangent at its output as extra arguments in the sweep, and
``kfac_segment(layer, damping=..., axis_name=None)`` forms that layer's factors
from them (the empirical Fisher of the sweep's own cotangents) with the default
layer-wise segments::

    layers = perturbkit.kfac_layers(lambda v, x: model.apply(v, x), variables, x)

    def segment_optimizer(name):               # one Dense/Conv call per segment, or REST
      if name not in layers.layers:
        return optax.adam(1e-3)
      return optax.chain(perturbkit.kfac_segment(layers.layers[name], damping=1e-1),
                         optax.sgd(1e-2, momentum=0.9))

    tx = perturbkit.interleaved(loss_fn, segment_optimizer)     # propagate='updated'

* With ``propagate='original'`` this equals whole-model K-FAC on the estimator's
  empirical factors; with ``'updated'`` it equals a hand-written sweep in which
  each layer's factors, inverses and step come first and the cotangent below is
  computed with its new kernel (``tests/test_kfac_segment.py``).
* Under ``shard_map``, ``kfac_segment(..., axis_name=)`` averages the devices'
  factors, and 8 devices equal one.
* The sweep has one backward pass, so these are the empirical Fisher's factors,
  and the statistics need no second pass.
* Update-then-propagate with K-FAC segments wants more damping than whole-model
  K-FAC: at damping 1e-2 with momentum 0.9 the sweep diverged on a small MLP
  fitting one batch, where ``propagate='original'`` and whole-model K-FAC
  converged; 0.1 was stable.
* NNX: ``perturbkit.nnx.interleaved`` runs the same sweep, so ``kfac_segment``
  works on NNX models too, with a segment's layer from
  ``perturbkit.nnx.kfac_layers`` or written out:
  ``perturbkit.LayerInfo('dense', ('Dense_0',), 'kernel', (d_in, d_out), True,
  ('__call__',))`` (checked against the Linen twin). There is no
  ``perturbkit.nnx.kfac_segment`` of its own yet.

LayerNorm and RMSNorm
---------------------
A norm over the last axis, ``y = x̂ ⊙ scale + bias``, has vector params, so its
Fisher block is preconditioned by its exact diagonal, as kfac-jax's
scale-and-shift blocks are by default: ``F = (1/N) Σ_n (∂ℓ_n/∂θ)²`` (summed over
the Fisher's lanes), with each example's gradient ``Σ_t g_t ⊙ x̂_t`` for the scale
and ``Σ_t g_t`` for the bias, summed over its locations and over the layer's
calls, ``x̂`` recomputed from the call's input in at least float32. The update is
``∇θ / (F + λ)``: the damping is added once, where a Kronecker block adds it to
each of its two factors. ``LayerFactors.a`` is the scale's diagonal and ``.g``
the bias's (the bias's in ``.a`` for a norm without a scale). The rule needs the
examples on the first axis of the norm's input (a norm on ``(T, N, d)``
activations is skipped, with the reason) and no ``mask``: ``kfac_layers``
skips a norm called with one, and the estimator refuses one given layers built
for a model that calls it without.

How it is tested
----------------
Against hand-written perturbation-argument networks; against the exact Fisher
where K-FAC is exact (one Dense layer, Gaussian output); the norms' diagonals
against ``jax.vmap(jax.grad)`` and per-example Jacobians
(``tests/test_kfac_norms.py``); the amortised path
against the every-step path fed the same batches (same factors and inverses on
the steps taken); on unmodified Hugging Face BERT, ViT, GPT-2 (its ``FlaxConv1D``
layers and LayerNorms), Llama and ResNet
(BatchNorm, train mode) (``tests/test_real_models_kfac.py``).
``notebooks/06_kfac.ipynb`` compares K-FAC, SGD and Adam on digits.

Relation to kfac-jax
--------------------
The factors match kfac-jax's on an MLP, a CNN (a ``SAME`` conv with bias, a
strided ``VALID`` conv without, a dense head) and a dense layer on sequences
(mean-pooled, a dense head), for the exact and the empirical
Fisher (``tests/test_kfac_jax_reference.py``, against factors kfac-jax 0.0.8
computed under jax 0.6.2, with which it imports; it does not import with the jax
pinned here: ``scripts/kfac_jax_reference.py`` says how they were made). The
conventions differ by known scalars only:

* Conv: kfac-jax averages a conv's ``A`` over its ``T`` locations and scales the
  block by ``T``; perturbkit sums over them (``A = T·A_kfac-jax``, same feature
  order: flattened ``(kh, kw, in)`` kernel rows, the bias last).
* ``G`` is equal for the exact Fisher; kfac-jax's empirical mode divides it once
  more by the batch size ``B`` (``G = B·G_kfac-jax``).
* Dense on ``(batch, T, d)`` inputs (a sequence): perturbkit treats the ``T``
  positions as locations, as for a conv (``A`` sums over them, ``G`` averages over
  them). ``A`` equals kfac-jax's; kfac-jax sums ``G`` over the positions and keeps
  the block's scale at 1, so ``G = G_kfac-jax / T`` for the exact Fisher,
  ``(B / T)·G_kfac-jax`` for the empirical one, and kfac-jax's block for such a
  layer is ``T`` times perturbkit's (for a conv the blocks are equal). Scale the
  damping or the learning rate accordingly when moving settings between the two.

Example:
  >>> from perturbkit import kfac
  >>> import perturbkit
  >>> kfac.kfac_estimator is perturbkit.kfac_estimator
  True
"""
from perturbkit.kfac._losses import categorical_output
from perturbkit.kfac._preconditioner import damped_inverse
from perturbkit.kfac._losses import gaussian_output
from perturbkit.kfac._estimator import kfac_estimator
from perturbkit.kfac._layers import kfac_layers
from perturbkit.kfac._preconditioner import kfac_preconditioner
from perturbkit.kfac._segment import kfac_segment
from perturbkit.kfac._layers import KFACLayers
from perturbkit.kfac._preconditioner import KFACState
from perturbkit.kfac._rules import LayerFactors
from perturbkit.kfac._rules import LayerInfo
from perturbkit.kfac._losses import OutputLoss

__all__ = [
    'categorical_output',
    'damped_inverse',
    'gaussian_output',
    'kfac_estimator',
    'kfac_layers',
    'kfac_preconditioner',
    'kfac_segment',
    'KFACLayers',
    'KFACState',
    'LayerFactors',
    'LayerInfo',
    'OutputLoss',
]
