"""Megatron-LM's own GPT CI recipes (``tests/data/megatron_ci_recipes.json``) as command lines, shrunk.

:func:`command_line` turns a recipe's MODEL_ARGS into the arguments Megatron-LM's launcher
(``tests/functional_tests/shell_test_utils/_run_training.sh`` at the pinned commit) passes to pretrain_gpt.py:
``${VARS}`` filled as its ``envsubst`` does (a variable the environment does not set is left as written and the
shell's ``eval`` then expands it to nothing), a ``true`` value is the bare flag, a ``[a b]`` value is the
words inside the brackets, a value with a space, ``|``, ``(`` or ``)`` is one argument, any other value is
word-split as ``eval`` does. :func:`shrink` then changes only model size, iterations, batch sizes, paths and
the data-parallel size; everything else (backend, precision, layout, features) is the recipe's own.
"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "megatron_ci_recipes.json"


def load() -> dict:
    with open(DATA) as f:
        return json.load(f)


def _envsubst(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), m.group(0)), value)


def command_line(pairs: list[list[str]], env: dict[str, str]) -> list[str]:
    """The argument list Megatron's launcher builds from MODEL_ARGS ``pairs`` with ``env`` as its environment."""
    out: list[str] = []
    for key, value in pairs:
        value = _envsubst(value, env).strip()
        if value == "":
            continue  # yq's select(.value != "") drops the key
        if value == "true":
            out.append(key)
        elif re.fullmatch(r"\([^)]+\)", value):
            out += [key, value]
        elif re.fullmatch(r"\[[^]]+\]", value):
            out += [key, *shlex.split(value[1:-1])]
        elif any(c in value for c in " |()"):
            out += [key, value]
        else:
            # eval word-splits; a $VAR the environment left unset expands to nothing
            words = [w for w in shlex.split(value) if not re.fullmatch(r"\$\{?\w+\}?", w)]
            out += [key, *words]
    return out


@dataclass(frozen=True)
class Paths:
    """What the test supplies in place of Megatron's CI storage: the corpus, tokenizer files and tmp dirs."""
    corpus_prefix: str
    vocab_file: str
    merge_file: str
    sentencepiece_model: str
    save: str
    load: str
    tensorboard: str
    data_cache: str


LAYERS_MAX = 16
"""Recipes of more layers run with a quarter of them (32 -> 8), keeping the layers per virtual stage in the same
ratio; those of 16 or fewer keep their own count (and so their pipeline split, even or uneven)."""
SIZES = {"--hidden-size": "64", "--num-attention-heads": "8", "--num-query-groups": "4", "--kv-channels": "8",
         "--ffn-hidden-size": "128", "--seq-length": "64", "--max-position-embeddings": "64",
         "--q-lora-rank": "32", "--kv-lora-rank": "16", "--qk-head-dim": "8", "--qk-pos-emb-head-dim": "8",
         "--v-head-dim": "8", "--dsa-indexer-n-heads": "4", "--dsa-indexer-head-dim": "8",
         "--dsa-indexer-topk": "16", "--vocab-size": "512", "--micro-batch-size": "1", "--eval-iters": "1"}
"""The shrunk model: hidden 64, 8 heads of 8 (2 per rank at t=4), 4 query groups, FFN 128, sequence 64 (8 per
rank at c=4 with the 2c chunks context parallelism splits it into), MLA/DSA sizes to match, a NullTokenizer
vocabulary of 512 (the byte-level corpus uses 257 ids); one sample per micro-batch and one evaluation step."""


def _int(args: dict[str, str], key: str, default: int = 1) -> int:
    return int(args.get(key, default))


def layout(pairs: list[list[str]]) -> tuple[int, int, int]:
    """(tensor, pipeline, context) parallel sizes of a recipe."""
    a = dict(pairs)
    return (_int(a, "--tensor-model-parallel-size"), _int(a, "--pipeline-model-parallel-size"),
            _int(a, "--context-parallel-size"))


def data_parallel_size(pairs: list[list[str]]) -> int:
    """2 where the recipe's own t*p*c is 1 or it asks for 2 distributed-optimizer instances (a run of one rank
    tests no data parallelism; 2 instances need d divisible by 2), otherwise 1."""
    a = dict(pairs)
    t, p, c = layout(pairs)
    return 2 if t * p * c == 1 or _int(a, "--num-distributed-optimizer-instances") > 1 else 1


def world_size(pairs: list[list[str]]) -> int:
    t, p, c = layout(pairs)
    return t * p * c * data_parallel_size(pairs)


def shrink(pairs: list[list[str]], paths: Paths, iters: int, save_interval: int | None = None) -> list[list[str]]:
    """The recipe's MODEL_ARGS with model size, run length, batch sizes and paths changed and W&B logging left out
    (:data:`WANDB_PREFIX`), as pairs, so that :func:`command_line` builds the command line from them as Megatron's
    launcher does."""
    a = dict(pairs)
    _, p, _ = layout(pairs)
    d = data_parallel_size(pairs)
    # one sample per micro-batch, as many micro-batches as stages (at least 2) and as the recipe's microbatch group
    # (--microbatch-group-size-per-virtual-pipeline-stage g needs g <= microbatches: one whole group)
    gbs = d * max(p, 2, _int(a, "--microbatch-group-size-per-virtual-pipeline-stage", 0))
    new: dict[str, str] = {k: v for k, v in SIZES.items() if k in a}
    t = layout(pairs)[0]
    if "--num-query-groups" in a:  # a multiple of t (t=8 in the release recipes) that divides the 8 heads
        new["--num-query-groups"] = str(max(int(SIZES["--num-query-groups"]), t))
    layers = _int(a, "--num-layers")
    if layers > LAYERS_MAX:
        new["--num-layers"] = str(layers // 4)
        v = a.get("--num-layers-per-virtual-pipeline-stage")
        if v is not None:
            if int(v) % 4:
                new["--num-layers"] = str(layers)  # the virtual layout of 1 layer per stage needs all of them
            else:
                new["--num-layers-per-virtual-pipeline-stage"] = str(int(v) // 4)
    if "--global-batch-size" in a:
        new["--global-batch-size"] = str(gbs)
    if "--step-batch-size-schedule" in a:
        new["--step-batch-size-schedule"] = f"0:{gbs}"
    if "--train-iters" in a or "--train-samples" not in a:
        new["--train-iters"] = str(iters)
    else:
        samples = iters * gbs
        new["--train-samples"] = str(samples)
        for k in ("--lr-decay-samples", "--lr-warmup-samples"):
            if k in a:
                new[k] = str(samples if k == "--lr-decay-samples" else min(int(a[k]), gbs))
    new["--exit-interval"] = str(iters)  # Megatron's run_ci_test.sh sets it to --train-iters
    if save_interval is not None:
        new["--save-interval"] = str(save_interval)
    files = {"--data-path": paths.corpus_prefix, "--vocab-file": paths.vocab_file, "--merge-file": paths.merge_file,
             "--save": paths.save, "--load": paths.load, "--tensorboard-dir": paths.tensorboard,
             "--data-cache-path": paths.data_cache}
    if a.get("--tokenizer-type") in ("GPTSentencePieceTokenizer", "SentencePieceTokenizer", "Llama2Tokenizer"):
        files["--tokenizer-model"] = paths.sentencepiece_model
    new.update({k: v for k, v in files.items() if k in a})
    out = [[k, new.pop(k, v)] for k, v in pairs if not k.startswith(WANDB_PREFIX)]
    out += [[k, v] for k, v in new.items()]
    return out


WANDB_PREFIX = "--wandb-"
"""The release recipes log to Weights & Biases: an external service and a package (``wandb``) these tests do not
have; the driver refuses --wandb-project without the package in one line. :func:`shrink` leaves those flags out, as
it changes paths; the W&B writer has its own tests through a stand-in module (``tests/unit/test_loggers.py``)."""


@dataclass(frozen=True)
class Launch:
    """One torchrun launch of pretrain_gpt.py: torchrun's exit status and report, and each rank's output."""
    returncode: int
    report: str  # torchrun's own stderr (its failure summary)
    rank_stdout: tuple[str, ...]
    rank_stderr: tuple[str, ...]


def launch(argv: list[str], nproc: int, log_dir: Path, timeout_s: int = 300) -> Launch:
    """``torchrun --nproc-per-node nproc --log-dir log_dir --redirects 3 pretrain_gpt.py argv`` as Megatron's CI
    launches its recipes (each rank's stdout and stderr in its own file, apart from torchrun's report)."""
    import subprocess

    from driver_harness import PYTHON, REPO, _env
    from h3t_ext.testing import free_port

    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "--log-dir", str(log_dir), "--redirects", "3",
           str(REPO / "pretrain_gpt.py"), *argv]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout_s)
    attempts = sorted(log_dir.glob("*/attempt_*"))
    assert len(attempts) == 1, attempts
    read = [((attempts[0] / str(r) / "stdout.log").read_text(), (attempts[0] / str(r) / "stderr.log").read_text())
            for r in range(nproc)]
    return Launch(proc.returncode, proc.stderr, tuple(o for o, _ in read), tuple(e for _, e in read))
