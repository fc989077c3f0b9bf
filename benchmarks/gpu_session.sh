#!/usr/bin/env bash
# Every GPU check the open issues ask for, as one prepared script for a lent GPU machine (H100 / H200).
#
#   bash benchmarks/gpu_session.sh OUT [STEP[=SECONDS] ...]
#
# Steps, in the order given (default: all, in this order, each under its own time limit in seconds):
#   env         nvidia-smi, torch / CUDA / transformers versions                                     (30)
#   tests       python -m pytest tests/gpu (never-run tests first: offload's pinned buffers, then the plan's
#               (issue 18's 1M-token head chunks), ring, sliced core, tiled loss; flex over ten lengths
#               (compiles) and the slow GPU mode last),
#               with each test's duration;
#               measurements to gpu_records.jsonl                                                      (330)
#   validation  benchmarks/gpu_validation.py: the planner's maximum and 10% above it, measured peak
#               against the prediction, Qwen3-4B as one rank of sp=8 (Llama-3.1-8B's: the tests)       (200)
#   packed      benchmarks/packed_attention.py: per-document sdpa against one flex call, recompiles    (60)
#   loss        benchmarks/tiled_loss_speed.py: tiled against plain loss, 32K tokens, vocab 152K      (60)
#   kernels     benchmarks/chunk_kernel_calls.py: a rank's heads in one kernel call or one per chunk  (45)
#   lora        benchmarks/lora_head_chunks.py: a LoRA model in 4 head chunks against 1, dropout 0 / 0.1,
#               and the model without LoRA; one profiled step each (device busy time, launches)       (90)
#   cpuchunks   benchmarks/head_chunk_ratio.py on the host's CPU cores alone (gloo, no GPU): issue 18's
#               C=4 / C=1 step-time goal at P=4 and P=2, 8,192 tokens, with a core per rank (the 2-core VM
#               runs 4 ranks on 2 cores, where no exchange can overlap), 7 reps each; P=4 first, saved
#               when it ends (estimated from this VM: P=4 about 110 s, P=2 about 220 s on a core per rank)  (480)
#
# A step written with a leading '+' (e.g. +cpuchunks) runs in the background while the steps after it run; the
# script waits for it at the end (under its own limit). Where the machine has 8 cores or more (and taskset), the
# background step runs on the upper half of them and the steps after it on the lower half, so neither takes the
# other's cores (the bench then records the cores it had). Run cpuchunks so, beside `tests validation`:
# `env +cpuchunks tests validation`. Those two measure memory and exactness; validation's step time and MFU are
# taken beside it then (the host's memory bandwidth is shared). Never beside the timed GPU steps (packed loss
# kernels lora).
#
# A lease gives about 15 minutes of device time in all (a machine's start included), a call at most 10: run the
# steps over two calls, `env +cpuchunks tests validation` (at most 560 s, 10 more for each step that must be killed;
# cpuchunks ends within it) then `packed loss kernels lora` (at most 255 s; on 2026-11-30 they took 99 s). A failing or timed-out step does not stop
# the others. A step that reaches its limit is interrupted (SIGINT, as Ctrl-C; killed 10 s later if still running), so
# pytest still prints the tracebacks of the failures so far, the durations and its junit XML, and a script its
# traceback; under timeout's default SIGTERM the tests step of the first lease kept only its progress dots.
# Every step's output goes under $GPU_SESSION_WORK (default /tmp/gpu_session), which is packed into
# OUT/gpu_session.tgz after each step (so a call cut off keeps what finished); OUT/session.log lists each
# step's command, exit status and seconds. GPU_SESSION_DRY_RUN=1 prints the commands and runs nothing.
# Every step runs the CUDA allocator as `ulysses-sp train` does (expandable segments), unless one is configured.
#
# Seen on the first lease (an H200, 2026-11-30): the tests step ran 30 of 62 tests in 240 s (the GPU-mode test
# about 67 s); Llama-3.1-8B at sp=1 (all of its fp32 states in host memory) was killed by the host's 128 GiB, so
# the validation points are now ones a 128 GiB host holds.
set -u

if [ $# -lt 1 ]; then
    echo "usage: bash benchmarks/gpu_session.sh OUT [STEP[=SECONDS] ...]" >&2
    exit 2
fi
out=$1
shift
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env +cpuchunks tests validation packed loss kernels lora)
work=${GPU_SESSION_WORK:-/tmp/gpu_session}
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root/src:$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -z "${PYTORCH_CUDA_ALLOC_CONF:-}" ] && [ -z "${PYTORCH_ALLOC_CONF:-}" ]; then
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
fi

command_for() {  # the step's default seconds, then its command
    case $1 in
        env) echo "30 nvidia-smi; python3 -c 'import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)'" ;;
        tests) echo "330 GPU_RECORD=$work/gpu_records.jsonl python3 -m pytest -q -p no:cacheprovider $root/tests/gpu/test_gpu_offload.py $root/tests/gpu/test_gpu_plan.py $root/tests/gpu/test_gpu_ring.py $root/tests/gpu/test_gpu_sliced_core.py $root/tests/gpu/test_gpu_tiled_loss.py $root/tests/gpu/test_gpu_cores.py $root/tests/gpu/test_gpu_head_chunks.py $root/tests/gpu/test_gpu_flex_lengths.py $root/tests/gpu/test_gpu_bench.py --timeout=150 -rfEs --durations=0 --junitxml=$work/gpu_tests.xml" ;;
        validation) echo "200 python3 $root/benchmarks/gpu_validation.py --point qwen3-4b:8:10GiB --step-budget-s 90 --host-memory 120GiB --out $work" ;;
        packed) echo "60 TORCH_LOGS=recompiles python3 $root/benchmarks/packed_attention.py --seq-len 32768 --docs 1 8 32 128 512 --heads 4 --kv-heads 1 --head-dim 128 --out $work" ;;
        loss) echo "60 python3 $root/benchmarks/tiled_loss_speed.py --tokens 32768 --hidden 2560 --vocab 151936 --dtype bf16 --chunk-tokens 0 --rounds 5 --name $work/tiled_loss_gpu" ;;
        kernels) echo "45 python3 $root/benchmarks/chunk_kernel_calls.py --device cuda --dtype bf16 --head-dim 128 --tokens 32768 --name $work/chunk_kernel_calls_gpu" ;;
        lora) echo "90 python3 $root/benchmarks/lora_head_chunks.py --device cuda --dtype bf16 --hidden 2048 --heads 16 --kv-heads 4 --tokens 32768 --chunks 4 --rounds 5 --plain --profile --name $work/lora_head_chunks_gpu" ;;
        cpuchunks) echo "480 CUDA_VISIBLE_DEVICES= python3 $root/benchmarks/head_chunk_ratio.py --worlds 4 2 --runs 1 --reps 7 --out $work --name head_chunk_ratio_host" ;;
        *) return 1 ;;
    esac
}

for spec in "${steps[@]}"; do  # every step is checked before any runs
    spec=${spec#+}
    name=${spec%%=*}
    if ! command_for "$name" > /dev/null; then
        echo "gpu_session.sh: unknown step '$name'; steps: env tests validation packed loss kernels lora cpuchunks" >&2
        exit 2
    fi
    if [ "$spec" != "$name" ] && ! [[ ${spec#*=} =~ ^[1-9][0-9]*$ ]]; then
        echo "gpu_session.sh: step '$spec': the limit after '=' must be a whole number of seconds, e.g. $name=120" >&2
        exit 2
    fi
done

planned() {  # the step's limit (its own or the default) and command
    local limit cmd
    read -r limit cmd <<< "$(command_for "${1%%=*}")"
    [ "$1" != "${1%%=*}" ] && limit=${1#*=}
    echo "$limit $cmd"
}

if [ "${GPU_SESSION_DRY_RUN:-0}" = 1 ]; then
    for spec in "${steps[@]}"; do
        read -r limit cmd <<< "$(planned "${spec#+}")"
        background=${spec%%[!+]*}
        spec=${spec#+}
        echo "${spec%%=*} ($limit s${background:+, in the background}): $cmd"
    done
    exit 0
fi

mkdir -p "$out" "$work"
cd "$root" || exit 2
run_step() {  # name limit cmd [cores]: the step under its limit (on those cores), its log, its session.log line
    local start=$SECONDS status pin=()
    [ -n "${4:-}" ] && pin=(taskset -c "$4")
    timeout --signal=INT --kill-after=10 "$2" ${pin[@]+"${pin[@]}"} bash -c "$3" > "$work/$1.log" 2>&1
    status=$?
    echo "== $1: exit $status after $((SECONDS - start)) s$([ $status -eq 124 ] && echo ' (time limit)')" \
        | tee -a "$out/session.log"
    tail -n 5 "$work/$1.log"
}

cores=$(nproc 2> /dev/null || echo 1)
pin_back="" pin_front=""  # the background steps' cores and, once one runs, the other steps'
if [ "$cores" -ge 8 ] && command -v taskset > /dev/null; then
    pin_back="$((cores / 2))-$((cores - 1))"
fi
background=()
for spec in "${steps[@]}"; do
    behind=${spec%%[!+]*}
    spec=${spec#+}
    name=${spec%%=*}
    read -r limit cmd <<< "$(planned "$spec")"
    if [ -n "$behind" ]; then
        echo "== $name ($limit s, in the background${pin_back:+, on cores $pin_back}): $cmd" | tee -a "$out/session.log"
        run_step "$name" "$limit" "$cmd" "$pin_back" &
        background+=($!)
        [ -n "$pin_back" ] && pin_front="0-$((cores / 2 - 1))"
        continue
    fi
    echo "== $name ($limit s${pin_front:+, on cores $pin_front}): $cmd" | tee -a "$out/session.log"
    run_step "$name" "$limit" "$cmd" "$pin_front"
    tar --warning=no-file-changed -czf "$out/gpu_session.tgz" -C "$work" .  # (a background step may be writing)
done
for pid in "${background[@]}"; do
    wait "$pid"
done
tar -czf "$out/gpu_session.tgz" -C "$work" .
