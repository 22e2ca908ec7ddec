"""--calculate-per-token-loss: the gradients of the token-weighted mean loss over the global batch (megatron-core's
finalize_model_grads divides the summed gradients by the batch's loss tokens), where Megatron's default weighs each
microbatch's mean loss alike. The microbatches here hold different numbers of loss tokens (short documents, their
end-of-document tokens masked by --eod-mask-loss), so the two weightings train apart; with it, data parallelism
and pipeline parallelism give the single rank's losses and gradient norms (within 1e-5 relative), each from the
same start checkpoint."""
from __future__ import annotations

import json
import subprocess

import pytest

from driver_harness import PYTHON, REPO, TIMEOUT_S, TINY_MODEL, _env, check_ok, metrics, run_pretrain, \
    single_rank_reference


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> str:
    """The project's stdlib corpus cut into documents of 1 to 13 bytes: a 64-token sample holds about ten
    end-of-document tokens, a different number in each."""
    d = tmp_path_factory.mktemp("short_docs")
    subprocess.run([PYTHON, str(REPO / "tools/make_stdlib_corpus.py"), "--output", str(d / "stdlib.jsonl"),
                    "--min-bytes", "40000"], check=True, cwd=REPO, env=_env(), capture_output=True, timeout=TIMEOUT_S)
    text = " ".join(json.loads(line)["text"] for line in (d / "stdlib.jsonl").read_text().splitlines())
    docs, at, n = [], 0, 0
    while at < len(text):
        size = 1 + (n * 7) % 13
        docs.append(json.dumps({"text": text[at:at + size]}))
        at, n = at + size, n + 1
    (d / "short.jsonl").write_text("\n".join(docs) + "\n")
    subprocess.run([PYTHON, str(REPO / "tools/preprocess_data.py"), "--input", str(d / "short.jsonl"),
                    "--output-prefix", str(d / "short"), "--append-eod"], check=True, cwd=REPO, env=_env(),
                   capture_output=True, timeout=TIMEOUT_S)
    return str(d / "short_text_document")


def _argv(prefix: str, *extra: str) -> list[str]:
    return [*TINY_MODEL, "--data-path", prefix, "--eod-mask-loss", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--train-iters", "3", *extra]


def _losses_and_norms(m: dict) -> list[float]:
    its = m["iterations"]
    return [r["loss"] for r in its] + [r["grad_norm"] for r in its]


@pytest.fixture(scope="module")
def reference(short_documents, tmp_path_factory):
    return single_rank_reference(tmp_path_factory.mktemp("per_token_ref"),
                                 _argv(short_documents, "--calculate-per-token-loss"))


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "1"], ["--pipeline-model-parallel-size", "2"]],
                         ids=["d2", "p2"])
def test_two_ranks_match_one(reference, short_documents, tmp_path, layout):
    ckpt, ref = reference
    out = tmp_path / "m.json"
    check_ok(run_pretrain([*_argv(short_documents, "--calculate-per-token-loss"), *layout, "--load", str(ckpt),
                           "--metrics-json", str(out)], nproc=2))
    assert _losses_and_norms(metrics(out)) == pytest.approx(_losses_and_norms(ref), rel=1e-5, abs=0)


def test_the_token_weighting_is_the_one_trained(reference, short_documents, tmp_path):
    ckpt, ref = reference
    out = tmp_path / "mean.json"
    check_ok(run_pretrain([*_argv(short_documents), "--load", str(ckpt), "--metrics-json", str(out)]))
    mean = metrics(out)["iterations"]
    assert mean[0]["loss"] == pytest.approx(ref["iterations"][0]["loss"], rel=1e-6)  # same weights, same report
    assert mean[0]["grad_norm"] != pytest.approx(ref["iterations"][0]["grad_norm"], rel=1e-4)  # another gradient
