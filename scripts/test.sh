#!/usr/bin/env bash
# Install rayrunner with its test extras, lint and type-check it, and run the whole test suite on a local cluster.
# `bash scripts/test.sh --fast [pytest args]`: the contributors' tier (~2 min), with the install already done (.venv):
# ruff, mypy and the tests not marked `slow` (no Ray cluster, no `serve run`, no real model taking seconds to load:
# tests/conftest.py says which). CI runs the whole suite, without `--fast`.
set -euo pipefail
if [ "${1:-}" = --fast ]; then
  shift
  cd "$(dirname "$0")/.."
  if [ ! -x .venv/bin/python ]; then
    echo "no .venv here: run \`bash scripts/test.sh\` (or \`source scripts/install.sh test\`) once first" >&2
    exit 2
  fi
  export PATH="$PWD/.venv/bin:$PATH" RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0  # as install.sh sets them
  source scripts/cluster_env.sh
  ruff check rayrunner tests bench
  mypy
  exec python -m pytest -q -m "not slow" "$@"
fi
source "$(dirname "$0")/install.sh" test
# vLLM's own venv, for the vllm backend's tests, installs meanwhile (tests/integration/test_vllm_backend.py waits).
bash scripts/install_vllm.sh &
ruff check rayrunner tests bench
mypy
exec python -m pytest -q "$@"
