#!/bin/bash
# One call on a lent GPU machine (the device tool; ../shared/GPU.md): build zkern on the bare machine, then run the
# named steps in order, each under its own limit and failing soft, so that one that hangs costs only itself.
# Everything lands in bench/results/gpu-lease/, packed into $OUT/results.tgz after every step (a call cut off at its
# limit still brings back what finished); the whole log is $OUT/lease.log; a summary table is printed last.
#
#   bash bench/gpu_lease.sh BUDGET_S STEP...
#
# Steps, cheap to dear (what each proves is in docs/gpu.md):
#   bw        the machine's ceilings: device copy, host<->device, bf16 matmul, host memory (gpu_probe.py bw)
#   lean      issue 57's first figures, after every view became 256-byte aligned: torch doing zkern's arithmetic
#             (torch-mixed), DDP with fused AdamW and zkern stages 0-3 at 1b with 4K tokens a step, then torch-mixed,
#             DDP-fused and zkern stages 0 and 3 at 16K: step time and each phase's, TFLOPS and MFU against the
#             measured matmul (goals: stage 0 at or under torch-mixed and DDP-fused, its forward within 3% of
#             torch-mixed's, MFU >= 42% at 4K and >= 48% at 16K)
#   memory    zkern stages 0 and 3, FSDP2 and DDP (fused AdamW) at 1b: the allocator's figures by phase, the peak's
#             sites from an allocator trace (gpu_probe.py variants --snapshot)
#   kernels   the kernels suite with its gates (contraction off on every launch)
#   checks    the GPU-touching tests (pytest -n 14 --timeout 90) and, beside them, zkern over NCCL with two and
#             four ranks on this one GPU (gpu_probe.py world2): correctness only, so they share the card
#   memory2   stage 3 and FSDP2 at world 2 on this GPU: each rank's own allocator (no timing)
#   offload   stage 2 + offload_optimizer, stage 3 + offload_param at 1b: the host step's phases
#   pipeline  the offload suite at 1b, stages 2 and 3: gradients to the host during backward, at step(), and the
#             delayed update (the host Adam behind the next step's compute)
#   peers     DDP and FSDP2 with torch's default AdamW, zkern's arithmetic in torch, zkern stages 1 and 2
#   16k       zkern stage 0 and DDP (fused) at 16K tokens a step
#   headline  issue 42's figure, a lease of its own: a 7B model at 16K tokens a step, every block recomputed, on one
#             GPU with the optimizer on the host: zkern's offload with bf16 master and moments
#   headline-peers  the same model and batch under FSDP2's CPUOffloadPolicy and DeepSpeed's ZeRO-Offload (where
#             installed): one timed step each (torch's AdamW on the host takes tens of seconds a step at 7B)
#   headline-more  zkern's offload with bf16 state and the delayed update, then, on a card of more than 120 GB (an
#             H200), the same model without offload (105 GB of model states: the offloaded step's goal is 1.3x of it;
#             an H100 would only record its out-of-memory)
#   ratio     the 1.3x goal where both fit one H100: the 1b model at 16K tokens a step (16 x 1024), every block
#             recomputed, without offload, then offloaded with bf16 state: with the delayed update, with the
#             speculative step, and with neither
#   partial   partial offload at 1b (8K tokens a step): stage 2 without offload, with offload_optimizer.ratio 0.25,
#             0.5 and 0.75, and with full offload: what each share on the device buys in step time
#   speculative  the headline's model and batch, zkern's offload with bf16 state and the speculative step (the host
#             Adam inside backward, kept where the step is unclipped; the probe does not clip): the exact route to
#             the 300 TFLOPS goal (14 host bytes a parameter, 92 GB at 7B)
#   parity    the headline's model, batch and lr, zkern's fp32-state offload beside torch-mixed-offload (the same
#             arithmetic in plain torch, its AdamW on the host), every step's loss and gradient norm: on 2026-11-27
#             FSDP2's third loss parted from zkern's by 0.38, and this says which of the two trains as the arithmetic
#             says (the reference takes about 12 s a step at 7B)
#   headline-ds  DeepSpeed's ZeRO-Offload on the headline's model and batch, with gradient norms:
#             from .lease-wheels/ (`make lease-wheels`, carried on the call) where the machine lacks DeepSpeed
#   uploads   stage 3 with offload_param at 1b and 16K tokens a step: prefetched units' host chunks up on a side
#             stream (the default) beside the same copies in line on the compute stream (stage3/uploads.py), and
#             DeepSpeed's SuperOffload shape: the same with bf16 state and the speculative step
#   largest   zkern's offload with bf16 state at 13B (4K tokens a step): does it train on one GPU and this host
#
# The machine's python3 holds torch; nothing is installed into it: the CPU extension is built in place, its sources
# in parallel, and the CUDA extension builds in the background from the first second (for this card's architecture
# only). Test processes cap their threads: 14 pytest processes on 16 cores, each with a thread per core, made tests
# run past their limit on the first H100 call. Times seen (H100, 2026-11-25): the serial build 58 s, six GPU test
# files over 240 s at -n 12, the kernels suite 30 s, one engine stage at 1b with its peers 100-130 s.
set -u
BUDGET=$1
shift
OUT=${OUT:-/tmp/lease-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/lease.log") 2>&1
T0=$(date +%s)
R=bench/results/gpu-lease
mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD LEASE_FAILURES=$PWD/$R/failures.txt
export TORCH_EXTENSIONS_DIR=/tmp/zkern-torch-ext
unset TRITON_INTERPRET
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
say() { echo "[lease +$(( $(date +%s) - T0 ))s] $*"; }
pack() { tar czf "$OUT/results.tgz" "$R" 2>/dev/null; }
clocks() {
    nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,clocks_event_reasons.active \
        --format=csv,noheader 2>/dev/null || nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu \
        --format=csv,noheader
}
# run NAME MAX_S CMD...: at most MAX_S seconds and never past the budget; the exit status goes to steps.txt.
run() {
    local name=$1 max=$2
    shift 2
    local limit
    limit=$(left)
    ((limit > max)) && limit=$max
    if ((limit < 20)); then say "$name: skipped, budget spent"; echo "$name skipped" >>"$R/steps.txt"; return; fi
    say "$name: start (limit ${limit}s): $*"
    local t=$(date +%s)
    timeout -k 5 "$limit" "$@"
    local rc=$?
    say "$name: exit $rc"
    echo "$name exit $rc in $(( $(date +%s) - t ))s" >>"$R/steps.txt"
    pack
}
P="python3 bench/gpu_probe.py"
# DeepSpeed's steps: the image has none and reaches no index, so the carried wheels go into a folder of their own,
# put on the path of those steps alone (their pydantic and typing_extensions must not shadow the image's elsewhere).
with_deepspeed() {
    if python3 -c "import deepspeed" 2>/dev/null || ! ls .lease-wheels/deepspeed-*.whl >/dev/null 2>&1; then
        "$@"
        return
    fi
    local site=/tmp/lease-site
    [ -d $site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --target $site .lease-wheels/*.whl \
        >"$R/deepspeed-install.log" 2>&1 || tail -5 "$R/deepspeed-install.log"
    PYTHONPATH=$PWD:$site PATH=$site/bin:$PATH "$@"
}
M=${LEASE_MODEL:-1b}  # the engine suite's preset; "tiny" rehearses the whole script on a CPU in a minute or two
H=${LEASE_MODEL:-7b}  # the headline's model
L=${LEASE_MODEL:-13b}  # the largest step's

say "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/machine.txt"
echo "clocks before: $(clocks)" | tee -a "$R/machine.txt"
nproc
free -g | head -2
# the 7B model without offload beside the headline where the card can hold its 105 GB of model states
BESIDE=$(python3 -c "import torch; print('zkern2' if torch.cuda.get_device_properties(0).total_memory > 120e9 else '')" \
    2>/dev/null)
say "the CUDA extension builds in the background"
TORCH_CUDA_ARCH_LIST=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())") MAX_JOBS=4 \
    timeout 240 python3 -c "import zkern.cuda as c; c._ext()" >"$R/cuda-build.log" 2>&1 &
CUDA_BUILD=$!  # waited for by pid: a bare `wait` would also wait for the log's tee, which never ends
say "build the CPU extension in place, sources in parallel"
python3 setup.py -q build_ext --inplace >"$R/build.log" 2>&1 || { tail -30 "$R/build.log"; pack; exit 1; }
say "built"

for step in "$@"; do
    case $step in
        bw) run bw 60 $P bw --json "$R/bw.json" ;;
        lean) run lean 200 $P variants torch-mixed ddp-fused zkern0 zkern1 zkern2 zkern3 --model "$M" \
                --bw-json "$R/bw.json" --json "$R/lean-4k.json"
            run lean16k 150 $P variants torch-mixed ddp-fused zkern0 zkern3 --model "$M" --micro-batch 16 \
                --bw-json "$R/bw.json" --json "$R/lean-16k.json" ;;
        memory) run memory 150 $P variants zkern0 zkern3 fsdp2-fused ddp-fused --model "$M" --snapshot \
            --bw-json "$R/bw.json" --json "$R/memory.json" ;;
        kernels) wait $CUDA_BUILD; run kernels 70 python3 bench/run.py --suite kernels --json "$R/kernels.json" \
            --gate bench/gates.toml ;;
        checks)
            run world2 170 $P world2 --json "$R/world2.json" >"$R/world2.log" 2>&1 &
            W2=$!
            OMP_NUM_THREADS=1 run tests 170 python3 -m pytest -q -p no:cacheprovider -p bench.lease_failures -n 14 \
                --timeout 90 --durations 15 --junitxml "$R/tests.xml" tests/kernels/test_triton.py tests/bench/test_gpu.py \
                tests/kernels/test_cuda_kernels.py tests/optim/test_bf16_state.py
            wait $W2
            tail -15 "$R/world2.log" ;;
        memory2) run memory2 90 $P variants zkern3 fsdp2-fused --model "$M" --world 2 --threads 8 \
            --json "$R/memory-world2.json" ;;
        offload) run offload 120 $P variants zkern2-offload zkern3-offload --model "$M" --bw-json "$R/bw.json" \
            --json "$R/offload.json" ;;
        pipeline) run pipeline 210 python3 bench/run.py --suite offload --stage 2,3 --model "$M" --precision bf16 \
            --steps 8 --json "$R/offload-pipeline.json" ;;
        peers) run peers 150 $P variants ddp fsdp2 torch-mixed zkern1 zkern2 --model "$M" --bw-json "$R/bw.json" \
            --json "$R/peers.json" ;;
        16k) run 16k 90 $P variants zkern0 ddp-fused --model "$M" --micro-batch 16 --bw-json "$R/bw.json" \
            --json "$R/16k.json" ;;
        headline) run headline 150 $P variants zkern2-offload-bf16 --model "$H" --micro-batch 8 \
            --checkpoint non_reentrant --warmup 1 --steps 3 --timeout 140 --bw-json "$R/bw.json" \
            --json "$R/headline.json" ;;
        headline-peers) run headline-peers 260 $P variants fsdp2-offload deepspeed2-offload --model "$H" \
            --micro-batch 8 --checkpoint non_reentrant --warmup 1 --steps 1 --timeout 200 --bw-json "$R/bw.json" \
            --json "$R/headline-peers.json" ;;
        parity) run parity 330 $P variants zkern2-offload torch-mixed-offload --model "$H" --micro-batch 8 \
            --checkpoint non_reentrant --warmup 1 --steps 2 --grad-norms --timeout 220 --bw-json "$R/bw.json" \
            --json "$R/parity.json" ;;
        headline-ds) with_deepspeed run headline-ds 280 $P variants deepspeed2-offload --model "$H" --micro-batch 8 \
            --checkpoint non_reentrant --warmup 1 --steps 2 --grad-norms --timeout 270 --bw-json "$R/bw.json" \
            --json "$R/headline-ds.json" ;;
        headline-more) run headline-more 330 $P variants zkern2-offload-bf16-dpu $BESIDE --model "$H" \
            --micro-batch 8 --checkpoint non_reentrant --warmup 1 --steps 3 --timeout 140 --bw-json "$R/bw.json" \
            --json "$R/headline-more.json" ;;
        ratio) run ratio 240 $P variants zkern2 zkern2-offload-bf16-dpu zkern2-offload-bf16-spec zkern2-offload-bf16 \
            --model "$M" --micro-batch 16 --checkpoint non_reentrant --warmup 1 --steps 3 --timeout 90 \
            --bw-json "$R/bw.json" --json "$R/ratio.json" ;;
        partial) run partial 240 $P variants zkern2 zkern2-offload-r25 zkern2-offload-r50 zkern2-offload-r75 \
            zkern2-offload --model "$M" --micro-batch 8 --checkpoint non_reentrant --warmup 1 --steps 3 --timeout 90 \
            --bw-json "$R/bw.json" --json "$R/partial.json" ;;
        speculative) run speculative 150 $P variants zkern2-offload-bf16-spec --model "$H" --micro-batch 8 \
            --checkpoint non_reentrant --warmup 1 --steps 3 --timeout 140 --bw-json "$R/bw.json" \
            --json "$R/speculative.json" ;;
        uploads) run uploads 240 $P variants zkern3-offload zkern3-offload-inline zkern3-offload-bf16-spec \
            --model "$M" --micro-batch 8 \
            --checkpoint non_reentrant --warmup 1 --steps 3 --timeout 90 --bw-json "$R/bw.json" \
            --json "$R/uploads.json" ;;
        largest) run largest 200 $P variants zkern2-offload-bf16 --model "$L" --micro-batch 2 \
            --checkpoint non_reentrant --warmup 1 --steps 2 --timeout 190 --json "$R/largest.json" ;;
        *) say "unknown step $step" ;;
    esac
done
echo "clocks after: $(clocks)" | tee -a "$R/machine.txt"
say "done"
pack
$P summary "$R"
