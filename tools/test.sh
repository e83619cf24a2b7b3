#!/usr/bin/env bash
# One command that sets up a fresh machine and runs the whole test suite (CPU only):
#   bash tools/test.sh [pytest args]
# Creates .venv, installs nextn with its test extras (torch==2.13.0 CPU wheel, pinned in pyproject.toml),
# installs Debian's `prometheus` (promtool + server, used by the metrics tests) when missing and we are root,
# then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install -q -e '.[test]'
if ! command -v promtool >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
        || echo "warning: could not install prometheus; the promtool/Prometheus tests will skip" >&2
fi
exec .venv/bin/python -m pytest "$@"
