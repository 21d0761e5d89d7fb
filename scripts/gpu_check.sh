#!/usr/bin/env bash
# The first thing to run on a CUDA machine: nanomm's GPU checks, one prepared script (issue 12, item 6).
#
#   bash scripts/gpu_check.sh                                       # results under gpu_check/ (or $OUT when set)
#   PYTHON=/opt/torch/.venv/bin/python3 bash scripts/gpu_check.sh   # when `python` on the PATH has no CUDA torch
#
# It needs a CUDA build of torch and the dev extra (transformers, pytest) already installed: GPU machines may
# have no network. The whole run ends within GPU_CHECK_SECONDS (default 450 s, inside 8 minutes): each stage has
# its own limit (120 + 150 + 90 + 90 + 60 + 45 s) and is cut to the time left; a stage is skipped when under
# 20 s remain. The limits add up to more than the deadline: the last stages get what is left.
# A stage that fails, times out or is skipped is reported, and the next one still runs. Two files under $OUT hold
# everything, and both are rewritten after every stage, so a run that is killed part way (a remote call's time
# limit, say) still leaves a record of every stage that finished; a TERM to the script stops the running stage:
#   gpu_check.json   the machine, each stage's exit status, time and output, the bench results
#   summary.txt      the numbers, in words, each beside its target
# Each stage's own files (its output, its bench JSON, generated checkpoints of the dry run) go to
# $GPU_CHECK_WORK (default $OUT/stages).
#
# The tests: engine against the dense reference on CUDA (float32, with and without CUDA graphs), bf16 logits,
# transformers parity, a graph replay against eager (float32 and bf16, every family), a mixed step's forward
# under torch.cuda.set_sync_debug_mode("error"), the profiled KV pool. Then the GPU step at full size: the
# preset "2b" is Qwen2-VL-2B's shape with all 28 text layers and 32 vision blocks (random weights, bf16):
#   step-2b    batch-1 decode against the HBM roofline (target >= 50%), batch 32 against transformers (>= 3x)
#   burst-2b   32 requests, one 896x896 picture (1,024 visual tokens) each, arriving at once: TTFT p50 (target
#              <= 0.6 s) and p99 (<= 1.2 s), mean encode and prefill time
#   profile    profile_steps.py on the same checkpoint: the kernels launched per prefill step and per layer of
#              an eager decode step, and where the engine's steps (and a demo training step) spend their time
# Then bench.py in bf16 against transformers at batch 32 on `small`, and bench_quant.py's batch-1 decode of
# float32, bfloat16, int8 and int4 weights.
#
# GPU_CHECK_ONLY="step-2b bench-quant" runs only the stages named (tests, step-2b, burst-2b, profile,
# bench-small, bench-quant).
#
# GPU_CHECK_DRY_RUN=1 runs the same stages on the CPU with the tiny preset and quick benches: how the test
# suite checks this script (tests/test_scripts.py) without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check}"
WORK="${GPU_CHECK_WORK:-$OUT/stages}"
PYTHON="${PYTHON:-python}"
DEADLINE=$((SECONDS + ${GPU_CHECK_SECONDS:-450}))
DRY_RUN="${GPU_CHECK_DRY_RUN:-0}"
ONLY="${GPU_CHECK_ONLY:-}"  # stage names, space-separated: run only these (a rerun of what a first run skipped)
for name in $ONLY; do
    case $name in
        tests | step-2b | burst-2b | profile | bench-small | bench-quant) ;;
        *) echo "GPU_CHECK_ONLY: no stage is called '$name' (tests, step-2b, burst-2b, profile, bench-small," \
                "bench-quant)"
           exit 2 ;;
    esac
done
DEVICE=(--device cuda --dtype bfloat16)
SMALL=(--preset small --cache-dir checkpoints/bench-small)
FULL_2B=(--preset 2b --cache-dir checkpoints/bench-2b-full)
BURST=(--burst-num-requests 32 --burst-image-side 896 --max-num-batched-tokens 8192)
QUANT=(--device cuda --repeats 3 --max-tokens 32)
if [ "$DRY_RUN" = 1 ]; then
    DEVICE=(--device cpu --dtype float32 --quick)
    SMALL=(--preset tiny --cache-dir "$WORK/ckpt-tiny")
    FULL_2B=("${SMALL[@]}")
    BURST=(--burst-num-requests 4 --burst-image-side 112)
    QUANT=(--device cpu --quick --cache-dir "$WORK/ckpt-tiny")
fi
mkdir -p "$OUT" "$WORK"
rm -f "$WORK"/*.txt "$WORK"/*.json "$WORK/stages.tsv"  # an earlier run's results must not pass for this one's
status=0
running=""  # the process group of the stage now running (its `timeout` leads one of its own)

write_results() {  # gpu_check.json and summary.txt from what $WORK holds now
    timeout -k 5 30 "$PYTHON" scripts/gpu_check_summary.py "$WORK" "$OUT" > "$OUT/summary.txt.partial" 2>&1 \
        || status=1
    mv "$OUT/summary.txt.partial" "$OUT/summary.txt"
}

stopped() {  # killed from outside: stop the running stage too (it is in a process group of its own), record, exit
    [ -n "$running" ] && kill -TERM -- "-$running" 2>/dev/null
    echo "stopped from outside" >> "$WORK/stopped.txt"
    write_results
    exit 143
}
trap stopped TERM INT HUP

stage() {  # stage NAME SECONDS COMMAND...: run one stage, cut to the time left, into $WORK/NAME.txt
    local name=$1 limit=$2 start=$SECONDS rc outcome
    shift 2
    [[ -z "$ONLY" || " $ONLY " == *" $name "* ]] || return 0  # GPU_CHECK_ONLY names other stages
    local left=$((DEADLINE - SECONDS - 10))  # 10 s kept for the last write of the results
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then  # under 20 s to the deadline
        echo "== $name: skipped, out of time"
        echo "skipped: under 20 s left of GPU_CHECK_SECONDS" > "$WORK/$name.txt"
        rc=1 outcome=skipped
    else
        echo "== $name (limit ${limit}s): $*"
        # -k: a stage that ignores the polite signal (stuck in a driver call, say) is killed 5 s later.
        # In the background and waited for, so that a TERM to this script reaches `stopped` at once.
        timeout -k 5 "$limit" "$@" > "$WORK/$name.txt" 2>&1 &
        running=$!
        wait "$running"
        rc=$? running=""
        case $rc in 0) outcome=passed ;; 124 | 137) outcome=timed-out ;; *) outcome=failed ;; esac
        tail -n 25 "$WORK/$name.txt"
        echo "== $name: $outcome (exit $rc) after $((SECONDS - start))s"
    fi
    echo "$name $rc $((SECONDS - start)) $outcome" >> "$WORK/stages.tsv"
    [ "$rc" -eq 0 ] || status=1
    write_results
}

no_torch() {  # the reason, in summary.txt and gpu_check.json, then exit
    echo "$1 (set PYTHON to the interpreter that has a CUDA torch)" | tee "$WORK/stopped.txt"
    write_results
    exit 1
}

{
    timeout -k 5 30 nvidia-smi || echo "nvidia-smi: not found or no answer"
    echo "python: $(command -v "$PYTHON")"
    "$PYTHON" --version
    timeout -k 5 60 "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'available', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    timeout -k 5 60 "$PYTHON" -c "import transformers; print('transformers', transformers.__version__)" \
        || echo "transformers: missing"
} > "$WORK/env.txt" 2>&1
cat "$WORK/env.txt"
timeout -k 5 60 "$PYTHON" -c "import torch" 2>/dev/null || no_torch "$PYTHON cannot import torch"
if [ "$DRY_RUN" != 1 ]; then
    timeout -k 5 60 "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || no_torch "no CUDA device visible to the torch of $PYTHON"
fi
write_results

stage tests 120 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_graphs.py \
    tests/test_loader.py::test_loads_onto_cuda

stage step-2b 150 "$PYTHON" scripts/bench.py "${DEVICE[@]}" "${FULL_2B[@]}" --workload decode --hf-batch-sizes 32 \
    --json "$WORK/step-2b.json"

stage burst-2b 90 "$PYTHON" scripts/bench.py "${DEVICE[@]}" "${FULL_2B[@]}" --workload burst "${BURST[@]}" --no-hf \
    --json "$WORK/burst-2b.json"

stage profile 90 "$PYTHON" scripts/profile_steps.py "${DEVICE[@]}" "${FULL_2B[@]}" --json "$WORK/profile.json"

stage bench-small 60 "$PYTHON" scripts/bench.py "${DEVICE[@]}" "${SMALL[@]}" --workload decode --hf-batch-sizes 32 \
    --json "$WORK/bench-small.json"

stage bench-quant 45 "$PYTHON" scripts/bench_quant.py speed "${QUANT[@]}" --json "$WORK/bench-quant.json"

cat "$OUT/summary.txt"
exit $status
