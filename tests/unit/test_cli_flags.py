"""One definition of Megatron's layout, recompute and activation-offload flags (h3t_ext/planner/cli_flags.py) for
``h3t-plan`` and the training driver: both command lines take each shared flag with the same destination,
choices, arity and help, and differ only where they must (the type that parses a count, the default sizes, and
the members ``h3t-plan search`` leaves to the search: the uneven split, full recompute's method and Megatron's
offload request, which fixes the alpha the search chooses)."""
from __future__ import annotations

import argparse

from h3t_ext.planner.args import build_parser as planner_parser
from h3t_training.config.arguments import build_parser as driver_parser

SHARED = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
          "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
          "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
          "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
          "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-modules",
          "--fine-grained-activation-offloading", "--offload-modules", "--activation-offload-fraction",
          "--min-offloaded-tensor-size", "--delta-offload-bytes-across-pp-ranks", "--cpu-offloading-num-layers")
SEARCH_LEAVES_OUT = {"--num-virtual-stages-per-pipeline-rank", "--decoder-first-pipeline-num-layers",
                     "--decoder-last-pipeline-num-layers", "--account-for-embedding-in-pipeline-split",
                     "--account-for-loss-in-pipeline-split", "--recompute-method", "--recompute-num-layers",
                     "--recompute-modules", "--fine-grained-activation-offloading", "--offload-modules",
                     "--activation-offload-fraction", "--min-offloaded-tensor-size",
                     "--delta-offload-bytes-across-pp-ranks", "--cpu-offloading-num-layers"}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _shape(action: argparse.Action) -> tuple:
    return action.dest, action.choices, action.nargs, action.help, action.metavar, type(action).__name__


def test_shared_flags_are_one_definition_in_both_command_lines():
    driver = driver_parser()._option_string_actions
    subs = _subparsers(planner_parser())
    estimate, search = subs["estimate"]._option_string_actions, subs["search"]._option_string_actions
    for flag in SHARED:
        assert _shape(estimate[flag]) == _shape(driver[flag]), flag
        assert driver[flag].help, flag
        if flag in SEARCH_LEAVES_OUT:
            assert flag not in search, flag
        else:
            assert _shape(search[flag]) == _shape(driver[flag]), flag


def test_what_differs_is_the_count_type_and_the_default_sizes():
    driver = driver_parser()._option_string_actions
    subs = _subparsers(planner_parser())
    estimate, search = subs["estimate"]._option_string_actions, subs["search"]._option_string_actions
    t = "--tensor-model-parallel-size"
    assert driver[t].type is int and driver[t].default is None  # checked after Megatron's aliases resolve
    assert estimate[t].type is search[t].type is not int  # the planner checks the range as it parses
    assert (estimate[t].default, search[t].default) == (1, None)
    assert estimate[t].type("8") == 8


def test_help_names_every_value_as_the_flag_does_never_a_hidden_destination():
    """A flag stored under a private destination (a Megatron spelling accepted as written) shows its own name in
    ``--help``, not the destination's (``--moe-aux-loss-coeff MOE_AUX_LOSS_COEFF``, never ``_SPELLING_...``)."""
    for name, sub in _subparsers(planner_parser()).items():
        text = sub.format_help()
        assert "_SPELLING" not in text and " _" not in text.replace("\n", " ").split("options:")[0], name
        assert "--moe-aux-loss-coeff MOE_AUX_LOSS_COEFF" in text.replace("\n", " ") or name == "calibrate", name
    assert " _" not in driver_parser().format_usage()
