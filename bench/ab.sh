#!/usr/bin/env bash
# Decode speed of an older commit against this tree, interleaved on one box: `nextn bench spec` on the demo (the
# engine alone, one session, plain greedy and K = 3, best of 3 per run) run alternately on OLD_REV (a temporary
# git worktree, the same .venv, its own C-kernel build) and on this tree, ROUNDS times. Prints each run's tokens/s
# and the median of the rounds' new/old ratios (> 1: this tree is faster).
# Usage: bash bench/ab.sh OLD_REV [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
old_rev=$1
rounds=${2:-4}
old=$(mktemp -d)/old
git worktree add -q --detach "$old" "$old_rev"
trap 'git worktree remove --force "$old"' EXIT
run() {  # $1: source tree -> "plain_tok_s k3_tok_s"
    PYTHONPATH="$1" OMP_NUM_THREADS=1 .venv/bin/python -c \
        'import sys; from server.cli import main; sys.argv[0] = "nextn"; sys.exit(main())' bench spec models/demo --k 3 --max-tokens 128 \
        --repeat 3 --json | .venv/bin/python -c 'import json,sys; r=json.load(sys.stdin); print(r["plain"]["tok_s"], r["rows"][0]["tok_s"])'
}
ratios=()
for i in $(seq "$rounds"); do
    read -r op o3 < <(run "$old")
    read -r np n3 < <(run "$PWD")
    echo "round $i: old plain $op K=3 $o3 | new plain $np K=3 $n3 tok/s"
    ratios+=("$op $o3 $np $n3")
done
printf '%s\n' "${ratios[@]}" | .venv/bin/python -c '
import statistics, sys
rows = [list(map(float, l.split())) for l in sys.stdin if l.strip()]
p = [r[2] / r[0] for r in rows]; k = [r[3] / r[1] for r in rows]
print(f"new/old, median of {len(rows)} rounds: plain {statistics.median(p):.3f}x (range {min(p):.3f}-{max(p):.3f}), "
      f"K=3 {statistics.median(k):.3f}x (range {min(k):.3f}-{max(k):.3f})")'
