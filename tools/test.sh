#!/usr/bin/env bash
# One command that sets up a fresh machine and runs the whole test suite (CPU only):
#   bash tools/test.sh [pytest args]
# Creates .venv, installs nextn with its test extras (torch==2.13.0 CPU wheel, pinned in pyproject.toml),
# installs Debian's `prometheus` (promtool + server, used by the metrics and deploy tests) and `haproxy` (the
# rolling-restart test's load balancer) when missing and we are root, then runs pytest.
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
exec .venv/bin/python -m pytest "$@"
