#!/usr/bin/env python3
"""Pretrain a Llama model with megatron-core and h3t-ext (``--ckpt``, ``--offload-alpha``, ``--auto-plan``).

Megatron-LM's flag names; see ``python pretrain_llama.py --help`` and examples/.
"""
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # h3t_training and h3t_ext of this repo
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|TransformerEngine|cuda_graph_scope).*")
PROG = "pretrain_llama.py"


def main(argv=None, prog: str = PROG, defaults=None) -> int:
    """Parse (Llama defaults for pretrain_llama.py, Megatron-LM's for pretrain_gpt.py) and train."""
    from h3t_training.run_guard import die_with_launcher
    die_with_launcher()  # under torchrun/mpirun/srun: no orphan outlives a killed launcher
    from h3t_training.config import parse_args
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # the launcher's; the library reads no environment
    args = parse_args(argv, prog=prog, defaults=defaults, world_size=world_size)  # one-line error, exit 2

    from h3t_ext.runtime.config import RuntimeConfigError
    from h3t_training.checkpointing import CheckpointError
    from h3t_training.optimizer import NonFiniteError
    from h3t_training.run_guard import RunLockError
    from h3t_training.training import pretrain
    try:
        return pretrain(args, rank=int(os.environ.get("RANK", "0")))
    except NonFiniteError as e:  # raised on every rank alike: said once
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{prog}: error: {e}\n")
        return 2
    except (CheckpointError, RuntimeConfigError, RunLockError) as e:
        sys.stderr.write(f"{prog}: error: {e}\n")
        return 2
    except RuntimeError as e:  # a collective or transfer that failed: a peer died, or a wait timed out
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not any(k in first for k in ("Connection closed by peer", "Connection reset by peer", "Timed out",
                                         "timed out", "Broken pipe")):
            raise
        sys.stderr.write(f"{prog}: error: rank {os.environ.get('RANK', '0')}: a distributed operation failed: "
                         f"{first}\n")
        return 3


if __name__ == "__main__":
    sys.exit(main())
