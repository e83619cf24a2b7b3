"""Engine-level CLI subcommands (`nextn generate`, `nextn bench spec`, `nextn dspark-extract`).

`register(subparsers)` adds them to the `nextn` argparse tree; each sets `func` to its handler.
"""
from __future__ import annotations

import argparse


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Add the engine subcommands to `subparsers`; each parser gets `func(args) -> int`."""
    # Filled in by the engine work; kept importable from the start so server/cli.py can wire it.
    return None
