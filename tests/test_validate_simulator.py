"""The simulator checked against the twin: the host's costs measured on it (`nanomm-bench stage-costs --emulate`)
and the validation table (`nanomm-bench validate`), each in its reduced run. These check that the figures are
produced and complete, never a timing or a band."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_host_costs_of_the_twin_are_measured_into_what_the_simulator_reads(tmp_path):
    out = tmp_path / "host.json"
    done = subprocess.run([sys.executable, "-m", "nanomm.bench", "stage-costs", "--emulate",
                           "h200:qwen2-vl-2b", "--quick", "--json", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    host = json.loads(out.read_text())
    assert {"step_s", "step_s_per_sequence", "request_s", "request_s_per_byte"} <= set(host)
    assert set(host["request_s"]) == {"integrated"}  # --quick: the integrated engine only
    assert len(host["measured"]["step"]["samples"]) == 2 and len(host["measured"]["integrated"]["samples"]) == 6


@pytest.mark.slow
def test_the_validation_table_has_every_topology_and_load_measured_and_simulated(tmp_path):
    host = tmp_path / "host.json"
    host.write_text(json.dumps({"step_s": 5e-4, "step_s_per_sequence": 2e-5,
                                "request_s": {"integrated": 0.005, "1e1pd": 0.008, "1eNp1d": 0.012},
                                "request_s_per_byte": {"integrated": 1e-7, "1e1pd": 2e-7, "1eNp1d": 2e-7}}))
    out = tmp_path / "validation.json"
    done = subprocess.run([sys.executable, "-m", "nanomm.bench", "validate", "--host-costs", str(host),
                           "--quick", "--json", str(out)], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["topology"], r["level"]) for r in rows] == [
        (t, level) for t in ("integrated", "1e1pd", "1e1p1d", "1e2p1d") for level in (0.5, 0.8, 0.95)]
    for row in rows:
        (run,) = row["runs"]  # --quick: one run a point
        assert run["errors"] == 0 and len(run["records"]) == 4
        for side in ("measured", "predicted"):
            assert all(run[side][name] is not None for name in ("goodput", "ttft_p50", "ttft_p90", "tpot_p50"))
        assert set(run["in_band"]) == {"goodput", "ttft_p50", "ttft_p90", "tpot_p50"}
        assert run["cpu_share"] and {"load", "router" if row["topology"].endswith("p1d") else "load"} <= set(
            run["cpu_share"])
    table = report["table"].splitlines()
    assert len(table) == 2 + 12 and all(line.count("|") == 14 for line in table)
    assert table == done.stdout.strip().splitlines()[-14:]
