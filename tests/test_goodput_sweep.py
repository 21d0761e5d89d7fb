"""The highest sustainable rate (nanomm/sim/sweep.py): the P99 goodput of vLLM's EPD experiment."""

import json

from nanomm.bench import cli, simulate as simulate_cli
from nanomm.sim.stages import SimResult
from nanomm.sim.sweep import highest_rate_within, meets_p99


def fake_run(rate: float) -> SimResult:
    """TTFT grows with the rate: 100 requests whose slowest 2% wait rate / 10 s; TPOT 20 ms throughout."""
    ttft = [0.1] * 98 + [rate / 10] * 2
    return SimResult("dp1", {"worker": 1}, ttft, [0.02] * 100, 1.0, rate, 10.0, {"worker": 0.5})


def test_the_sweep_finds_where_the_p99_crosses_the_slo():
    found = highest_rate_within(fake_run, slo_ttft_s=2.0, slo_tpot_s=0.1, low=1, high=64)
    assert 20 * 0.98 <= found.rate <= 20 and meets_p99(found.result, 2.0, 0.1)
    assert not meets_p99(fake_run(found.rate * 1.03), 2.0, 0.1)
    assert highest_rate_within(fake_run, 2.0, 0.1, low=1, high=15).rate == 15  # the top already meets it
    assert highest_rate_within(fake_run, 2.0, 0.1, low=30, high=64).rate == 0.0  # even the bottom misses
    assert highest_rate_within(fake_run, 2.0, 0.015, low=1, high=64).rate == 0.0  # the TPOT SLO counts too


def test_p99_goodput_from_the_command_line(tmp_path, capsys):
    """On the twin's cost model, each topology's sustained rate for each seed, and the P99s of that run."""
    out = tmp_path / "sweep.json"
    assert cli.run(simulate_cli, ["--emulate", "a100:qwen3-vl-4b", "--topologies", "dp2", "1e1pd",
                                  "--mix", "1x320x320:1", "--text-tokens", "40", "--output-tokens", "8",
                                  "--slo-ttft", "2", "--slo-tpot", "0.1", "--p99-goodput", "1", "200",
                                  "--num-requests", "60", "--repeats", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["topology"], r["seed"]) for r in results] == [("dp2", 0), ("dp2", 1), ("1e1pd", 0), ("1e1pd", 1)]
    for r in results:
        assert 1 <= r["sustained_rate"] <= 200 and r["ttft_p99_s"] <= 2 and r["tpot_p99_s"] <= 0.1
    assert "min" in capsys.readouterr().out
