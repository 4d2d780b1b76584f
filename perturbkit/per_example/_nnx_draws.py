"""Whether a replayed NNX call draws from an ``nnx.Rngs`` stream of its module, seen at
the draw itself.

A draw moves the stream's ``RngCount``, but a count that moves is no proof of a
draw: ``nnx.remat`` and ``nnx.scan`` hand every variable of the modules they run
back as a new value, drawn from or not (dropout of a model in ``model.eval()``
draws nothing). So the replay's own copy of each stream is made an instance of a
subclass that notes every draw; a copy of it made inside an NNX transform keeps
the subclass, so a draw inside ``nnx.scan``/``nnx.remat`` is noted as well.
"""
import contextlib
import threading
from typing import Iterator

import jax
from flax import nnx
from flax.nnx import rnglib

_THREAD = threading.local()


class _WatchedRngStream(rnglib.RngStream):
  """An ``nnx.Rngs`` stream that notes each draw in the watches open in its thread."""

  def __call__(self) -> jax.Array:
    for seen in getattr(_THREAD, 'watches', ()):
      seen.append(True)
    return super().__call__()


@contextlib.contextmanager
def watched_draws(module: nnx.Module) -> Iterator[list[bool]]:
  """Notes the draws from ``module``'s own streams made inside the block.

  ``module`` must be the replay's private copy: its streams keep the watching
  class afterwards.

  Yields:
    A list that holds one entry per draw once the block has run.
  """
  for _, node in nnx.iter_graph(module):
    if type(node) is rnglib.RngStream:  # pylint: disable=unidiomatic-typecheck
      object.__setattr__(node, '__class__', _WatchedRngStream)
  seen: list[bool] = []
  watches = getattr(_THREAD, 'watches', None)
  if watches is None:
    watches = _THREAD.watches = []
  watches.append(seen)
  try:
    yield seen
  finally:
    watches.remove(seen)
