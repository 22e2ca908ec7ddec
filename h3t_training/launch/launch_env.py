"""Who this process is in the job: its rank, the world size and the rendezvous address, from its launcher.

torch.distributed's ``env://`` convention (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) is what torchrun, ``scripts/launch_mpirun.sh`` and ``scripts/launch_slurm.sbatch``
set, and what megatron-core's and Megatron-LM's own initialisation read. Open MPI's ``mpirun`` starting
``python pretrain_gpt.py`` directly (Megatron-Kwai's ATC '24 scripts do, passing only
``-x MASTER_ADDR -x MASTER_PORT``) sets its own variables instead, ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,
LOCAL_SIZE}``, which Megatron-Kwai's ``arguments.py`` reads. :func:`from_environ` reads either, once, in the entry
point; :func:`torch_variables` is what the entry point exports so that every later reader (the process group,
Megatron's own loop) sees torch's names. Nothing below the entry points reads the launcher's variables.

Slurm's ``SLURM_PROCID`` is not read: a batch script's own shell has it too, and a plain ``python`` there must stay
one rank (``scripts/launch_slurm.sbatch`` maps it per task).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Mapping, MutableMapping, Optional

from h3t_training.errors import ArgumentError

OPEN_MPI = "OMPI_COMM_WORLD_SIZE"
"""Set by Open MPI's mpirun in every process it starts."""


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job as its launcher gave it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "none"
    """``torch`` (torch's variables were set: torchrun, this project's wrappers), ``openmpi`` or ``none``."""
    master_addr: Optional[str] = None
    master_port: Optional[int] = None

    def watched_terminal(self, stdout) -> bool:
        """Whether ``stdout`` is a terminal a person watches (where a progress bar belongs): a tty, except under
        Open MPI, whose mpirun hands every rank a pty of its own and forwards it to mpirun's stdout, which
        scripts (Megatron-Kwai's) tee into their logs; Megatron-LM draws no bar at all."""
        return self.launcher != "openmpi" and stdout.isatty()

    @property
    def ranks_per_node(self) -> int:
        """The ranks the launcher starts on this process's node: its local world size, or ``local_rank + 1`` where
        a launcher set a local rank beyond it (one that sets no local world size)."""
        return max(self.local_world_size, self.local_rank + 1)


def _int(environ: Mapping[str, str], name: str, default: Optional[int], low: int) -> int:
    raw = environ.get(name)
    if raw is None:
        if default is None:
            raise ArgumentError(f"the launcher set no {name}")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ArgumentError(f"{name}={raw!r} from the launcher is not an integer") from None
    if value < low:
        raise ArgumentError(f"{name}={value} from the launcher is below {low}")
    return value


def from_environ(environ: Mapping[str, str]) -> LaunchEnv:
    """The launch of this process: torch's variables when ``RANK`` is set, else Open MPI's, else one rank.

    Raises :class:`~h3t_training.errors.ArgumentError` (one line) on a malformed variable, a rank outside the
    world, or several Open MPI ranks without the rendezvous address (``-x MASTER_ADDR=... -x MASTER_PORT=...``)."""
    if "RANK" in environ:
        names, launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"), "torch"
    elif OPEN_MPI in environ:
        names, launcher = (("OMPI_COMM_WORLD_RANK", OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_RANK",
                            "OMPI_COMM_WORLD_LOCAL_SIZE"), "openmpi")
    else:
        return LaunchEnv(master_addr=environ.get("MASTER_ADDR"),
                         master_port=_int(environ, "MASTER_PORT", 0, 0) or None)
    rank = _int(environ, names[0], None, 0)
    world = _int(environ, names[1], 1, 1)
    local_rank = _int(environ, names[2], 0, 0)
    local_world = _int(environ, names[3], 1, 1)
    if rank >= world:
        raise ArgumentError(f"{names[0]}={rank} from the launcher is outside its world of {world} ({names[1]})")
    addr, port = environ.get("MASTER_ADDR"), _int(environ, "MASTER_PORT", 0, 0) or None
    if launcher == "openmpi" and world > 1 and (addr is None or port is None):
        raise ArgumentError(f"mpirun started {world} ranks without the rendezvous address: pass "
                            "-x MASTER_ADDR=<first host> -x MASTER_PORT=<free port> to mpirun "
                            "(or launch with scripts/launch_mpirun.sh)")
    return LaunchEnv(rank, world, local_rank, local_world, launcher, addr, port)


def torch_variables(env: LaunchEnv) -> dict[str, str]:
    """torch's ``env://`` variables for ``env`` (empty for a single process started without a launcher)."""
    if env.launcher == "none":
        return {}
    out = {"RANK": str(env.rank), "WORLD_SIZE": str(env.world_size), "LOCAL_RANK": str(env.local_rank),
           "LOCAL_WORLD_SIZE": str(env.local_world_size)}
    if env.master_addr is not None:
        out["MASTER_ADDR"] = env.master_addr
    if env.master_port is not None:
        out["MASTER_PORT"] = str(env.master_port)
    return out


def adopt(environ: MutableMapping[str, str]) -> LaunchEnv:
    """:func:`from_environ`, with torch's variables written into ``environ`` (the entry points pass
    ``os.environ``: the one place a launcher's own names become torch's)."""
    env = from_environ(environ)
    environ.update(torch_variables(env))
    return env


def adopt_or_report(environ: MutableMapping[str, str], prog: str) -> Optional[LaunchEnv]:
    """:func:`adopt` for an entry point: None after writing ``prog: error: ...`` (one line) when the launch is bad."""
    try:
        return adopt(environ)
    except ArgumentError as e:
        sys.stderr.write(f"{prog}: error: {e}\n")
        return None


__all__ = ["LaunchEnv", "OPEN_MPI", "adopt", "adopt_or_report", "from_environ", "torch_variables"]
