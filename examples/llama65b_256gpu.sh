#!/usr/bin/env bash
# llama-65b on 256 GPUs; see llama_256gpu.sh for the environment it reads.
MODEL_NAME=llama-65b exec bash "$(dirname "${BASH_SOURCE[0]}")/llama_256gpu.sh" "$@"
