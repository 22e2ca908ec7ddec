"""The driver's training: model, optimizer (with offload and FSDP), checkpoints, the training and
evaluation loops, and Megatron's own loop (``megatron_native``)."""
