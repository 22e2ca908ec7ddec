"""The driver's entry points drop megatron-core's notices a driver user cannot act on, and only those."""
import logging

from h3t_training.launch.quiet_imports import GPT_MODEL_LOGGER, ignore_optional_accelerator_warnings


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_gpt_model_deprecation_notice_is_dropped_and_other_records_kept():
    logger = logging.getLogger(GPT_MODEL_LOGGER)
    sink = _Collect()
    logger.addHandler(sink)
    try:
        ignore_optional_accelerator_warnings()
        ignore_optional_accelerator_warnings()  # idempotent: one filter
        # megatron-core 0.19.2's GPTModel.__init__ text
        logger.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes, no new features. "
                       "Please reference the migration guide `docs/user-guide/hybrid-model-migration.md` for details "
                       "on how to use `HybridModel`")
        logger.warning("vocab size %d is not divisible by %d", 50257, 128)
        assert sink.messages == ["vocab size 50257 is not divisible by 128"]
        assert len(logger.filters) == 1
    finally:
        logger.removeHandler(sink)
