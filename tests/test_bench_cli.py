"""`nanomm-bench`, the workbench's one command (nanomm/bench/cli.py): every subcommand is listed, each module keeps
vLLM's `add_cli_args(parser)` / `main(args)` convention, and each subcommand's own help runs as a user types it."""

import json
import subprocess
import sys

import pytest

from nanomm.bench import cli

EXPECTED = ["load", "simulate", "autoscale", "stage-costs", "validate", "day", "soak", "long-chats", "shapes"]


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


def test_shapes_checks_answers_by_hand():
    from nanomm.bench.shapes import parse_answer

    assert parse_answer("colour", '{"colour":"red"}') == "red"
    assert parse_answer("count", '{"count": 3}') == "3"
    for kind, text in (("colour", "red"), ("colour", '{"colour":"teal"}'), ("colour", '{"colour":"red","n":1}'),
                       ("count", '{"count":true}'), ("count", '{"count":10}'), ("count", '{"count":"3"}'),
                       ("shape", '{"shape":"circle"'), ("shape", '["circle"]')):
        assert parse_answer(kind, text) is None, (kind, text)


def test_shapes_runs_from_the_command_line(tmp_path, capsys):
    """The smallest run: one question per kind, timed without speculation. Every answer under a schema is JSON
    with the kind's one field (checked here with json.loads), and both timed runs decode the same tokens."""
    pytest.importorskip("llguidance")
    out = tmp_path / "shapes.json"
    assert cli.main(["shapes", "--per-kind", "1", "--timed", "1", "--no-ngram", "--json", str(out)]) == 0
    assert "asked + schema" in capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = {(r["kind"], r["condition"]): r for r in result["rows"]}
    assert len(rows) == 15 and all(r["n"] == 1 for r in rows.values())
    for kind in ("colour", "shape", "count"):
        for condition in ("schema", "asked + schema"):
            row = rows[kind, condition]
            assert row["valid_json"] == 1.0 and list(json.loads(row["examples"][0])) == [kind]
    free, shaped = result["costs"]
    assert (free["schema"], shaped["schema"]) == (False, True) and free["tokens"] == shaped["tokens"] > 3
    assert free["grammar_us_per_token"] == 0 < shaped["grammar_us_per_token"]


def test_shapes_refuses_more_timed_questions_than_asked(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["shapes", "--per-kind", "2", "--timed", "3"])
    assert done.value.code == 2 and "--timed" in capsys.readouterr().err
