#!/usr/bin/env bash
# Install rayrunner and serve serve_config.yaml on http://127.0.0.1:8000 (default model: SmolLM2-135M-Instruct).
set -euo pipefail
source "$(dirname "$0")/install.sh"
exec serve run serve_config.yaml
