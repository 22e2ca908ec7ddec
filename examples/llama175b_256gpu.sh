#!/usr/bin/env bash
# llama-175b on 256 GPUs; see llama_256gpu.sh for the environment it reads.
MODEL_NAME=llama-175b exec bash "$(dirname "${BASH_SOURCE[0]}")/llama_256gpu.sh" "$@"
