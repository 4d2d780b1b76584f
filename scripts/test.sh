#!/usr/bin/env bash
# Installs perturbkit with its test extras, lints, and runs the tests, doctests and notebooks.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -e ".[test]"
ruff check perturbkit tests scripts
python -m pytest -q "$@"
