"""Pretraining driver for CPU runs and megatron-core 0.16.1: flags, model, data, optimizer, loop.

Laid out like Megatron-LM's ``megatron/training`` but under a module path no megatron-core
release ships, so it installs beside a megatron-core (0.17+) that brings its own.
"""
