"""The Linen front end: how Linen calls are found and replayed, over ``perturbkit.core``.

How Linen calls are found: ``_interceptor.py``, the only code that talks to
``nn.intercept_methods``; each selected call gets a stable key in its module's
scope. How a call becomes a point: ``_driver.discover`` runs the loss abstractly
(``jax.eval_shape``) and replays each top-level ``apply`` with the
``'perturbations'`` collection mutable, so Flax itself creates the zero
perturbations, lifted transforms included; the differentiated run then hands
zeros made inside the trace to the loss as that collection, and
``Module.perturb`` adds them. How a segment updates itself in the backward pass:
``_segments.py`` replays a Linen call as the pure function ``(w, x) -> y`` that
``perturbkit.core._segment_vjp`` differentiates, ``_segmentation.py`` records the
calls for the shared choice of segments, and ``_schedule.py`` wires them into
``init``/``step``. Data flows one way: filters -> interceptor -> driver
(activation gradients) -> schedule (interleaved training). The NNX front end
(``perturbkit.nnx``) has the same pieces: ``_calls.py`` swaps each submodule's
class for a cached subclass during the traced call (restored in ``finally``),
and its ``_driver.py``, ``_segmentation.py``, ``_segments.py`` and
``_schedule.py`` are the counterparts of these, over the same core.
"""
