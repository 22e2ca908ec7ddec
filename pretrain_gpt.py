#!/usr/bin/env python3
"""Pretrain a GPT model with megatron-core and h3t-ext, under Megatron-LM's entry name and defaults.

Where Megatron's own ``megatron.training`` is importable (megatron-core 0.17+) and a GPU is
present, the run is Megatron's own ``pretrain()`` with h3t-ext's flags, layer spec and schedules
added through its seams (:mod:`h3t_training.loop.megatron_native`). Otherwise (CPU, megatron-core
0.16.1, or flags only h3t-ext's driver has, such as ``--auto-plan``) it is the driver of
``pretrain_llama.py`` with Megatron-LM's ``pretrain_gpt.py`` defaults (LayerNorm, GeLU MLP, learned
absolute positions, biases, tied embeddings, dropout 0.1, linear LR decay, GPT2BPETokenizer).
Every flag of Megatron-LM's pretrain_gpt.py is implemented, noticed or refused: docs/flags.md.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PROG = "pretrain_gpt.py"
DRIVER_ONLY_FLAGS = ("--auto-plan", "--strict-p2p", "--strict-p2p-comm", "--metrics-json", "--memory-budget", "--gpu")
"""Flags of h3t-ext's own driver that Megatron's loop does not have: given one, the driver runs."""


def use_megatron_loop(argv, *, note: bool = False) -> bool:
    """Megatron's own pretrain() when it is importable and can start (megatron/core/datasets has Megatron-LM's
    Makefile), a GPU is present and no driver-only flag is given; ``note``: say in one line why it does not start
    when only the Makefile is missing (the driver then runs)."""
    from h3t_training.loop import megatron_native

    if not megatron_native.available() or any(a.split("=")[0] in DRIVER_ONLY_FLAGS for a in argv):
        return False
    import torch
    if not torch.cuda.is_available():
        return False
    why = megatron_native.missing_dataset_makefile()
    if why is not None and note:
        sys.stderr.write(f"{PROG}: note: Megatron's own training loop cannot start: {why}; h3t-ext's driver runs\n")
    return why is None


def _check_gpu_slots(launch) -> None:
    """Megatron's own loop puts each rank on the GPU of its local rank: one line (ArgumentError) where the node shows
    fewer GPUs than the launcher starts ranks on it (Megatron-LM would stop in a traceback at set_device)."""
    import torch

    from h3t_training.config.feature_checks import gpu_slots_refusal
    from h3t_training.errors import NodeArgumentError
    refusal = gpu_slots_refusal(launch.ranks_per_node, torch.cuda.device_count())
    if refusal:
        raise NodeArgumentError(refusal)


def main(argv=None) -> int:
    from h3t_training.config.arguments import MEGATRON_GPT_DEFAULTS

    from h3t_training.launch import launch_env

    argv = list(sys.argv[1:] if argv is None else argv)
    # Open MPI's variables (a bare mpirun, as Megatron-Kwai's scripts launch) become torch's for both loops
    launch = launch_env.adopt_or_report(os.environ, PROG)
    if launch is None:
        return 2
    if use_megatron_loop(argv, note=launch.rank == 0):
        from h3t_ext.runtime.config import RuntimeConfigError
        from h3t_training.errors import ArgumentError, node_line, said_by_its_node
        from h3t_training.loop import megatron_native
        try:
            _check_gpu_slots(launch)
            return megatron_native.run(argv, defaults=MEGATRON_GPT_DEFAULTS)
        except (ArgumentError, RuntimeConfigError) as e:
            if launch.rank == 0:  # every rank fails alike, one says so
                sys.stderr.write(f"{PROG}: error: {e}\n")
            elif said_by_its_node(e, launch.rank, launch.local_rank):  # nodes may differ: each node's first says
                sys.stderr.write(f"{PROG}: error: {node_line(str(e), launch.rank)}\n")
            return 2
    from pretrain_llama import main as driver_main
    return driver_main(argv, prog=PROG, defaults=MEGATRON_GPT_DEFAULTS, launch=launch)


if __name__ == "__main__":
    sys.exit(main())
