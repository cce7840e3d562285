#!/usr/bin/env bash
# One call on a lent GPU machine: install, build, test and benchmark rocdraft on the device.
# Sized for a 10-minute run; every step has its own timeout and writes its output to $OUT
# (the device tool brings $OUT back). Run from the repository root:
#   bash scripts/device_check.sh            # OUT defaults to ./device-out
# Wheels carried along in ./wheels (e.g. amd-aiter, flash-attn builds matching the machine's
# torch) are installed without an index; the machine's own torch is kept.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
log() { echo "[device_check $(date +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
step() {  # step NAME TIMEOUT CMD...: run, keep its output, never abort the whole check
    local name=$1 limit=$2; shift 2
    log "start $name"
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    log "end $name rc=$rc"
    tail -n 5 "$OUT/$name.txt" | sed 's/^/    /' | tee -a "$OUT/summary.txt"
}

log "machine: $(nproc) cores; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || rocm-smi --showproductname 2>/dev/null | head -3)"
python -c "import torch; print('torch', torch.__version__, 'hip', torch.version.hip, 'cuda', torch.version.cuda)" | tee -a "$OUT/summary.txt"

# 1. Install: rocdraft with its test extra, keeping the machine's torch; carried wheels if any.
if ls wheels/*.whl >/dev/null 2>&1; then
    step install_wheels 180 python -m pip install --no-index --find-links wheels wheels/*.whl
fi
step install 180 python -m pip install -e ".[test]"

# 2. The HIP/CUDA extension (just-in-time build on first use).
step build_extension 240 python -c "
from rocdraft.hip_kernels import dispatch
print('extension loaded:', dispatch.hip_available(), dispatch.hip_unavailable_reason())"

# 3. Backends as the registry sees them on this machine.
step backends 60 rocdraft backends

# 4. GPU tests: vendor backends vs TORCH_SDPA, end-to-end lossless, graphs vs eager, kernels.
step gpu_tests 300 python -m pytest -q -m gpu tests -x -p no:cacheprovider
step triton_tests 240 python -m pytest -q -p no:cacheprovider tests/test_triton_kv_write.py \
    tests/test_triton_unified_attention.py tests/test_triton_draft_step.py

# 5. Benchmarks (figures for the closing note).
step bench_kv_write 60 python scripts/bench_kv_write.py --device cuda --json
step bench_attention 60 python scripts/bench_attention.py --device cuda --json
step bench_draft_loop 120 python scripts/bench_draft_loop.py --device cuda --json
step bench_drafter 60 python scripts/bench_drafter.py --json
log "done; outputs in $OUT"
