#!/usr/bin/env bash
# Install rayrunner with its test extras, lint and type-check it, and run the whole test suite on a local cluster.
set -euo pipefail
source "$(dirname "$0")/install.sh" test
ruff check rayrunner tests bench
mypy
exec python -m pytest -q "$@"
