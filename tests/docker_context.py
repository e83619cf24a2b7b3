"""What `docker build` would see and do, without a docker engine: the Dockerfile's instructions, the build
context after ``.dockerignore``, and COPY into a stand-in for the image's WORKDIR.

- ``parse_dockerfile``: instructions as ``Instruction(keyword, args, stage)`` (continuations joined, comment
  and parser-directive lines dropped; ``stage`` = index of the FROM it belongs to).
- ``DockerIgnore``: BuildKit's ``.dockerignore`` rules (moby/patternmatcher): patterns are cleaned paths
  relative to the context root, ``*``/``?``/``[...]`` never cross ``/``, ``**`` spans any number of
  directories, a pattern that matches a directory also excludes everything under it, ``!`` re-includes,
  and the last matching pattern decides.
- ``materialize_context``: copies the files the build context would hold into a folder.
- ``apply_copy``: one ``COPY SRC... DEST`` (docker's rules: a source directory's contents go into DEST).
"""
from __future__ import annotations

import os
import posixpath
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str     # the rest of the (joined) line
    stage: int    # 0-based index of the FROM this instruction follows (-1: before the first FROM)


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions of a Dockerfile with the default escape character (heredocs are not supported)."""
    out: list[Instruction] = []
    stage, pending = -1, ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and pending):
            continue  # comments (directives included) and blank lines, also inside a continuation
        if not line:
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        full, pending = pending + line, ""
        keyword, _, args = full.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, args.strip(), stage))
    return out


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    """The instructions of the last stage (the image `docker build` produces without --target)."""
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def _segment_regex(pattern: str) -> str:
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):  # "**/" = zero or more directories
                out += "(?:.*/)?"
                i += 1
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                out += re.escape(c)
            else:
                body = pattern[i + 1:end]
                out += "[" + ("^" + body[1:] if body.startswith("^") else body) + "]"
                i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(c)
        i += 1
    return out


class DockerIgnore:
    """Parsed ``.dockerignore``; ``excluded(path)`` for a context-relative POSIX path."""

    def __init__(self, text: str) -> None:
        self.rules: list[tuple[bool, re.Pattern[str]]] = []  # (is exception, regex)
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            pattern = posixpath.normpath(line[1:].strip() if negate else line).lstrip("/")
            if pattern in ("", "."):
                continue
            # matches the path itself or any of its parent directories
            self.rules.append((negate, re.compile(_segment_regex(pattern) + "(?:/.*)?")))

    def excluded(self, path: str) -> bool:
        verdict = False
        for negate, rx in self.rules:
            if rx.fullmatch(path):
                verdict = not negate
        return verdict


def context_files(root: Path, ignore: DockerIgnore) -> list[str]:
    """Context-relative paths of the files `docker build root` sends (directories that are excluded
    and hold no exception are not walked)."""
    has_exceptions = any(neg for neg, _ in ignore.rules)
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        if not has_exceptions:
            dirnames[:] = [d for d in dirnames if not ignore.excluded(prefix + d)]
        files += [prefix + f for f in filenames if not ignore.excluded(prefix + f)]
    return sorted(files)


def materialize_context(root: Path, dest: Path) -> list[str]:
    """Copy the build context of `root` (its .dockerignore applied) into `dest`; returns its files."""
    ignore_file = root / ".dockerignore"
    ignore = DockerIgnore(ignore_file.read_text() if ignore_file.is_file() else "")
    files = context_files(root, ignore)
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    return files


def apply_copy(args: str, context: Path, workdir: Path) -> None:
    """Run ``COPY args`` (relative DEST = relative to `workdir`; ``--flags`` such as --chown ignored)."""
    words = [w for w in shlex.split(args) if not w.startswith("--")]
    *sources, dest = words
    target = workdir / dest
    for src in sources:
        path = context / src
        if path.is_dir():
            shutil.copytree(path, target, dirs_exist_ok=True)
        elif dest.endswith("/") or len(sources) > 1 or target.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / path.name)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
