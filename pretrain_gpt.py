#!/usr/bin/env python3
"""Pretrain a GPT model with megatron-core and h3t-ext, under Megatron-LM's entry name and defaults.

The same driver as ``pretrain_llama.py``; the defaults are Megatron-LM's ``pretrain_gpt.py`` ones
(LayerNorm, GeLU MLP, learned absolute positions, biases, tied embeddings, dropout 0.1, linear LR
decay, GPT2BPETokenizer). Every flag of Megatron-LM's pretrain_gpt.py is implemented, noticed or refused: docs/flags.md.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from h3t_training.arguments import MEGATRON_GPT_DEFAULTS  # noqa: E402
from pretrain_llama import main  # noqa: E402

PROG = "pretrain_gpt.py"

if __name__ == "__main__":
    sys.exit(main(prog=PROG, defaults=MEGATRON_GPT_DEFAULTS))
