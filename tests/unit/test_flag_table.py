"""The flag table's promise that no flag is accepted and ignored: an implemented flag that the driver's parser does
not define itself (a table-only flag, parsed as a string) must be read where it acts."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from h3t_training.config.arguments import build_parser
from h3t_training.config.flag_table import TABLE, notice_lines
from h3t_training.config.sections import parse_args
from parse_harness import BASE

PACKAGE = Path(__file__).resolve().parents[2] / "h3t_training"


def _flags_read_with_table_value() -> set[str]:
    read = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                    "table_value", "table_int"):
                read.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                            and a.value.startswith("--"))
    return read


def _table_only(parser) -> dict[str, object]:
    return {f: e for f, e in TABLE.items()
            if parser._option_string_actions[f].dest.startswith("_table_flag_")}  # noqa: SLF001


def test_every_table_only_implemented_flag_is_read_where_it_acts():
    parser = build_parser("pretrain_gpt.py", {})
    implemented = {f for f, e in _table_only(parser).items() if e.cls == "implemented"}
    assert implemented >= {"--manual-gc", "--kaimm-gc-interval", "--empty-unused-memory-level"}
    assert implemented - _flags_read_with_table_value() == set()


def test_an_implemented_flag_gets_no_notice_and_a_noticed_one_gets_its_reason():
    lines = notice_lines([TABLE["--manual-gc"], TABLE["--kaimm-gc-interval"], TABLE["--overlap-sp-ag"]])
    assert lines == [f"note: --overlap-sp-ag: {TABLE['--overlap-sp-ag'].reason.text}"]


def test_megatron_kwai_overlap_p2p_switch_is_the_drivers_default():
    for argv in (BASE, [*BASE, "--overlap-p2p-communication"]):
        assert parse_args(argv, world_size=1).overlap_p2p_comm is True
    assert TABLE["--overlap-p2p-communication"].cls == "implemented"


PARSER_CHECKED_REFUSALS = {"megatron_fsdp"}
"""Table groups whose flags the driver's parser defines and refuses itself where they cannot run (Megatron FSDP on
CPU: ``config/feature_checks``), so the docs' class is the CPU one and the parser's own check enforces it."""


def test_a_flag_the_parser_defines_is_documented_as_what_it_does():
    """The converse of the table-only rule: a flag the driver's own parser defines is read by the driver, so its row
    must not call it noticed (accepted and ignored) or refused (the data-path flags and the hyphenated spellings of
    Megatron-LM's scheduler switches were, while the driver implemented them)."""
    parser = build_parser("pretrain_gpt.py", {})
    own = {f: e for f, e in TABLE.items()
           if not parser._option_string_actions[f].dest.startswith("_table_flag_")}  # noqa: SLF001
    assert {"--train-data-path", "--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"} <= set(own)
    wrong = {f: (e.key, e.cls) for f, e in own.items()
             if e.cls != "implemented" and e.key not in PARSER_CHECKED_REFUSALS}
    assert wrong == {}


def test_both_spellings_of_the_scheduler_switches_set_the_same_field():
    for spelling in ("--override-opt_param-scheduler", "--override-opt-param-scheduler"):
        assert parse_args([*BASE, spelling], world_size=1).override_opt_param_scheduler is True
    for spelling in ("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"):
        assert parse_args([*BASE, spelling], world_size=1).use_checkpoint_opt_param_scheduler is True


def test_moe_and_other_optimizer_settings_are_noticed_while_their_feature_is_off(capsys):
    """Megatron-LM ignores a MoE setting without --num-experts and another optimizer's setting under Adam; the driver
    says so in a notice instead of refusing the script. With --num-experts, or expert parallelism above 1 (which
    Megatron-LM asserts needs experts), they are refused as before."""
    from parse_harness import error_body

    config = parse_args([*BASE, "--expert-model-parallel-size", "1", "--moe-router-topk", "2", "--moe-grouped-gemm",
                         "--sgd-momentum", "0.9", "--muon-momentum", "0.95"], world_size=2)
    noticed = {line.split(":")[1].strip() for line in config.flag_notices}
    assert noticed == {"--expert-model-parallel-size", "--moe-router-topk", "--moe-grouped-gemm", "--sgd-momentum",
                       "--muon-momentum"}
    assert all("same result" in line for line in config.flag_notices)
    body = error_body([*BASE, "--num-experts", "8", "--moe-router-topk", "2"], capsys)
    assert body.startswith("--moe-router-topk, --num-experts are not supported: mixture-of-experts layers")
    assert error_body([*BASE, "--expert-model-parallel-size", "2"], capsys).startswith(
        "--expert-model-parallel-size is not supported")
    assert error_body([*BASE, "--gtp-remat-nccl-ub"], capsys).startswith("--gtp-remat-nccl-ub is not supported")


def test_every_dormant_flag_is_a_refused_row_of_the_table():
    from h3t_training.config.flag_dormancy import DORMANCIES, SAME_AS_DEFAULT

    named = [f for d in DORMANCIES.values() for f in d.flags] + list(SAME_AS_DEFAULT)
    assert [f for f in named if f not in TABLE or TABLE[f].cls != "refused"] == []
    groups = [f for d in DORMANCIES.values() for f in d.flags]
    assert len(groups) == len(set(groups))  # a flag has one reason to be unread


def _noticed(argv) -> set[str]:
    return {line.split(":")[1].strip() for line in parse_args([*BASE, *argv], world_size=2).flag_notices
            if line.startswith("note: --")}


def test_settings_of_a_feature_left_off_are_noticed_and_refused_with_it(capsys):
    """Megatron-LM reads these only while their feature is on (flag_dormancy cites where): a script that carries them
    with the feature off trains the same model, so it is noticed; with the feature on it is refused as before."""
    from parse_harness import error_body

    off = ["--qk-clip-alpha", "0.3", "--mup-width-mult", "2", "--fim-rate", "0.9", "--yarn-beta-fast", "16",
           "--relative-attention-num-buckets", "64", "--apply-wd-to-qk-layernorm",
           "--no-strict-fsdp-dtensor-load", "--sft-tokenizer-prompt-format",
           "x", "--openai-gelu", "--apply-residual-connection-post-layernorm"]
    assert _noticed(off) >= {f for f in off if f.startswith("--")}
    for on, setting in ((["--qk-clip"], ["--qk-clip-alpha", "0.3"]), (["--use-mup"], ["--mup-width-mult", "2"]),
                        (["--fim-data"], ["--fim-rate", "0.9"]),
                        (["--qk-layernorm"], ["--apply-wd-to-qk-layernorm"])):
        body = error_body([*BASE, *on, *setting], capsys)
        assert setting[0] in body.split(" is not supported")[0].split(" are not supported")[0], (on, body)


def test_tokenizer_settings_are_noticed_only_under_tokenizers_that_never_read_them(capsys, tmp_path):
    from parse_harness import error_body

    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--mock-data"]
    assert _noticed([*null, "--trust-remote-code", "--tokenizer-sentencepiece-legacy", "--chat-template", "t",
                     "--tokenizer-metadata", "m.json", "--vocab-extra-ids", "100"]) >= {
        "--trust-remote-code", "--tokenizer-sentencepiece-legacy", "--chat-template", "--tokenizer-metadata",
        "--vocab-extra-ids"}
    # under the driver's own ByteTokenizer (not Megatron-LM's) nothing is said to be ignored by Megatron-LM
    assert error_body([*BASE, "--trust-remote-code"], capsys).startswith("--trust-remote-code is not supported")
    # SentencePieceTokenizer with sentinel tokens adds ids in Megatron-LM 0.16: refused
    model = tmp_path / "sp.model"
    model.write_bytes(b"")
    assert error_body([*BASE, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(model),
                       "--vocab-extra-ids", "100"], capsys).startswith("--vocab-extra-ids is not supported")


def test_refused_flags_given_megatron_lms_default_are_noticed(capsys):
    from parse_harness import error_body

    given = ["--softmax-type", "vanilla", "--rope-type", "rope", "--vocab-extra-ids", "0", "--mup-output-mult", "1"]
    assert _noticed(given) == {"--softmax-type", "--rope-type", "--vocab-extra-ids", "--mup-output-mult"}
    for flag, other in (("--softmax-type", "off-by-one"), ("--rope-type", "yarn"), ("--mup-output-mult", "0.5")):
        assert error_body([*BASE, flag, other], capsys).startswith(f"{flag} is not supported")


def test_xavier_init_is_refused_as_megatron_lm_fails_on_it():
    """--init-method-xavier-uniform's group states that Megatron-LM cannot run it: its config builder passes
    scaled_init_method, which the installed megatron-core's TransformerConfig refuses. A release that accepts it
    fails this test, and the flag is then to be implemented."""
    import dataclasses

    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert TABLE["--init-method-xavier-uniform"].key == "megatron_fails"
    assert TABLE["--init-method-xavier-uniform"].cls == "refused"
    assert "scaled_init_method" not in {f.name for f in dataclasses.fields(TransformerConfig)}
    with pytest.raises(TypeError, match="scaled_init_method"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                          init_method=torch.nn.init.xavier_uniform_, scaled_init_method=torch.nn.init.xavier_uniform_)
