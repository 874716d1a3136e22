"""Backends: how one planned segment becomes code the engine runs.

- ``aten`` (``tandem.backends.aten``): straight-line Python over aten calls, exact to eager.
- ``inductor`` (``tandem.backends.inductor``): the segment as one graph compiled by PyTorch's
  inductor, so pointwise ops (and the values the mirror pass recomputes) fuse into kernels.

Both give a segment function ``function(slots) -> None`` that reads its inputs from the step's
value slots and writes its outputs back, so the executor, the engine and the gradient hooks do
not know which backend made it.

``tandem.backends.bernoulli`` registers ``tandem::bernoulli``, the op both run for dropout's draw
on the CPU: eager's numbers, vectorised (the dropout pass emits it).
"""

from __future__ import annotations

BACKENDS = ("aten", "inductor")
