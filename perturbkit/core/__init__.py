"""The framework-neutral core, shared by the Linen and NNX front ends and the families.

It holds the call records and points bookkeeping, the segment custom VJP, the
choice of segments, the sweep and trainer step, jaxpr analysis and tree helpers;
it imports neither front end nor any family. How a call becomes a point:
``_points.py`` (the zero arrays added to a call's output; each front end finds
the calls). How a segment updates itself in the backward pass:
``_segment_vjp.py``, a ``jax.custom_vjp`` of a pure function ``(w, x) -> y``
whose backward takes ``dw`` at the old weights, ``pmean``-s it, steps, and
differentiates ``x`` at the new weights; the cotangent returned for ``w`` is the
true ``dw``, so one ``jax.grad`` gives every segment's gradient, and the new
weights leave the backward pass as the gradient of a zero carrier input.
``_segment_choice.py`` chooses and checks the segments, with ``_consumers.py``
reading the jaxpr for every equation that takes a segment's params; ``_sweep.py``
holds the optimizer side (groups, guarded steps, the update of ``REST`` after the
sweep, metrics) and knows nothing of Flax. Conv patches for K-FAC and
per-example norms are strided slices of the padded input (``_conv_patches.py``);
the per-example family finds examples mixed by the loss by walking the jaxpr
(``perturbkit/per_example/_mixing.py``).
"""
