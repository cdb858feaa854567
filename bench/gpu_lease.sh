#!/bin/bash
# One call on a lent GPU machine (the device tool; ../shared/GPU.md's list): build zkern on the bare machine, then
# run the named steps in order, each under its own limit, so that one that hangs costs only itself. Everything a
# step writes lands in $OUT/results.tgz (re-packed after every step, so a call cut off at its limit still brings
# back what finished) and the whole log in $OUT/lease.log.
#
#   bash bench/gpu_lease.sh BUDGET_S STEP...     steps: env tests retests alltests kernels engine0..engine3
#                                                 offload2 offload3 verify
#
# The machine's python3 holds torch; nothing is installed into it: the extension is built in place.
# Test steps cap each process's threads (OMP_NUM_THREADS): 8-14 pytest processes on 16 cores, each with a thread
# per core, made two tests run past their 150 s limit on the first H100 call. Plan with the first calls' times
# (bench/results/h100-2026-11-25-lease-*.log): the build ~45-60 s, the six GPU test files ~250 s, the kernels suite
# ~30 s, one engine stage at 1b ~100-130 s (its peers included).
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
unset TRITON_INTERPRET
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
say() { echo "[lease +$(( $(date +%s) - T0 ))s] $*"; }
pack() { tar czf "$OUT/results.tgz" "$R"; }
# run NAME MAX_S CMD...: at most MAX_S seconds and never past the budget.
run() {
    local name=$1 max=$2
    shift 2
    local limit
    limit=$(left)
    ((limit > max)) && limit=$max
    if ((limit < 20)); then say "$name: skipped, budget spent"; return; fi
    say "$name: start (limit ${limit}s): $*"
    timeout -k 5 "$limit" "$@"
    say "$name: exit $?"
    pack
}

say "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c "import torch, triton, transformers, accelerate, sys; print(sys.version.split()[0], 'torch', \
torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', \
transformers.__version__, 'accelerate', accelerate.__version__)"
nproc
free -g | head -2
say "build the CPU extension in place"
python3 setup.py -q build_ext --inplace -j 16 >"$R/build.log" 2>&1 || { tail -30 "$R/build.log"; pack; exit 1; }
say "built"

for step in "$@"; do
    case $step in
        env) run env 60 sh -c "python3 -m zkern.env_report --json > $R/env.json" ;;
        tests) OMP_NUM_THREADS=2 run tests 240 python3 -m pytest -q -p no:cacheprovider \
            -p bench.lease_failures -n 12 --timeout 150 --durations 15 --junitxml "$R/tests.xml" tests/test_triton.py \
            tests/test_gpu.py tests/test_cuda_kernels.py tests/test_cuda_shared.py tests/test_bf16_state.py \
            tests/test_layout.py ;;
        retests) OMP_NUM_THREADS=2 run retests 170 python3 -m pytest -q -p no:cacheprovider -p bench.lease_failures \
            -n 8 --timeout 150 --junitxml "$R/retests.xml" tests/test_cuda_kernels.py tests/test_triton.py \
            tests/test_bf16_state.py ;;
        alltests) OMP_NUM_THREADS=1 run alltests 540 python3 -m pytest tests -q -p no:cacheprovider \
            -p bench.lease_failures -n 14 --timeout 300 -m "gpu or not dist" \
            --junitxml "$R/alltests.xml" ;;
        kernels) run kernels 150 python3 bench/run.py --suite kernels --json "$R/kernels.json" \
            --gate bench/gates.toml ;;
        engine[0-3]) run "$step" 200 python3 bench/run.py --stage "${step#engine}" --model 1b \
            --json "$R/1b-stage${step#engine}.json" ;;
        offload[23]) run "$step" 300 python3 bench/run.py --stage "${step#offload}" --model 1b --offload \
            --steps 8 --json "$R/1b-offload-stage${step#offload}.json" ;;
        verify) run verify 200 python3 -m zkern.verify --device cuda --json "$R/verify.json" ;;
        *) say "unknown step $step" ;;
    esac
done
say "done"
pack
