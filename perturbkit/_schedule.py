"""``interleaved``: update-then-propagate training, segment by segment.

Walking backward through the model, each segment (a submodule call) gets its
gradient, averaged over devices, and its optimizer step at once; the gradient
for everything the segment consumed is then computed with the UPDATED weights.
The segments are custom-VJP replays (``_segments``); what their backward pass
computes (the new weights, the activation-gradient norm) leaves it as the
gradient of a zero *carrier* input, the same device as the zero perturbations
of ``_driver``.
"""
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from flax import traverse_util

from perturbkit._driver import _check_loss, discover
from perturbkit._errors import OptimizerStateError, SegmentationError, SharedSegmentError
from perturbkit._interceptor import intercept
from perturbkit._points import COLLECTION
from perturbkit._segments import _split, run_segment
from perturbkit._types import CallFilter, Path, PyTree, Variables

REST = '<rest>'
"""The group of params owned by no segment (e.g. created directly in the root)."""

Optimizer = optax.GradientTransformation | Callable[[str], optax.GradientTransformation]


class InterleavedState(NamedTuple):
  """The training state: a pytree, so it passes through ``jax.jit`` and sharding.

  Attributes:
    step: Number of steps taken.
    variables: All model collections (``params``, ``batch_stats``, ...).
    opt_state: One optimizer state per segment name, and one for ``REST``.
    grad_norm: The previous step's global gradient norm (for clipping).
  """
  step: jax.Array
  variables: dict
  opt_state: dict
  grad_norm: jax.Array

  @property
  def params(self) -> PyTree:
    """The current parameters."""
    return self.variables['params']


class Interleaved(NamedTuple):
  """A pair of pure functions, like ``optax.GradientTransformation``.

  Attributes:
    init: ``(variables, *example_args) -> InterleavedState``.
    step: ``(state, *args) -> (state, metrics)``; jittable.
    segments: ``(variables, *example_args) -> list of segment names``.
  """
  init: Callable[..., InterleavedState]
  step: Callable[..., tuple[InterleavedState, dict]]
  segments: Callable[..., list[str]]


def _name(path: Path) -> str:
  return '/'.join(path)


def _subtree(tree: Mapping, path: Path) -> Any:
  for k in path:
    tree = tree[k]
  return tree


def _without(tree: Mapping, paths: Sequence[Path]) -> dict:
  """``tree`` with the subtrees at ``paths`` removed (empty dicts pruned)."""
  out = {}
  for k, v in tree.items():
    inner = [p[1:] for p in paths if p[0] == k]
    if () in inner:
      continue
    if inner and isinstance(v, Mapping):
      v = _without(v, inner)
      if not v:
        continue
    out[k] = v
  return out


def _with(tree: Mapping, path: Path, value: Any) -> dict:
  out = dict(tree)
  if len(path) == 1:
    out[path[0]] = value
  else:
    out[path[0]] = _with(tree.get(path[0], {}), path[1:], value)
  return out


def _module_paths(params: Mapping, depth: int, prefix: Path = ()) -> list[Path]:
  """Paths of the module scopes ``depth`` levels down the params tree."""
  found = []
  for k, v in params.items():
    if isinstance(v, Mapping):
      if len(prefix) + 1 == depth:
        found.append(prefix + (k,))
      else:
        found.extend(_module_paths(v, depth, prefix + (k,)))
  return found


def _optimizer_for(optimizer: Optimizer, name: str) -> optax.GradientTransformation:
  if isinstance(optimizer, optax.GradientTransformation):
    return optimizer
  tx = optimizer(name)
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(f'The optimizer function returned {tx!r} for segment {name!r}; it must '
                    'return an optax.GradientTransformation.')
  return tx


def _clip_scale(max_norm: float | None, previous_norm: jax.Array) -> jax.Array:
  if max_norm is None:
    return jnp.ones(())
  return jnp.where(previous_norm > max_norm, max_norm / jnp.maximum(previous_norm, 1e-30), 1.0)


def _tree_where(pred: jax.Array, on_true: PyTree, on_false: PyTree) -> PyTree:
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _guarded_step(tx: optax.GradientTransformation, grads: PyTree, opt_state: PyTree,
                  params: PyTree, scale: jax.Array, guard: bool):
  """One optimizer step on one group: ``(params, opt_state, finite)``.

  With ``guard``, a gradient whose norm is not finite keeps the old params and
  state. The test reuses the norm reported in the metrics, and a conditional
  (not an elementwise select) skips the work, so the finite path makes no
  extra pass over the state and can update it in place.
  """
  finite = jnp.isfinite(optax.tree.norm(grads))

  def take():
    updates, new_opt = tx.update(jax.tree.map(lambda g: g * scale, grads), opt_state, params)
    return optax.apply_updates(params, updates), new_opt

  if not guard:
    return *take(), finite
  new_params, new_opt = jax.lax.cond(finite, take, lambda: (params, opt_state))
  return new_params, new_opt, finite


def interleaved(loss_fn: Callable[..., Any], optimizer: Optimizer, *,
                segments: int | CallFilter | None = None, propagate: str = 'updated',
                axis_name: str | None = None, has_aux: bool = False,
                clip_global_norm: float | None = None,
                skip_nonfinite: bool = True) -> Interleaved:
  """Interleaved update-then-propagate training for an unmodified Linen model.

  Segments are submodule calls, processed in reverse order of execution. For
  segment k, its output cotangent is the sum of what every later consumer sent
  back (each computed with that consumer's already-updated weights) plus the
  loss's direct contribution; ``dw_k`` is taken at the old ``w_k`` (then
  ``pmean``-ed over ``axis_name``), ``w_k`` takes its optimizer step, and the
  cotangents for everything segment k consumed are computed at the new ``w_k``.
  Glue code, skip connections and outputs used several times are exact.
  Params owned by no segment get their ordinary gradient and are updated at the
  end. Mutable collections (``batch_stats``) are updated as the model's own
  ``apply(..., mutable=...)`` would; rng users see the same random numbers in
  the weight-gradient and input-gradient replays of a segment.

  A segment's params should be read only by its own call: a term of the loss
  that uses them directly (an L2 penalty, say) is part of their final
  gradient but not of the step taken inside the sweep, which sees only what
  flows back through the call.

  Each segment has its own optimizer state, so transformations that look at
  the whole gradient (``optax.clip_by_global_norm``) act per segment. For a
  global norm, ``clip_global_norm=c`` scales every gradient of a step by
  ``min(1, c / n)`` where ``n`` is the PREVIOUS step's global norm (no second
  backward pass; the first step is not clipped).

  Args:
    loss_fn: ``(variables, *args) -> loss`` (or ``(loss, aux)`` with
      ``has_aux``), calling ``model.apply(variables, ...)``.
    optimizer: An ``optax.GradientTransformation`` used for every segment, or a
      function ``segment_name -> GradientTransformation`` (per-segment learning
      rates; the unsegmented params are named ``perturbkit.REST``).
    segments: ``None`` for the top-level submodule calls, an ``int`` depth, or a
      call filter (then ``init`` needs example arguments).
    propagate: ``'updated'`` (propagate with the new weights) or ``'original'``
      (old weights: the result equals ``jax.grad`` + ``optimizer.update``).
    axis_name: Mapped axis to average gradients over (``shard_map``/``pmap``).
    has_aux: Whether ``loss_fn`` returns ``(loss, aux)``; aux goes to metrics.
    clip_global_norm: Optional global-norm clip using the previous step's norm.
    skip_nonfinite: A segment (or the unsegmented group) whose gradient has a
      non-finite entry keeps its params and optimizer state for the step, and
      ``metrics['segment_skipped'][name]`` / ``metrics['skipped']`` report it
      (default); if false, the step is applied as it is.

  Returns:
    An :class:`Interleaved` with pure ``init`` and ``step``.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, optax
    >>> import perturbkit
    >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(1)])
    >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
    >>> loss_fn = lambda v, x, y: jnp.mean((model.apply(v, x) - y) ** 2)
    >>> tx = perturbkit.interleaved(loss_fn, optax.sgd(0.1))
    >>> state = tx.init(model.init(jax.random.key(0), x))
    >>> state, metrics = jax.jit(tx.step)(state, x, y)
    >>> sorted(metrics['grad_norm'])
    ['layers_0', 'layers_2']
  """
  if propagate not in ('updated', 'original'):
    raise ValueError(f"propagate must be 'updated' or 'original', got {propagate!r}.")
  if segments is not None and not isinstance(segments, int) and not callable(segments):
    raise TypeError(f'segments must be None, an int depth or a call filter, got {segments!r}.')

  def segment_paths(variables: Variables, *args) -> list[Path]:
    params = variables['params']
    if segments is None or isinstance(segments, int):
      return _module_paths(params, 1 if segments is None else segments)
    if not args:
      raise SegmentationError(
          'A segment filter selects calls, which are only known by tracing the model: '
          'pass example arguments, `init(variables, *args)`.')
    points: set[tuple] = set()
    discover(loss_fn, variables, args, {}, filter=segments, point_paths=points)
    owned = {p[:-1] for p in points}
    return sorted(p for p in owned if _has_params(params, p))

  def init(variables: Variables, *args) -> InterleavedState:
    if 'params' not in variables:
      raise TypeError("The variables must have a 'params' collection, as model.init returns.")
    variables = {c: v for c, v in dict(variables).items() if c != COLLECTION}
    paths = segment_paths(variables, *args)
    if not paths:
      raise SegmentationError('No segment owns any params; check `segments`.')
    params = variables['params']
    opt_state = {_name(p): _optimizer_for(optimizer, _name(p)).init(_subtree(params, p))
                 for p in paths}
    opt_state[REST] = _optimizer_for(optimizer, REST).init(_without(params, paths))
    return InterleavedState(jnp.zeros((), jnp.int32), variables, opt_state,
                            jnp.zeros((), jnp.float32))

  def paths_of(state: InterleavedState) -> list[Path]:
    names = [n for n in state.opt_state if n != REST]
    params = state.params
    paths = [tuple(n.split('/')) for n in names]
    for p in paths:
      if not _has_params(params, p):
        raise OptimizerStateError(
            f'The optimizer state has a segment {_name(p)!r} that the params do not have; '
            'build the state with `init` on these variables.')
    return paths

  def check_opt_state(state: InterleavedState, paths: list[Path]):
    params = state.params
    groups = {_name(p): _subtree(params, p) for p in paths}
    groups[REST] = _without(params, paths)
    for name, w in groups.items():
      want = jax.tree.structure(jax.eval_shape(_optimizer_for(optimizer, name).init, w))
      got = jax.tree.structure(state.opt_state[name])
      if want != got:
        raise OptimizerStateError(
            f'The optimizer state of {name!r} does not match its params ({got} vs {want}); '
            'build the state with `init` for the same params and optimizer.')

  def step(state: InterleavedState, *args) -> tuple[InterleavedState, dict]:
    paths = paths_of(state)
    check_opt_state(state, paths)
    by_path = {p: _name(p) for p in paths}
    variables = state.variables
    params = variables['params']
    is_segment = lambda module, method_name: tuple(module.path) in by_path
    lifted: list[str] = []
    discover(loss_fn, variables, args, {}, filter=is_segment, unreachable=lifted)
    if lifted:
      raise SegmentationError(
          f'The segments {lifted} run inside a lifted transform (nn.scan, nn.vmap) whose '
          'params are sliced per iteration; make the whole transformed module part of one '
          'segment (e.g. segments at its parent\'s depth), or choose other segments.')
    scale = _clip_scale(clip_global_norm, state.grad_norm)
    swept: set[str] = set()

    def backward_for(name: str):
      tx = _optimizer_for(optimizer, name)

      def backward(g, dw, w):
        carried = {'activation_grad_norm': optax.tree.norm(g).astype(jnp.float32)}
        if propagate == 'original':
          return None, carried
        swept.add(name)
        new_w, new_opt, _ = _guarded_step(tx, dw, state.opt_state[name], w, scale,
                                          skip_nonfinite)
        carried['step'] = (new_w, _split(new_opt)[0])
        return new_w, carried
      return backward

    def carrier_for(path: Path) -> dict:
      carrier = {'activation_grad_norm': jnp.zeros((), jnp.float32)}
      if propagate == 'updated':
        floats = _split(state.opt_state[by_path[path]])[0]
        carrier['step'] = (jax.tree.map(jnp.zeros_like, _subtree(params, path)),
                           [jnp.zeros_like(leaf) for leaf in floats])
      return carrier

    def differentiable(params, carriers):
      mutated: dict = {}
      called: set[Path] = set()

      def on_call(call, run):
        # Calls made inside a segment are not intercepted, so any second call on
        # a segment's module (a second `__call__`, or another method such as a
        # tied embedding's `attend`) is a genuine second use of its weights.
        if call.path in called:
          raise SharedSegmentError(_name(call.path))
        called.add(call.path)
        w = call.module.variables.get('params', {})
        if jax.tree.map(jnp.shape, w) != jax.tree.map(jnp.shape, _subtree(params, call.path)):
          raise SegmentationError(
              f'The segment {call.name!r} runs inside a lifted transform (nn.scan, nn.vmap) '
              'whose params are sliced; make the whole transformed module one segment '
              '(its parent), or choose other segments.')
        name = by_path[call.path]
        return run_segment(call, backward_for(name), carriers[name], axis_name)

      def on_root(module, method, run, a, kw):
        out = run()
        current = module.variables
        mutated.update({c: current[c] for c in current
                        if c not in ('params', COLLECTION) and module.is_mutable_collection(c)})
        return out

      with intercept(is_segment, on_call, on_root):
        out = loss_fn({**variables, 'params': params}, *args)
      loss = _check_loss(out, has_aux)
      return loss, (out[1] if has_aux else None, mutated)

    carriers = {by_path[p]: carrier_for(p) for p in paths}
    (loss, (aux, mutated)), (grads, carried) = jax.value_and_grad(
        differentiable, argnums=(0, 1), has_aux=True)(params, carriers)

    rest_grads = _without(grads, paths)
    act_norms = {name: c['activation_grad_norm'] for name, c in carried.items()}
    if axis_name is not None:
      rest_grads = jax.lax.pmean(rest_grads, axis_name)
      loss = jax.lax.pmean(loss, axis_name)
      act_norms = jax.lax.pmean(act_norms, axis_name)
    groups = {by_path[p]: (_subtree(grads, p), _subtree(params, p)) for p in paths}
    groups[REST] = (rest_grads, _without(params, paths))
    new_params, new_opt_state, grad_norms, skipped = params, {}, {}, {}
    for name, (g, w) in groups.items():
      tx = _optimizer_for(optimizer, name)
      grad_norms[name] = optax.tree.norm(g)
      finite = jnp.isfinite(grad_norms[name])
      skipped[name] = jnp.logical_not(finite)
      if name in swept:
        # The sweep already took this step; only the optimizer's non-float leaves
        # (a step count) are taken here, and XLA drops the rest of this update.
        new_w, floats = carried[name]['step']
        _, fresh = tx.update(jax.tree.map(lambda x: x * scale, g), state.opt_state[name], w)
        if skip_nonfinite:
          fresh = _tree_where(finite, fresh, state.opt_state[name])
        new_opt_state[name] = _split(fresh)[1](floats)
      else:
        new_w, new_opt_state[name], _ = _guarded_step(
            tx, g, state.opt_state[name], w, scale, skip_nonfinite)
      if name == REST:
        for p, v in traverse_util.flatten_dict(new_w).items():
          new_params = _with(new_params, p, v)
      else:
        new_params = _with(new_params, tuple(name.split('/')), new_w)
    global_norm = jnp.sqrt(sum(n ** 2 for n in grad_norms.values()))
    kept_norm = jnp.where(jnp.isfinite(global_norm), global_norm, state.grad_norm)
    new_variables = {**variables, **mutated, 'params': new_params}
    new_state = InterleavedState(state.step + 1, new_variables, new_opt_state, kept_norm)
    metrics = {'loss': loss, 'grad_norm': {n: v for n, v in grad_norms.items() if n != REST},
               'activation_grad_norm': act_norms, 'global_grad_norm': global_norm,
               'skipped': jnp.any(jnp.stack(list(skipped.values()))),
               'segment_skipped': skipped}
    if has_aux:
      metrics['aux'] = aux
    return new_state, metrics

  def segment_names(variables: Variables, *args) -> list[str]:
    return [_name(p) for p in segment_paths(dict(variables), *args)]

  return Interleaved(init, step, segment_names)


def _has_params(tree: Mapping, path: Path) -> bool:
  for k in path:
    if not isinstance(tree, Mapping) or k not in tree:
      return False
    tree = tree[k]
  return bool(jax.tree.leaves(tree))
