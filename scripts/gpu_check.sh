#!/usr/bin/env bash
# The first thing to run on a CUDA machine: nanomm's GPU checks, one prepared script (issue 12, item 6).
#
#   bash scripts/gpu_check.sh            # results under gpu_check/ (or $OUT when set)
#
# It needs a CUDA build of torch and the dev extra (transformers, pytest) already installed: GPU machines may
# have no network. Every stage has its own time limit (150 + 110 + 110 + 45 = 415 s, leaving a minute for start-up
# and the summary), so that the whole run ends within 8 minutes; a stage
# that fails or times out is reported and the next one still runs. It writes:
#   gpu_check.json       everything: the machine, each stage's exit status and time, both bench results
#   summary.txt          the numbers issue 12 asks for, in words
#   env.txt, tests.txt, bench-small.txt, bench-2b.txt, bench-quant.txt: each stage's own output
# The tests: engine against the dense reference on CUDA (float32, with and without CUDA graphs), bf16 logits,
# transformers parity, a graph replay against eager (float32 and bf16), the profiled KV pool. The benches:
# bench.py in bf16 against transformers at batch 32, on `small` and on the 2b-shaped preset (the real
# Qwen2-VL-2B widths, 1 text layer); bench_quant.py's batch-1 decode of float32, bfloat16, int8 and int4 weights.
#
# GPU_CHECK_DRY_RUN=1 runs the same stages on the CPU with the tiny preset and quick benches: how the test
# suite checks this script (tests/test_scripts.py) without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check}"
DEVICE=(--device cuda --dtype bfloat16)
SMALL=(--preset small --cache-dir checkpoints/bench-small)
TWO_B=(--preset 2b-shaped --cache-dir checkpoints/bench-2b-shaped)
if [ "${GPU_CHECK_DRY_RUN:-0}" = 1 ]; then
    DEVICE=(--device cpu --dtype float32 --quick)
    SMALL=(--preset tiny --cache-dir "$OUT/ckpt-tiny")
    TWO_B=("${SMALL[@]}")
fi
mkdir -p "$OUT"
status=0

stage() {  # stage NAME SECONDS COMMAND...: run one stage under a time limit into $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/stages.txt"
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.txt"
    echo "== $name: exit $rc after $((SECONDS - start))s" | tee -a "$OUT/stages.txt"
    echo "$name $rc $((SECONDS - start))" >> "$OUT/stages.tsv"
    [ "$rc" -eq 0 ] || status=1
}

{
    nvidia-smi || echo "nvidia-smi: not found"
    python --version
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available',
torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    python -c "import transformers; print('transformers', transformers.__version__)" || echo "transformers: missing"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ "${GPU_CHECK_DRY_RUN:-0}" != 1 ] && ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible to torch: nothing to check" | tee "$OUT/summary.txt"
    exit 1
fi

stage tests 150 python -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_graphs.py \
    tests/test_loader.py::test_loads_onto_cuda

stage bench-small 110 python scripts/bench.py "${DEVICE[@]}" "${SMALL[@]}" --workload decode --hf-batch-sizes 32 \
    --json "$OUT/bench-small.json"

stage bench-2b 110 python scripts/bench.py "${DEVICE[@]}" "${TWO_B[@]}" --workload decode --hf-batch-sizes 32 \
    --json "$OUT/bench-2b.json"

QUANT=(--device cuda --repeats 3 --max-tokens 32)
[ "${GPU_CHECK_DRY_RUN:-0}" = 1 ] && QUANT=(--device cpu --quick --cache-dir "$OUT/ckpt-tiny")
stage bench-quant 45 python scripts/bench_quant.py speed "${QUANT[@]}" --json "$OUT/bench-quant.json"

python - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
stages = {name: {"exit": int(rc), "seconds": int(s)} for name, rc, s in
          (line.split() for line in (out / "stages.tsv").read_text().splitlines())}
combined = {"env": (out / "env.txt").read_text(), "stages": stages,
            "tests_tail": (out / "tests.txt").read_text()[-4000:] if (out / "tests.txt").exists() else None}
for name in ("bench-small", "bench-2b", "bench-quant"):
    path = out / f"{name}.json"
    combined[name] = json.loads(path.read_text()) if path.exists() else None
(out / "gpu_check.json").write_text(json.dumps(combined, indent=1, default=str))
print("stages:", ", ".join(f"{k} exit {v['exit']} in {v['seconds']}s" for k, v in stages.items()))
for name in ("bench-small", "bench-2b"):
    path = out / f"{name}.json"
    if not path.exists():
        print(f"{name}: no result")
        continue
    r = json.loads(path.read_text())
    w = r["workloads"]["decode"]
    print(f"{name}: {r['machine'].get('gpu')}, {r['dtype']}; read {r['roofline']['read_gbps']:.0f} GB/s, "
          f"matmul {r['roofline']['matmul_gflops'] / 1e3:.0f} TFLOP/s")
    print(f"  batch 32: nanomm {w['nanomm']['tokens_per_s']:.0f} tok/s, transformers best "
          f"{w.get('hf', {}).get('best_tokens_per_s', float('nan')):.0f} tok/s, ratio {w.get('speedup', float('nan')):.2f}x "
          f"(target >= 3x), identical {w.get('agreement', {}).get('identical')}/{w['num_requests']}")
    b1 = w["batch1_roofline"]
    print(f"  batch 1: decode step {b1['measured_step_s_median'] * 1e3:.2f} ms against a roofline of "
          f"{b1['roofline_step_s_mean'] * 1e3:.2f} ms: {b1['fraction_of_roofline']:.0%} (target >= 50% on 2b)")
    print(f"  batch 32 decode step: {w['decode_roofline']['fraction_of_roofline']:.0%} of the roofline")
if combined["bench-quant"]:
    rows = combined["bench-quant"]["rows"]
    print("bench-quant, batch-1 decode tok/s: " + ", ".join(f"{k} {v['tok_s']:.0f} ({v['tok_s'] / rows['float32']['tok_s']:.2f}x, "
          f"{v['tok_s'] / v['roofline_tok_s']:.0%} of roofline)" for k, v in rows.items()))
EOF
exit $status
