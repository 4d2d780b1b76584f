"""The one place that talks to ``nn.intercept_methods``.

``intercept(filter, on_call)`` runs a block in which every submodule method call
selected by ``filter`` is handed to ``on_call(call, run)``, where ``run()``
executes the original call and ``call`` names it. Handlers decide what to do
around the call (add a perturbation, insert a hook, replace it by a segment).

Each selected call gets a stable name within its module's scope, the *point key*:
``'__call__'`` for the first call of ``__call__``, ``'__call__#1'`` for the second,
and so on. A call of a method made while the same method of the same module runs
(``super().__call__(x)`` in a subclass of ``nn.Dense``, a LoRA layer) is part of
that call: it passes through with no key of its own, as it does in NNX, where
such a call is never intercepted. A lifted transform runs its body in scopes of its own. ``nn.remat``
(``nn.checkpoint``) and ``nn.vmap`` trace it once per call, so their traces
count on from the calls before them, and a second call of the same lifted
module gets the next keys (``'__call__#1'``). Others may trace a body more than
once for one call (``nn.scan``, and any transform around or inside one): each
of their traces counts from the start of its own scopes, so its traces name
their calls the same way. ``nn.cond``, ``nn.switch`` and ``nn.while_loop`` run
functions of the module that calls them, each in a trace of its own: every
function of one transform counts on from the calls before the transform, so
that the branches name the same calls alike and never like a call outside,
and the calls after it count on from every branch. The counts of one
``apply`` are carried over to the next ``apply`` inside the same block, so a loss
that runs the model twice gets distinct points for the two runs.

A submodule's own ``apply`` made inside a call of the model
(``self.lm_head.apply({'params': {'kernel': embedding.T}}, h)``, how Hugging Face
ties an output layer to the input embedding) runs the submodule on variables it
is given. Where the block asks for it (``nested_applies=True``), that ``apply`` is
a call of the submodule, with the key a direct call would have; the calls inside
it count in a trace of their own.
"""
import contextlib
import dataclasses
import re
import threading
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp

from perturbkit.core._callables import selects
from perturbkit.core.filters import linen_path_prefix, module_path
from perturbkit.core._points import point_key, raise_counts, transform_name
from perturbkit.core._types import CallFilter, Path
from perturbkit.errors import OutsideApplyError


@dataclasses.dataclass(frozen=True)
class Call:
  """One submodule method call, as handlers see it.

  Attributes:
    module: The bound module whose method is called.
    method_name: The method's name, e.g. ``'__call__'``.
    key: The point key of this call within the module's scope.
    args: The call's positional arguments.
    kwargs: The call's keyword arguments.
    outside_apply: Whether the call runs outside every method call of the
      model (on a ``model.bind``-bound module, in ``nn.apply(fn, model)``).
    in_function: Whether the call runs inside a function of ``nn.cond``,
      ``nn.switch`` or ``nn.while_loop`` (a branch): its values are those of
      the branch's trace, also where its module is bound outside the branch.
    mapped: Whether the call runs inside ``nn.map_variables`` with its mapped
      collections writable (``mutable=True``, as ``nn.SpectralNorm`` has): the
      transform's function may then map the ``'perturbations'`` collection too
      (``nn.SpectralNorm`` would normalize a point like a weight), so no point
      can be made there. Elsewhere a transform that maps the collection leaves
      it read-only, and no point is made either (``nn.WeightNorm``).
  """
  module: nn.Module
  method_name: str
  key: str
  args: tuple = ()
  kwargs: dict = dataclasses.field(default_factory=dict)
  outside_apply: bool = False
  in_function: bool = False
  mapped: bool = False

  @property
  def path(self) -> Path:
    """The module's path in the model, the same as its params' key path."""
    return module_path(self.module)

  @property
  def name(self) -> str:
    """``'Block_0/Dense_1/__call__'``: the module path and the point key."""
    return '/'.join(self.path + (self.key,))


Handler = Callable[[Call, Callable[[], Any]], Any]
# A transparent block's filter and handler: what a replay of a module needs to
# hand the calls inside it to that block's handler again.
ReplayHook = tuple[CallFilter, 'Handler']
RootHandler = Callable[[nn.Module, Callable[..., Any], Callable[[], Any], tuple, dict], Any]



# Lifted transforms that run functions of the module that calls them (the branches of a
# conditional, a loop's condition and body), each function traced once, by the number
# of functions one call of the transform runs (None: as many as it is given).
_FUNCTION_TRANSFORMS = {'cond': 2, 'switch': None, 'while_loop': 2}

# Lifted transforms that trace their body once per call (Flax's debug paths name them).
# ``jit``: once per call where the block keeps ``JIT_CALLS`` mutable (see ``in_jit``).
_TRACED_ONCE = frozenset({'remat', 'checkpoint', 'vmap', 'jit', *_FUNCTION_TRANSFORMS})

# A collection in which each call inside ``nn.jit`` leaves a marker, where it is mutable.
JIT_CALLS = 'perturbkit_jit_calls'


def transforms_of(module: nn.Module) -> list[str]:
  """Every lifted transform ``module`` runs inside, as Flax's debug paths name them
  (``'remat(scan(layers))'`` names two)."""
  return re.findall(r'(\w+)\(', ' '.join(map(str, module.scope.debug_path)))


def in_jit(module: nn.Module) -> bool:
  """Whether ``module`` runs inside ``nn.jit``.

  ``nn.jit`` reuses its trace for a later call with inputs of the same structure,
  and the interceptor never sees that call. Where ``JIT_CALLS`` is mutable, each
  call inside the transform leaves a new marker in it, so the next call's inputs
  differ: every call is traced, and gets keys of its own.
  """
  return 'jit' in transforms_of(module)


def in_map_variables(module: nn.Module) -> bool:
  """Whether ``module`` runs inside ``nn.map_variables`` (``nn.WeightNorm``, ``nn.SpectralNorm``):
  it sees its params as the transform's function maps them."""
  return 'map_variables' in transforms_of(module)


def function_transform(module: nn.Module) -> str | None:
  """``'cond'``, ``'switch'`` or ``'while_loop'`` where ``module`` is the module such a
  transform passes to the function it runs (Flax names the transform last in the
  scope's debug path, ``'cond(block)'``), else ``None``."""
  if module.scope is None or module.scope.parent is not None or not module.scope.debug_path:
    return None
  name = transform_name(module.scope.debug_path[-1])
  return name if name in _FUNCTION_TRANSFORMS else None


@dataclasses.dataclass
class _Group:
  """The functions of one call of a function transform seen so far (its branches)."""
  where: tuple  # the transform and the module it runs on: its scope's debug path
  start: dict[tuple[Path, str], int]
  functions: list[Any]

  def takes(self, where: tuple, function: Any) -> bool:
    """Whether ``function``, run on ``where``, is another function of this call."""
    most = _FUNCTION_TRANSFORMS[transform_name(where[-1])]
    return (where == self.where and all(f is not function for f in self.functions)
            and (most is None or len(self.functions) < most))


@dataclasses.dataclass
class _Trace:
  """One trace running (the apply, a lifted call's trace, a nested apply)."""
  start: dict[tuple[Path, str], int]  # the counts its keys start from
  # Its start and every call counted in it or in a trace inside it: where a transform
  # traced once inside it counts on from.
  seen: dict[tuple[Path, str], int] = dataclasses.field(default_factory=dict)
  # The least counts of its calls after a function transform ran in it: past every branch.
  floor: dict[tuple[Path, str], int] = dataclasses.field(default_factory=dict)
  # The function transform that ran last in it, while no call of its own followed.
  group: _Group | None = None


def _traced_once(module: nn.Module) -> bool:
  """Whether the lifted trace ``module`` tops runs once per call: every transform around it
  (``'remat(scan(layers))'`` names two) traces its body once."""
  names = transforms_of(module)
  return bool(names) and set(names) <= _TRACED_ONCE


class _State:
  """Counters and flags of one ``intercept`` block; dropped when the block ends."""

  def __init__(self, filter: CallFilter, on_call: 'Handler', transparent: bool):
    self.filter = filter
    self.on_call = on_call
    self.transparent = transparent
    self.offsets: dict[tuple[Path, str], int] = {}
    self.apply_counts: dict[tuple[Path, str], int] = {}
    self.trace_counts: dict[Any, dict[tuple[Path, str], int]] = {}  # by the trace's root scope
    self.traces: list[_Trace] = [_Trace({})]  # innermost last
    self.function_roots: set[Any] = set()  # the root scopes of the functions running
    self.roots_active = 0
    # (module, method name) of the calls running now: a call of the same method of the same
    # module inside one of them (``super().__call__`` in a subclass) is part of it.
    self.running: set[tuple[int, str]] = set()
    self.modules: list[nn.Module] = []  # the modules whose calls run now, innermost last
    self.suspended = 0
    self.rootless_scope = None  # the root scope of the last call outside a method call
    # id -> (it, root module, root -> it) of each submodule a root method returned
    self.returned: dict[int, tuple[nn.Module, nn.Module, Callable[[nn.Module], Any]]] = {}
    self.mapped = 0  # how many nn.map_variables traces with writable mapped collections run

  def start_apply(self):
    for k, n in self.apply_counts.items():
      self.offsets[k] = self.offsets.get(k, 0) + n
    self.apply_counts.clear()
    self.trace_counts.clear()
    self.traces = [_Trace({})]

  @contextlib.contextmanager
  def trace(self, start: dict[tuple[Path, str], int]) -> Iterator[None]:
    self.traces[-1].group = None  # a call between two function transforms, as in next_key
    self.traces.append(_Trace(dict(start), dict(start)))
    try:
      yield
    finally:
      raise_counts(self.traces[-2].seen, self.traces.pop().seen)

  def run_function(self, module: nn.Module, function: Any, run: Callable[[], Any]) -> Any:
    """Runs a function of a function transform (a branch) as a trace of its own.

    It is another function of the transform the last one was (the same
    keys) when it comes right after it, runs on the same module and is not
    one of its functions yet; otherwise it starts a new call of a transform,
    which counts on from every call before.
    """
    outer = self.traces[-1]
    where = tuple(module.scope.debug_path)
    if outer.group is None or not outer.group.takes(where, function):
      outer.group = _Group(where, dict(outer.seen), [])
    group = outer.group
    group.functions.append(function)
    self.function_roots.add(module.scope.root)
    try:
      with self.trace(group.start):
        return run()
    finally:
      self.function_roots.discard(module.scope.root)
      raise_counts(outer.floor, outer.seen)
      outer.group = group  # the calls inside ran in the function's own trace

  @contextlib.contextmanager
  def mapping(self, module: nn.Module) -> Iterator[None]:
    """Counts the trace ``module`` tops in ``mapped`` while it runs, where it is one of
    ``nn.map_variables`` whose mapped collections are writable: its scope is exactly as
    mutable as the module that runs the transform, which Flax gives it only then."""
    mapped = (transform_name(module.scope.debug_path[-1]) == 'map_variables'
              and bool(self.modules) and module.scope.mutable is self.modules[-1].scope.mutable)
    self.mapped += mapped
    try:
      yield
    finally:
      self.mapped -= mapped

  def next_key(self, module: nn.Module, method_name: str) -> str:
    trace = self.traces[-1]
    trace.group = None  # a call between two function transforms: the next is a new one
    counts = self.trace_counts.setdefault(module.scope.root, dict(trace.start))
    k = (tuple(module.path), method_name)
    n = max(counts.get(k, 0), trace.floor.get(k, 0))
    counts[k] = n + 1
    trace.seen[k] = max(trace.seen.get(k, 0), n + 1)
    self.apply_counts[k] = max(self.apply_counts.get(k, 0), n + 1)
    return point_key(method_name, self.offsets.get(k, 0) + n)

  def applied_child(self, module: nn.Module, method_name: str) -> nn.Module | None:
    """The submodule of the running call that ``module``, the root of an ``apply`` made
    inside it, is a copy of (``self.lm_head.apply(...)``); None for any other ``apply``."""
    if not self.modules or module.name is None or not method_name.isidentifier():
      return None
    child = _copied_child(self.modules[-1], module)
    return child if child is not None and child.scope is not None and child.path else None

  def holder_of(self, module: nn.Module, method_name: str) -> nn.Module | None:
    """The root a returned submodule was called from (the latest first) that has a child
    ``module`` is a copy of, made for its own ``apply`` with other variables and neither
    mutable collections nor random numbers; None if there is none. The child must be an
    attribute of the root (made in its ``setup``), so that a replay of the root finds it."""
    if (module.name is None or not method_name.isidentifier() or module.scope.mutable
        or module.scope.rngs):
      return None
    for _, root, _ in reversed(list(self.returned.values())):
      child = _copied_child(root, module)
      if child is not None and getattr(root, module.name, None) is child:
        return root
    return None


def _copied_child(parent: nn.Module, module: nn.Module) -> nn.Module | None:
  """The child of ``parent`` named as ``module`` and of its type (the submodule ``module``
  may be a copy of, made for its own ``apply``), or None."""
  child = parent._state.children.get(module.name)
  return child if isinstance(child, nn.Module) and type(child) is type(module) else None


def returned_modules(root: nn.Module, method: Any, out: Any, args: tuple,
                     kwargs: dict) -> dict[int, tuple[nn.Module, nn.Module, Callable]]:
  """The submodules in ``out``, what the root call ``method(*args, **kwargs)`` of ``root``
  returned, by id: each with itself, ``root`` and a function that gets it from a copy of
  ``root`` (calling the method again), so that a call of it can run as a root call."""
  leaves = jax.tree.leaves(out)
  found = {}
  for i, leaf in enumerate(leaves):
    if isinstance(leaf, nn.Module) and leaf.scope is not None and leaf.path:
      def fetch(r, i=i):
        got = getattr(r, method)(*args, **kwargs) if isinstance(method, str) else method(
            r, *args, **kwargs)
        return jax.tree.leaves(got)[i]
      found[id(leaf)] = (leaf, root, fetch)
  return found


def _is_method_call(module: nn.Module, method_name: str) -> bool:
  # Flax also routes `setup` through interceptors, and, for submodules, internal
  # helpers named like lambdas; neither is a call of the model. A root call may
  # be any function passed as `apply(..., method=fn)`.
  if module.scope is None or method_name == 'setup':
    return False
  return not module.path or method_name.isidentifier()


class _Local(threading.local):
  """The ``intercept`` blocks open in this thread, innermost last.

  Flax keeps its interceptor stack per thread; so does perturbkit, so that
  models traced at once in several threads never see each other's blocks.
  """

  def __init__(self):
    self.states: list[_State] = []


_LOCAL = _Local()


@contextlib.contextmanager
def intercept(filter: CallFilter, on_call: Handler,
              on_root: RootHandler | None = None, *,
              takes_root: Callable[[nn.Module], bool] | None = None,
              transparent: bool = False, outside_apply: bool = False,
              nested_applies: bool = False, initializing: bool = False) -> Iterator[None]:
  """Hands every selected submodule call inside the block to ``on_call``.

  Args:
    filter: Selects the calls, ``(module, method_name) -> bool``.
    on_call: ``(call, run) -> output``; ``run()`` executes the original call.
    on_root: Optional ``(module, method, run, args, kwargs) -> output``,
      called for the root call of each top-level ``apply``/``init``;
      ``method`` is the called function (a method name where it is one).
    takes_root: Optional ``module -> bool``: which root calls ``on_root`` takes
      (default: all). The others run as they would without ``on_root``.
    transparent: The handler only wraps each call's output (a backward hook)
      and may see the same call again in a replay, so :func:`suspended`
      leaves this block active.
    outside_apply: The handler takes calls made outside every method call of
      the model (``Call.outside_apply``); otherwise such a call is an
      :class:`OutsideApplyError` (transparent blocks take them always). Each
      new bound tree they run in counts as a new apply.
    nested_applies: A submodule's own ``apply`` made inside a call of the model
      (a tied output layer) is handed over as a call of that submodule;
      otherwise it runs unseen, and only the calls inside it are handed over.
    initializing: The handler also takes the calls of a model's ``init`` made
      inside the block (the perturbation points of ``wrap``'s own ``init``).
      Otherwise such an ``init`` runs unseen, the calls inside it included, and
      the calls after it are numbered as if it had not run: a model
      initializing makes variables, not the outputs the function computes
      (Hugging Face's ``generate`` makes its key-value cache with ``init``
      before its first call of the model).

  Yields:
    Nothing; the interception ends with the block.
  """
  state = _State(filter, on_call, transparent)

  def interceptor(next_fun, args, kwargs, context):
    module, method_name = context.module, context.method_name
    run = lambda: next_fun(*args, **kwargs)
    if (not state.suspended and state.roots_active and method_name != 'setup'
        and function_transform(module) and module.scope.root not in state.function_roots):
      # A branch of nn.cond/nn.switch (a function of nn.while_loop) on its module: the
      # module running its own code, no call of the model.
      return state.run_function(module, getattr(context.orig_method, 'func', None), run)
    if state.suspended or not _is_method_call(module, method_name):
      return next_fun(*args, **kwargs)
    if not module.path and not initializing and module.is_initializing():
      state.suspended += 1
      try:
        return run()
      finally:
        state.suspended -= 1
    if not state.roots_active and state.returned.get(id(module), (None,))[0] is module:
      # A submodule a root method returned (Hugging Face's `_get_encoder_module()`), called
      # by the function given to `apply`: a call of the model, as in that root method.
      _, root, fetch = state.returned[id(module)]
      replay = lambda r, *a, **kw: getattr(fetch(r), method_name)(*a, **kw)
      return _root(root, replay, run, args, kwargs, on_root)
    holder = (state.holder_of(module, method_name)
              if nested_applies and not state.roots_active and not module.path else None)
    if holder is not None:
      # A submodule's own `apply` in a function given to the root's `apply`, after the call
      # of a submodule a root method returned (Hugging Face's `decode`: the tied
      # `module.lm_head.apply(...)` after the decoder): a call of that submodule, as in a
      # method of the root.
      given, name = module.variables, module.name

      def replay(root, *a, **kw):
        state.modules.append(root)  # the running call whose child the apply is
        try:
          return getattr(root, name).apply(given, *a, method=method_name, **kw)
        finally:
          state.modules.pop()

      return _root(holder, replay, run, args, kwargs, on_root)
    if not module.path:
      if state.roots_active:  # a nested `apply` (or a lifted transform's wrapper)
        child = state.applied_child(module, method_name) if nested_applies else None
        nested = lambda: _in_trace_of_its_own(module, run)
        if child is not None:
          return _call(child, method_name, nested, args, kwargs)
        return nested()
      method = method_name if hasattr(type(module), method_name) else getattr(
          context.orig_method, 'func', context.orig_method)
      handler = on_root if takes_root is None or takes_root(module) else None
      out = _root(module, method, run, args, kwargs, handler)
      if handler is not None and outside_apply:
        state.returned.update(returned_modules(module, method, out, args, kwargs))
      return out
    if state.roots_active and module.scope.parent is None:  # the top call of a lifted trace
      with state.trace(state.traces[-1].seen if _traced_once(module) else {}), \
          state.mapping(module):
        if not hasattr(type(module), method_name):
          # A function given to the transform with the module (`nn.map_variables(f)(layer)`,
          # as nn.WeightNorm runs its layer): the calls inside it are the model's calls.
          return run()
        return _call(module, method_name, run, args, kwargs)
    return _call(module, method_name, run, args, kwargs)

  def _root(module, method, run, args, kwargs, handler):
    state.start_apply()
    state.roots_active += 1
    state.modules.append(module)
    try:
      return run() if handler is None else handler(module, method, run, args, kwargs)
    finally:
      state.roots_active -= 1
      state.modules.pop()

  def _in_trace_of_its_own(module, run):
    state.modules.append(module)
    try:
      with state.trace({}):
        return run()
    finally:
      state.modules.pop()

  def _call(module, method_name, run, args, kwargs):
    running = (id(module), method_name)
    if running in state.running:  # `super().__call__` inside the module's own call
      return run()
    state.running.add(running)
    state.modules.append(module)
    try:
      return _new_call(module, method_name, run, args, kwargs)
    finally:
      state.running.discard(running)
      state.modules.pop()

  def _new_call(module, method_name, run, args, kwargs):
    outside = not state.roots_active
    if outside and module.scope.root is not state.rootless_scope:
      # Outside every method call of the model (a `bind`-bound module's child, or a
      # function given to `nn.apply`): each bound tree counts as an apply of its own.
      state.start_apply()
      state.rootless_scope = module.scope.root
    key = state.next_key(module, method_name)
    if module.is_mutable_collection(JIT_CALLS) and in_jit(module):
      module.put_variable(JIT_CALLS, key, jnp.zeros((), jnp.int8))
    if not selects(filter, module, method_name):
      return run()
    call = Call(module, method_name, key, args, kwargs, outside, bool(state.function_roots),
                bool(state.mapped))
    if state.transparent:
      return on_call(call, run)
    if outside and not outside_apply:
      raise OutsideApplyError(call.name)
    ran = []

    def run_once():
      ran.append(True)
      return run()

    output = on_call(call, run_once)
    if ran:
      return output
    # The handler ran the call its own way (a segment replay), so blocks opened
    # inside this one never saw it; transparent ones (hooks) still wrap its output,
    # the innermost (the one Flax runs closest to the call) first.
    for inner in reversed(_LOCAL.states[_LOCAL.states.index(state) + 1:]):
      if inner.transparent and not inner.suspended and selects(inner.filter, module, method_name):
        output = inner.on_call(call, lambda out=output: out)
    return output

  _LOCAL.states.append(state)
  try:
    with nn.intercept_methods(interceptor):
      yield
  finally:
    _LOCAL.states.remove(state)


def open_hooks() -> tuple[ReplayHook, ...]:
  """The transparent blocks (backward hooks) that see the calls made now, outermost first.

  A handler that replays its module as a fresh ``apply`` (a segment) takes these
  when it is called and gives them to :func:`replaying`, also for replays that
  run after the blocks have closed (a custom VJP's backward pass).
  """
  return tuple((s.filter, s.on_call) for s in _LOCAL.states if s.transparent and not s.suspended)


@contextlib.contextmanager
def replaying(prefix: Path, hooks: tuple[ReplayHook, ...]) -> Iterator[None]:
  """A replay of the module at ``prefix`` as its own ``apply``.

  Every block open in this thread passes the replay's calls through (opaque
  ones would intercept them a second time, transparent ones would see them
  under paths relative to the module), and ``hooks`` (from :func:`open_hooks`)
  are opened again for them, with the module's path before every path, so
  that they see the calls as in an ordinary run of the whole model.
  """
  states = list(_LOCAL.states)
  for s in states:
    s.suspended += 1
  try:
    with contextlib.ExitStack() as stack:
      stack.enter_context(linen_path_prefix(prefix))
      for filter, on_call in hooks:
        stack.enter_context(intercept(filter, on_call, transparent=True))
      yield
  finally:
    for s in states:
      s.suspended -= 1


def intercepting() -> bool:
  """Whether a block that acts on calls (not only a transparent one) is open in this thread."""
  return any(not s.transparent and not s.suspended for s in _LOCAL.states)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
  """Calls made inside this block pass through every open ``intercept`` of this thread.

  Handlers use it when they run a call their own way (a replay of a segment),
  so that the calls inside are not intercepted a second time; a perturbkit
  function called inside another one's loss uses it so that each level sees
  only its own calls. Transparent blocks (backward hooks) stay active.
  """
  states = [s for s in _LOCAL.states if not s.transparent]
  for s in states:
    s.suspended += 1
  try:
    yield
  finally:
    for s in states:
      s.suspended -= 1
