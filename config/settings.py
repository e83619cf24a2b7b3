"""Typed settings for `nextn serve`: one frozen pydantic model, four layered sources.

Precedence (highest first): command line > ``NEXTN_*`` environment variables > TOML file
(``--config FILE`` / ``NEXTN_CONFIG``, else ``config/default.toml``) > the field defaults below.
This module is the only place in nextn that reads environment variables.

Every field ``foo_bar`` is the flag ``--foo-bar``, the variable ``NEXTN_FOO_BAR`` and the TOML key
``foo_bar`` in the ``[serve]`` table (``model_dir`` is the positional ``MODEL_DIR`` on the command line).
A bad value from any source raises ``SettingsError`` whose message is one line naming the setting,
the value and where it came from. Values left on ``auto`` (or unset) are resolved by ``resolve`` from the
machine and the checkpoint's config; the caller logs every such automatic choice.
"""
from __future__ import annotations

import json
import logging
import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from engine.hub import is_repo_id  # no torch at import: only a download imports it

log = logging.getLogger("nextn.config")

REPO_ROOT = Path(__file__).resolve().parents[1]
#: The bundled demo checkpoint (present in a source checkout; `pip install -e .` keeps it reachable).
DEMO_MODEL_DIR = REPO_ROOT / "models" / "demo"
DEFAULT_CONFIG_FILE = Path(__file__).resolve().parent / "default.toml"
ENV_PREFIX = "NEXTN_"
#: `--config` itself has an environment variable but is not a setting.
CONFIG_ENV = ENV_PREFIX + "CONFIG"
#: Without --max-model-len the context is min(the checkpoint's max_position_embeddings, this): a
#: Qwen3.5 checkpoint advertises 262144 positions, far more than the KV a demo or a CPU should hold.
DEFAULT_MAX_MODEL_LEN_CAP = 4096
#: The engine's telemetry tracks this many draft positions (engine.spec.SPEC_TELEM_POS).
MAX_SPEC_TOKENS = 8
#: --speculative-config methods that name this server's MTP drafting (vLLM's spellings).
SPEC_METHODS = ("mtp", "qwen3_5_mtp", "qwen3_next_mtp", "qwen3_5_moe_mtp", "deepseek_mtp")
#: Without --max-queue the admission queue is sized from memory: one waiting request may hold its prompt ids on
#: both sides of the engine pipe and its detokenizer and grammar state, bounded by QUEUE_BYTES_PER_TOKEN per token of
#: the context plus QUEUE_BYTES_PER_REQUEST; the queue may fill QUEUE_MEMORY_SHARE of the available memory, and the
#: bound stays within DEFAULT_MAX_QUEUE_RANGE (a burst of hundreds always queues, as on vLLM, whose queue has no
#: bound at all).
QUEUE_BYTES_PER_TOKEN = 64
QUEUE_BYTES_PER_REQUEST = 64 * 1024
QUEUE_MEMORY_SHARE = 8  # 1/8 of the available memory
DEFAULT_MAX_QUEUE_RANGE = (1024, 16384)
#: --max-logprobs default: vLLM's (the OpenAI chat API's top_logprobs bound); -1 = no bound (the vocabulary).
DEFAULT_MAX_LOGPROBS = 20
FULL_VOCAB_LOGPROB_ENTRIES = 1 << 24  # logprobs -1 (the whole vocabulary): at most this many entries in a response
#: Images per prompt without --limit-mm-per-prompt. vLLM allows 999; each http(s) image may be fetched up to
#: --media-max-mb, so the default here bounds what one request can make the server fetch and decode.
DEFAULT_IMAGES_PER_PROMPT = 16
#: Modalities --limit-mm-per-prompt names (vLLM's keys); only images are served, the others may be given as 0.
MM_MODALITIES = ("image", "video", "audio")
#: Keys of --mm-processor-kwargs and of a request's `mm_processor_kwargs` (the image processor's pixel bounds, in
#: either of transformers' spellings).
MM_PROCESSOR_KEYS = ("min_pixels", "max_pixels", "size")


class SettingsError(ValueError):
    """A setting is invalid; ``str(err)`` is one line fit for stderr."""


def mm_limits(value: Mapping[str, Any]) -> dict[str, int]:
    """vLLM's --limit-mm-per-prompt: modality -> count (`{"image": 4, "video": 0}`), a count also given as
    `{"count": N, ...}` (vLLM's newer form); images default to DEFAULT_IMAGES_PER_PROMPT. ValueError naming what is
    wrong."""
    out = {"image": DEFAULT_IMAGES_PER_PROMPT}
    for key, v in value.items():
        if key not in MM_MODALITIES:
            raise ValueError(f"unknown modality {key!r} (known: {', '.join(MM_MODALITIES)})")
        n = v.get("count") if isinstance(v, dict) else v
        if type(n) is not int or n < 0:
            raise ValueError(f"{key} needs a count >= 0 (or {{\"count\": N}}), got {v!r}")
        out[key] = n
    return out


def pixel_bounds(value: Any, where: str = "mm_processor_kwargs") -> tuple[int | None, int | None]:
    """(min_pixels, max_pixels) of an image-processor kwargs object (--mm-processor-kwargs, a request's
    `mm_processor_kwargs`): `min_pixels` / `max_pixels`, or transformers' `size` {shortest_edge, longest_edge}
    (both pixel counts); None where not given. ValueError naming `where` and an unknown key or a bad value."""
    if not isinstance(value, dict):
        raise ValueError(f'{where} must be an object such as {{"max_pixels": 1048576}}')
    unknown = sorted(set(value) - set(MM_PROCESSOR_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (supported: "
                         f"{', '.join(MM_PROCESSOR_KEYS)})")
    size = value.get("size") or {}
    if not isinstance(size, dict) or set(size) - {"shortest_edge", "longest_edge"}:
        raise ValueError(f"{where}: size must be an object with shortest_edge and/or longest_edge")
    out = []
    for name, alias in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        v = value.get(name, size.get(alias))
        if v is not None and (type(v) is not int or v <= 0):
            raise ValueError(f"{where}: {name} must be a positive integer (a pixel count), got {v!r}")
        out.append(v)
    lo, hi = out
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"{where}: min_pixels {lo} is over max_pixels {hi}")
    return lo, hi


class ServeSettings(BaseModel):
    """Every `nextn serve` setting. Frozen: build a new one (``model_copy``) to change a value."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_dir: Path = Field(DEMO_MODEL_DIR, validate_default=True,
                            description="HF checkpoint directory, or a Hugging Face hub id ORG/NAME, downloaded into "
                                        "the hub cache (a path that exists wins) (default: the bundled demo)")
    revision: str | None = Field(
        None, min_length=1, description="hub ids: the branch, tag or commit to download (default: main)")
    download_dir: Path | None = Field(
        None, description="hub ids: the cache directory to download into and load from (default: huggingface_hub's "
                          "cache, HF_HUB_CACHE or ~/.cache/huggingface/hub)")
    host: str = Field("127.0.0.1", min_length=1, description="address to bind")
    port: int = Field(8000, ge=1, le=65535, description="TCP port to bind")
    served_model_name: str | None = Field(
        None, min_length=1, description="model id clients send and responses report; on the command line further "
                                        "names are aliases (vLLM's nargs) (default: the hub id, or MODEL_DIR's name)")
    served_model_aliases: tuple[str, ...] = Field(
        (), description="more names clients may send as `model` (responses report served_model_name); on the command "
                        "line: --served-model-name NAME ALIAS...; in the environment: names separated by spaces")
    num_speculative_tokens: int = Field(
        3, ge=0, le=MAX_SPEC_TOKENS, description="MTP draft tokens per round K (0 = plain decode)")
    spec_draft_p_min: float = Field(
        0.0, ge=0.0, le=1.0, description="stop drafting when the draft token's probability is below this")
    spec_capmax: int = Field(7, ge=1, le=MAX_SPEC_TOKENS, description="upper bound on K")
    spec_adaptive: bool = Field(
        True, description="choose each row's draft count 0..K every round from its measured acceptance and the "
                          "profiled cost of a round (--no-spec-adaptive: every round drafts K)")
    speculative_config: dict[str, Any] | None = Field(
        None, description="vLLM's JSON: {\"method\": \"mtp\", \"num_speculative_tokens\": K, "
                          "\"num_speculative_tokens_per_batch_size\": {\"BATCH\": K, ...}} (K cap for batches up to "
                          "BATCH rows); sets num_speculative_tokens")
    max_model_len: int | None = Field(
        None, ge=2, description=f"context length, prompt + completion (default: min(checkpoint, "
                                f"{DEFAULT_MAX_MODEL_LEN_CAP}))")
    max_num_seqs: int = Field(8, ge=1, description="sessions decoded together in one batched round (state-pool slots)")
    max_num_batched_tokens: int = Field(
        512, ge=1, description="tokens one scheduler step may run (the round's verify tokens, then prompt blocks of "
                               "the 256-token prefill grid; a step with a waiting prompt runs at least one block)")
    prefix_cache_gb: float | None = Field(
        None, ge=0, allow_inf_nan=False,
        description="memory for the exact prefix cache in GiB (host RAM on cpu, device memory on cuda; 0 = off) "
                    "(default: 40 percent of the memory left free after the state pool, at most 8 GiB on cpu)")
    max_queue: int | None = Field(
        None, ge=1, description="sessions waiting for a slot before requests get 429 with Retry-After (default: sized "
                                f"from the available memory, {DEFAULT_MAX_QUEUE_RANGE[0]} to "
                                f"{DEFAULT_MAX_QUEUE_RANGE[1]}; set it for back-pressure)")
    max_logprobs: int = Field(
        DEFAULT_MAX_LOGPROBS, ge=-1, description="vLLM's: most logprobs a request may ask for per token "
                                                 "(top_logprobs, completions logprobs, prompt_logprobs; a request's "
                                                 "-1 means the whole vocabulary); -1 = no bound")
    generation_config: str = Field(
        "auto", min_length=1, description="vLLM's: where request defaults for unset temperature, top_p, top_k, min_p, "
                                          "repetition_penalty and max_tokens (max_new_tokens) come from: auto = the "
                                          "checkpoint's generation_config.json, vllm = none (the built-in defaults), "
                                          "or a directory holding a generation_config.json")
    override_generation_config: dict[str, float] | None = Field(
        None, description="vLLM's: a JSON object laid over the generation config, e.g. '{\"temperature\": 0.5}' "
                          "(those six fields only)")
    api_key: SecretStr | None = Field(
        None, min_length=1, description="require `Authorization: Bearer KEY` on every /v1 route (default: no key; "
                                        "never logged)")
    allow_special_tokens_in_content: bool = Field(
        False, description="tokenize special-token text inside chat messages (<|im_start|>...) as control "
                           "tokens, as transformers does; only for trusted callers (default: plain text)")
    timeout_header: float = Field(
        10.0, gt=0, description="seconds a connection has to send a request's headers (then it is closed)")
    timeout_body: float = Field(60.0, gt=0, description="seconds a request has to send its body (then 408)")
    timeout_keep_alive: float = Field(5.0, gt=0, description="seconds an idle keep-alive connection stays open")
    max_connections: int = Field(
        512, ge=1, description="open HTTP connections; a connection beyond it is closed at once")
    # --- structured outputs (grammar/): bounds on what one request's grammar may cost ---
    grammar_max_bytes: int = Field(
        256 * 1024, ge=1, description="largest grammar source (JSON schema, regex, lark, choices, tools) in bytes; "
                                      "larger ones get 400")
    grammar_compile_timeout: float = Field(
        10.0, gt=0, description="seconds a grammar may take to compile; slower ones get 400")
    grammar_cache_size: int = Field(256, ge=1, description="compiled grammars kept (LRU)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available, else cpu")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto = float32 on cpu, the checkpoint's dtype on cuda")
    cpu_threads: int | None = Field(
        None, ge=1, description="torch threads on a cpu device (default: OMP_NUM_THREADS when set, else the usable "
                                "cores minus one, left to the HTTP event loop; at least 1)")
    cpu_kernel_threads: int | None = Field(
        None, ge=1, le=2, description="threads nextn's C kernels use on a cpu device: 1, or 2 (the calling thread "
                                      "and one helper share a GEMM's column blocks and a step's rows when a job is "
                                      "large enough; the bits never depend on it) (default: min(2, usable cores))")
    cpu_kernel: bool = Field(
        True, description="on a cpu device with a float32 model, run the decode / verify / draft steps and the "
                          "prefill on nextn's C kernels (GDN and attention token steps, RMSNorm; GEMMs and "
                          "MLP with AVX2 + FMA), "
                          "built with the system C compiler on first use (torch ops when there is none; "
                          "--no-cpu-kernel: always torch ops)")
    kernels: Literal["auto", "strict"] = Field(
        "auto", description="cuda: every Triton kernel is checked against its torch twin at startup; auto = a kernel "
                            "that fails runs its twin instead (logged, in /health and the nextn_kernel_info gauge), "
                            "strict = any failed kernel or CUDA graph capture stops the server (exit 1; for a GPU CI)")
    # --- images (vLLM's flags) ---
    limit_mm_per_prompt: dict[str, Any] = Field(
        {"image": DEFAULT_IMAGES_PER_PROMPT}, validate_default=True,
        description='JSON: most items per prompt by modality, vLLM\'s form, e.g. \'{"image": 4}\' (images only; '
                    f'default {{"image": {DEFAULT_IMAGES_PER_PROMPT}}}); more images in a request is a 400')
    mm_processor_kwargs: dict[str, Any] | None = Field(
        None, description='JSON: image preprocessing overrides, {"min_pixels": N, "max_pixels": N} (or "size": '
                          '{"shortest_edge", "longest_edge"}); a request\'s own mm_processor_kwargs override these '
                          "(default: the checkpoint's preprocessor_config.json)")
    allowed_media_domains: tuple[str, ...] | None = Field(
        None, description="host names http(s) image URLs may name (in the environment: separated by spaces or "
                          "commas) (default: any host)")
    allowed_local_media_path: Path | None = Field(
        None, description="directory file:// image URLs may read from (default: file:// is refused)")
    media_fetch_timeout: float = Field(
        5.0, gt=0, description="seconds one http(s) image fetch may take (vLLM's VLLM_IMAGE_FETCH_TIMEOUT)")
    media_max_mb: float = Field(
        20.0, gt=0, allow_inf_nan=False, description="largest encoded image in MiB (an http body, a file, a data: "
                                                    "URL's payload)")
    media_allow_redirects: bool = Field(
        False, description="follow http redirects for image URLs (each hop checked against the allowed domains)")
    language_model_only: bool = Field(
        False, description="load the text model only (no vision tower: its memory is saved); requests with images "
                           "get 400")
    mm_encoder_cache_mb: int = Field(
        512, ge=0, description="memory for the engine's image-embedding cache in MiB (a repeated image is not "
                               "encoded again; 0 = off)")
    engine_process: bool = Field(
        True, description="run the engine (model, scheduler) in its own process, so the HTTP event loop's work "
                          "never waits on the engine's GIL nor the engine on the loop's (--no-engine-process: one "
                          "process)")
    metrics_compat: Literal["none", "vllm"] = Field(
        "none", description="vllm = also expose vLLM's `vllm:` metric names on /metrics")
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field("info", description="log level")
    # research door (README "Research"): read once at process start; no request field, header or route reaches it
    research_opti_controller_q: float | None = Field(
        None, ge=0.0, le=1.0, allow_inf_nan=False,
        description="research door, diagnostic only (measured NO-GO): arm the OPTIPIPE increment-2 controller "
                    "with threshold Q on p(d1)*p(d2), a finite number in [0, 1] (default: absent = off)")

    @field_validator("device", "dtype", "kernels", "metrics_compat", "log_level", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v

    @field_validator("model_dir")
    @classmethod
    def _model_dir_exists(cls, v: Path) -> Path:
        if not v.is_dir() and (v.exists() or not is_repo_id(str(v))):
            hint = " (the bundled demo model is missing; pass a checkpoint directory)" if v == DEMO_MODEL_DIR else ""
            raise ValueError(f"model directory {v} does not exist{hint} (nor is it a hub id ORG/NAME)")
        return v

    @field_validator("served_model_aliases", mode="before")
    @classmethod
    def _split_names(cls, v: Any) -> Any:
        return tuple(v.split()) if isinstance(v, str) else v

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _mm_limits(cls, v: dict[str, Any]) -> dict[str, int]:
        return mm_limits(v)

    @field_validator("mm_processor_kwargs")
    @classmethod
    def _pixel_bounds(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            pixel_bounds(v)
        return v

    @field_validator("allowed_media_domains", mode="before")
    @classmethod
    def _domains(cls, v: Any) -> Any:
        return v.replace(",", " ").split() if isinstance(v, str) else v  # the environment's "a.example b.example"

    @field_validator("override_generation_config", "limit_mm_per_prompt", "mm_processor_kwargs", "speculative_config",
                     mode="before")
    @classmethod
    def _parse_json(cls, v: Any) -> Any:
        return json_object(v)

    @model_validator(mode="before")
    @classmethod
    def _speculative_config(cls, data: Any) -> Any:
        """--speculative-config's num_speculative_tokens becomes the setting (it wins over num_speculative_tokens from
        any source: the config file's default is one)."""
        if not isinstance(data, dict) or data.get("speculative_config") is None:
            return data
        sc = json_object(data["speculative_config"])
        data = {**data, "speculative_config": sc}
        if "num_speculative_tokens" in sc:
            data["num_speculative_tokens"] = sc["num_speculative_tokens"]
        return data

    @field_validator("speculative_config")
    @classmethod
    def _check_speculative_config(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        known = {"method", "model", "num_speculative_tokens", "num_speculative_tokens_per_batch_size"}
        unknown = sorted(set(v) - known)
        if unknown:
            raise ValueError(f"speculative_config: unsupported key(s) {unknown}")
        method = v.get("method", "mtp")
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: method {method!r} is not supported (this server drafts with the "
                             f"checkpoint's MTP head: one of {', '.join(SPEC_METHODS)})")
        spec_schedule(v)
        return v

    @property
    def spec_schedule(self) -> tuple[tuple[int, int], ...]:
        """--speculative-config's num_speculative_tokens_per_batch_size: ((batch size up to, K cap), ...) ascending."""
        return spec_schedule(self.speculative_config or {})

    @model_validator(mode="after")
    def _k_within_capmax(self) -> ServeSettings:
        if self.num_speculative_tokens > self.spec_capmax:
            raise ValueError(f"num_speculative_tokens ({self.num_speculative_tokens}) exceeds spec_capmax "
                             f"({self.spec_capmax})")
        return self

    @property
    def prefix_cache_bytes(self) -> int | None:
        """`prefix_cache_gb` in bytes (None: the engine sizes it from free memory)."""
        return None if self.prefix_cache_gb is None else int(self.prefix_cache_gb * 2**30)

    @property
    def encoder_cache_bytes(self) -> int:
        """`mm_encoder_cache_mb` in bytes."""
        return self.mm_encoder_cache_mb * 2**20

    @property
    def url(self) -> str:
        """Base URL clients use (``http://host:port``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def json_object(v: Any) -> Any:
    """A setting given as JSON text (the command line, the environment) parsed; must be an object."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise ValueError(f"not valid JSON: {e}") from None
        if not isinstance(v, dict):
            raise ValueError("must be a JSON object")
    return v


def spec_schedule(sc: Mapping[str, Any]) -> tuple[tuple[int, int], ...]:
    """num_speculative_tokens_per_batch_size of a speculative config, as ((batch size up to, K cap), ...) ascending:
    a JSON object {"BATCH": K} or a list of [BATCH, K] pairs; () when absent. Raises ValueError when malformed."""
    raw = sc.get("num_speculative_tokens_per_batch_size")
    if raw is None:
        return ()
    pairs = list(raw.items()) if isinstance(raw, dict) else raw
    try:
        out = sorted((int(b), int(k)) for b, k in pairs)
    except (TypeError, ValueError):
        raise ValueError("speculative_config: num_speculative_tokens_per_batch_size must map batch sizes to K "
                         "({\"8\": 2, ...} or [[8, 2], ...])") from None
    if not out or any(b < 1 or not 0 <= k <= MAX_SPEC_TOKENS for b, k in out):
        raise ValueError(f"speculative_config: num_speculative_tokens_per_batch_size needs batch sizes >= 1 and K in "
                         f"0..{MAX_SPEC_TOKENS}, got {raw!r}")
    return tuple(out)


#: Settings whose values never appear in messages or logs: the `SecretStr` ones.
SECRET_SETTINGS = frozenset(name for name, f in ServeSettings.model_fields.items()
                            if SecretStr in (f.annotation, *get_args(f.annotation)))


def field_names() -> list[str]:
    """Setting names in declaration order (the CLI flags are generated from these)."""
    return list(ServeSettings.model_fields)


def env_var(name: str) -> str:
    """Environment variable of setting `name`, e.g. ``port`` -> ``NEXTN_PORT``."""
    return ENV_PREFIX + name.upper()


def flag(name: str) -> str:
    """Command-line spelling of setting `name`, e.g. ``max_num_seqs`` -> ``--max-num-seqs``."""
    return "MODEL_DIR" if name == "model_dir" else "--" + name.replace("_", "-")


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"config file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SettingsError(f"config file {path} is not valid TOML: {e}") from None
    unknown_tables = sorted(set(raw) - {"serve"})
    if unknown_tables:
        raise SettingsError(f"config file {path}: unknown top-level key(s) {unknown_tables} (settings go in [serve])")
    table = raw.get("serve", {})
    if not isinstance(table, dict):
        raise SettingsError(f"config file {path}: [serve] must be a table")
    return table


def _read_env(environ: Mapping[str, str]) -> dict[str, str]:
    known = {env_var(n): n for n in field_names()}
    unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known and k != CONFIG_ENV)
    if unknown:
        log.warning("ignoring unknown environment variable(s) %s", ", ".join(unknown))
    return {known[k]: v for k, v in environ.items() if k in known and v != ""}


def load_settings(cli: Mapping[str, Any], *, config_file: Path | None = None,
                  environ: Mapping[str, str] | None = None) -> ServeSettings:
    """Merge the four sources into a validated `ServeSettings`.

    `cli` holds only the settings given on the command line (keys are field names). `config_file` is
    ``--config``; without it ``NEXTN_CONFIG``, then ``config/default.toml``. `environ` defaults to
    ``os.environ``. Raises `SettingsError` (one line) for an unknown key or a bad value from any source.
    """
    environ = os.environ if environ is None else environ
    if config_file is None and environ.get(CONFIG_ENV):
        config_file = Path(environ[CONFIG_ENV])
    path = config_file if config_file is not None else DEFAULT_CONFIG_FILE
    layers = [(_read_toml(path), lambda key: f"{key} in {path}"), (_read_env(environ), env_var), (cli, flag)]
    values: dict[str, Any] = {}
    source: dict[str, str] = {}  # setting -> where its value came from, for error messages
    for layer, where in layers:
        for key, value in layer.items():
            if key not in ServeSettings.model_fields:
                raise SettingsError(f"unknown setting {where(key)}")
            values[key], source[key] = value, where(key)
    try:
        return ServeSettings(**values)
    except ValidationError as e:
        raise SettingsError(_one_line(e, values, source)) from None


def _one_line(err: ValidationError, values: Mapping[str, Any], source: Mapping[str, str]) -> str:
    """The first error as one line, preferring values that were given over defaults."""
    errors = sorted(err.errors(), key=lambda e: not (e["loc"] and e["loc"][0] in values))
    first = errors[0]
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    if not first["loc"]:  # a cross-field rule
        return f"invalid settings: {msg}{more}"
    key = str(first["loc"][0])
    if key not in values:
        return f"invalid default {flag(key)}: {msg}{more}"
    shown = "<hidden>" if key in SECRET_SETTINGS else repr(values[key])
    return f"invalid value {shown} for {source[key]}: {msg}{more}"


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_memory() -> int | None:
    """Bytes of host memory this process may still use: MemAvailable, lowered to the room left under a cgroup v2
    memory limit when there is one; None when neither can be read."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            found.append(max(0, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text().strip())))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def default_max_queue(max_model_len: int, memory: int | None) -> tuple[int, str]:
    """The admission queue bound without --max-queue, and why: as many waiting requests of up to `max_model_len`
    tokens as fit in 1/QUEUE_MEMORY_SHARE of `memory` bytes, within DEFAULT_MAX_QUEUE_RANGE (its low end when the
    memory is unknown)."""
    low, high = DEFAULT_MAX_QUEUE_RANGE
    per = max_model_len * QUEUE_BYTES_PER_TOKEN + QUEUE_BYTES_PER_REQUEST
    if memory is None:
        return low, f"available memory unknown; {low} to {high}"
    n = min(high, max(low, memory // QUEUE_MEMORY_SHARE // per))
    return n, (f"1/{QUEUE_MEMORY_SHARE} of {memory / 2**30:.1f} GiB available at {per // 1024} KiB per waiting request "
               f"of up to {max_model_len} tokens, within {low} to {high}")


def resolve(settings: ServeSettings, *, cuda_available: bool, max_position_embeddings: int,
            has_mtp: bool, cores: int | None = None, environ: Mapping[str, str] | None = None,
            memory: Callable[[], int | None] = available_memory,
            hub_id: str | None = None) -> tuple[ServeSettings, list[tuple[int, str]]]:
    """Replace the automatic values by concrete ones, from the machine and the checkpoint's config.

    device auto -> cuda when available, else cpu; dtype auto -> float32 on cpu (on cuda it stays auto:
    the checkpoint's dtype); cpu_threads on cpu -> OMP_NUM_THREADS when set, else `cores` (default: the usable
    cores) minus one, at least 1: the HTTP event loop needs a core, and torch's default of every core makes a
    small model's steps wait on spinning OpenMP threads (bench/RESULTS.md: one client 259-287 tokens/s with 2
    threads vs 722 with 1 on a 2-core box); served_model_name -> `hub_id` (the hub id MODEL_DIR was downloaded
    from, vLLM's default) or MODEL_DIR's name; max_model_len ->
    min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP); max_queue -> `default_max_queue` of the context and
    `memory()` (the available host memory, or None when unknown); cpu_kernel_threads on cpu -> min(2, usable cores)
    (the helper thread works only inside large C kernel calls, when torch's threads are idle; on a 2-core box it
    lifts 8 streams' throughput, bench/RESULTS.md); K -> 0 when the checkpoint has no MTP weights; engine_process
    -> False when the research door is armed. Returns the new settings and one (log level, message) note per
    automatic choice, for the caller to log once everything is valid. Raises
    `SettingsError` for ``--device cuda`` without CUDA or a max_model_len above max_position_embeddings.
    """
    update: dict[str, Any] = {}
    notes: list[tuple[int, str]] = []

    def choose(name: str, value: Any, why: str, level: int = logging.INFO) -> None:
        update[name] = value
        notes.append((level, f"{name} {getattr(settings, name)} -> {value} ({why})"))

    device = settings.device
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
        choose("device", device, "CUDA available" if cuda_available else "no CUDA")
    elif device == "cuda" and not cuda_available:
        raise SettingsError("--device cuda was requested but CUDA is not available")
    if settings.dtype == "auto" and device == "cpu":
        choose("dtype", "float32", "cpu")
    n = (usable_cores() if cores is None else cores) if device == "cpu" else 0
    if device == "cpu" and settings.cpu_threads is None:
        omp = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").strip()
        if omp.isdigit() and int(omp) >= 1:
            choose("cpu_threads", int(omp), "OMP_NUM_THREADS")
        else:
            choose("cpu_threads", max(1, n - 1), f"{n} usable core(s), one left to the HTTP event loop")
    if device == "cpu" and settings.cpu_kernel_threads is None:
        choose("cpu_kernel_threads", min(2, n), f"{n} usable core(s)")
    if settings.served_model_name is None:
        if hub_id is not None:
            choose("served_model_name", hub_id, "the hub id, as vLLM names it")
        else:
            choose("served_model_name", settings.model_dir.resolve().name, "model directory name")
    if settings.max_model_len is None:
        choose("max_model_len", min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP),
               f"min of the checkpoint's {max_position_embeddings} and {DEFAULT_MAX_MODEL_LEN_CAP}")
    elif settings.max_model_len > max_position_embeddings:
        raise SettingsError(f"--max-model-len {settings.max_model_len} exceeds the checkpoint's "
                            f"max_position_embeddings ({max_position_embeddings})")
    if settings.max_queue is None:
        choose("max_queue", *default_max_queue(update.get("max_model_len", settings.max_model_len),
                                               memory()))
    if settings.num_speculative_tokens > 0 and not has_mtp:
        choose("num_speculative_tokens", 0, "the checkpoint has no MTP weights: plain decode", logging.WARNING)
    if settings.engine_process and settings.research_opti_controller_q is not None:
        choose("engine_process", False, "the research door's controller and counters live in the serving process",
               logging.WARNING)
    return settings.model_copy(update=update), notes
