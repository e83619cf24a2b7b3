#!/usr/bin/env bash
# One command that sets up a fresh machine and runs the whole test suite (CPU only):
#   bash tools/test.sh [pytest args]          # everything (CI: .ci/run)
#   bash tools/test.sh -m "not slow"          # the inner loop: no whole-process, install or interpreter-model tests
# Creates .venv, installs nextn with its test extras (torch==2.13.0 CPU wheel, pinned in pyproject.toml),
# installs Debian's `prometheus` (promtool + server, used by the metrics and deploy tests) and `haproxy` (the
# rolling-restart test's load balancer) when missing and we are root, then runs pytest on min(4, cores)
# pytest-xdist workers, each test file on one worker (its module fixtures: servers, models, an install, are built
# once). NEXTN_TEST_WORKERS=N sets the number; 0 runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install -q -e '.[test]'
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v haproxy >/dev/null 2>&1 || missing+=(haproxy)
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null) \
        || echo "warning: could not install ${missing[*]}; the tests that need them will skip" >&2
fi
workers=${NEXTN_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}
if [ "$workers" -gt 4 ]; then workers=4; fi
if [ "$workers" -lt 2 ]; then workers=0; fi
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"
