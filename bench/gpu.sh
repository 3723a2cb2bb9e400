#!/usr/bin/env bash
# Tandem decode benchmark on one NVIDIA GPU, in one command (about 3-4 minutes):
#
#     bash bench/gpu.sh                 # from the repository root (or anywhere: it cd's there)
#     OUT=/some/dir bash bench/gpu.sh   # also keep the JSON files there
#
# Needs only torch (CUDA build), transformers and numpy (click optional); nothing is
# installed and no network is used: the models are random-weight Llama-architecture
# models (SmolLM2-135M shape and Llama-3.2-1B shape) built in memory.
#
# 1. Correctness pre-check: pipelined == blocking tokens on the GPU (bf16, CUDA graphs);
#    stops here, loudly, if they differ.
# 2. Decode table per model: bf16, CUDA graphs, 1 and 32 streams, blocking vs pipelined,
#    device idle fraction from CUDA events (the engine's bubble meter), host ms per step,
#    and transformers generate on the same weights and prompts as the baseline.
# 3. The zombie-tax case (random-135m, 1 stream, ~110-token answer ending on a stop token).
# 4. A short summary table, printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-$(command -v python3 || command -v python)}"
DIR="${OUT:-$(mktemp -d /tmp/tandem-gpu-bench.XXXXXX)}"
mkdir -p "$DIR"
TOKENS="${TOKENS:-128}"
REPEATS="${REPEATS:-3}"
DEVICE="${DEVICE:-cuda}"                    # DEVICE=cpu MODELS=tiny-random: a dry run of this script anywhere
MODELS="${MODELS:-random-135m random-1b}"
PRECHECK_MODEL="${PRECHECK_MODEL:-random-135m}"
START=$SECONDS

echo "== Tandem GPU decode benchmark ($(date -u '+%Y-%m-%d %H:%M:%S UTC')), results in $DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null || true
"$PY" -c "import torch, transformers, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'| transformers', transformers.__version__, '| numpy', numpy.__version__, '| cpus', __import__('os').cpu_count())" \
    || { echo "FAILED: torch/transformers/numpy not importable with $PY"; exit 1; }
lscpu 2>/dev/null | grep -E "Model name|^CPU\(s\)" || true

echo "== 1/4 correctness pre-check (pipelined == blocking on the GPU)"
if ! timeout 120 "$PY" -m bench.gpu_check precheck "$PRECHECK_MODEL" "$DEVICE"; then
    echo "!!!! PRECHECK FAILED: pipelined and blocking disagree (or CUDA is unusable); not benchmarking."
    exit 1
fi
echo "   [$((SECONDS - START)) s]"

run_decode() {  # name, time limit, extra options
    local model=$1 limit=$2; shift 2
    echo "== decode $model (limit ${limit}s)"
    timeout "$limit" "$PY" -m bench.decode --model "$model" --device "$DEVICE" --streams 1,32 \
        --tokens "$TOKENS" --repeats "$REPEATS" --mode blocking,pipelined --baseline transformers \
        --json-out "$DIR/decode-$model.json" "$@"
    local rc=$?
    [ $rc -eq 0 ] || echo "!!!! decode $model exited with $rc (124 = time limit); partial JSON kept if any"
    echo "   [$((SECONDS - START)) s]"
}
# random-135m (and the zombie case) within 90 s, random-1b within 130 s: 5 minutes in all at most.
first=1
for model in $MODELS; do
    if [ $first -eq 1 ]; then
        echo "== 2/4 $model (+ zombie case)"; run_decode "$model" 90 --zombie-case; first=0
    else
        echo "== 3/4 $model"; run_decode "$model" 130
    fi
done

echo "== 4/4 summary ($((SECONDS - START)) s in all)"
files=()
for model in $MODELS; do files+=("$DIR/decode-$model.json"); done
"$PY" -m bench.gpu_check summary "${files[@]}" | tee "$DIR/summary.txt"
