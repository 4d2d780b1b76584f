"""Caching, interventions and patching for NNX models: ``fn(model, *args)``.

The functions of ``perturbkit.interpret`` (see their docstrings there), taking the
NNX module where the Linen ones take the variables. Each runs a copy of the
model merged inside its own trace: the caller's model and its state are never
changed (batch statistics and RNG counts do not move).
"""
from typing import Any, Callable, Mapping, Sequence

import jax
from flax import nnx

from perturbkit.core import filters
from perturbkit.core._types import CallFilter
from perturbkit.interpret import (_attribution, _cache, _grad_cam, _integrated, _interventions,
                                  _learnable, _patching)
from perturbkit.interpret._cache import Cache
from perturbkit.interpret._learnable import Intervention
from perturbkit.interpret._result import IntegratedGradientsResult, PatchingResult
from perturbkit.nnx._traced_points import traced_points


def run_with_cache(fn: Callable[..., Any], *, filter: CallFilter | bool | None = None,
                   return_inputs: bool = False,
                   grads: bool = False) -> Callable[..., tuple[Any, Cache]]:
  """The output of every selected call of an NNX model, from one run.

  As :func:`perturbkit.run_with_cache`, with ``fn(model, *args, **kwargs)``;
  the cache is keyed like the params state (``cache.outputs['layers'][0]['__call__']``).
  Calls inside ``nnx.remat`` and ``nnx.jit`` are cached like any other; inside
  ``nnx.scan`` over stacked modules (or ``nnx.vmap`` mapping the perturbations),
  stacked per iteration like their gradients, where the edits and patching
  address each iteration (``'layers/attn/__call__[2]'``). Calls inside
  ``nnx.vmap`` with the module's state broadcast raise
  ``ActivationsUnavailableError`` (leave them out with the filter).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
    >>> out, cache = perturbkit.nnx.run_with_cache(lambda m, x: m(x))(model, jnp.ones((2, 3)))
    >>> cache.outputs['layers'][0]['__call__'].shape
    (2, 4)
  """
  return _cache.run_with_cache(traced_points, fn, filter=filter, return_inputs=return_inputs,
                               grads=grads, function='perturbkit.nnx.run_with_cache')


def run_with_edits(fn: Callable[..., Any], *,
                   filter: CallFilter | bool | None = None) -> Callable[..., Any]:
  """Runs an unmodified NNX model with edits at chosen calls: ``(model, edits, *args)``.

  As :func:`perturbkit.run_with_edits`; an edit's key is the call's path in
  the model and its point key, ``{'layers/0/__call__': edit}`` or
  ``{'layers': {0: {'__call__': edit}}}``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import perturbkit
    >>> from perturbkit import interpret
    >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
    >>> edited = perturbkit.nnx.run_with_edits(lambda m, x: m(x))
    >>> out = edited(model, {'layers/0/__call__': interpret.zero_ablate()}, jnp.ones((2, 3)))
    >>> out.tolist()   # the last layer's bias, zeros at init
    [[0.0], [0.0]]
  """
  return _interventions.run_with_edits(traced_points, fn, filter=filter,
                                       function='perturbkit.nnx.run_with_edits')


def activation_patching(fn: Callable[..., Any], *, filter: CallFilter | bool | None = None,
                        axis: int | None = None, positions: Sequence[int] | None = None,
                        view: tuple[int, ...] | None = None,
                        leaves: int | Sequence[int] | None = None,
                        batch_size: int | None = 8,
                        progress: bool = False) -> Callable[..., PatchingResult]:
  """Activation patching of an NNX model: ``(model, clean, corrupted) -> PatchingResult``.

  As :func:`perturbkit.activation_patching`, with ``fn(model, inputs) -> metric``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
    >>> metric = lambda m, x: m(x).mean()
    >>> patch = perturbkit.nnx.activation_patching(metric)
    >>> patch(model, jnp.ones((2, 3)), jnp.zeros((2, 3))).paths
    ('layers/0/__call__', 'layers/2/__call__')
  """
  return _patching.activation_patching(traced_points, fn, filter=filter, axis=axis,
                                       positions=positions, view=view, leaves=leaves,
                                       batch_size=batch_size,
                                       progress=progress, function='perturbkit.nnx.activation_patching')


def attribution_patching(fn: Callable[..., Any], *, filter: CallFilter | bool | None = None,
                         axis: int | None = None,
                         positions: Sequence[int] | None = None,
                         view: tuple[int, ...] | None = None,
                         leaves: int | Sequence[int] | None = None
                         ) -> Callable[..., PatchingResult]:
  """Attribution patching of an NNX model: ``(model, clean, corrupted) -> PatchingResult``.

  As :func:`perturbkit.attribution_patching`, with ``fn(model, inputs) -> metric``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
    ...                        nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
    >>> metric = lambda m, x: m(x).mean()
    >>> result = perturbkit.nnx.attribution_patching(metric)(
    ...     model, jnp.ones((2, 3)), jnp.zeros((2, 3)))
    >>> bool(jnp.allclose(result.effects[1, 0], result.clean_metric - result.corrupted_metric))
    True
  """
  return _attribution.attribution_patching(traced_points, fn, filter=filter, axis=axis,
                                           positions=positions, view=view, leaves=leaves,
                                           function='perturbkit.nnx.attribution_patching')


def grad_times_activation(fn: Callable[..., Any], *, filter: CallFilter | bool | None = None,
                          axis: int | None = None,
                          positions: Sequence[int] | None = None,
                          view: tuple[int, ...] | None = None,
                          leaves: int | Sequence[int] | None = None
                          ) -> Callable[..., PatchingResult]:
  """Gradient x activation of an NNX model's calls: ``(model, inputs) -> PatchingResult``.

  As :func:`perturbkit.grad_times_activation`, with ``fn(model, inputs) -> metric``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
    ...                        nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
    >>> result = perturbkit.nnx.grad_times_activation(lambda m, x: m(x).mean())(
    ...     model, jnp.ones((2, 3)))
    >>> result.effects.shape
    (2, 1)
  """
  return _attribution.grad_times_activation(traced_points, fn, filter=filter, axis=axis,
                                            positions=positions, view=view, leaves=leaves,
                                            function='perturbkit.nnx.grad_times_activation')


def layer_integrated_gradients(fn: Callable[..., Any], *, filter: CallFilter | bool | None = None,
                               axis: int | None = None, positions: Sequence[int] | None = None,
                               view: tuple[int, ...] | None = None,
                               leaves: int | Sequence[int] | None = None,
                               steps: int = 16, method: str = 'gauss_legendre',
                               batch_size: int | None = 8, progress: bool = False,
                               gaps: bool = False
                               ) -> Callable[..., IntegratedGradientsResult]:
  """Layer integrated gradients of an NNX model: ``(model, inputs, baseline=None)``.

  As :func:`perturbkit.layer_integrated_gradients`, with ``fn(model, inputs) -> metric``;
  ``gaps=True`` adds each call's metric at its baseline and the quadrature's
  completeness gap there (:class:`perturbkit.IntegratedGradientsResult`).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
    ...                        nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
    >>> ig = perturbkit.nnx.layer_integrated_gradients(lambda m, x: m(x).mean(), steps=4,
    ...                                                gaps=True)
    >>> result = ig(model, jnp.ones((2, 3)))
    >>> bool(jnp.allclose(result.effects[1, 0], result.clean_metric, atol=1e-6))  # linear, zero bias
    True
    >>> result.endpoint_metrics.tolist(), bool(jnp.abs(result.gaps).max() < 1e-6)  # linear: complete
    ([0.0, 0.0], True)
  """
  return _integrated.layer_integrated_gradients(
      traced_points, fn, filter=filter, axis=axis, positions=positions, view=view, leaves=leaves,
      steps=steps, method=method, batch_size=batch_size, progress=progress, gaps=gaps,
      function='perturbkit.nnx.layer_integrated_gradients')


def grad_cam(fn: Callable[..., Any], *, filter: CallFilter | bool | None = None,
             upsample: bool | tuple[int, int] = False
             ) -> Callable[..., tuple[Any, dict[str, Any]]]:
  """Grad-CAM maps of an NNX model's convolutions: ``(model, images) -> (metric, maps)``.

  As :func:`perturbkit.grad_cam`, with ``fn(model, images) -> metric``; the
  default filter selects every ``nnx.Conv`` call.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import perturbkit
    >>> model = nnx.Sequential(nnx.Conv(1, 3, (3, 3), rngs=nnx.Rngs(0)),
    ...                        lambda h: h.mean(axis=(1, 2)), nnx.Linear(3, 2, rngs=nnx.Rngs(1)))
    >>> metric = lambda m, x: m(x)[:, 1].sum()
    >>> _, maps = perturbkit.nnx.grad_cam(metric)(model, jnp.ones((2, 4, 4, 1)))
    >>> list(maps), maps['layers/0/__call__'].shape
    (['layers/0/__call__'], (2, 4, 4))
  """
  return _grad_cam.grad_cam(traced_points, fn,
                            filter=filters.by_type(nnx.Conv) if filter is None else filter,
                            upsample=upsample, function='perturbkit.nnx.grad_cam')


def _frozen(model: nnx.Module) -> nnx.Module:
  """A copy of ``model`` whose state does not carry gradients."""
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, jax.lax.stop_gradient(state))


def run_with_interventions(fn: Callable[..., Any], interventions: Mapping[str, Intervention], *,
                           filter: CallFilter | bool | None = None) -> Callable[..., Any]:
  """Runs an NNX model with learnable interventions: ``(model, params, *args)``.

  As :func:`perturbkit.run_with_interventions`, with ``fn(model, *args,
  **kwargs)``; the model's state is frozen, and not changed.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import perturbkit
    >>> from perturbkit import interpret
    >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
    >>> gate = {'gate': interpret.gates('layers/0/__call__', (4,), init_logit=30.0)}
    >>> run = perturbkit.nnx.run_with_interventions(lambda m, x: m(x), gate)
    >>> x = jnp.ones((2, 3))
    >>> bool(jnp.allclose(run(model, interpret.init_interventions(gate), x), model(x)))
    True
  """
  return _learnable.run_with_interventions(traced_points, fn, interventions, filter=filter,
                                           freeze=_frozen,
                                           function='perturbkit.nnx.run_with_interventions')
