"""Make torchvision importable where its compiled operators cannot load (a CUDA wheel on a CPU torch).

timm imports torchvision, and transformers imports it when installed. The only torchvision wheel for
torch 2.13 on PyPI is a CUDA build: its ``_C.so`` needs ``libtorch_cuda.so``, which a CPU torch lacks.
torchvision then skips its operators, as designed, but two of its fake-kernel registrations
(``nms``, ``qnms``) run unguarded and fail with "operator torchvision::nms does not exist".

``ensure_importable()`` loads the operators the way torchvision does; only where that fails does it
declare the schemas of those two operators, so the registrations succeed. The operators stay without
a kernel: calling them raises, and nothing tandem's models or timm's classifiers run needs them.
No installed file is changed.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

log = logging.getLogger("tandem")

# the unguarded registrations of torchvision/_meta_registrations.py, with torchvision's own schemas
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_library: torch.library.Library | None = None  # kept alive: dropping it would unregister the schemas


def ensure_importable() -> bool:
    """Returns True when torchvision is installed (with or without its compiled operators)."""
    global _library
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    if _library is not None or _has_operator("nms"):
        return True
    extension = os.path.join(os.path.dirname(spec.origin), "_C.so")
    try:
        torch.ops.load_library(extension)
        return True
    except (OSError, RuntimeError) as error:
        log.debug("torchvision's operators do not load here (%s); declaring their schemas", error)
    _library = torch.library.Library("torchvision", "DEF")  # noqa: PLW0603
    for name, schema in _SCHEMAS.items():
        if not _has_operator(name):
            _library.define(schema)
    return True


def _has_operator(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
        return True
    except RuntimeError:
        return False
