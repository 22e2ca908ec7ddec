"""h3t-plan in-process: its exit code and output for an argument list, parse errors included (shared by the
planner's command-line tests of both tiers)."""
import json

from h3t_ext.planner.cli import main


def run_main(argv, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of h3t-plan's main(argv), parse errors included."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def run_json(argv, capsys):
    """The --json output of a run that must succeed."""
    code, out, err = run_main([*argv, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)
