"""Whole-model rows of bench/gpu.py: random-weight Qwen3.5-shaped models through the engine's kernel path
(engine/model/ops) and the scheduler's CUDA graphs (engine/graphs.py), in bf16.

Per model: the HBM floor of a decode step (bytes of the weights a step reads / measured copy bandwidth), the
startup time (kernel self-check + CUDA graph capture, as `nextn serve` does it), the step times at batch 1 and 8
(plain decode = verify T=1, verify T=K+1 for K=1..4, MTP draft depth, a K=3 round, as graph replays), prefill
tokens/s, end-to-end greedy tokens/s through the scheduler and transformers `generate` as
the peer; and the exactness checks in the model dtype: a session's logits bitwise equal alone or batched and
at T=1 or inside T=K+1, the MTP draft alone == batched, greedy spec == plain greedy token for token (K=1..4,
forced drafts so every acceptance length occurs), and our logits vs transformers' on the same weights.

--smoke runs the same on tiny shapes on the CPU: the kernels under TRITON_INTERPRET=1 via the test-only
`ops.force_kernels()`, the graph runner executing its static-buffer bodies without capture.
Only torch, triton and (for the peer) transformers are imported; nothing from tests/.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
import zlib
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from cuda_timing import cuda_ms
from engine.cache import GdnPool, StatePool
from engine.graphs import GraphRunner
from engine.model.config import Qwen35Config
from engine.model.ops import dispatch as ops
from engine.model.qwen35 import Qwen35ForCausalLM
from engine.scheduler import Scheduler
from engine.spec import DraftedSession, SpecSession

K_MAX = 4
W = K_MAX + 1


@dataclass(frozen=True)
class ModelSpec:
    name: str
    cfg: Qwen35Config
    ctx: int  # cached tokens per session when the steps are timed
    prompt: int  # prefill tokens/s: one prompt of this many tokens
    chunk: int  # prefill chunk
    new: int  # generated tokens per session in the end-to-end runs
    peer: bool  # transformers generate as the peer
    batch: int = 8  # the batched rows (8 on the GPU; fewer in the interpreter)


def _cfg(name: str, *, H: int, layers: int, nh: int, nkv: int, nv: int, V: int = 248320, I: int = 0,  # noqa: E741
         moe: tuple[int, int, int, int] | None = None, tied: bool = False, dk: int = 128, hd: int = 256,
         nk: int = 16, dtype: torch.dtype = torch.bfloat16) -> Qwen35Config:
    kw = dict(num_experts=moe[0], num_experts_per_tok=moe[1], moe_intermediate_size=moe[2],
              shared_expert_intermediate_size=moe[3]) if moe else dict(intermediate_size=I)
    return Qwen35Config(
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text", vocab_size=V, hidden_size=H,
        num_hidden_layers=layers,
        layer_types=tuple("full_attention" if (i + 1) % min(4, layers) == 0 else "linear_attention"
                          for i in range(layers)),
        num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd, linear_num_key_heads=nk,
        linear_key_head_dim=dk, linear_num_value_heads=nv, linear_value_head_dim=dk, tie_word_embeddings=tied,
        mtp_num_hidden_layers=1, dtype=dtype, **kw)


#: Qwen3.5 shapes (shared/reference/qwen35-architecture.md section 1.3), bf16
QWEN_0_8B = _cfg("0.8B", H=1024, I=3584, layers=24, nh=8, nkv=2, nv=16, tied=True)
QWEN_9B = _cfg("9B", H=4096, I=12288, layers=32, nh=16, nkv=4, nv=32)
QWEN_35B_8L = _cfg("35B-A3B", H=2048, layers=8, nh=16, nkv=2, nv=32, moe=(256, 8, 512, 512))
TINY = dict(H=64, layers=2, nh=2, nkv=1, nv=4, V=512, dk=16, hd=16, nk=2)


def specs(smoke: bool, quick: bool = False) -> list[ModelSpec]:
    """The models of a run: on the GPU the three Qwen3.5 shapes; --smoke tiny ones (fp32 dense and MoE with the
    transformers cross-check, bf16 dense); --smoke --quick the bf16 dense one alone (the test's variant)."""
    if smoke:
        tiny = TINY
        bf16 = ModelSpec("tiny dense bf16", _cfg("tiny", I=96, **tiny), 20, 40, 16, 8, False, 3)
        if quick:  # shorter contexts and runs, the same checks
            return [dataclasses.replace(bf16, ctx=12, prompt=24, new=6)]
        return [ModelSpec("tiny dense", _cfg("tiny", I=96, **tiny, dtype=torch.float32), 20, 40, 16, 8, True, 3),
                bf16,
                ModelSpec("tiny MoE", _cfg("tiny", moe=(6, 2, 32, 48), **tiny, dtype=torch.float32), 20, 40, 16, 8,
                          True, 3)]
    return [
        ModelSpec("Qwen3.5-0.8B shape", QWEN_0_8B, 1024, 4096, 512, 64, True),
        ModelSpec("Qwen3.5-9B shape", QWEN_9B, 1024, 4096, 512, 64, True),
        ModelSpec("Qwen3.5-35B-A3B shape, 8 of 40 layers", QWEN_35B_8L, 1024, 4096, 512, 48, False),
        # --- FP8 rows: Qwen's block-128 FP8 checkpoints (engine/loader.py, W8A16 matmul in ops/matmul_fp8.py) go
        # here as ModelSpecs of the same shapes with FP8 weights, so each gets the same step rows (decode and
        # K = 3 rounds against the HBM floor of its 1-byte weights) and the bitwise spec == plain check ---
    ]


@dataclass
class Step:
    model: str
    step: str
    batch: int
    ms: float | None
    ratio: float | None = None  # vs `vs`
    vs: str = ""
    goal: str = ""
    met: bool | None = None


@dataclass
class Check:
    model: str
    check: str
    ok: bool | None  # None: skipped (out of time, no transformers with Qwen3.5): reported, not a failure
    detail: str = ""


# ----------------------------------------------------------------------------------------------------- building
@torch.no_grad()
def build(cfg: Qwen35Config, device: str, seed: int = 0) -> Qwen35ForCausalLM:
    """A random-weight model made directly on `device` in cfg.dtype (scaled like tests/tiny.py so logits are
    spread), fused for inference."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(cfg.dtype)
    try:
        with torch.device(device):
            m = Qwen35ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in m.named_parameters():
        if name.endswith("A_log"):
            p.uniform_(0.0, 2.5, generator=g)
        elif name.endswith("dt_bias"):
            p.normal_(0.0, 0.5, generator=g)
        elif "norm" in name:
            p.normal_(1.0 if name.endswith("linear_attn.norm.weight") else 0.0, 0.2, generator=g)
        elif name.endswith("embed_tokens.weight"):
            p.normal_(0.0, 1.0, generator=g)
        else:
            p.normal_(0.0, 1.5 / math.sqrt(p.shape[-1]), generator=g)
    m.eval()
    m.fuse()
    return m


def weight_bytes(m: Qwen35ForCausalLM) -> int:
    """Bytes of the weights one decode step reads: every trunk parameter and the LM head (the embedding is a
    gather; the MTP head is not part of plain decode), MoE experts at top_k / num_experts of their size."""
    cfg = m.config
    seen: set[int] = set()
    total = 0.0
    for name, p in m.named_parameters():
        if name.startswith("mtp.") or name.endswith("embed_tokens.weight") and not cfg.tie_word_embeddings:
            continue
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        frac = cfg.num_experts_per_tok / cfg.num_experts if ".experts." in name else 1.0
        total += p.numel() * p.element_size() * frac
    return int(total)


# ------------------------------------------------------------------------------------------------------ helpers
class Timer:
    """Median time of a callable with CUDA events (on the CPU, --smoke: nothing is run or timed)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def ms(self, fn: Callable[[], object], iters: int = 20) -> float | None:
        return cuda_ms(fn, iters) if self.cuda else None


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def gdn_snapshot(pool: StatePool, slots: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of every GDN window slot of `slots` (a step overwrites window slots 0..T-1, the live one too)."""
    return [(c.conv[slots].clone(), c.rec[slots].clone()) for c in pool.layers if isinstance(c, GdnPool)]


def gdn_restore(pool: StatePool, slots: list[int], snap: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for c, (conv, rec) in zip((c for c in pool.layers if isinstance(c, GdnPool)), snap):
        c.conv[slots] = conv
        c.rec[slots] = rec


def forced_drafter(ref: list[int], plen: int, V: int, seed: int, wrong_rate: float = 0.3):
    """A `DraftedSession` drafter: the true greedy token, except at hashed positions where it is deliberately wrong."""
    def override(pos: int, j: int, d: int) -> int:
        i = pos - plen
        if i >= len(ref):
            return d
        h = zlib.crc32(f"{seed}:{pos}:{j}".encode()) % 1000
        return (ref[i] + 1 + h % (V - 1)) % V if h < wrong_rate * 1000 else ref[i]
    return override


def _prompts(n: int, length: int, V: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (length - i % 3,), generator=g).tolist() for i in range(n)]


def _run_sched(m: Qwen35ForCausalLM, prompts: list[list[int]], new: int, k: int, max_len: int,
               drafters: list | None = None, dev: str = "cuda") -> tuple[list[list[int]], float, Scheduler]:
    """Greedy sessions batched through a Scheduler (CUDA graphs on the kernel path). Returns (tokens per session,
    decode tokens/s from the second round on: after the prefill and the round that captures the graphs, the
    scheduler)."""
    sched = Scheduler(m, max_num_seqs=len(prompts), max_model_len=max_len, k=k,
                      max_num_batched_tokens=sum(len(p) for p in prompts) + 64, step_graphs=True)
    ss = [DraftedSession(m, p, new, k=k, pool=sched.pool, drafter=drafters[i]) if drafters
          else SpecSession(m, p, new, k=k, pool=sched.pool) for i, p in enumerate(prompts)]
    for s in ss:
        sched.add(s)
    sched.step()  # every prompt prefilled, first tokens out
    assert not sched.joining
    sched.step()  # the first round: captures its CUDA graphs (not timed)
    _sync(dev)
    done0 = sum(len(s.emitted) for s in ss)
    t0 = time.perf_counter()
    while sched.num_sessions:
        sched.step()
    _sync(dev)
    dt = time.perf_counter() - t0
    return [s.emitted for s in ss], (sum(len(s.emitted) for s in ss) - done0) / max(dt, 1e-9), sched


# --------------------------------------------------------------------------------------------------- the rows
def model_rows(spec: ModelSpec, dev: str, copy_gbps: float | None, deadline: float) -> tuple[list[Step], list[Check]]:
    """Everything for one model shape (see the module docstring)."""
    cuda = dev == "cuda"
    m = build(spec.cfg, dev)
    with (nullcontext() if cuda else ops.force_kernels()), torch.inference_mode():
        steps, checks = _step_rows(spec, m, dev, copy_gbps)
        if time.monotonic() < deadline:
            s2, c2 = _e2e_rows(spec, m, dev, deadline)
            steps, checks = steps + s2, checks + c2
        else:
            checks.append(Check(spec.name, "end-to-end rows", None, "skipped: out of time"))
    del m
    if cuda:
        torch.cuda.empty_cache()
    return steps, checks


def _prefill_path(m: Qwen35ForCausalLM) -> str:
    """What the model's prefill forwards run (engine/model/qwen35.py `FwdCtx.prefill_kernels`): the prefill grid's
    attention and chunked GDN kernels, or, for the ones that fell back (or off the kernel path), the host path."""
    w = m.lm_head.weight
    off = [k for k in ("attention_prefill", "gdn_prefill") if not ops.use_kernel(k, w)]
    return "the prefill kernels" if not off else f"host path for {', '.join(off)}"


def _prefill_tps(spec: ModelSpec, m: Qwen35ForCausalLM, dev: str, B: int) -> float:
    """Prefill tokens/s through the scheduler, the model's own prefill (on the kernel path: the prefill grid's
    attention and chunked GDN kernels, `_prefill_path`): B prompts of spec.prompt // B tokens each (the same
    tokens in all), chunks of spec.chunk under a budget of B chunks per step, one new token each (the prefill's
    own)."""
    n = spec.prompt // B
    sched = Scheduler(m, max_num_seqs=B, max_model_len=n + 16, k=0, max_num_batched_tokens=B * spec.chunk,
                      step_graphs=True)
    ss = [SpecSession(m, p[:n], 1, k=0, pool=sched.pool) for p in _prompts(B, n + 2, m.config.vocab_size, 1)]
    for s in ss:
        sched.add(s)
    _sync(dev)
    t0 = time.perf_counter()
    while sched.num_sessions:
        sched.step()
    _sync(dev)
    return B * n / (time.perf_counter() - t0)


def _step_rows(spec: ModelSpec, m: Qwen35ForCausalLM, dev: str,
               copy_gbps: float | None) -> tuple[list[Step], list[Check]]:
    """HBM floor, prefill tokens/s, the bitwise step checks and the step times (graph replays)."""
    cfg, name, B8 = m.config, spec.name, spec.batch
    V = cfg.vocab_size
    timer = Timer(dev == "cuda")
    wb = weight_bytes(m)
    floor = wb / (copy_gbps * 1e9) * 1e3 if copy_gbps else None
    steps = [Step(name, f"HBM floor ({wb / 1e9:.2f} GB of weights per decode step)", 1, floor)]
    steps.append(startup_row(spec, m, dev))
    _prefill_tps(dataclasses.replace(spec, prompt=spec.chunk), m, dev, 1)  # warm-up: compiles the chunk's kernels
    for B in (1, B8):
        steps.append(Step(name, f"prefill, {spec.prompt // B} tokens x {B}, chunks of {spec.chunk}, "
                                f"{_prefill_path(m)} (tokens/s)", B,
                          None, _prefill_tps(spec, m, dev, B), "tokens/s"))
    checks: list[Check] = []
    # B8 sessions with spec.ctx cached tokens in a K = 4 pool; the scheduler's graph runner
    sched = Scheduler(m, max_num_seqs=B8, max_model_len=spec.ctx + 64, k=K_MAX,
                      max_num_batched_tokens=B8 * spec.ctx + 64, step_graphs=True)
    ss = [SpecSession(m, p, 1000, k=K_MAX, pool=sched.pool) for p in _prompts(B8, spec.ctx, V, 2)]
    for x in ss:
        sched.add(x)
    sched.step()
    runner, pool = sched.runner, sched.pool
    assert isinstance(runner, GraphRunner) and not sched.joining
    slots, pos0, cur = [x.slot for x in ss], [x.cache.length for x in ss], [x.cache.cur for x in ss]
    dpos = [x.scratch.length for x in ss]
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(0, V, (B8, W), generator=g).to(dev)
    hid = (torch.randn(B8, W, cfg.hidden_size, generator=g) * 0.5).to(dev, cfg.dtype)
    snap = gdn_snapshot(pool, slots)

    def verify(rows: list[int], t: int, T: int, cur_: list[int]) -> torch.Tensor:
        """Logits [len(rows), T, V] of tokens t..t+T-1 of `rows` (a copy), from the restored states."""
        r = runner.verify(m, pool, toks[rows, t:t + T], [slots[i] for i in rows], [pos0[i] + t for i in rows], cur_)
        return r[2].clone()

    # exactness checks first (the timing loops below overwrite the sessions' window slots)
    everyone = list(range(B8))
    full = verify(everyone, 0, W, cur)
    bad = []
    for rows in ([0], [B8 - 1], everyone[1:3] if B8 <= 4 else [1, 6, 7]):  # alone; a padded bucket on the GPU
        gdn_restore(pool, slots, snap)
        got = verify(rows, 0, W, [cur[i] for i in rows])
        bad += [i for j, i in enumerate(rows) if not torch.equal(got[j], full[i])]
    checks.append(Check(name, f"verify logits (T={W}) of a session alone / in a smaller batch == in {B8} rows, "
                              f"bitwise ({cfg.dtype})", not bad, f"rows differing: {bad}" if bad else ""))
    gdn_restore(pool, slots, snap)
    c = list(cur)
    bad_t = []
    for t in range(W):
        lt = verify(everyone, t, 1, c)
        bad_t += [(t, i) for i in everyone if not torch.equal(lt[i, 0], full[i, t])]
        c = [0] * B8  # a T = 1 step leaves the state in window slot 0
    checks.append(Check(name, f"T=1 steps == columns of one T={W} verify, bitwise, {B8} rows", not bad_t,
                        f"(step, row) differing: {bad_t[:6]}" if bad_t else ""))
    lb = runner.draft(m, pool, toks, hid, slots, dpos, [W - 1] * B8)[1].clone()
    l1 = runner.draft(m, pool, toks[2:3], hid[2:3], slots[2:3], dpos[2:3], [W - 1])[1]
    checks.append(Check(name, "MTP draft logits alone == batched, bitwise", torch.equal(l1[0], lb[2])))

    plain: dict[int, float | None] = {}
    for B in (1, B8):
        def t_verify(T: int, B: int = B) -> float | None:
            return timer.ms(lambda: runner.verify(m, pool, toks[:B, :T], slots[:B], pos0[:B], [0] * B))

        plain[B] = t_verify(1)
        ref, vs = (floor, "HBM floor") if B == 1 else (plain[1], "batch 1")
        ratio = plain[B] / ref if plain[B] and ref else None
        steps.append(Step(name, "plain decode (verify T=1)", B, plain[B], ratio, vs,
                          "<= 1.5x", None if ratio is None else ratio <= 1.5))
        for K in range(1, K_MAX + 1):
            ms = t_verify(K + 1)
            ratio = ms / plain[B] if ms and plain[B] else None
            goal = "<= 1.2x" if K + 1 == 4 else ""
            steps.append(Step(name, f"verify K+1={K + 1}", B, ms, ratio, "plain decode", goal,
                              None if ratio is None or not goal else ratio <= 1.2))
        ms = timer.ms(lambda: runner.draft(m, pool, toks[:B, :1], hid[:B, :1], slots[:B], dpos[:B], None))
        ratio = ms / plain[B] if ms and plain[B] else None
        lim = 0.3 if cfg.hidden_size <= 1024 else 0.15
        steps.append(Step(name, "MTP draft depth (T=1, with the LM head)", B, ms, ratio, "plain decode",
                          f"<= {lim}x", None if ratio is None else ratio <= lim))
        v4 = next(s_.ms for s_ in steps if s_.step == "verify K+1=4" and s_.batch == B)
        k3 = 3 * ms + v4 if ms is not None and v4 is not None else None  # a K = 3 round's forwards
        ref, vs = (floor, "HBM floor") if B == 1 else (plain[B], "plain decode")
        steps.append(Step(name, "K=3 round (3 MTP draft steps + verify T=4)", B, k3,
                          k3 / ref if k3 and ref else None, vs))
    if dev == "cuda":  # the step times above are graph replays only if every capture succeeded
        checks.append(Check(name, "the timed steps ran as CUDA graph replays", runner.capture and runner.num_graphs > 0,
                            f"{runner.num_graphs} graphs captured" + ("" if runner.capture else
                                                                      "; a capture failed: eager from then on")))
    for x in ss:
        sched.remove(x)
    return steps, checks


def startup_row(spec: ModelSpec, m: Qwen35ForCausalLM, dev: str) -> Step:
    """What `nextn serve` does before the first request, timed: the kernel self-check at this model's shapes and
    the capture of every CUDA graph of a max-num-seqs 8, K = 3 scheduler (engine/selfcheck.py `startup`). The
    first model of a run pays Triton's compiles; later ones find most kernels in its cache."""
    from engine import selfcheck

    sched = Scheduler(m, max_num_seqs=8 if dev == "cuda" else 2, max_model_len=spec.ctx + 64, k=3,
                      max_num_batched_tokens=512, step_graphs=True)
    _sync(dev)
    t0 = time.perf_counter()
    rep = selfcheck.startup(m, sched.runner)
    _sync(dev)
    sec = time.perf_counter() - t0
    g = rep.graphs
    what = "no graphs on a CPU" if g is None else f"{len(g.captured)} CUDA graphs captured, {len(g.eager)} eager"
    bad = [c.kernel for c in rep.kernels if not c.ok]
    return Step(spec.name, f"startup: kernel self-check ({len(rep.kernels) - len(bad)}/{len(rep.kernels)} pass) + "
                           f"{what} (s)", 8 if dev == "cuda" else 2, None, sec, "seconds")


def _e2e_rows(spec: ModelSpec, m: Qwen35ForCausalLM, dev: str, deadline: float) -> tuple[list[Step], list[Check]]:
    """Greedy through the scheduler: spec (forced drafts, K = 1..4) == plain, batch 1 == batch 8, tokens/s,
    and the transformers peer."""
    name, B8, V = spec.name, spec.batch, m.config.vocab_size
    prompts = _prompts(B8, min(spec.ctx, 256), V, 4)
    max_len = max(len(p) for p in prompts) + spec.new + 16
    ref, tps8, _ = _run_sched(m, prompts, spec.new, 0, max_len, dev=dev)
    steps = [Step(name, f"end to end plain greedy, {spec.new} tokens/session (tokens/s)", B8, None, tps8, "tokens/s")]
    diffs = []
    for K in range(1, K_MAX + 1):
        drafters = [forced_drafter(ref[i], len(p), V, K) for i, p in enumerate(prompts)]
        out, _, _ = _run_sched(m, prompts, spec.new, K, max_len, drafters, dev=dev)
        diffs += [K] if out != ref else []
    checks = [Check(name, f"greedy spec == plain greedy, K=1..{K_MAX}, {B8} sessions batched, forced drafts "
                          f"({m.config.dtype})", not diffs, f"K differing: {diffs}" if diffs else "")]
    one, tps1, _ = _run_sched(m, prompts[:1], spec.new, 0, max_len, dev=dev)
    steps.append(Step(name, f"end to end plain greedy, {spec.new} tokens (tokens/s)", 1, None, tps1, "tokens/s"))
    checks.append(Check(name, f"batch-1 plain greedy == the same session in a batch of {B8}", one[0] == ref[0]))
    if spec.peer and time.monotonic() < deadline:
        sp, cp = peer_rows(spec, m, prompts[0], spec.new, tps1, dev)
        steps, checks = steps + sp, checks + cp
    return steps, checks


def hf_text_config(cfg: Qwen35Config) -> dict:
    d = dict(model_type=cfg.model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
             num_hidden_layers=cfg.num_hidden_layers, layer_types=list(cfg.layer_types),
             num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
             head_dim=cfg.head_dim, linear_num_key_heads=cfg.linear_num_key_heads,
             linear_key_head_dim=cfg.linear_key_head_dim, linear_num_value_heads=cfg.linear_num_value_heads,
             linear_value_head_dim=cfg.linear_value_head_dim, linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
             rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings, hidden_act="silu",
             max_position_embeddings=cfg.max_position_embeddings, attention_bias=False,
             rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                              "partial_rotary_factor": cfg.partial_rotary_factor})
    if cfg.is_moe:
        d.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                 moe_intermediate_size=cfg.moe_intermediate_size,
                 shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    else:
        d["intermediate_size"] = cfg.intermediate_size
    return d


@torch.no_grad()
def peer_rows(spec: ModelSpec, m: Qwen35ForCausalLM, prompt: list[int], n: int, ours_tps: float,
              dev: str) -> tuple[list[Step], list[Check]]:
    """transformers on the same weights: its `generate` decode tokens/s at batch 1 (the peer), and our logits vs
    its logits (prefill, and a kernel-path decode step) as an independent check of the model math."""
    name = spec.name
    if dev != "cuda":
        sys.modules.setdefault("fla", None)  # fla-core + triton without a GPU breaks HF Qwen3.5 (CPU smoke)
    try:
        import fla.ops  # noqa: F401  (transformers' Qwen3.5 uses fla-core's GDN kernels when importable)

        hf_gdn = "fla-core GDN kernels"
    except Exception:  # noqa: BLE001 - absent (the H200 image has none) or blocked: its torch GDN path
        hf_gdn = "torch GDN path, no fla-core"
    try:
        import transformers
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        cls = transformers.Qwen3_5MoeForCausalLM if m.config.is_moe else transformers.Qwen3_5ForCausalLM
        ccls = transformers.Qwen3_5MoeTextConfig if m.config.is_moe else transformers.Qwen3_5TextConfig
    except (ImportError, AttributeError) as e:
        return [], [Check(name, "transformers peer", None, f"skipped: {e}")]
    prev = torch.get_default_dtype()
    torch.set_default_dtype(m.config.dtype)
    try:
        with torch.device(dev):
            hf = cls(ccls(**hf_text_config(m.config)))
    finally:
        torch.set_default_dtype(prev)
    sd = {k: v for k, v in m.state_dict().items() if not k.startswith("mtp.")}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and m.config.tie_word_embeddings)]
    hf.eval()
    checks = [Check(name, "transformers model takes our weights", not missing and not unexpected,
                    f"missing {missing[:3]}, unexpected {unexpected[:3]}" if missing or unexpected else "")]
    # ours: prefill (cache-free forward) and one kernel-path decode step through the scheduler's runner
    sched = Scheduler(m, max_num_seqs=1, max_model_len=len(prompt) + 16, k=0, max_num_batched_tokens=4096,
                      step_graphs=True)
    s = SpecSession(m, prompt, 2, k=0, pool=sched.pool)
    sched.add(s)
    sched.step()
    x = torch.tensor([prompt + [s.pending]], device=dev)
    got_prefill = m(x[:, :-1])[0, -1]
    got_step = sched.runner.verify(m, sched.pool, x[:, -1:], [s.slot], [s.cache.length], [s.cache.cur])[2][0, 0]
    ref = hf(x).logits[0].float()  # [T, V]
    tol = 5e-2 if m.config.dtype == torch.bfloat16 else 1e-4
    for what, got, want in (("prefill, last prompt row", got_prefill, ref[-2]),
                            ("decode step, kernel path", got_step, ref[-1])):
        rel = ((got - want).abs().max() / want.abs().max()).item()
        same = "same" if int(got.argmax()) == int(want.argmax()) else "differs"
        checks.append(Check(name, f"logits vs transformers ({what})", rel <= tol,
                            f"max rel err {rel:.2e} (tol {tol:.0e}), argmax {same}"))
    xp = x[:, :-1]

    def gen_s(new: int) -> float:
        _sync(dev)
        t0 = time.perf_counter()
        hf.generate(xp, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        _sync(dev)
        return time.perf_counter() - t0

    gen_s(2)  # warm-up
    hf_tps = (n - 1) / max(gen_s(n) - gen_s(1), 1e-9)  # decode only: generate(n) minus its prefill + 1st token
    del hf
    ratio = ours_tps / hf_tps
    return [Step(name, f"transformers {transformers.__version__} generate ({hf_gdn}), {n} tokens, batch 1 "
                       "(decode tokens/s)", 1, None, hf_tps, "tokens/s"),
            Step(name, "ours end to end plain greedy / transformers generate", 1, None, ratio, "transformers",
                 ">= 10x", ratio >= 10 if dev == "cuda" else None)], checks


def print_model_tables(steps: list[Step], checks: list[Check], steps_title: str = "Whole-model steps",
                       checks_title: str = "Whole-model checks") -> None:
    if steps:
        print(f"\n## {steps_title}\n")
        print("| model | step | batch | ms | ratio | vs | goal | met |")
        print("|---|---|---|---|---|---|---|---|")
    for s in steps:
        ms = "-" if s.ms is None else f"{s.ms:.3f}"
        ratio = "-" if s.ratio is None else (f"{s.ratio:.0f}" if s.vs == "tokens/s" else
                                             f"{s.ratio:.1f}" if s.vs == "seconds" else f"{s.ratio:.2f}x")
        met = "-" if s.met is None else ("yes" if s.met else "NO")
        print(f"| {s.model} | {s.step} | {s.batch} | {ms} | {ratio} | {s.vs} | {s.goal} | {met} |")
    if checks:
        print(f"\n## {checks_title}\n")
        print("| model | check | result | detail |")
        print("|---|---|---|---|")
    for c in checks:
        result = "SKIP" if c.ok is None else ("PASS" if c.ok else "FAIL")
        print(f"| {c.model} | {c.check} | {result} | {c.detail} |")


__all__ = ["ModelSpec", "Step", "Check", "specs", "model_rows", "print_model_tables"]
