"""A checkpoint's recommended sampling settings (its generation_config.json), as vLLM applies them.

vLLM's rule (`ModelConfig.get_diff_sampling_param`): with `--generation-config auto` (the default) the model's
generation_config.json, with a directory that directory's generation_config.json, with `vllm` nothing; then
`--override-generation-config JSON` is laid over it; of the result only temperature, top_p, top_k, min_p,
repetition_penalty and max_new_tokens (-> the default max_tokens) are used, and only where they are set
(do_sample and the rest are ignored). They apply to a request that leaves the field unset; a request's own value
always wins, so `temperature: 0` stays the exact greedy path. No HTTP here: the server applies them per request.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

#: generation_config.json fields that become request defaults (max_new_tokens is the request's max_tokens).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
#: `--generation-config` values besides a directory.
MODES = ("auto", "vllm")
FILE_NAME = "generation_config.json"


class GenerationConfigError(ValueError):
    """A generation config cannot be used; ``str(err)`` is one line naming the file or flag and the field."""


@dataclass(frozen=True)
class GenerationDefaults:
    """Per-request defaults for unset sampling fields (None: the server's built-in default), and where they came
    from (`source`, for the startup log)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    source: str = "none"

    def values(self) -> dict[str, float | int]:
        """The defaults that are set, by request field name (max_tokens, not max_new_tokens)."""
        return {f.name: v for f in fields(self) if f.name != "source" and (v := getattr(self, f.name)) is not None}

    def describe(self) -> str:
        """One log line: the values and their source."""
        vals = " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.values().items())
        if not vals:
            return f"generation defaults: none, the built-in ones apply ({self.source})"
        return f"generation defaults {vals} ({self.source}); a request's own values win"


def _check(name: str, value: Any, where: str) -> float | int:
    """One field's value, range-checked as the request field is (vLLM's ranges)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise GenerationConfigError(f"{where}: {name} must be a number, got {value!r}")
    ok = {"temperature": value >= 0, "top_p": 0 < value <= 1, "min_p": 0 <= value <= 1,
          "repetition_penalty": value > 0,
          "top_k": float(value).is_integer() and value >= -1,
          "max_new_tokens": float(value).is_integer() and value >= 1}[name]
    if not ok:
        raise GenerationConfigError(f"{where}: {name} {value!r} is out of range")
    return int(value) if name in ("top_k", "max_new_tokens") else float(value)


def load_generation_defaults(mode: str, model_dir: str | Path,
                             override: Mapping[str, Any] | None = None) -> GenerationDefaults:
    """The defaults for `--generation-config mode` (auto: `model_dir`'s generation_config.json; vllm: none; else a
    directory holding one) with `override` (`--override-generation-config`) laid over them. A missing file means no
    defaults. Raises `GenerationConfigError` for unreadable JSON, an unknown override key or a value out of range."""
    raw: dict[str, Any] = {}
    if mode == "vllm":
        source = "--generation-config vllm: the built-in defaults"
    else:
        path = (Path(model_dir) if mode == "auto" else Path(mode)) / FILE_NAME
        source = f"from {path}"
        if path.is_file():
            try:
                loaded = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise GenerationConfigError(f"{path} cannot be read: {e}") from None
            if not isinstance(loaded, dict):
                raise GenerationConfigError(f"{path} must hold a JSON object")
            raw = {k: loaded[k] for k in SAMPLING_FIELDS if loaded.get(k) is not None}
            raw = {k: _check(k, v, str(path)) for k, v in raw.items()}
        elif mode != "auto":
            raise GenerationConfigError(f"--generation-config {mode}: no {FILE_NAME} there")
        else:
            source = f"{path} does not exist"
    if override:
        unknown = sorted(set(override) - set(SAMPLING_FIELDS))
        if unknown:
            raise GenerationConfigError(f"--override-generation-config: unknown field(s) {unknown}; the fields are "
                                        f"{', '.join(SAMPLING_FIELDS)}")
        given = {k: _check(k, v, "--override-generation-config") for k, v in override.items() if v is not None}
        raw.update(given)
        source += f", overridden by --override-generation-config {json.dumps(dict(override), sort_keys=True)}"
    max_tokens = raw.pop("max_new_tokens", None)
    return GenerationDefaults(**raw, max_tokens=max_tokens, source=source)  # type: ignore[arg-type]
