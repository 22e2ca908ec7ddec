"""Pretraining driver (Megatron-LM's ``megatron/training`` layout): flags, model, data, optimizer, loop."""
