#!/usr/bin/env bash
# Installs perturbkit with its test extras at the pinned versions (constraints.txt), lints, and runs the tests, doctests and notebooks.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -c constraints.txt -e ".[test]"
ruff check perturbkit tests scripts
python -m pytest -q "$@"
