#!/usr/bin/env bash
# CPU self-consistency + speed gate on the bundled demo model: per K, tok/s, ratio vs plain greedy (same run),
# acceptance, tokens per round, per-position rates, PASS only when the output is identical to plain greedy.
# Usage: bash bench/spec_cpu.sh [extra `nextn bench spec` flags, e.g. --json]
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/nextn bench spec models/demo --k 1..4 --max-tokens 128 --repeat 3 "$@"
