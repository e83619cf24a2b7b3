"""The image's HEALTHCHECK: exit 0 when ``GET /health`` of the server in this container answers 200, else 1.

``python docker/healthcheck.py [NEXTN SERVE ARGS...]``. Without arguments it reads the server's command line
from ``/proc/1/cmdline`` (the ENTRYPOINT plus the ``docker run`` arguments; with ``docker run --init`` PID 1
is the init process, whose command line still ends with them). The port is resolved the way ``nextn serve``
resolves it (``config.settings.load_settings``: ``--port`` > ``NEXTN_PORT`` > ``--config``/``NEXTN_CONFIG``
file > default), so it follows every way of setting it; the host is always loopback (the ENTRYPOINT binds
0.0.0.0). Settings that do not validate mean the server cannot be up either: exit 1. Imports only the
standard library and ``config`` (pydantic), never torch, so running it every interval is cheap.
"""
from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

TIMEOUT_S = 4.0  # below the HEALTHCHECK --timeout


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The last value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``), None when absent."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def server_port(args: Sequence[str], environ: Mapping[str, str]) -> int:
    """The port `nextn serve ARGS` binds under `environ`. Raises ``config.settings.SettingsError``."""
    from config.settings import load_settings

    port, config = _flag_value(args, "--port"), _flag_value(args, "--config")
    return load_settings({"port": port} if port is not None else {},
                         config_file=Path(config) if config is not None else None, environ=environ).port


def main(argv: Sequence[str]) -> int:
    if argv:
        args = list(argv)
    else:
        args = Path("/proc/1/cmdline").read_bytes().decode(errors="replace").split("\0")
    try:
        port = server_port(args, os.environ)
    except ValueError as e:  # SettingsError
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1
    url = f"http://127.0.0.1:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    except OSError as e:  # refused, timed out, reset
        print(f"unhealthy: {url}: {e}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"unhealthy: {url} answered {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
