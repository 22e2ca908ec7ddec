#!/usr/bin/env python3
"""Dump everything ``search(...)`` returns for five fixed cases (one a mixture-of-experts model), to check that a speed change alters no result.

Each case is parsed by ``h3t-plan search``'s own parser (so ``--precision auto`` and the memory ladder are the CLI's)
and searched twice, best-first with the CLI's ``--top 10`` and, for the three small cases, ranking every feasible plan
(``top=None``). Written per plan: the full ``repr`` of the plan and of its estimate (every memory and time term, the
timeline's totals, plausibility), its Megatron flags and whether it ties with the best; per search: the plans priced,
the rejection counts, the closest infeasible plan, the tie and plausibility lines. Compare two dumps with ``diff``:

    python scripts/planner_search_digest.py > before.txt    # on the commit before the change
    python scripts/planner_search_digest.py > after.txt
    diff before.txt after.txt && echo identical
"""
from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from h3t_ext.planner import format as fmt  # noqa: E402
from h3t_ext.planner.args import build_parser  # noqa: E402
from h3t_ext.planner.from_args import constraints_from_args, model_from_args, system_from_args  # noqa: E402
from h3t_ext.planner.search import search  # noqa: E402

CASES: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("llama-175b on 4096 h800 (bench_planner)", ("--model", "llama-175b", "--num-gpus", "4096", "--seq-length", "4096",
                                                 "--global-batch-size", "2048", "--gpu", "h800", "--precision", "auto"),
     False),
    ("gpt3-175b on 64 a100-40g", ("--model", "gpt3-175b", "--num-gpus", "64", "--seq-length", "2048",
                                  "--global-batch-size", "512", "--gpu", "a100-40g"), True),
    ("llama2-70b on 256 h800", ("--model", "llama2-70b", "--num-gpus", "256", "--seq-length", "4096",
                                "--global-batch-size", "1024", "--gpu", "h800", "--precision", "auto"),
     False),
    ("llama-7b on 8 h100-sxm", ("--model", "llama-7b", "--num-gpus", "8", "--seq-length", "2048",
                               "--global-batch-size", "128", "--gpu", "h100-sxm", "--precision", "auto"),
     True),
    ("mixtral-8x7b, every other layer MoE, on 64 h100-sxm", (
        "--model", "mixtral-8x7b", "--moe-layer-freq", "2", "--num-gpus", "64", "--seq-length", "4096",
        "--global-batch-size", "256", "--gpu", "h100-sxm"), True),
)
"""(title, h3t-plan search arguments, also rank every feasible plan)."""


def _dump(title: str, argv: tuple[str, ...], top) -> None:
    ns = build_parser().parse_args(["search", *argv])
    model, system = model_from_args(ns), system_from_args(ns)
    result = search(model, system, num_gpus=ns.num_gpus, seq_length=ns.seq_length,
                    global_batch_size=ns.global_batch_size, constraints=constraints_from_args(ns),
                    alpha_mode=ns.offload_alpha, memory_budget_bytes=ns.memory_budget, exhaustive=ns.exhaustive,
                    top=top, host_memory_budget_bytes=ns.host_memory_budget)
    print(f"=== {title}: top={top}")
    print(f"considered {result.considered}, feasible {len(result.plans)}")
    for reason, n in sorted(result.rejected.items()):
        print(f"rejected {n:7d} {reason}")
    print(f"closest infeasible: {result.closest_infeasible!r}")
    print(fmt.tie_line(result))
    print(fmt.plausibility_line(result, top or len(result.plans)))
    tied = set(result.tied_with_best())
    for i, r in enumerate(result.plans):
        print(f"--- #{i + 1} tokens/s {r.tokens_per_second!r} peak {r.evaluation.estimate.peak_memory_bytes} "
              f"tied {i in tied}")
        print("flags " + " ".join(r.megatron_flags))
        print(f"evaluation {r.evaluation!r}")


def main() -> int:
    for title, argv, every in CASES:
        _dump(title, argv, 10)
        if every:
            _dump(title, argv, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
