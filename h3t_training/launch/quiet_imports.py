"""The import-time warnings of megatron-core that an optional accelerator is absent.

megatron-core warns when TransformerEngine or NVIDIA Apex cannot be imported (it falls back to its local or torch
implementations) and about TransformerEngine's ``cuda_graph_scope``; on CPU, and on a GPU without them, each
process would print eight such lines before its first own line. They are optional accelerators (the driver
notes what runs where), so the entry points and the tools that import megatron-core ignore these warnings and
only these.

megatron-core 0.19 also logs, from every ``GPTModel`` it builds, that GPTModel is deprecated in favour of its
HybridModel. The driver builds GPTModel on purpose (its layer specs are GPTModel's, and 0.16-0.18 have no
HybridModel), so the notice is one a user of the driver cannot act on; it is dropped by a filter on that logger
(:func:`ignore_optional_accelerator_warnings` installs it), and every other record of that logger is kept.

:class:`DropMessages` is the one filter of such notices: this module's, the dataset builder's (``data/datasets.py``)
and torchrun's signal notices (``launch/torchrun.py``)."""
from __future__ import annotations

import logging
import warnings

OPTIONAL_ACCELERATOR_WARNING = r".*(Transformer Engine|Apex|TransformerEngine|cuda_graph_scope).*"
"""The messages ignored (a regular expression matched against the warning's text)."""


GPT_MODEL_LOGGER = "megatron.core.models.gpt.gpt_model"
GPT_MODEL_DEPRECATION = "GPTModel IS DEPRECATED"
"""The start of megatron-core 0.19's notice (``GPTModel.__init__``'s ``log_single_rank`` warning)."""


class DropMessages(logging.Filter):
    """A logger's records whose message contains any of ``parts`` are dropped; every other record is kept."""

    def __init__(self, *parts: str):
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.parts)


_GPT_MODEL_FILTER = DropMessages(GPT_MODEL_DEPRECATION)


def ignore_optional_accelerator_warnings() -> None:
    """Ignore the optional accelerators' import warnings and 0.19's GPTModel deprecation notice (idempotent)."""
    warnings.filterwarnings("ignore", message=OPTIONAL_ACCELERATOR_WARNING)
    logging.getLogger(GPT_MODEL_LOGGER).addFilter(_GPT_MODEL_FILTER)  # a logger holds a filter once


__all__ = ["DropMessages", "GPT_MODEL_DEPRECATION", "GPT_MODEL_LOGGER", "OPTIONAL_ACCELERATOR_WARNING",
           "ignore_optional_accelerator_warnings"]
