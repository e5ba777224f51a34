#!/usr/bin/env bash
# The GPU checks, on a machine with a CUDA GPU: install rayrunner (the CUDA torch build: install.sh sees the GPU) and
# run the tests marked `gpu` (skipped elsewhere), e.g. parked weights waking from pinned host memory at bus speed.
set -euo pipefail
source "$(dirname "$0")/install.sh" test
exec python -m pytest -q -m gpu "$@"
