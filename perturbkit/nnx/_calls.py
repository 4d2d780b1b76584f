"""The one place that instruments NNX submodule calls.

NNX has no method interceptor (Linen's ``nn.intercept_methods`` sees nothing
inside NNX modules). ``instrument(roots, on_call)`` runs a block in which every
submodule of the roots carries two things:

* its class is a cached subclass of its own class whose ``__call__`` (and other
  public methods) hand the call to the handlers of the blocks open in the
  calling thread, and behave as the original methods everywhere else;
* a static attribute with its path in the root, per open block
  (``((0, ('layers', 0)),)``).

Both are part of the module's graphdef, so the copies that NNX transforms make
inside the model (``nnx.scan``, ``nnx.vmap``, ``nnx.remat``) are instrumented as
well and still know where they sit; object ids would not say that. The class is
set with ``object.__setattr__``, as NNX's own unflattening does, so the swap is
not recorded as an attribute. On leaving the block every module gets its class
and attributes back, also when the block raises.

perturbkit's entry points instrument the copies NNX makes inside their own
transforms (``nnx.eval_shape``, ``nnx.value_and_grad``), not the caller's model
object; only ``with_hooks``, which runs inside the caller's transform, swaps the
classes of the objects it is given for the duration of the call. Point keys
follow the Linen front end (``'__call__'``, ``'__call__#1'``): calls are counted
per module path and method within one block.

The branches of one ``nnx.cond`` (``nnx.switch``) share their keys: JAX traces
every branch, each on its own copy of the model, and joins what they leave in
the module's state, so the same call in each branch must make the same point
(it then holds the gradient of whichever branch ran). Each branch counts from
the counts before the conditional, and the calls after it count on past every
branch. Flax's update context of the conditional (``'cond'``/``'switch'``,
open while its branches run) names the conditional, and the state its branch
merged names the branch.

As in ``_interceptor``, a block is *transparent* (backward hooks: the handler
runs the call and wraps its output) or *opaque* (its handler may run the call
its own way, a segment replay). When an opaque handler does not run the call,
the transparent blocks closer to it still wrap the output, innermost first,
and the replay gets their handlers (``replay_hooks``) for the calls inside it.
"""
import contextlib
import dataclasses
import functools
import inspect
import threading
from typing import Any, Callable, Iterator, Sequence

from flax import nnx
from flax.nnx import bridge as nnx_bridge
from flax.nnx import graphlib

from perturbkit.core._points import point_key, raise_counts
from perturbkit.errors import UninstrumentableModuleError

SITES_ATTR = '_perturbkit_sites'
_MARKER = '_perturbkit_instrumented'

NNXPath = tuple[str | int, ...]


@dataclasses.dataclass(frozen=True)
class Call:
  """One submodule method call, as handlers see it.

  Attributes:
    module: The called module (its class is the instrumented subclass).
    method_name: The method's name, e.g. ``'__call__'``.
    path: The module's path in the instrumented model, e.g. ``('layers', 0)``.
    key: The point key of this call, ``'__call__'``, ``'__call__#1'``, ...
    copied: Whether the module is a copy an NNX transform made inside the
      model (``nnx.scan``, ``nnx.vmap``, ``nnx.remat``), not the instance the
      block instrumented: its values there are values of the transform's trace.
    conditional: ``'nnx.cond'`` or ``'nnx.switch'`` where the call runs in a
      branch of one (the innermost), ``''`` where it runs in branches of both
      kinds nested (their keys are not shared), else ``None``.
    args: The call's positional arguments.
    kwargs: The call's keyword arguments.
  """
  module: nnx.Module
  method_name: str
  path: NNXPath
  key: str
  copied: bool = False
  args: tuple = ()
  kwargs: dict = dataclasses.field(default_factory=dict)
  conditional: str | None = None

  @property
  def name(self) -> str:
    """``'layers/0/__call__'``: the module path and the point key."""
    return '/'.join(map(str, self.path + (self.key,)))


Handler = Callable[[Call, Callable[[], Any]], Any]

# The NNX conditionals, by the tag of the update context they open around their branches.
_CONDITIONALS = {'cond': 'nnx.cond', 'switch': 'nnx.switch'}

# The branches a call runs in, outermost first: (conditional's context, branch's state).
Branches = tuple[tuple[Any, Any], ...]


def branches() -> tuple[str | None, Branches | None]:
  """The conditional the current call runs in a branch of, and the branches it runs in.

  ``(None, ())`` outside every ``nnx.cond``/``nnx.switch``; ``('', None)``
  inside both kinds nested (Flax keeps one stack per kind, so their order is
  unknown and the call is counted as any other).
  """
  # Flax internals: where a Flax version lacks them, branch calls are counted as any other
  # (their points then differ per branch, and discovery warns about them).
  stacks = getattr(getattr(graphlib, 'GRAPH_CONTEXT', None), 'update_context_stacks', None) or {}
  open_ = [(tag, stacks[tag]) for tag in _CONDITIONALS if stacks.get(tag)]
  if not open_:
    return None, ()
  if len(open_) > 1:
    return '', None
  tag, stack = open_[0]
  return _CONDITIONALS[tag], tuple((c, getattr(c, 'outer_index_inner_ref', None)) for c in stack)


@dataclasses.dataclass
class _Group:
  """One conditional whose branches are running: the counts its branches start from."""
  context: Any  # Flax's update context of the conditional (held: its identity names it)
  start: dict[tuple[NNXPath, str], int]
  branch: Any  # the state the running branch merged (held: its identity names the branch)
  high: dict[tuple[NNXPath, str], int] = dataclasses.field(default_factory=dict)


class _Block:
  """Handler and counters of one ``instrument`` block; dropped when it ends."""

  def __init__(self, on_call: Handler, instances: frozenset[int], transparent: bool):
    self.on_call = on_call
    self.instances = instances
    self.transparent = transparent
    self.counts: dict[tuple[NNXPath, str], int] = {}
    self.groups: list[_Group] = []  # the conditionals running, outermost first
    self.suspended = 0

  def _end_group(self):
    """The calls after the innermost conditional count on past every branch of it."""
    raise_counts(self.counts, self.groups.pop().high)

  def enter(self, running: Branches):
    """Sets the counts for a call inside the branches ``running`` (from :func:`branches`)."""
    kept = 0
    while (kept < min(len(self.groups), len(running))
           and self.groups[kept].context is running[kept][0]):
      kept += 1
    while len(self.groups) > kept:
      self._end_group()
    if kept and self.groups[-1].branch is not running[kept - 1][1]:
      # Another branch of the same conditional: it counts from where the first one did.
      group = self.groups[-1]
      raise_counts(group.high, self.counts)
      self.counts = dict(group.start)
      group.branch = running[kept - 1][1]
    for context, branch in running[kept:]:
      self.groups.append(_Group(context, dict(self.counts), branch))

  def next_key(self, path: NNXPath, method_name: str, running: Branches | None = ()) -> str:
    if running is not None:
      self.enter(running)
    n = self.counts.get((path, method_name), 0)
    self.counts[(path, method_name)] = n + 1
    return point_key(method_name, n)


# A transparent handler and the path its block gives a module: what a replay of
# that module needs to hand its inner calls to the handler again.
ReplayHook = tuple[Handler, NNXPath]


class _ThreadState(threading.local):
  """This thread's open blocks (innermost last), the call being handled, and its replay hooks."""

  def __init__(self):
    self.blocks: list[_Block] = []
    self.current: Call | None = None
    self.replay_hooks: tuple[ReplayHook, ...] = ()


# A module swapped in one thread and called from another runs as the original
# there: dispatch only looks at the calling thread's blocks.
_THREAD = _ThreadState()


def path_of(module: Any) -> NNXPath | None:
  """The path of an instrumented NNX module in its model, or ``None``.

  Inside a handler this is the path in the model of the block handling the
  call (blocks opened on different roots see different paths).
  """
  current = _THREAD.current
  if current is not None and current.module is module:
    return current.path
  sites = vars(module).get(SITES_ATTR) if hasattr(module, '__dict__') else None
  return sites[-1][1] if sites else None


def _handled(block: _Block, call: Call, run: Callable[[], Any],
             replay_hooks: tuple[ReplayHook, ...] = ()) -> Any:
  previous = _THREAD.current, _THREAD.replay_hooks
  _THREAD.current, _THREAD.replay_hooks = call, replay_hooks
  try:
    return block.on_call(call, run)
  finally:
    _THREAD.current, _THREAD.replay_hooks = previous


def _opaque(block: _Block, call: Call, run: Callable[[], Any],
            inner: Sequence[tuple[_Block, Call]],
            replay_hooks: tuple[ReplayHook, ...]) -> Any:
  """Runs an opaque handler (one that may replace the call, e.g. by a segment replay).

  When the handler does not call ``run()``, the blocks closer to the call never
  saw it; the transparent ones (backward hooks) still wrap its output, the
  innermost first, as they would have on the original call. The calls inside
  the handler's own replay reach them through :func:`replay_instrumented`.
  """
  ran = []

  def run_once():
    ran.append(True)
    return run()

  output = _handled(block, call, run_once, replay_hooks)
  if not ran:
    for inner_block, inner_call in inner:
      if inner_block.transparent:
        output = _handled(inner_block, inner_call, lambda out=output: out)
  return output


# Attributes that ``nnx.bridge.ToNNX`` must not see: it turns every attribute of
# the instance into a Linen variable and refuses anything else.
_NOT_FOR_BRIDGE = (SITES_ATTR, '__captures__')


def _run_bridged(original: Callable[..., Any], module: Any, args: tuple, kwargs: dict) -> Any:
  """Runs a ``ToNNX`` method with perturbkit's and ``nnx.capture``'s attributes set aside."""
  own = vars(module)
  aside = {name: own.pop(name) for name in _NOT_FOR_BRIDGE if name in own}
  try:
    return original(module, *args, **kwargs)
  finally:
    own.update(aside)


def _dispatching(method_name: str, original: Callable[..., Any],
                 bridged: bool = False) -> Callable[..., Any]:
  @functools.wraps(original)
  def method(self, *args, **kwargs):
    if bridged:
      run = lambda: _run_bridged(original, self, args, kwargs)
    else:
      run = lambda: original(self, *args, **kwargs)
    blocks = _THREAD.blocks
    active = []
    sites = vars(self).get(SITES_ATTR, ())
    conditional, running = branches() if sites else (None, ())
    for depth, path in reversed(sites):
      if depth < len(blocks) and not blocks[depth].suspended:
        block = blocks[depth]
        key = block.next_key(path, method_name, running)
        active.append((block, Call(self, method_name, path, key, id(self) not in block.instances,
                                   args, kwargs, conditional)))
    # Every transparent block would see the calls made inside this one; an
    # opaque handler that replays the module gets them for that replay.
    replay_hooks = tuple((b.on_call, c.path) for b, c in active if b.transparent)
    # Innermost block closest to the call: its handler sees the original
    # output, the next block out sees what that handler returned, and so on.
    for i, (block, call) in enumerate(active):
      if block.transparent:
        run = functools.partial(_handled, block, call, run)
      else:
        run = functools.partial(_opaque, block, call, run, active[:i], replay_hooks)
    return run()
  return method


def replay_hooks() -> tuple[ReplayHook, ...]:
  """The transparent handlers that would see the calls inside the call being handled.

  An opaque handler that replays its module (a segment) takes these when it is
  called and gives them to :func:`replay_instrumented`, also for replays that
  run after the blocks have closed (a custom VJP's backward pass).
  """
  return _THREAD.replay_hooks


@contextlib.contextmanager
def replay_instrumented(replica: nnx.Module, hooks: Sequence[ReplayHook]) -> Iterator[None]:
  """Hands the calls inside ``replica`` to ``hooks``, as the original module's would be.

  Args:
    replica: A copy of a handled call's module, with plain classes.
    hooks: From :func:`replay_hooks`, innermost block first; each handler sees
      the replica's submodules at its path for the original module plus their
      path in the replica.

  Yields:
    Nothing; the replica's classes are restored when the block ends.
  """
  with contextlib.ExitStack() as stack:
    for handler, prefix in reversed(tuple(hooks)):
      stack.enter_context(instrument([replica], handler, transparent=True, prefix=prefix))
    yield


# Classes whose public methods are container or framework API, not model calls.
_FRAMEWORK_MODULES = ('flax.nnx.module', 'flax.nnx.pytreelib', 'flax.nnx.reprlib',
                      'flax.nnx.helpers', 'collections.abc', 'typing', 'builtins')


def _model_methods(cls: type) -> dict[str, Callable[..., Any]]:
  """``__call__`` and the public methods a model class defines, by name."""
  methods = {}
  for name in dir(cls):
    if name != '__call__' and name.startswith('_'):
      continue
    owner = next((c for c in cls.__mro__ if name in vars(c)), None)
    if owner is None:
      continue
    if name != '__call__' and owner.__module__ in _FRAMEWORK_MODULES:
      continue
    function = vars(owner)[name]
    if inspect.isfunction(function):
      methods[name] = function
  return methods


_CLASS_LOCK = threading.Lock()
# Instrumented subclass of each class, created once. Entries are never changed
# after creation, so sharing them between threads is safe; the cache keeps
# graphdefs (which record the class) and JAX's pytree registry from growing.
_CLASSES: dict[type, type] = {}


def instrumented_class(cls: type) -> type:
  """The cached dispatching subclass of ``cls`` (``cls`` itself if it is one)."""
  if vars(cls).get(_MARKER, False):
    return cls
  with _CLASS_LOCK:
    sub = _CLASSES.get(cls)
    if sub is None:
      bridged = issubclass(cls, nnx_bridge.ToNNX)
      namespace = {name: _dispatching(name, fn, bridged)
                   for name, fn in _model_methods(cls).items()}
      # `_perturbkit_path_of` lets front-end-neutral code (path filters) ask a
      # module for its path without importing this module.
      namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__,
                       __doc__=cls.__doc__, _perturbkit_path_of=staticmethod(path_of),
                       **{_MARKER: True})
      sub = type(cls)(cls.__name__, (cls,), namespace,
                      pytree=getattr(cls, '_pytree__is_pytree', True))
      _CLASSES[cls] = sub
    return sub


def own_class(module: nnx.Module) -> type:
  """The module's class as the model defines it: the class an instrumented module's
  subclass extends (a copy made inside an NNX transform keeps the subclass)."""
  cls = type(module)
  return cls.__bases__[0] if vars(cls).get(_MARKER, False) else cls


def submodules(model: nnx.Module) -> list[tuple[NNXPath, nnx.Module]]:
  """Every submodule of ``model`` (not ``model`` itself) with its path, once each."""
  return [(tuple(path), m) for path, m in nnx.iter_modules(model) if path]


@contextlib.contextmanager
def instrument(roots: Sequence[nnx.Module], on_call: Handler, *, transparent: bool = False,
               prefix: NNXPath = (), include_roots: bool = False) -> Iterator[None]:
  """Hands every submodule method call inside the block to ``on_call``.

  Blocks nest: a call on a module instrumented by several open blocks of this
  thread goes through each block's handler, the innermost closest to the call.

  Args:
    roots: The models; their submodules are instrumented, the roots are not
      (a root's output is the model's output).
    on_call: ``(call, run) -> output``; ``run()`` executes the original method
      (or the next inner block's handler).
    transparent: The handler always calls ``run()`` and only wraps the output
      (a backward hook). An opaque handler may run the call its own way (a
      segment replay) instead; the transparent blocks opened inside it then
      wrap what it returns, and its replay can hand them its inner calls
      (:func:`replay_hooks`).
    prefix: Put before every path (the roots' own path in a larger model).
    include_roots: Instrument the roots as well, at path ``prefix`` (the calls
      of the whole model: per-example replays of a whole model call).

  Yields:
    Nothing; classes and attributes are restored when the block ends, also
    when it raises.

  Raises:
    UninstrumentableModuleError: a submodule's class cannot be subclassed or
      its instance does not accept the subclass.
  """
  depth = len(_THREAD.blocks)
  swapped: list[tuple[nnx.Module, type, Any]] = []
  missing = object()
  try:
    for root in roots:
      for path, module in [((), root)] * include_roots + submodules(root):
        if any(m is module for m, _, _ in swapped):
          continue
        cls = type(module)
        try:
          sub = instrumented_class(cls)
          object.__setattr__(module, '__class__', sub)
        except Exception as e:  # pylint: disable=broad-except
          raise UninstrumentableModuleError('/'.join(map(str, path)), cls, e) from e
        previous = vars(module).get(SITES_ATTR, missing)
        swapped.append((module, cls, previous))
        sites = () if previous is missing else previous
        object.__setattr__(module, SITES_ATTR, sites + ((depth, tuple(prefix) + path),))
    _THREAD.blocks.append(_Block(on_call, frozenset(id(m) for m, _, _ in swapped),
                                 transparent))
    try:
      yield
    finally:
      _THREAD.blocks.pop()
  finally:
    for module, cls, previous in reversed(swapped):
      object.__setattr__(module, '__class__', cls)
      if previous is missing:
        vars(module).pop(SITES_ATTR, None)
      else:
        object.__setattr__(module, SITES_ATTR, previous)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
  """Calls made inside this block in this thread run as the original methods."""
  blocks = list(_THREAD.blocks)
  for b in blocks:
    b.suspended += 1
  try:
    yield
  finally:
    for b in blocks:
      b.suspended -= 1
