#!/usr/bin/env python3
"""GPU benchmark and checks of the engine's kernel path: the first contact of nextn with a GPU, the Triton kernels
and the whole model.

    python bench/gpu.py             on a GPU, one call of at most 8 minutes (--budget-s, default 360), in order:
                                    selfcheck: the launch table of this device (every kernel's config and its
                                      shared-memory estimate vs the device's limit) and the startup self-check
                                      at the 9B shape (each kernel vs its twin at the model's own shapes, with
                                      the dtype / reduction-length tolerance, as `nextn serve` runs it; what
                                      every target compiles is bench/compile_targets.py's, no GPU needed);
                                    prefill: the prefill kernels (which the model's prefill calls) called
                                      directly at the 9B shape for 512, 4k and 32k-token prompts (GDN chunk
                                      kernel vs the torch chunked form, prefill attention vs causal SDPA,
                                      prefill matmuls, a 9B-shaped model's tokens/s from their sum; each kernel
                                      vs its twin); the whole model's prefill is timed under models;
                                    models: per random-weight bf16 model (0.8B, 9B, 35B-A3B with 8 of its 40
                                      layers): HBM floor, startup time (self-check + CUDA graph capture),
                                      plain decode / verify K+1 / MTP draft / K=3 round step times at batch 1
                                      and 8 (graph replays), prefill tokens/s at batch 1 and 8 (the model's
                                      prefill: through the prefill kernels), end-to-end
                                      greedy tokens/s, transformers `generate` as the peer, the bitwise checks
                                      in bf16 (spec == plain, alone == batched, T=1 == T=K+1); FP8 rows go next
                                      to them (gpu_model.specs);
                                    kernels: budget permitting, every decode kernel vs its twin with timings at
                                      Qwen3.5-0.8B / 9B shapes (and the 35B-A3B experts).
                                    Goals with met / NOT met at the end. Markdown on stdout (--md PATH: also to a
                                    file); --json PATH also writes the rows. Exit status 1 on any failed check.
    python bench/gpu.py --smoke     the same sections at tiny shapes (no timings); without CUDA on the CPU under
                                    TRITON_INTERPRET=1 (set here); exit status 1 on any FAIL.
    python bench/gpu.py --smoke --quick   its bf16 part: one tiny bf16 model (tests/test_gpu_bench.py)

Tests never assert timings: the figures go to bench/RESULTS.md as ratios. Model rows: bench/gpu_model.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_timing import cuda_ms  # noqa: E402  (bench/, the script's folder)

W = 5  # K + 1 = 5 verify positions (K = 4)
BATCH = 8
SECTIONS = ("selfcheck", "prefill", "models", "kernels")
PREFILL_LENGTHS = (512, 4096, 32768)  # prompt tokens of the prefill rows on a GPU (--smoke: 70, a chunk + a tail)

@dataclass(frozen=True)
class Dims:
    """Model shape (shared/reference/qwen35-architecture.md section 1.3) and the test contexts."""

    name: str
    H: int
    I: int  # noqa: E741  (dense MLP width)
    nh: int
    nkv: int
    hd: int
    nk: int
    dk: int
    nv: int
    dv: int
    V: int
    layers: int
    ctx: tuple[int, ...]  # KV lengths (pos0) of the attention rows
    tied: bool = False

    @property
    def C(self) -> int:  # GDN conv channels
        return 2 * self.nk * self.dk + self.nv * self.dv

    def weight_bytes(self, elt: int = 2) -> int:
        """Bytes of every weight a decode step reads (3:1 GDN:attention layers, dense MLP, LM head)."""
        gdn = self.H * (self.C + 2 * self.nv * self.dv + 2 * self.nv) + self.C * 4
        attn = self.H * (2 * self.nh * self.hd + 2 * self.nkv * self.hd + self.nh * self.hd)
        mlp = 3 * self.H * self.I
        n_attn = self.layers // 4
        return elt * ((self.layers - n_attn) * gdn + n_attn * attn + self.layers * mlp + self.V * self.H)


@dataclass(frozen=True)
class MoeDims:
    name: str
    H: int
    E: int
    topk: int
    Im: int


TINY = Dims("tiny", H=64, I=96, nh=4, nkv=2, hd=16, nk=2, dk=16, nv=4, dv=32, V=5000, layers=4, ctx=(3, 300, 41))
TINY_MOE = MoeDims("tiny-moe", H=64, E=6, topk=2, Im=32)
QWEN = [
    Dims("0.8B", H=1024, I=3584, nh=8, nkv=2, hd=256, nk=16, dk=128, nv=16, dv=128, V=248320, layers=24,
         ctx=(100, 4000, 32000, 700), tied=True),
    Dims("9B", H=4096, I=12288, nh=16, nkv=4, hd=256, nk=16, dk=128, nv=32, dv=128, V=248320, layers=32,
         ctx=(100, 4000, 32000, 700)),
]
QWEN_MOE = MoeDims("35B-A3B experts", H=2048, E=256, topk=8, Im=512)


@dataclass
class Row:
    kernel: str
    shape: str
    dtype: str
    err: float  # max |kernel - twin| / max(1, max |twin|)
    tol: float
    invariant: bool | None  # None: no invariance check for this kernel
    kernel_us: float | None = None
    torch_us: float | None = None
    torch_name: str = ""
    gbps: float | None = None

    @property
    def ok(self) -> bool:
        return self.err <= self.tol and self.invariant is not False


class Ctx:
    """Device, dtype, seeded data and the timer of one run."""

    def __init__(self, device: str, dtype: torch.dtype, timing: bool):
        self.device, self.dtype, self.timing = device, dtype, timing
        self.g = torch.Generator().manual_seed(0)

    def randn(self, *shape: int, scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.g) * scale).to(self.device, dtype or self.dtype)

    def time_us(self, fn: Callable[[], object], iters: int = 20) -> float | None:
        """Median of `iters` CUDA-event timings after 3 warm-up calls (None when not timing)."""
        if not self.timing:
            return None
        return cuda_ms(fn, iters) * 1e3

    @property
    def tol(self) -> float:
        return 1e-4 if self.dtype == torch.float32 else 3e-2


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    if got.isnan().any():
        return float("inf")
    return ((got - want).abs().max() / want.abs().max().clamp(min=1.0)).item()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a, b))


# ---------------------------------------------------------------------------------------------------------------
# one function per kernel: check vs twin, bitwise invariance, timing vs a torch equivalent
# ---------------------------------------------------------------------------------------------------------------

def check_matmul(c: Ctx, d: Dims, ops) -> list[Row]:
    rows = []
    mm = ops.matmul
    weights = [("gate/up", d.I, d.H, None), ("down", d.H, d.I, None), ("in_proj_qkv", d.C, d.H, None),
               ("lm_head", d.V, d.H, torch.float32)]
    M = BATCH * W
    for name, N, K, odt in weights:
        w = c.randn(N, K, scale=K ** -0.5)
        x = c.randn(M, K)
        y = mm.matmul(x, w, out_dtype=odt)
        err = rel_err(y, mm.matmul_ref(x, w, odt))
        inv = True
        for r in (0, M - 1):
            alone = mm.matmul(x[r:r + 1], w, out_dtype=odt)[0]
            inv &= same(alone, y[r])
            for m, at in ((2, 1), (9, 8)):
                other = c.randn(m, K, scale=3.0)
                other[at] = x[r]
                inv &= same(mm.matmul(other, w, out_dtype=odt)[at], alone)
        for m in (1, M):
            xm = x[:m]
            t_k = c.time_us(lambda: mm.matmul(xm, w, out_dtype=odt))
            t_t = c.time_us(lambda: F.linear(xm, w))
            gb = None if t_k is None else (N * K * w.element_size()) / t_k / 1e3
            rows.append(Row(f"matmul {name} M={m}", f"{d.name} [{N}x{K}]", str(c.dtype)[6:], err, c.tol, inv,
                            t_k, t_t, "F.linear", gb))
    return rows


def check_grouped(c: Ctx, md: MoeDims, ops) -> list[Row]:
    mm = ops.matmul
    rows = []
    w = c.randn(md.E, 2 * md.Im, md.H, scale=md.H ** -0.5)
    for T in (1, BATCH, BATCH * W):
        x = c.randn(T, md.H)
        idx = torch.stack([torch.randperm(md.E, generator=c.g)[:md.topk] for _ in range(T)]).to(c.device)
        order, offsets = mm.group_by_expert(idx, md.E)
        rows_ = order // md.topk
        y = mm.grouped_matmul(x, w, offsets, rows_)
        err = rel_err(y, mm.grouped_matmul_ref(x, w, offsets, rows_))
        pos = {int(s): m for m, s in enumerate(order.tolist())}
        o1, off1 = mm.group_by_expert(idx[T - 1:], md.E)
        y1 = mm.grouped_matmul(x[T - 1:], w, off1, o1 // md.topk)
        inv = all(same(y1[m1], y[pos[(T - 1) * md.topk + s]]) for m1, s in enumerate(o1.tolist()))
        t_k = c.time_us(lambda: mm.grouped_matmul(x, w, offsets, rows_))
        t_t = c.time_us(lambda: mm.grouped_matmul_ref(x, w, offsets, rows_))
        rows.append(Row(f"grouped matmul gate_up tokens={T}", f"{md.name} E={md.E} k={md.topk}", str(c.dtype)[6:],
                        err, c.tol, inv, t_k, t_t, "per-expert F.linear"))
    # the combine of the last T: expert outputs (sorted rows) weighted and summed per token in slot order
    ac = ops.act
    inv_ = torch.empty_like(order)
    inv_[order] = torch.arange(order.numel(), device=c.device)
    yd = c.randn(T * md.topk, md.H)
    wts = torch.softmax(c.randn(T, md.topk, dtype=torch.float32), -1).to(c.dtype)
    sh, sg = c.randn(T, md.H), c.randn(T, 1)
    out = ac.moe_combine(yd, inv_, wts, sh, sg)
    r4 = inv_.view(T, md.topk)[4]
    one = ac.moe_combine(yd[r4], torch.arange(md.topk, device=c.device), wts[4:5], sh[4:5], sg[4:5])
    rows.append(Row(f"moe_combine tokens={T}", f"{md.name} k={md.topk}", str(c.dtype)[6:],
                    rel_err(out, ac.moe_combine_ref(yd, inv_, wts, sh, sg)), c.tol, same(one[0], out[4]),
                    c.time_us(lambda: ac.moe_combine(yd, inv_, wts, sh, sg)),
                    c.time_us(lambda: ac.moe_combine_ref(yd, inv_, wts, sh, sg)), "gather + weighted sum"))
    return rows


def _sdpa_pool(q, k_cache, v_cache, slot, pos0, scale, gate):
    """Torch equivalent of the pool attention: gather each row's KV, one masked SDPA over the batch."""
    N, T, nh, hd = q.shape
    n = int(pos0.max()) + T
    k = k_cache[slot, :n].transpose(1, 2)  # [N, nkv, n, hd]
    v = v_cache[slot, :n].transpose(1, 2)
    pos = pos0[:, None] + torch.arange(T, device=q.device)  # [N, T]
    mask = torch.arange(n, device=q.device)[None, None, :] <= pos[:, :, None]  # [N, T, n]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale,
                                       enable_gqa=True)
    return o.transpose(1, 2) * torch.sigmoid(gate)


def check_attention(c: Ctx, d: Dims, ops) -> list[Row]:
    at = ops.attention
    rows = []
    L = max(d.ctx) + 2 * W
    L += -L % 16
    k_cache, v_cache = c.randn(BATCH, L, d.nkv, d.hd), c.randn(BATCH, L, d.nkv, d.hd)
    scale = d.hd ** -0.5
    for N in (1, BATCH):
        slot = torch.arange(N, device=c.device).flip(0)
        pos0 = torch.tensor([d.ctx[i % len(d.ctx)] for i in range(N)], device=c.device)
        q, gate = c.randn(N, W, d.nh, d.hd), c.randn(N, W, d.nh, d.hd)
        o = at.attention(q, k_cache, v_cache, slot, pos0, scale, gate)
        err = rel_err(o, at.attention_ref(q, k_cache, v_cache, slot, pos0, scale, gate))
        inv = True
        for i in range(N):
            for t in (0, W - 1):
                o1 = at.attention(q[i:i + 1, t:t + 1], k_cache, v_cache, slot[i:i + 1], pos0[i:i + 1] + t, scale,
                                  gate[i:i + 1, t:t + 1])
                inv &= same(o1[0, 0], o[i, t])
        for T in (1, W):
            qs, gs = q[:, :T].contiguous(), gate[:, :T].contiguous()
            t_k = c.time_us(lambda: at.attention(qs, k_cache, v_cache, slot, pos0, scale, gs))
            t_t = c.time_us(lambda: _sdpa_pool(qs, k_cache, v_cache, slot, pos0, scale, gs))
            kv_bytes = int((pos0 + T).sum()) * 2 * d.nkv * d.hd * k_cache.element_size()
            gb = None if t_k is None else kv_bytes / t_k / 1e3
            rows.append(Row(f"attention rows={N} T={T}", f"{d.name} ctx {list(d.ctx)[:N]}", str(c.dtype)[6:], err,
                            c.tol, inv, t_k, t_t, "gather + SDPA", gb))
    return rows


def check_gdn(c: Ctx, d: Dims, ops) -> list[Row]:
    gu = ops.gdn_update
    rows = []
    N = BATCH
    slot = torch.arange(N, device=c.device).flip(0)
    cur = torch.arange(N, device=c.device) % W
    q, k = c.randn(N, W, d.nk, d.dk), c.randn(N, W, d.nk, d.dk)
    v = c.randn(N, W, d.nv, d.dv)
    g = -torch.rand(N, W, d.nv, generator=c.g).to(c.device)
    beta = torch.rand(N, W, d.nv, generator=c.g).to(c.device)
    rec0 = c.randn(N, W, d.nv, d.dk, d.dv, scale=0.1, dtype=torch.float32)
    rec, rec_t, rec_s = rec0.clone(), rec0.clone(), rec0.clone()
    o = gu.gdn_update(q, k, v, g, beta, rec, slot, cur, qk_l2norm=True)
    err = max(rel_err(o, gu.gdn_update_ref(q, k, v, g, beta, rec_t, slot, cur, qk_l2norm=True)),
              rel_err(rec[slot], rec_t[slot]))
    inv, cc = True, cur
    for t in range(W):
        o1 = gu.gdn_update(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], rec_s, slot, cc,
                           qk_l2norm=True)
        inv &= same(o1[:, 0], o[:, t]) and same(rec_s[slot, 0], rec[slot, t])
        cc = torch.zeros_like(cur)
    for T in (1, W):
        args = (q[:, :T], k[:, :T], v[:, :T], g[:, :T], beta[:, :T])
        t_k = c.time_us(lambda: gu.gdn_update(*args, rec, slot, cur, qk_l2norm=True))
        t_t = c.time_us(lambda: gu.gdn_update_ref(*args, rec_t, slot, cur, qk_l2norm=True))
        rows.append(Row(f"gdn_update rows={N} T={T}", f"{d.name} {d.nv}x{d.dk}x{d.dv}", str(c.dtype)[6:], err,
                        c.tol, inv, t_k, t_t, "torch recurrence"))
    x = c.randn(N, W, d.C)
    wgt = c.randn(d.C, 4, scale=0.5)
    conv0 = c.randn(N, W, d.C, 3)
    conv, conv_t, conv_s = conv0.clone(), conv0.float(), conv0.clone()
    y = gu.conv_update(x, conv, wgt, slot, cur)
    err = max(rel_err(y, gu.conv_update_ref(x.float(), conv_t, wgt.float(), slot, cur)),
              rel_err(conv[slot], conv_t[slot]))
    inv, cc = True, cur
    for t in range(W):
        y1 = gu.conv_update(x[:, t:t + 1], conv_s, wgt, slot, cc)
        inv &= same(y1[:, 0], y[:, t]) and same(conv_s[slot, 0], conv[slot, t])
        cc = torch.zeros_like(cur)
    for T in (1, W):
        xs = x[:, :T]
        t_k = c.time_us(lambda: gu.conv_update(xs, conv, wgt, slot, cur))
        t_t = c.time_us(lambda: gu.conv_update_ref(xs, conv_s, wgt, slot, cur))
        rows.append(Row(f"conv_update rows={N} T={T}", f"{d.name} C={d.C}", str(c.dtype)[6:], err, c.tol, inv,
                        t_k, t_t, "torch window conv"))
    return rows


def check_act(c: Ctx, d: Dims, ops) -> list[Row]:
    """SwiGLU (MLP activation) and the GDN gates: kernel vs twin, a row alone vs among M rows."""
    ac = ops.act
    M = BATCH * W
    gu = c.randn(M, 2 * d.I, scale=2.0)
    y = ac.silu_mul(gu)
    rows = [Row(f"silu_mul rows={M}", f"{d.name} I={d.I}", str(c.dtype)[6:], rel_err(y, ac.silu_mul_ref(gu)), c.tol,
                same(ac.silu_mul(gu[3:4])[0], y[3]), c.time_us(lambda: ac.silu_mul(gu)),
                c.time_us(lambda: ac.silu_mul_ref(gu)), "F.silu(gate) * up")]
    ab = c.randn(M, 2 * d.nv, scale=3.0)
    a, b = ab[:, :d.nv], ab[:, d.nv:]
    neg_a = -torch.rand(d.nv, generator=c.g).to(c.device).exp()
    dtb = c.randn(d.nv, dtype=torch.float32)
    gk, bk = ac.gdn_gates(a, b, neg_a, dtb)
    gr, br = ac.gdn_gates_ref(a, b, neg_a, dtb)
    g1, b1 = ac.gdn_gates(a[5:6], b[5:6], neg_a, dtb)
    rows.append(Row(f"gdn_gates rows={M}", f"{d.name} nv={d.nv}", str(c.dtype)[6:],
                    max(rel_err(gk, gr), rel_err(bk, br)), c.tol, same(g1[0], gk[5]) and same(b1[0], bk[5]),
                    c.time_us(lambda: ac.gdn_gates(a, b, neg_a, dtb)),
                    c.time_us(lambda: ac.gdn_gates_ref(a, b, neg_a, dtb)), "softplus / sigmoid"))
    return rows


def check_norms(c: Ctx, d: Dims, ops) -> list[Row]:
    nm = ops.norm
    rows = []
    M = BATCH * W
    eps = 1e-6
    x, r = c.randn(M, d.H), c.randn(M, d.H)
    w = c.randn(d.H, scale=0.1)
    o, z = c.randn(M, d.nv, d.dv), c.randn(M, d.nv, d.dv)
    wg = 1 + c.randn(d.dv, scale=0.1)
    cases = [
        ("rms_norm", lambda xx: nm.rms_norm(xx, w, eps), lambda xx: nm.rms_norm_ref(xx, w, eps), x),
        ("add_rms_norm", lambda xx: nm.add_rms_norm(xx, r[:xx.shape[0]], w, eps)[0],
         lambda xx: nm.add_rms_norm_ref(xx, r[:xx.shape[0]], w, eps)[0], x),
        ("gated_rms_norm", lambda xx: nm.gated_rms_norm(xx, z[:xx.shape[0]], wg, eps),
         lambda xx: nm.gated_rms_norm_ref(xx, z[:xx.shape[0]], wg, eps), o),
    ]
    for name, kern, twin, inp in cases:
        y = kern(inp)
        err = rel_err(y, twin(inp))
        inv = same(kern(inp[:1])[0], y[0])
        t_k = c.time_us(lambda: kern(inp))
        t_t = c.time_us(lambda: twin(inp))
        rows.append(Row(f"{name} rows={M}", f"{d.name} {list(inp.shape[1:])}", str(c.dtype)[6:], err, c.tol, inv,
                        t_k, t_t, "torch twin"))
    return rows


def check_sampling(c: Ctx, d: Dims, ops) -> list[Row]:
    sp = ops.sample
    rows = []
    M = BATCH * W
    lg = c.randn(M, d.V, scale=3.0, dtype=torch.float32)
    lg[0, [5, d.V - 1]] = 100.0  # a tie: lowest index
    got = sp.argmax(lg)
    err = 0.0 if same(got, lg.argmax(-1)) else float("inf")
    rows.append(Row(f"argmax rows={M}", f"{d.name} V={d.V}", "float32", err, 0.0, None,
                    c.time_us(lambda: sp.argmax(lg)), c.time_us(lambda: lg.argmax(-1)), "torch.argmax"))
    N = BATCH
    lgs = lg[:N]
    inv_t = torch.linspace(0.0, 2.0, N, device=c.device)
    thr = sp.sampling_thresholds(lgs, inv_t, torch.tensor([0, 20] * (N // 2), device=c.device),
                                 torch.full((N,), 0.95, device=c.device), torch.zeros(N, device=c.device))
    seed, off = torch.arange(N, device=c.device) + 1, torch.arange(N, device=c.device) * 3
    got = sp.sample(lgs, inv_t, thr, seed, off)
    want = sp.sample_ref(lgs, inv_t, thr, seed, off)
    mismatch = int((got != want).sum())  # the same Philox draws: any mismatch is an error
    rows.append(Row(f"sample rows={N} (top-k/p)", f"{d.name} V={d.V}", "float32", float(mismatch), 0.0, None,
                    c.time_us(lambda: sp.sample(lgs, inv_t, thr, seed, off)),
                    c.time_us(lambda: torch.multinomial(torch.softmax(lgs, -1), 1)), "softmax+multinomial"))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# first contact: the launch table, the startup self-check, the prefill kernels at the 9B shape
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class LaunchRow:
    kernel: str
    config: str
    smem_kb: float
    limit_kb: float | None

    @property
    def ok(self) -> bool:
        return self.limit_kb is None or self.smem_kb <= self.limit_kb


def launch_rows(cc: tuple[int, int] | None, dtype: torch.dtype, dims: dict[str, int]) -> list[LaunchRow]:
    """Every launch-table entry's config for (cc, dtype, dims) with its static shared-memory estimate and the
    device's limit (engine/model/ops/launch.py). CPU-checkable: cc is a plain tuple."""
    from engine.model.ops import launch

    lim = launch.smem_limit(cc)
    out = []
    for name, e in launch.TABLE.items():
        sub = {k: dims[k] for k in e.dims}
        cfg = launch.choose(name, dtype, cc, **sub)
        blocks = " ".join(f"{k}={v}" for k, v in cfg.blocks)
        out.append(LaunchRow(name, f"{blocks} warps={cfg.num_warps} stages={cfg.num_stages}",
                             launch.smem_bytes(name, cfg, dtype, **sub) / 1024, None if lim is None else lim / 1024))
    return out


def print_launch_table(rows: list[LaunchRow], cc: tuple[int, int] | None, dtype: torch.dtype) -> None:
    print(f"\n## Launch table (compute capability {'interpreter' if cc is None else '%d.%d' % cc}, "
          f"{str(dtype)[6:]})\n")
    print("| kernel | config | shared memory (est.) | limit | fits |")
    print("|---|---|---|---|---|")
    for r in rows:
        lim = "-" if r.limit_kb is None else f"{r.limit_kb:.0f} KB"
        print(f"| {r.kernel} | {r.config} | {r.smem_kb:.1f} KB | {lim} | {'yes' if r.ok else 'NO'} |")


def model_dims(cfg) -> dict[str, int]:
    """The dims the launch table reads, from a Qwen35Config."""
    from engine.model.ops import launch
    from engine.model.ops._triton import cdiv

    return dict(hd=cfg.head_dim, dk=cfg.linear_key_head_dim, dv=cfg.linear_value_head_dim, H=cfg.hidden_size,
                nv=cfg.linear_num_value_heads, nch=cdiv(cfg.vocab_size, launch.RACE_CHUNK))


def selfcheck_rows(cfg, name: str, device: str) -> list:
    """The startup self-check (engine/selfcheck.py) at `cfg`'s shapes on `device`: one Check per kernel. A kernel
    that fails falls back to its twin for the rest of the run, as it would in the server."""
    import gpu_model as gm
    from engine import selfcheck

    return [gm.Check(name, f"self-check {c.kernel} ({c.seconds:.1f} s)", c.ok, c.detail)
            for c in selfcheck.check_kernels(cfg, device)]


#: the 9B shape of the prefill rows (shared/reference/qwen35-architecture.md section 1.3) and the tiny smoke one
PREFILL_9B = dict(name="Qwen3.5-9B shape", nk=16, nv=32, dk=128, dv=128, nh=16, nkv=4, hd=256, H=4096, I=12288,
                  gdn_layers=24, attn_layers=8)
PREFILL_TINY = dict(name="tiny", nk=2, nv=4, dk=16, dv=16, nh=2, nkv=1, hd=16, H=64, I=96, gdn_layers=1,
                    attn_layers=1)


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The torch peer of a prompt chunk from position 0: causal SDPA (flash) over contiguous K/V whose heads are
    already repeated for the query heads (no boolean mask, no GQA flag: flash stays eligible)."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       scale=scale)
    return o.transpose(1, 2)


def prefill_rows(c: Ctx, d: dict, lengths: tuple[int, ...], twin_max: int = 4096) -> tuple[list, list]:
    """Prefill through the kernels the model's prefill calls (engine/model/qwen35.py `FwdCtx.prefill_kernels`),
    called directly here, one prompt of T tokens from position 0 per length: the chunked GDN kernel and the prefill
    attention kernel of one layer each (vs the torch chunked form and causal SDPA), the prefill-tiling matmuls of
    one layer of each kind, and a 9B-shaped model's tokens/s from their sum (layers x kernels; norms, convs, gates
    and the LM head left out; the models section times whole models' prefill through the scheduler). Checks: each kernel vs its twin at the
    first length."""
    import gpu_model as gm

    name, steps, checks, dev = d["name"], [], [], c.device
    C = 2 * d["nk"] * d["dk"] + d["nv"] * d["dv"]
    gdn_w = [(C, d["H"]), (d["nv"] * d["dv"], d["H"]), (d["H"], d["nv"] * d["dv"])]  # in_proj_qkv, z, out_proj
    attn_w = [(2 * d["nh"] * d["hd"], d["H"]), (2 * d["nkv"] * d["hd"], d["H"]), (d["H"], d["nh"] * d["hd"])]
    mlp_w = [(2 * d["I"], d["H"]), (d["H"], d["I"])]  # fused gate|up, down
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    for T in lengths:
        try:
            s_, c_ = _prefill_length(c, d, T, T == lengths[0], twin_max, (gdn_w, attn_w, mlp_w), zero)
        except Exception as e:  # noqa: BLE001 - one length's failure (e.g. out of memory) must not hide the others
            s_, c_ = [], [gm.Check(name, f"prefill {T} tokens", False, f"{type(e).__name__}: {e}")]
        steps, checks = steps + s_, checks + c_
        if dev == "cuda":
            torch.cuda.empty_cache()
    return steps, checks


def _prefill_length(c: Ctx, d: dict, T: int, check: bool, twin_max: int, weights: tuple, zero: torch.Tensor
                    ) -> tuple[list, list]:
    """`prefill_rows` for one prompt length (check: also each kernel vs its twin)."""
    import gpu_model as gm
    from engine.model.ops import attention as at
    from engine.model.ops import attention_prefill as ap
    from engine.model.ops import gdn_prefill as gp
    from engine.model.ops import matmul as mm
    from engine.model.ops.gdn import gdn_chunked, l2norm

    name, steps, checks = d["name"], [], []
    dev, f32 = c.device, torch.float32
    gdn_w, attn_w, mlp_w = weights
    iters = 5 if T > 4096 else 20
    q, k = c.randn(1, T, d["nk"], d["dk"]), c.randn(1, T, d["nk"], d["dk"])
    v = c.randn(1, T, d["nv"], d["dv"])
    gl = (-torch.rand(1, T, d["nv"], generator=c.g) * 0.3).to(dev)
    beta = torch.rand(1, T, d["nv"], generator=c.g).to(dev)
    rec = torch.zeros(1, 1, d["nv"], d["dk"], d["dv"], dtype=f32, device=dev)
    gdn = lambda: gp.chunked_gdn(q, k, v, gl, beta, rec, zero, zero, zero, qk_l2norm=True,  # noqa: E731
                                 out_dtype=c.dtype)
    t_gdn = c.time_us(gdn, iters)
    qa, gate = c.randn(1, T, d["nh"], d["hd"]), c.randn(1, T, d["nh"], d["hd"])
    kc, vc = c.randn(1, T, d["nkv"], d["hd"]), c.randn(1, T, d["nkv"], d["hd"])
    sc = d["hd"] ** -0.5
    attn = lambda: ap.prefill_attention(qa, kc, vc, zero, zero, sc, gate)  # noqa: E731
    t_attn = c.time_us(attn, iters)
    if check:  # correctness at the first length, vs the twins
        r0 = rec.clone()
        o_k = gp.chunked_gdn(q, k, v, gl, beta, r0, zero, zero, zero, qk_l2norm=True)
        r1 = rec.clone()
        o_t = gp.chunked_gdn_ref(q, k, v, gl, beta, r1, zero, zero, zero, qk_l2norm=True)
        err = max(rel_err(o_k, o_t), rel_err(r0, r1))
        checks.append(gm.Check(name, f"GDN chunk kernel == its twin, {T} tokens", err <= c.tol,
                               f"max rel err {err:.2e} (tol {c.tol:.0e})"))
        err = rel_err(attn(), at.attention_ref(qa, kc, vc, zero, zero, sc, gate))
        checks.append(gm.Check(name, f"prefill attention kernel == its twin, {T} tokens", err <= c.tol,
                               f"max rel err {err:.2e} (tol {c.tol:.0e})"))
    t_twin = None
    if c.timing and T <= twin_max:
        r = d["nv"] // d["nk"]
        qe = l2norm(q.float().repeat_interleave(r, 2)) * d["dk"] ** -0.5
        ke = l2norm(k.float().repeat_interleave(r, 2))
        t_twin = c.time_us(lambda: gdn_chunked(qe, ke, v.float(), gl, beta, rec[:, 0]), 3)
    r = d["nh"] // d["nkv"]
    kx, vx = kc.repeat_interleave(r, 2), vc.repeat_interleave(r, 2)
    t_sdpa = c.time_us(lambda: _sdpa_causal(qa, kx, vx, sc) * torch.sigmoid(gate), iters)
    del kx, vx
    mm_us: dict[tuple[int, int], float | None] = {}
    for N, K in {*gdn_w, *attn_w, *mlp_w}:
        x, w = c.randn(T, K), c.randn(N, K, scale=K ** -0.5)
        mm_us[(N, K)] = c.time_us(lambda: mm.matmul(x, w, phase="prefill"), iters)
        del x, w
    steps.append(gm.Step(name, f"GDN chunk kernel, {T} tokens, one layer", 1, None if t_gdn is None else
                         t_gdn / 1e3, None if not (t_gdn and t_twin) else t_twin / t_gdn,
                         "torch chunked form's time / ours"))
    steps.append(gm.Step(name, f"prefill attention kernel, {T} tokens, one layer", 1,
                         None if t_attn is None else t_attn / 1e3,
                         None if not (t_attn and t_sdpa) else t_sdpa / t_attn, "causal SDPA's time / ours"))
    total = None
    if c.timing:
        layer = lambda ws: sum(mm_us[w] for w in ws)  # noqa: E731
        total = (d["gdn_layers"] * (t_gdn + layer(gdn_w)) + d["attn_layers"] * (t_attn + layer(attn_w))
                 + (d["gdn_layers"] + d["attn_layers"]) * layer(mlp_w))
    steps.append(gm.Step(name, f"prefill {T} tokens through the kernels ({d['gdn_layers']} GDN + "
                               f"{d['attn_layers']} attention layers: their kernels and prefill matmuls; norms, "
                               "conv, gates, LM head left out) (tokens/s)", 1,
                         None if total is None else total / 1e3, None if total is None else T / total * 1e6,
                         "tokens/s"))
    return steps, checks


def copy_bandwidth_gbps(device: str) -> float:
    n = 1 << 29  # 1 GiB of fp16
    src = torch.empty(n, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    c = Ctx(device, torch.float16, timing=True)
    us = c.time_us(lambda: dst.copy_(src), iters=10)
    assert us is not None
    return 2 * n * 2 / us / 1e3


def run_checks(c: Ctx, dims: list[Dims], moe: MoeDims, sampling: bool = True) -> list[Row]:
    from engine.model.ops import act, attention, gdn_update, matmul, norm, sample

    class Ops:  # the kernel modules, imported after TRITON_INTERPRET is settled
        pass

    ops = Ops()
    ops.matmul, ops.attention, ops.gdn_update, ops.norm, ops.sample = matmul, attention, gdn_update, norm, sample
    ops.act = act
    rows = []
    for d in dims:
        for fn in (check_matmul, check_attention, check_gdn, check_act, check_norms) + (
                (check_sampling,) if sampling else ()):
            rows += fn(c, d, ops)
            if c.device == "cuda":
                torch.cuda.empty_cache()
    rows += check_grouped(c, moe, ops)
    return rows


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[Row], timing: bool) -> None:
    head = "| kernel | shape | dtype | max rel err (tol) | invariant | result |"
    if timing:
        head += " kernel us | torch us | torch | kernel GB/s |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        inv = "-" if r.invariant is None else ("bitwise" if r.invariant else "NO")
        line = (f"| {r.kernel} | {r.shape} | {r.dtype} | {r.err:.2e} ({r.tol:.0e}) | {inv} | "
                f"{'PASS' if r.ok else 'FAIL'} |")
        if timing:
            line += f" {fmt(r.kernel_us)} | {fmt(r.torch_us)} | {r.torch_name} | {fmt(r.gbps, '.0f')} |"
        print(line)


def write_json(path: Path, rows: list[Row], steps: list, checks: list, meta: dict,
               launch: list[LaunchRow] = ()) -> None:
    path.write_text(json.dumps({"meta": meta, "kernels": [r.__dict__ | {"ok": r.ok} for r in rows],
                                "steps": [s_.__dict__ for s_ in steps],
                                "checks": [c_.__dict__ for c_ in checks],
                                "launch": [r.__dict__ | {"ok": r.ok} for r in launch]}, indent=1, default=str))


def print_goals(steps: list) -> None:
    """The issue's goals, one line each: the figure, the goal, met / NOT met / not measured."""
    goals = [s_ for s_ in steps if s_.goal]
    if not goals:
        return
    print("\n## Goals\n")
    print("| model | step | batch | figure | goal | met |")
    print("|---|---|---|---|---|---|")
    for s_ in goals:
        fig = "-" if s_.ratio is None else f"{s_.ratio:.2f}x {s_.vs}"
        met = "not measured" if s_.met is None else ("met" if s_.met else "NOT met")
        print(f"| {s_.model} | {s_.step} | {s_.batch} | {fig} | {s_.goal} | {met} |")


class Tee:
    """stdout also written to a file (--md): the markdown a run prints, kept even when it is cut short."""

    def __init__(self, path: Path):
        self.f, self.out = path.open("w"), sys.stdout

    def write(self, x: str) -> int:
        self.f.write(x)
        self.f.flush()
        return self.out.write(x)

    def flush(self) -> None:
        self.f.flush()
        self.out.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, checks only (CPU: TRITON_INTERPRET=1)")
    ap.add_argument("--quick", action="store_true",
                    help="with --smoke: kernels in bf16 and the bf16 tiny model only (the test suite's variant)")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON (rewritten after every section)")
    ap.add_argument("--md", type=Path, help="also write the printed markdown to this file")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of: {', '.join(SECTIONS)} (run in "
                                                                      "that order on a GPU)")
    ap.add_argument("--budget-s", type=float, default=360.0,
                    help="on the GPU, start no model section nor the kernel section with under 60 s of this budget "
                         "left, nor a model's end-to-end part or its transformers peer once it is spent (default "
                         "360: with the imports and the last section's overrun the run fits in 8 minutes)")
    args = ap.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown section(s) {', '.join(sorted(unknown))} (choose from {', '.join(SECTIONS)})")
    if args.md:
        sys.stdout = Tee(args.md)  # type: ignore[assignment]
    try:
        return run(args)
    finally:
        if args.md:
            sys.stdout = sys.stdout.out  # type: ignore[attr-defined]


def run(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    deadline = t_start + (float("inf") if args.smoke else args.budget_s)
    sections = set(args.sections.split(","))
    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.smoke:
            print("no CUDA device: run with --smoke (the kernels under TRITON_INTERPRET=1)", file=sys.stderr)
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    from engine.model.ops._triton import HAS_TRITON

    if not HAS_TRITON:
        print("triton is not installed (pip install triton)", file=sys.stderr)
        return 2
    import triton

    import gpu_model as gm
    from engine.model.ops import dispatch

    device = "cuda" if cuda else "cpu"
    rows: list[Row] = []
    steps: list = []
    checks: list = []
    launch: list[LaunchRow] = []
    bw = copy_bandwidth_gbps(device) if cuda else None
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:],
            "device": torch.cuda.get_device_name() if cuda else "cpu (TRITON_INTERPRET=1)",
            "torch": torch.__version__, "triton": triton.__version__, "copy_gbps": bw}

    def save() -> None:
        if args.json:
            write_json(args.json, rows, steps, checks, meta, launch)
        sys.stdout.flush()

    print(f"# bench/gpu.py {' '.join(sys.argv[1:])} on {meta['device']}: torch {meta['torch']}, "
          f"triton {meta['triton']}, {meta['date']}")
    if bw is not None:
        print(f"copy bandwidth (read + write): {bw:.0f} GB/s")
    if "selfcheck" in sections:  # first contact: the launch table and every kernel against its twin
        cfg, shape = (gm.QWEN_9B, "9B shape") if not args.smoke else (gm.specs(True, True)[0].cfg, "tiny bf16")
        cc = torch.cuda.get_device_capability() if cuda else (9, 0)  # a CPU shows what an H200 would launch
        launch = launch_rows(cc, cfg.dtype, model_dims(cfg))
        print_launch_table(launch, cc, cfg.dtype)
        checks += [gm.Check(shape, f"launch table: {r.kernel} fits shared memory", r.ok,
                            f"{r.smem_kb:.0f} KB > {r.limit_kb:.0f} KB" if not r.ok else "") for r in launch]
        t0 = time.monotonic()
        with nullcontext() if cuda else dispatch.force_kernels():
            sc = selfcheck_rows(cfg, shape, device)
        checks += sc
        gm.print_model_tables([], sc, checks_title=f"Startup self-check at the {shape}: each kernel vs its twin "
                                                   f"({time.monotonic() - t0:.0f} s)")
        save()
    if "prefill" in sections:
        if deadline - time.monotonic() >= 60:
            st, ch = prefill_rows(Ctx(device, torch.bfloat16, timing=cuda), PREFILL_TINY if args.smoke else PREFILL_9B,
                                  (70,) if args.smoke else PREFILL_LENGTHS)
            steps += st
            checks += ch
            gm.print_model_tables(st, ch, "Prefill kernels (the model's prefill path), called directly",
                                  "Prefill kernels vs their twins")
        else:
            checks.append(gm.Check("-", "prefill section", None, "skipped: out of budget"))
        save()
    if args.smoke and "kernels" in sections:  # on the CPU first (cheap); on the GPU after the models (below)
        dtypes = (torch.bfloat16,) if args.quick else (torch.float32, torch.bfloat16)
        for dt in dtypes:
            rows += run_checks(Ctx(device, dt, timing=False), [TINY], TINY_MOE,
                               sampling=dt == torch.float32 or args.quick)
        print("\n## Kernels vs their twins (tiny shapes, TRITON_INTERPRET=1 on a CPU)\n")
        print_table(rows, timing=False)
        save()
    if "models" in sections:
        for spec in gm.specs(args.smoke, args.quick):
            left = deadline - time.monotonic()
            if left < 60:
                checks.append(gm.Check(spec.name, "model section", None, f"skipped: {left:.0f} s of budget left"))
                continue
            t0 = time.monotonic()
            try:
                st, ch = gm.model_rows(spec, device, bw, deadline)
            except Exception as e:  # noqa: BLE001 - one model's failure must not hide the others' rows
                import traceback

                traceback.print_exc()
                st, ch = [], [gm.Check(spec.name, "model section", False, f"{type(e).__name__}: {e}")]
                if cuda:
                    torch.cuda.empty_cache()
            steps += st
            checks += ch
            print(f"\n# {spec.name} ({time.monotonic() - t0:.0f} s)")
            gm.print_model_tables(st, ch)  # as soon as it is known: a run cut short keeps what it measured
            save()
    if not args.smoke and "kernels" in sections:
        if deadline - time.monotonic() >= 60:
            try:
                rows = run_checks(Ctx(device, torch.bfloat16, timing=True), QWEN, QWEN_MOE)
            except Exception as e:  # noqa: BLE001 - report it with the rest
                import traceback

                traceback.print_exc()
                rows = [Row(f"kernel section: {type(e).__name__}: {e}", "-", "-", float("inf"), 0.0, None)]
                torch.cuda.empty_cache()
            print("\n## Kernels vs their twins (bf16, Qwen3.5 shapes)\n")
            print_table(rows, timing=True)
        else:
            checks.append(gm.Check("-", "kernel section", None, "skipped: out of budget"))
        save()
    print_goals(steps)
    bad = [r.kernel for r in rows if not r.ok] + [f"{c_.model}: {c_.check}" for c_ in checks if c_.ok is False]
    n = len(rows) + sum(c_.ok is not None for c_ in checks)
    skipped = [f"{c_.model}: {c_.check}" for c_ in checks if c_.ok is None]
    print(f"\n{n - len(bad)}/{n} checks PASS" + (f", {len(skipped)} skipped ({'; '.join(skipped)})" if skipped else "")
          + ("" if not bad else ": FAIL " + "; ".join(bad)) + f" ({time.monotonic() - t_start:.0f} s)")
    save()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
