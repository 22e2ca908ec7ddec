"""The import-time warnings of megatron-core that an optional accelerator is absent.

megatron-core warns when TransformerEngine or NVIDIA Apex cannot be imported (it falls back to its local or torch
implementations) and about TransformerEngine's ``cuda_graph_scope``; on CPU, and on a GPU without them, each
process would print eight such lines before its first own line. They are optional accelerators (the driver
notes what runs where), so the entry points and the tools that import megatron-core ignore these warnings and
only these."""
from __future__ import annotations

import warnings

OPTIONAL_ACCELERATOR_WARNING = r".*(Transformer Engine|Apex|TransformerEngine|cuda_graph_scope).*"
"""The messages ignored (a regular expression matched against the warning's text)."""


def ignore_optional_accelerator_warnings() -> None:
    warnings.filterwarnings("ignore", message=OPTIONAL_ACCELERATOR_WARNING)


__all__ = ["OPTIONAL_ACCELERATOR_WARNING", "ignore_optional_accelerator_warnings"]
