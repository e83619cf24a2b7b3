"""The `nextn` console script: `nextn serve [MODEL]` plus the engine's and the research subcommands.

`serve` merges its settings (config.settings: CLI > NEXTN_* env > TOML > defaults), resolves MODEL (a
checkpoint directory, or a hub id ORG/NAME downloaded into the hub cache: engine/hub.py), loads the model
with a progress bar, starts the device worker and runs uvicorn. A bad setting or an unloadable model
exits with status 2 (settings, generation config) or 1 (model, hub) and one line on stderr. SIGTERM drains: /ready and new
requests get 503, admitted requests finish, then the process exits 0. SIGINT is uvicorn's own (stop
listening, wait for open responses; a second SIGINT forces the exit).

Connections are served by `GuardedH11Protocol` (uvicorn's h11 protocol): a request's headers must
arrive within --timeout-header seconds of the connection opening or going idle (a client trickling a
header byte at a time is closed), and at most --max-connections connections are open at once.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from config.settings import (
    DEFAULT_CONFIG_FILE,
    ServeSettings,
    SettingsError,
    env_var,
    field_names,
    flag,
    load_settings,
    resolve,
)

if TYPE_CHECKING:  # the engine (torch) is imported only once `serve` needs it, so flag errors are instant
    from server.multimodal import ImageServing
    from server.worker import Worker

log = logging.getLogger("nextn")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    sp = subparsers.add_parser("serve", help="run the OpenAI-compatible server",
                               description="Serve a Qwen3.5 checkpoint over the OpenAI API with MTP speculative "
                                           "decoding. Each flag also reads NEXTN_<FLAG> and the [serve] table of "
                                           "the TOML config; the command line wins.")
    fields = ServeSettings.model_fields
    for name in field_names():
        f = fields[name]
        default = "" if f.default is None else f"; default {f.default}"
        help_ = f"{f.description} [env {env_var(name)}{default}]"
        if name == "model_dir":
            sp.add_argument("model_dir", nargs="?", metavar="MODEL", default=argparse.SUPPRESS, help=help_)
        elif name == "served_model_aliases":  # the further names of --served-model-name
            continue
        elif name == "served_model_name":  # vLLM's nargs: the first name is reported, every name is accepted
            sp.add_argument(flag(name), dest=name, metavar="NAME", nargs="+", default=argparse.SUPPRESS, help=help_)
        elif name == "allowed_media_domains":  # vLLM's nargs: --allowed-media-domains A B
            sp.add_argument(flag(name), dest=name, metavar="DOMAIN", nargs="+", default=argparse.SUPPRESS, help=help_)
        elif f.annotation is bool:
            sp.add_argument(flag(name), dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                            help=help_)
        else:
            metavar = {"generation_config": "auto|vllm|DIR", "override_generation_config": "JSON",
                       "limit_mm_per_prompt": "JSON", "mm_processor_kwargs": "JSON",
                       "media_fetch_timeout": "SECONDS"}.get(
                name, "SECONDS" if name.startswith("timeout_") else name.split("_")[-1].upper())
            sp.add_argument(flag(name), dest=name, metavar=metavar, default=argparse.SUPPRESS, help=help_)
    sp.add_argument("--config", metavar="FILE", default=None,
                    help=f"TOML settings file [env NEXTN_CONFIG; default {DEFAULT_CONFIG_FILE}]")
    sp.set_defaults(func=serve)


def build_parser() -> argparse.ArgumentParser:
    """The `nextn` argument parser: `serve`, the engine's and the research subcommands (each sets `func`)."""
    from engine import commands
    from research import commands as research_commands

    parser = _Parser(prog="nextn", description="nextn: OpenAI-compatible Qwen3.5 server with exact MTP "
                                               "speculative decoding")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_serve(subparsers)
    commands.register(subparsers)
    research_commands.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `nextn` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


def _fail(status: int, message: str) -> int:
    print(f"nextn serve: error: {message}", file=sys.stderr)
    return status


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServeSettings:
    """The serve settings for parsed `args` (only flags actually given override env/file/defaults).
    Raises `SettingsError`."""
    cli = {k: v for k, v in vars(args).items() if k in ServeSettings.model_fields}
    if isinstance(cli.get("served_model_name"), list):  # --served-model-name NAME [ALIAS ...]: the whole list
        names = cli.pop("served_model_name")
        cli["served_model_name"], cli["served_model_aliases"] = names[0], tuple(names[1:])
    return load_settings(cli, config_file=Path(args.config) if args.config else None, environ=environ)


def serve(args: argparse.Namespace) -> int:
    """`nextn serve`: settings -> model -> worker -> uvicorn, until SIGTERM (drain) or SIGINT."""
    try:
        settings = settings_from_args(args)
    except SettingsError as e:
        return _fail(2, str(e))

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.log_level == "info":  # huggingface_hub's HTTP client logs every request at info; its bars show them
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
    from engine.gen_defaults import GenerationConfigError, load_generation_defaults
    from engine.hub import HubError, resolve_model

    try:  # a hub id: downloaded (or found in the cache) before anything heavy starts
        source = resolve_model(settings.model_dir, revision=settings.revision, download_dir=settings.download_dir)
    except HubError as e:
        return _fail(1, str(e))
    settings = settings.model_copy(update={"model_dir": source.path})
    try:
        defaults = load_generation_defaults(settings.generation_config, settings.model_dir,
                                            settings.override_generation_config)
    except GenerationConfigError as e:
        return _fail(2, str(e))

    import torch

    from engine.loader import CheckpointError, load_config, load_model
    from engine.model.config import ConfigError
    from engine.tokenizer import Tokenizer

    try:
        cfg = load_config(settings.model_dir)
        settings, notes = resolve(settings, cuda_available=torch.cuda.is_available(),
                                  max_position_embeddings=cfg.max_position_embeddings, has_mtp=cfg.has_mtp,
                                  hub_id=source.repo_id)
    except SettingsError as e:
        return _fail(2, str(e))
    except (ConfigError, CheckpointError) as e:
        return _fail(1, f"cannot load {settings.model_dir}: {e}")
    for level, note in notes:
        log.log(level, "%s", note)
    from engine.model.ops import cpu

    on_cpu = settings.device == "cpu"
    cpu.configure(torch_threads=settings.cpu_threads if on_cpu else None,
                  kernel_threads=settings.cpu_kernel_threads if on_cpu else None, enabled=settings.cpu_kernel)
    dtype = None if settings.dtype == "auto" else settings.dtype
    try:  # with an engine process, the model is loaded there (the same loader; its errors come back as one line)
        model = None if settings.engine_process else load_model(settings.model_dir, device=settings.device,
                                                                dtype=dtype, progress=True,
                                                                language_model_only=settings.language_model_only)
        tokenizer = Tokenizer.from_dir(settings.model_dir)
    except (ConfigError, CheckpointError, ValueError, OSError) as e:
        return _fail(1, f"cannot load {settings.model_dir}: {e}")
    from engine.scheduler import PoolTooLarge
    from engine.selfcheck import KernelCheckFailed
    from server.engine_proc import EngineStartError

    try:
        return run_server(settings, model, tokenizer, generation_defaults=defaults)
    except SettingsError as e:  # a setting the checkpoint refuses (--mm-processor-kwargs, --allowed-local-media-path)
        return _fail(2, str(e))
    except (PoolTooLarge, EngineStartError, KernelCheckFailed) as e:
        return _fail(1, str(e))
    except ConfigError as e:  # an unusable preprocessor_config.json
        return _fail(1, f"cannot load {settings.model_dir}: {e}")


def build_server(settings: ServeSettings, model: Any, tokenizer: Any, generation_defaults: Any = None,
                 **worker_kw: Any) -> NextnServer:
    """Wire metrics, worker, serving classes and app for resolved `settings`; the worker is started.
    With settings.engine_process the worker is an `EngineProcess` that loads the model itself (`model` may be
    None; raises `EngineStartError` / its PoolTooLarge line when it cannot start), else an in-process `Worker`
    over `model`. `generation_defaults` (an `engine.gen_defaults.GenerationDefaults`; None: loaded from the
    settings' --generation-config, raising GenerationConfigError) fill unset sampling fields of every request and
    are logged with their source. `worker_kw` is passed to either (tests inject a `session_factory`; a
    module-level one for the engine process)."""
    from engine.gen_defaults import load_generation_defaults
    from engine.kpolicy import KPolicySpec
    from engine.loader import load_config
    from metrics.prometheus import ServingMetrics
    from server.app import build_app
    from server.serving import ServingChat, ServingCompletion
    from server.structured import StructuredOutputs

    assert settings.served_model_name is not None and settings.max_model_len is not None and \
        settings.max_queue is not None, "resolve settings first"
    k = settings.num_speculative_tokens
    spec_policy = KPolicySpec(k, settings.spec_adaptive, settings.spec_schedule) if k > 0 else None
    metrics = ServingMetrics(settings.served_model_name, num_spec_tokens=k,
                             compat_vllm=settings.metrics_compat == "vllm",
                             optipipe_stats=arm_research_door(settings.research_opti_controller_q, k))
    cfg = model.config if model is not None else load_config(settings.model_dir)
    images = image_serving(settings)  # before the engine starts: a bad setting fails fast
    worker: Any
    if settings.engine_process:
        from server.engine_proc import EngineProcess, EngineSetup

        setup = EngineSetup(settings.model_dir, settings.device, None if settings.dtype == "auto" else settings.dtype,
                            settings.cpu_threads, settings.cpu_kernel, settings.cpu_kernel_threads, settings.log_level,
                            k, settings.spec_draft_p_min, settings.spec_capmax, settings.max_num_seqs,
                            settings.max_model_len, settings.max_num_batched_tokens, settings.prefix_cache_bytes,
                            settings.grammar_max_bytes,
                            settings.grammar_compile_timeout, settings.grammar_cache_size, kernels=settings.kernels,
                            language_model_only=settings.language_model_only,
                            encoder_cache_bytes=settings.encoder_cache_bytes, spec_policy=spec_policy,
                            **worker_kw)
        worker = EngineProcess(setup, metrics, max_queue=settings.max_queue, max_num_seqs=settings.max_num_seqs)
        worker.start()  # the child loads the model and reserves its pool; raises when it cannot
        dtype = worker.dtype
    else:
        from server.worker import Worker

        worker = Worker(model, metrics, k=k, p_min=settings.spec_draft_p_min, capmax=settings.spec_capmax,
                        max_num_seqs=settings.max_num_seqs, max_queue=settings.max_queue,
                        max_model_len=settings.max_model_len, max_num_batched_tokens=settings.max_num_batched_tokens,
                        prefix_cache_bytes=settings.prefix_cache_bytes, kernels=settings.kernels,
                        encoder_cache_bytes=settings.encoder_cache_bytes, spec_policy=spec_policy, **worker_kw)
        worker.start()
        dtype = str(cfg.dtype).removeprefix("torch.")
    metrics.set_kernel_info(worker.kernel_info)
    images = images.served_by(worker.vision)
    log.info("%s", images.describe())
    structured = StructuredOutputs(tokenizer, n_vocab=cfg.vocab_size, metrics=metrics,
                                   max_bytes=settings.grammar_max_bytes, timeout_s=settings.grammar_compile_timeout,
                                   cache_size=settings.grammar_cache_size)
    if generation_defaults is None:
        generation_defaults = load_generation_defaults(settings.generation_config, settings.model_dir,
                                                       settings.override_generation_config)
    log.info("%s", generation_defaults.describe())
    common: dict[str, Any] = dict(tokenizer=tokenizer, worker=worker, model_name=settings.served_model_name,
                                  model_aliases=settings.served_model_aliases,
                                  max_model_len=settings.max_model_len, vocab_size=cfg.vocab_size, k=k,
                                  structured=structured, max_logprobs=settings.max_logprobs,
                                  generation_defaults=generation_defaults)
    chat = ServingChat(special_tokens_in_content=settings.allow_special_tokens_in_content, images=images, **common)
    api_key = settings.api_key.get_secret_value() if settings.api_key is not None else None
    app = build_app(serving_chat=chat, serving_completion=ServingCompletion(**common), worker=worker,
                    metrics=metrics, model_root=str(settings.model_dir), api_key=api_key,
                    timeout_body=settings.timeout_body)
    protocol = guarded_h11(timeout_header=settings.timeout_header, max_connections=settings.max_connections)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, log_level=settings.log_level,
                            http=protocol, loop=event_loop(), timeout_keep_alive=settings.timeout_keep_alive)
    structured.start()  # the grammar tokenizer is built in the background (seconds at the real vocabulary)
    return NextnServer(config, worker, settings, dtype=dtype)


def image_serving(settings: ServeSettings) -> ImageServing:
    """What the server does with images, from the settings and the checkpoint's files (the engine's model then says
    whether it loaded a vision tower: `ImageServing.served_by`). Raises SettingsError for a media setting that
    cannot be used (an --allowed-local-media-path that is not a directory; --mm-processor-kwargs outside what the
    checkpoint allows)."""
    from server.media import MediaPolicy
    from server.multimodal import ImageServing

    total = MediaPolicy.total_timeout_s  # all of a request's images: at least one fetch's time
    if settings.media_fetch_timeout > total:
        log.info("images: a request's images may load for %g s (--media-fetch-timeout) instead of %g s",
                 settings.media_fetch_timeout, total)
        total = settings.media_fetch_timeout
    try:
        policy = MediaPolicy(
            allowed_media_domains=settings.allowed_media_domains,
            allowed_local_media_path=None if settings.allowed_local_media_path is None
            else str(settings.allowed_local_media_path),
            max_bytes=int(settings.media_max_mb * 2**20), fetch_timeout_s=settings.media_fetch_timeout,
            total_timeout_s=total, allow_redirects=settings.media_allow_redirects)
    except ValueError as e:
        raise SettingsError(str(e)) from None
    return ImageServing.build(settings.model_dir, language_model_only=settings.language_model_only,
                              max_images=settings.limit_mm_per_prompt["image"],
                              mm_processor_kwargs=settings.mm_processor_kwargs, policy=policy)


def event_loop() -> str:
    """uvicorn's event loop: uvloop when it is installed (a dependency; vLLM's server runs on it too), else asyncio,
    logged. On the 2-vCPU box uvloop cut the HTTP process's CPU per streamed run by 8% (1 client) to 16% (8), CPU
    that the engine's kernel helper thread shares (bench/RESULTS.md)."""
    import importlib.util

    if importlib.util.find_spec("uvloop") is not None:
        log.info("HTTP event loop: uvloop")
        return "uvloop"
    log.info("HTTP event loop: asyncio (uvloop is not installed)")
    return "asyncio"


def arm_research_door(q: float | None, k: int) -> Callable[[], Any] | None:
    """The OPTIPIPE research door (README "Research"), from the settings read once at process start: with a
    threshold, arm the increment-2 controller, log one line and return the counters' source for the /metrics
    `optipipe` block; without one (the default) do nothing at all and return None."""
    if q is None:
        return None
    from research.optipipe import optipipe_gate_stats, set_optipipe_controller_threshold

    set_optipipe_controller_threshold(q)
    log.warning("research door armed: OPTIPIPE opti controller q=%g (diagnostic only, measured NO-GO)%s", q,
                "" if k == 1 else f"; K={k}, so every row is refused (OptiFork forks K = 1 greedy rows)")
    return optipipe_gate_stats


def run_server(settings: ServeSettings, model: Any, tokenizer: Any, generation_defaults: Any = None) -> int:
    """Serve until shut down; returns the exit status (0 after a SIGTERM drain)."""
    server = build_server(settings, model, tokenizer, generation_defaults)
    if settings.log_level == "info":  # uvicorn's startup chatter; our one line replaces it
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    try:
        server.run()
    finally:
        server.worker.shutdown()
    return 0 if server.started else 1


class NextnServer(uvicorn.Server):
    """uvicorn.Server with nextn's signal handling: SIGTERM drains the worker before uvicorn stops;
    SIGINT (twice: force) is uvicorn's own. Captured signals are not re-raised on exit, so a drained
    shutdown exits 0."""

    def __init__(self, config: uvicorn.Config, worker: Worker, settings: ServeSettings, *, dtype: str) -> None:
        super().__init__(config)
        self.worker, self.settings, self.dtype = worker, settings, dtype

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            s = self.settings
            log.info("nextn serving model=%s device=%s dtype=%s K=%d url=%s max_queue=%d", s.served_model_name,
                     s.device, self.dtype, s.num_speculative_tokens, s.url, s.max_queue)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGTERM and not self.worker.draining:
            log.info("SIGTERM: draining %d active and %d queued session(s)", self.worker.num_active,
                     self.worker.num_waiting)
            self.worker.begin_drain()
            threading.Thread(target=self._exit_when_idle, name="nextn-drain", daemon=True).start()
        else:
            self.handle_exit(sig, frame)

    def _exit_when_idle(self) -> None:
        self.worker.wait_idle()
        log.info("drained; shutting down")
        self.should_exit = True


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 connection protocol with two bounds uvicorn lacks.

    - Header deadline: from the moment a connection opens, or finishes a response and waits for the next
      request, the next request's headers must be complete within `timeout_header` seconds, or the
      connection is closed. uvicorn's keep-alive timer alone restarts on every byte, so a client sending
      one header byte at a time could hold a connection forever. (The body is bounded by the app:
      `read_request`'s --timeout-body.)
    - Connection cap: a connection opened while `max_connections` are already open is closed at once
      (uvicorn's `limit_concurrency` only answers 503 to requests; it leaves idle connections open).

    Subclass per server with `guarded_h11`; uvicorn builds one instance per connection.
    """

    timeout_header: float = 10.0
    max_connections: int | None = None
    _deadline: asyncio.TimerHandle | None = None
    _waiting_after: object = None  # the request cycle the deadline was armed after (None: a new connection)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            transport.close()
            return
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._waiting_after = self.cycle
        self._deadline = self.loop.call_later(self.timeout_header, self._on_deadline)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_deadline(self) -> None:
        self._deadline = None
        if self.cycle is self._waiting_after and not self.transport.is_closing():
            self.transport.close()  # the headers did not arrive in time

    def handle_events(self) -> None:
        super().handle_events()
        if self._deadline is not None and self.cycle is not self._waiting_after:
            self._disarm()  # a request's headers are complete

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm()  # before super(): it may start a pipelined request at once
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def guarded_h11(*, timeout_header: float, max_connections: int | None) -> type[GuardedH11Protocol]:
    """A `GuardedH11Protocol` class with these bounds, to pass as uvicorn's `http` protocol."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"timeout_header": timeout_header, "max_connections": max_connections})
