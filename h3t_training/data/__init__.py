"""The driver's data: tokenizers, megatron-core datasets and the batch schedule (which samples when)."""
