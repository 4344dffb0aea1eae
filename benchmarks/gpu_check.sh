#!/usr/bin/env bash
# What only a machine with a GPU can check, as one script (CI has no GPU). Run from the repository root:
#     bash benchmarks/gpu_check.sh            # after `make test`'s setup (creates .venv)
# Prints each section's output; exits non-zero if a test fails. Record the results in BENCHMARKS.md.
# With OUT set to a folder, also writes there: gpu_check.log (everything printed), pytest_cuda.xml (JUnit) and
# throughput.json (every throughput measurement), smollm_one_device.json. Expected to take under 8 minutes on one
# fast GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
section() { echo; echo "=== $* (at ${SECONDS}s) ==="; }

checks() {
    local status=0
    section "device"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())"

    section "one-device exactness on CUDA (fp32, bf16) and, with 2+ GPUs, 2 processes over NCCL"
    $PY -m pytest -q tests/test_cuda.py ${OUT:+--junitxml "$OUT/pytest_cuda.xml"} || status=1

    section "CUDA tests elsewhere in the suite (precision checks)"
    $PY -m pytest -q tests/test_lightning_seam.py -k cuda || status=1

    section "memory: peak CUDA memory per process, 2 GiB model, SGD (1 process; 2 and 4 with enough GPUs)"
    local ngpu procs
    ngpu=$($PY -c "import torch; print(torch.cuda.device_count())")
    procs="1"; [ "$ngpu" -ge 2 ] && procs="$procs 2"; [ "$ngpu" -ge 4 ] && procs="$procs 4"
    $PY benchmarks/memory.py --accelerator cuda --procs $procs || status=1
    $PY benchmarks/memory.py --accelerator cuda --procs $procs --optimizer adamw || status=1

    section "data parallel p=2 x r=2 over NCCL (4+ GPUs): optimizer state sharded vs not, reduction exposed vs the planner"
    if [ "$ngpu" -ge 4 ]; then
        $PY benchmarks/data_parallel.py --accelerator cuda --stages 2 --replicas 2 --width 4096 --batch 32 \
            ${OUT:+--json "$OUT/data_parallel.json"} || status=1
    else
        echo "needs 4 GPUs, found $ngpu: skipped"
    fi

    section "tensor parallelism t=2 against t=1 over NCCL (4+ GPUs): peak CUDA memory per process and step time"
    if [ "$ngpu" -ge 4 ]; then
        $PY benchmarks/tensor_parallel_memory.py --accelerator cuda --hidden 4096 --layers 16 --heads 32 --seq 2048 \
            ${OUT:+--json "$OUT/tensor_parallel_memory.json"} || status=1
    else
        echo "needs 4 GPUs (2 stages x 2 tensor-parallel ranks), found $ngpu: skipped"
    fi

    section "expert parallelism e=2 against e=1 over NCCL (4+ GPUs): expert weights and peak CUDA memory per process, step time"
    if [ "$ngpu" -ge 4 ]; then
        # 2 stages x 2 replicas in both runs; 8 MoE layers of 16 experts 1408 wide (top-2): 1.1 B expert parameters
        $PY benchmarks/expert_parallel_memory.py --accelerator cuda --hidden 2048 --layers 8 --heads 16 --experts 16 \
            --top-k 2 --expert-width 1408 --seq 2048 --rounds 2 ${OUT:+--json "$OUT/expert_parallel_memory.json"} || status=1
    else
        echo "needs 4 GPUs (2 stages x 2 data-parallel replicas), found $ngpu: skipped"
    fi

    section "throughput on CUDA: whole model vs the engine's 2 stages on one GPU; with 2+ GPUs the NCCL pairs"
    if $PY benchmarks/pipeline_throughput.py --help 2>/dev/null | grep -q -- "--accelerator"; then
        # Width 4096, m=4 and 8, 10 warm-up + 50 timed steps per run (the CUDA defaults): expected about a minute on one GPU.
        $PY benchmarks/pipeline_throughput.py --accelerator cuda --wait-idle 5 ${OUT:+--json "$OUT/throughput.json"} \
            || status=1
    else
        echo "pipeline_throughput.py has no --accelerator option yet: skipped"
    fi
    section "SmolLM-135M-shaped training step on one GPU: plain Lightning vs 2 emulated stages (2bw, 1f1b); tokens/s, MFU"
    # 30 layers, SmolLM's vocabulary, 16 x 1024 tokens per step, bf16, AdamW; three fresh runs, about 2 minutes.
    $PY benchmarks/realistic_llama.py --one-device --accelerator cuda --precision bf16-true --peak-tflops 989 \
        --layers 30 --vocab 49152 --seq 1024 --batch 16 --microbatches 4 --optimizers adamw --steps 10 --warmup 3 \
        ${OUT:+--json "$OUT/smollm_one_device.json"} || status=1

    section "packed documents on CUDA: a packed step (flex attention) over a plain one, 2048 x 4 and 8192 x 1 tokens"
    $PY benchmarks/packed_documents.py --device cuda --steps 8 --shapes 2048x4 8192x1 || status=1

    section "eager vs compiled layers on CUDA (m=4)"
    $PY benchmarks/pipeline_throughput.py --compile --accelerator cuda --microbatches 4 --wait-idle 5 || status=1
    section "done"
    return $status
}

if [ -n "${OUT:-}" ] && mkdir -p "$OUT"; then
    checks 2>&1 | tee "$OUT/gpu_check.log"
    exit "${PIPESTATUS[0]}"
fi
checks
