#!/usr/bin/env python3
"""Pretrain a Llama model with megatron-core and h3t-ext (``--ckpt``, ``--offload-alpha``, ``--auto-plan``).

Megatron-LM's flag names; see ``python pretrain_llama.py --help`` and examples/.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # h3t_training and h3t_ext of this repo
from h3t_training.launch.quiet_imports import ignore_optional_accelerator_warnings  # noqa: E402

ignore_optional_accelerator_warnings()
PROG = "pretrain_llama.py"


def main(argv=None, prog: str = PROG, defaults=None, launch=None) -> int:
    """Parse (Llama defaults for pretrain_llama.py, Megatron-LM's for pretrain_gpt.py) and train; a failure or
    Ctrl-C ends in one line (h3t_training.launch.failures). ``launch``: the launcher's environment when the caller
    (``pretrain_gpt.py``) has read it already."""
    from h3t_training.launch import launch_env
    from h3t_training.launch.failures import run_reported
    from h3t_training.launch.run_guard import die_with_launcher
    die_with_launcher()  # under torchrun/mpirun/srun: no orphan outlives a killed launcher
    # the launcher's (torch's variables, or Open MPI's under a bare mpirun); the library reads no environment
    launch = launch or launch_env.adopt_or_report(os.environ, prog)
    if launch is None:
        return 2
    rank, world_size = launch.rank, launch.world_size

    def run(progress) -> int:
        from h3t_training.config.sections import parse_args
        from h3t_training.loop.saved_args import read_saved_args
        progress.args = parse_args(argv, prog=prog, defaults=defaults, world_size=world_size, rank=rank,
                                   ranks_per_node=launch.ranks_per_node, local_rank=launch.local_rank,
                                   read_checkpoint_args=read_saved_args)  # bad flag: exit 2, said by rank 0
        from h3t_training.loop.training import pretrain
        return pretrain(progress.args, rank=rank, progress=progress,
                        progress_bar=launch.watched_terminal(sys.stdout))

    return run_reported(run, prog=prog, rank=rank)


if __name__ == "__main__":
    sys.exit(main())
