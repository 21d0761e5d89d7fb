"""`nanomm-bench`, the workbench's one command (nanomm/bench/cli.py): every subcommand is listed, each module keeps
vLLM's `add_cli_args(parser)` / `main(args)` convention, and each subcommand's own help runs as a user types it."""

import subprocess
import sys

import pytest

from nanomm.bench import cli

EXPECTED = ["load", "simulate", "autoscale", "stage-costs", "validate", "day", "soak", "long-chats"]


def test_the_help_lists_every_subcommand():
    run = subprocess.run([sys.executable, "-m", "nanomm.bench", "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert list(cli.SUBCOMMANDS) == EXPECTED
    for name in EXPECTED:
        assert f"    {name}" in run.stdout, name


@pytest.mark.parametrize("name", EXPECTED)
def test_each_subcommand_follows_the_convention_and_answers_help(name, capsys):
    module = cli.module_of(name)
    assert callable(module.add_cli_args) and callable(module.main)
    assert module.__doc__.splitlines()[0] and "Lesson" in module.__doc__
    with pytest.raises(SystemExit) as done:
        cli.main([name, "--help"])
    assert done.value.code == 0 and f"nanomm-bench {name}" in capsys.readouterr().out


def test_a_bad_argument_is_a_usage_error_naming_it(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["simulate", "--topologies", "e+pd"])
    assert done.value.code == 2 and "integrated, dp<N>, <X>e<Y>pd or <X>e<Y>p<Z>d" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        cli.main(["load", "--topology", "3e2pd"])  # each of 2 engines takes one encoder: the third would idle
    assert done.value.code == 2 and "at most 2 would work" in capsys.readouterr().err


def test_the_simulator_runs_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert cli.main(["simulate", "--topologies", "dp2", "1e1pd", "1e1p1d", "--rate", "5", "--num-requests", "20",
                     "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert all(name in printed for name in ("dp2", "1e1pd", "1e1p1d")) and out.is_file()
