"""The named errors of the K-FAC modules. Each message says how to fix the problem."""
from perturbkit._errors import PerturbkitError


class KFACUnsupportedLayerError(PerturbkitError, TypeError):
  """A call selected for K-FAC has no Kronecker-factor rule."""

  def __init__(self, where: str, reason: str, exclude: str | None = None):
    exclude = exclude or '`perturbkit.filters.by_type(nn.Dense, nn.Conv, nn.Embed)`'
    super().__init__(
        f'The call {where} was selected for K-FAC, but {reason}. K-FAC has rules for '
        '`nn.Dense`, `nn.Conv` (feature_group_count=1) and `nn.Embed` `__call__`s outside '
        'lifted transforms whose params no other code reads. Leave the filter at its '
        'default (unsupported layers are then listed in `layers.skipped` and their params '
        f'go to the fallback transform) or exclude the call, e.g. {exclude}.')


class KFACLossError(PerturbkitError, ValueError):
  """The loss given to K-FAC has no predictive distribution to sample from."""

  def __init__(self, loss: object, fisher: str):
    super().__init__(
        f'K-FAC cannot sample labels from the model for the loss {loss!r} '
        f"(fisher={fisher!r}): it does not name a predictive distribution. Pass "
        "`perturbkit.categorical_output()` (or 'softmax_cross_entropy', "
        '`optax.softmax_cross_entropy_with_integer_labels`) for logits, '
        "`perturbkit.gaussian_output(variance)` (or 'squared_error', `optax.l2_loss`) for "
        "regression, or use `fisher='empirical'` with a per-example loss "
        '`(output, targets) -> losses of shape (batch,)`.')


class KFACShapeError(PerturbkitError, ValueError):
  """Kronecker factors, params or gradients whose shapes do not match the layers."""

  def __init__(self, layer: str, detail: str):
    super().__init__(
        f'K-FAC layer {layer!r}: {detail}. The K-FAC state was built for another model '
        '(or the model changed). Call `perturbkit.kfac_layers(...)` again on the current '
        'model and re-create the preconditioner and its state with `tx.init(params)`.')


class KFACOutputError(PerturbkitError, TypeError):
  """``predict_fn`` does not return the one floating-point output K-FAC differentiates."""

  def __init__(self, got: str, has_aux: bool):
    hint = ('With has_aux=True, predict_fn must return (output, aux).' if has_aux else
            'A model with BatchNorm in train mode (or another mutable collection) returns '
            '(output, updates) from `model.apply(..., mutable=[...])`: pass '
            '`has_aux=True` to kfac_estimator, and estimate returns the updates as a fourth '
            'value.')
    super().__init__(
        f'For K-FAC, predict_fn must return one floating-point array (the logits or '
        f'predictions), got {got}. {hint}')
