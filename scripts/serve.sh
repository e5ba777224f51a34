#!/usr/bin/env bash
# Install rayrunner and serve serve_config.yaml on http://127.0.0.1:8000 (default model: SmolLM2-135M-Instruct).
set -euo pipefail
source "$(dirname "$0")/install.sh"
# `serve run` of an invalid config never serves and never exits: check it first (one line naming the field, exit 1).
rayrunner check-config serve_config.yaml
exec serve run serve_config.yaml
