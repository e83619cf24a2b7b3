"""A model argument -> a local checkpoint directory: a directory as given, or a Hugging Face hub id downloaded.

`nextn serve ORG/NAME` works as `vllm serve ORG/NAME` does: the files the server needs (`ALLOW_PATTERNS`: the
safetensors shards and their index, config, tokenizer, chat template, generation and preprocessor configs; never
GGUF, .bin or other formats) go into huggingface_hub's standard cache (or `--download-dir`), with its progress
bars on a terminal. A path that exists always wins over an id.

huggingface_hub reads its own environment variables: HF_TOKEN (else the token `hf auth login` saved),
HF_HUB_OFFLINE (serve from the cache with no network), HF_ENDPOINT (a mirror), HF_HOME / HF_HUB_CACHE (the cache).
nextn reads none of them itself (config/settings.py stays its one reader of environment variables);
`resolve_model` logs what huggingface_hub uses.

Before any weight is fetched, config.json is downloaded alone and checked (a model type nextn serves, a
quantization it loads), and the repo's file list is checked for safetensors weights (a GGUF-only repo is named as
such). Every failure is a `HubError` whose message says what to do; the download itself is huggingface_hub's,
atomic per file (an interrupted run leaves no file half-written in the snapshot, and the next run resumes).
"""
from __future__ import annotations

import fnmatch
import json
import logging
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("nextn.hub")

#: The files `nextn serve ORG/NAME` downloads (huggingface_hub `allow_patterns`).
ALLOW_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
                  "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                  "preprocessor_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")
#: A hub model id as nextn accepts it: ORG/NAME (one slash; letters, digits, '.', '_', '-').
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_LOGIN = "log in with `hf auth login` or set HF_TOKEN=hf_... (a token from https://huggingface.co/settings/tokens)"


class HubError(RuntimeError):
    """A hub id could not be turned into a checkpoint directory; ``str(err)`` is one line saying what to do."""


@dataclass(frozen=True)
class ModelSource:
    """Where the served checkpoint lives: `path` (a local directory), and for a hub id the id, the revision asked
    for and the commit it resolved to (None for a local directory)."""

    path: Path
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None


def is_repo_id(text: str) -> bool:
    """`text` has the form of a hub model id, ORG/NAME."""
    return _REPO_ID.fullmatch(text) is not None and not text.endswith((".", "-")) and ".." not in text


def resolve_model(model: str | Path, *, revision: str | None = None, download_dir: str | Path | None = None,
                  endpoint: str | None = None, offline: bool | None = None,
                  token: str | bool | None = None) -> ModelSource:
    """The checkpoint directory for `model`: an existing directory as is; else a hub id (ORG/NAME) downloaded (or,
    offline, found) in the hub cache at `revision` (default: the main branch). `endpoint`, `offline` and `token`
    default to what huggingface_hub reads from HF_ENDPOINT, HF_HUB_OFFLINE and HF_TOKEN / the login file. Raises
    `HubError` (one line saying what to do) for a path that is neither, a repo that does not exist, a gated repo
    without access, no network and nothing cached, a repo without safetensors weights, or a checkpoint of
    another architecture or quantization."""
    path = Path(model).expanduser()
    if path.is_dir():
        return ModelSource(path)
    text = str(model)
    if path.exists():
        raise HubError(f"{text} is a file, not a checkpoint directory")
    if not is_repo_id(text):
        raise HubError(f"model directory {text} does not exist (and {text} is not a hub id of the form ORG/NAME)")
    return _download(text, revision=revision, download_dir=download_dir, endpoint=endpoint, offline=offline,
                     token=token)


def _download(repo_id: str, *, revision: str | None, download_dir: str | Path | None, endpoint: str | None,
              offline: bool | None, token: str | bool | None) -> ModelSource:
    from huggingface_hub import constants, get_token, snapshot_download

    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    offline = constants.HF_HUB_OFFLINE if offline is None else offline
    cache = Path(download_dir).expanduser() if download_dir is not None else Path(constants.HF_HUB_CACHE)
    has_token = bool(token) if token is not None else get_token() is not None
    where = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    log.info("hub: %s from %s into %s; token: %s; %s (huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE, HF_TOKEN, "
             "HF_HUB_OFFLINE)", where, endpoint, cache, "yes" if has_token else "none",
             "offline: the cache only" if offline else "online")
    if not sys.stderr.isatty():  # bars on a terminal only; a log (a container's, a pipe) gets the lines above
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    kw = dict(revision=revision, cache_dir=str(cache), endpoint=endpoint, token=token, local_files_only=offline)
    try:
        first = Path(snapshot_download(repo_id, allow_patterns=["config.json"], **kw))
        files = _cached_tree(repo_id, revision, cache)
        if files is not None:
            _check_files(repo_id, files, offline)
        _check_config(repo_id, first / "config.json")
        start = time.monotonic()
        snapshot = Path(snapshot_download(repo_id, allow_patterns=list(ALLOW_PATTERNS), **kw))
    except HubError:
        raise
    except Exception as e:  # noqa: BLE001 - huggingface_hub's errors, turned into what to do
        raise HubError(_explain(e, repo_id, revision, endpoint, cache, offline, has_token)) from None
    _check_snapshot(repo_id, snapshot)
    if not offline:
        log.info("hub: %s ready in %s (%.1f s)", where, snapshot, time.monotonic() - start)
    return ModelSource(snapshot, repo_id=repo_id, revision=revision, commit=snapshot.name)


def _cached_tree(repo_id: str, revision: str | None, cache: Path) -> dict[str, int] | None:
    """The repo's files and sizes from the listing huggingface_hub cached while fetching config.json (no network);
    None when it has none (offline, from an older cache)."""
    try:  # huggingface_hub >= 2 caches the listing; older ones do not (then the snapshot check below still runs)
        from huggingface_hub import get_cached_repo_tree

        return {f.path: f.size or 0 for f in get_cached_repo_tree(repo_id, revision=revision, cache_dir=str(cache))}
    except Exception:  # noqa: BLE001 - no listing cached
        return None


def _check_files(repo_id: str, files: dict[str, int], offline: bool) -> None:
    """The repo holds safetensors weights (else a HubError naming what it holds); logs what will be downloaded."""
    weights = [f for f in files if f.endswith(".safetensors")]
    if not weights:
        gguf = [f for f in files if f.lower().endswith(".gguf")]
        if gguf:
            raise HubError(f"{repo_id} holds GGUF files only ({len(gguf)}, e.g. {gguf[0]}), a llama.cpp format; nextn "
                           f"loads safetensors checkpoints: serve the original repo instead (often the same name "
                           f"without -GGUF, e.g. Qwen/Qwen3.5-0.8B)")
        other = sorted(f for f in files if f.endswith((".bin", ".pt", ".pth", ".msgpack", ".h5", ".onnx")))
        raise HubError(f"{repo_id} has no safetensors weights" + (f" (only {', '.join(other[:3])})" if other else "")
                       + "; nextn loads model.safetensors or sharded *.safetensors with their index")
    wanted = [f for f in files if any(fnmatch.fnmatch(f, p) for p in ALLOW_PATTERNS)]
    if not offline:
        size = sum(files[f] for f in wanted)
        log.info("hub: %s: %d of its %d files (%s), to download unless cached", repo_id, len(wanted), len(files),
                 _human(size))


def _check_config(repo_id: str, path: Path) -> None:
    """config.json describes a model nextn serves (model type, quantization), before any weight is fetched."""
    from engine.loader import CheckpointError, quantization
    from engine.model.config import SUPPORTED_MODEL_TYPES

    if not path.is_file():
        raise HubError(f"{repo_id} has no config.json; nextn serves Hugging Face checkpoints (config.json, "
                       f"safetensors weights, tokenizer.json) of Qwen3.5 models")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HubError(f"{repo_id}: config.json cannot be read ({e})") from None
    tc = raw.get("text_config") if isinstance(raw, dict) else None
    types = {raw.get("model_type"), tc.get("model_type") if isinstance(tc, dict) else None} - {None}
    if not types or not types <= set(SUPPORTED_MODEL_TYPES):
        arch = ", ".join(raw.get("architectures") or []) or "an unknown architecture"
        kind = ", ".join(sorted(map(str, types))) or "none"
        raise HubError(f"{repo_id} is a {arch} checkpoint (model_type {kind}); nextn serves Qwen3.5 models "
                       f"(model_type {', '.join(SUPPORTED_MODEL_TYPES)}), e.g. Qwen/Qwen3.5-0.8B")
    try:
        quantization(raw)
    except CheckpointError as e:
        raise HubError(f"{repo_id}: {e}") from None


def _check_snapshot(repo_id: str, snapshot: Path) -> None:
    if not any(snapshot.glob("*.safetensors")):
        raise HubError(f"{repo_id}: the snapshot in {snapshot} has no safetensors weights; nextn loads "
                       f"model.safetensors or sharded *.safetensors with their index")


def _explain(e: Exception, repo_id: str, revision: str | None, endpoint: str, cache: Path, offline: bool,
             has_token: bool) -> str:
    """One line for a huggingface_hub failure: what happened and what to do."""
    where = repo_id + (f" (revision {revision})" if revision else "")
    from huggingface_hub import errors
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    incomplete = getattr(errors, "IncompleteSnapshotError", ())  # huggingface_hub >= 2

    page = f"{endpoint}/{repo_id}"
    if isinstance(e, GatedRepoError):
        if has_token:
            return (f"{repo_id} is gated and your token has no access to it: accept its terms on {page} with the "
                    f"account of that token")
        return f"{repo_id} is gated: accept its terms on {page}, then {_LOGIN}"
    if isinstance(e, RevisionNotFoundError):
        return f"{repo_id} has no revision {revision!r}: check --revision (a branch, tag or commit of {page})"
    if isinstance(e, RepositoryNotFoundError):
        private = "" if has_token else f"; a private repo needs a token: {_LOGIN}"
        return (f"{repo_id} is neither a local directory nor a model on {endpoint}: check the id (ORG/NAME, as on "
                f"its page){private}")
    if incomplete and isinstance(e, incomplete):
        return (f"the cached copy of {where} in {cache} is incomplete (an interrupted download?): run once with "
                f"network access to finish it")
    if isinstance(e, LocalEntryNotFoundError):
        if offline:
            return (f"{where} is not in the cache {cache} and HF_HUB_OFFLINE is set: run once with network access "
                    f"(without HF_HUB_OFFLINE), or point --download-dir at a cache that holds it")
        return (f"cannot reach {endpoint} and {where} is not in the cache {cache}: check the network (or HF_ENDPOINT "
                f"for a mirror), or download it where there is network and run with HF_HUB_OFFLINE=1")
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else "?"
        if status in (401, 403):
            return f"{endpoint} refused {repo_id} (HTTP {status}): {_LOGIN}, with access to {page}"
        return f"{endpoint} failed for {where} (HTTP {status}): {_first_line(e)}; try again later"
    if isinstance(e, OSError):
        return f"cannot download {where} into {cache}: {_first_line(e)}"
    return f"cannot download {where} from {endpoint}: {type(e).__name__}: {_first_line(e)}"


def _first_line(e: Exception) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)


def _human(n: int) -> str:
    """Bytes as B / KB / MB / GB (powers of 1000, as huggingface_hub's bars print them)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} B"
