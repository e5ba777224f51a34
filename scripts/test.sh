#!/usr/bin/env bash
# Install rayrunner with its test extras, lint and type-check it, and run the whole test suite on a local cluster.
set -euo pipefail
source "$(dirname "$0")/install.sh" test
# vLLM's own venv, for the vllm backend's tests, installs meanwhile (tests/integration/test_vllm_backend.py waits).
bash scripts/install_vllm.sh &
ruff check rayrunner tests bench
mypy
exec python -m pytest -q "$@"
