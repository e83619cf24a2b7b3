"""Kernels meet the device at startup: every Triton kernel of the model's path is compiled for the model's shapes
and dtype and compared with its torch twin on random inputs on the device, before the first request.

`check_kernels(cfg, device)` runs one check per kernel (`dispatch.KERNELS`) at the model's own shapes (every dense
GEMM shape of the model in both tilings, `linear_shapes`; the LM head's vocab at an N of the same compiled variant;
the layer and q / k norms; each MLP width; the model's expert count), so a pass covers the variants Triton compiles
for the real weights. The kernel wrapper writes into NaN-poisoned output buffers, the twin computes the same from
the same inputs, and `dispatch.mismatch` applies the tolerance of the output's dtype, reduction length and
accumulation (each check names its `dispatch.Accumulation`: a GEMM's K, a norm's row, a recurrence's terms, the
operands a kernel rounds). A kernel that raises (a compile failure, out of shared
memory, a launch error) or does not match is replaced by its twin for this process (`dispatch.fall_back`),
named in one log line, and reported as impl "torch" (the `nextn_kernel_info` gauge, /health's detail).

`startup(model, runner, strict=..., progress=...)` is what the server calls once the state pool exists and before
any session holds a slot: on the kernel path it runs the check, then captures the scheduler's CUDA graphs
(engine/graphs.py `GraphRunner.capture_all`), with one progress bar over both (as the loader shows one), logs
each part's time, and with strict raises `KernelCheckFailed` (one line) on any failure. On the torch path (CPU)
it does nothing.

Tests drive the check on a CPU under TRITON_INTERPRET=1 inside `dispatch.force_kernels()`, and inject failures
by replacing a kernel wrapper in its module (the check and the model look the wrappers up at call time); nothing
in the serving path can reach a fault.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .graphs import CaptureReport, GraphRunner
from .model.config import Qwen35Config
from .model.ops import act as _act
from .model.ops import attention as _attn
from .model.ops import attention_prefill as _attnp
from .model.ops import dispatch as ops
from .model.ops import gdn_prefill as _gdnp
from .model.ops import gdn_update as _gdn
from .model.ops import launch as _launch
from .model.ops import matmul as _mm
from .model.ops import matmul_fp8 as _fp8
from .model.ops import norm as _norm
from .model.ops import sample as _sample

log = logging.getLogger(__name__)

Acc = ops.Accumulation
#: (what, kernel's, twin's) or (what, kernel's, twin's, how the kernel accumulated it: the tolerance's Accumulation)
Outputs = list[tuple]

#: the largest N a matmul check allocates; a longer weight (the LM head's vocab) is checked at an N of the same compiled
#: variant (`_variant_n`)
MAX_CHECK_N = 16384


class KernelCheckFailed(RuntimeError):
    """A kernel failed its startup check under `--kernels strict`; `str(err)` is one line."""


@dataclass
class KernelCheck:
    """One kernel's verdict: ok (it runs), else why it failed (its twin runs instead)."""

    kernel: str
    ok: bool
    detail: str = ""
    seconds: float = 0.0

    @property
    def impl(self) -> str:
        return "triton" if self.ok else "torch"


@dataclass
class Startup:
    """What `startup` did (empty on the torch path): the kernel verdicts, the graph captures, the seconds."""

    kernels: list[KernelCheck] = field(default_factory=list)
    graphs: CaptureReport | None = None
    seconds: float = 0.0

    def kernel_info(self) -> dict[str, str]:
        """kernel -> "triton" | "torch", for every kernel checked ({} when none was)."""
        return {c.kernel: c.impl for c in self.kernels}


class _Rand:
    """Seeded inputs on the device in the model dtype, and NaN-poisoned output buffers."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int = 0):
        self.device, self.dtype = device, dtype
        self.g = torch.Generator(device=device).manual_seed(seed)

    def randn(self, *shape: int, scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.g, device=self.device, dtype=torch.float32) * scale
        return x.to(dtype or self.dtype)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.g, device=self.device, dtype=torch.float32)

    def nans(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype or self.dtype, device=self.device)

    def ints(self, *shape: int) -> torch.Tensor:
        return torch.full(shape, -1, dtype=torch.int64, device=self.device)

    def idx(self, *v: int) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.int64, device=self.device)


# ----------------------------------------------------------------------------------------------------- the checks
# One function per kernel: (config, inputs) -> [(what, kernel output, twin output)], at the model's head sizes,
# hidden size and dtype, with few rows (the shapes a kernel's compiled variant depends on).

def linear_shapes(c: Qwen35Config) -> list[tuple[str, int, int, torch.dtype | None]]:
    """(what, N, K, out_dtype) of every dense GEMM `c`'s model runs (engine/model/qwen35.py, moe.py), distinct, the
    fused weights (`fuse_linears`: q|k|v, the GDN's qkv|z|b|a, the MLP's gate|up) and their pieces (an unfused
    model, an FP8 piece): attention and GDN projections, the dense MLP or the MoE router, shared expert and its
    gate (N = 1), the MTP head's fc, and the LM head (fp32 logits). The MoE experts are `grouped_matmul`'s."""
    H, hd, nh, nkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    out: list[tuple[str, int, int, torch.dtype | None]] = []
    if "full_attention" in c.layer_types or c.has_mtp:
        out += [("attn q|k|v", 2 * nh * hd + 2 * nkv * hd, H, None), ("attn q", 2 * nh * hd, H, None),
                ("attn k", nkv * hd, H, None), ("attn o", H, nh * hd, None)]
    if "linear_attention" in c.layer_types:
        C, nv, dv = c.gdn_conv_dim, c.linear_num_value_heads, c.linear_value_head_dim
        out += [("gdn qkv|z|b|a", C + nv * dv + 2 * nv, H, None), ("gdn qkv", C, H, None),
                ("gdn z", nv * dv, H, None), ("gdn b", nv, H, None), ("gdn out", H, nv * dv, None)]
    mlps = [("shared", c.shared_expert_intermediate_size)] if c.is_moe else [("mlp", c.intermediate_size)]
    for name, inner in mlps:
        out += [(f"{name} gate|up", 2 * inner, H, None), (f"{name} gate", inner, H, None),
                (f"{name} down", H, inner, None)]
    if c.is_moe:
        out += [("router", c.num_experts, H, None), ("shared gate", 1, H, None)]
    if c.has_mtp:
        out.append(("mtp fc", H, 2 * H, None))
    out.append(("lm head", c.vocab_size, H, torch.float32))
    distinct: dict[tuple[int, int, torch.dtype | None], str] = {}
    for what, N, K, odt in out:
        distinct.setdefault((N, K, odt), what)
    return [(what, N, K, odt) for (N, K, odt), what in distinct.items()]


def _variant_n(N: int, K: int, cfg: _launch.Launch, phase: str,
               config: Callable[[int, int, _launch.Launch], tuple[int, int]]) -> int:
    """N itself up to MAX_CHECK_N; beyond, the smallest N' >= MAX_CHECK_N that compiles and runs the same variant of
    the matmul kernel as N: N' = N mod BN (the same partial last tile; so the same divisibility by 16, Triton's
    specialisation of N and of y's row stride) and the same K split (`config`: matmul_config or fp8_config; the
    prefill tiling never splits)."""
    if N <= MAX_CHECK_N:
        return N
    split = (lambda n: 1) if phase == "prefill" else (lambda n: config(n, K, cfg))
    bn = cfg["BN"]
    n = MAX_CHECK_N - MAX_CHECK_N % bn + N % bn
    for _ in range(4096):
        if split(n) == split(N):
            return n
        n += bn
    return N


def _matmul(c: Qwen35Config, r: _Rand) -> Outputs:
    """Every dense GEMM shape of the model (`linear_shapes`) in both tilings, 3 rows each."""
    out = []
    for what, N, K, odt in linear_shapes(c):
        for phase in _mm.PHASES:
            n = _variant_n(N, K, _launch.get(f"matmul/{phase}", r.dtype, r.device), phase, _mm.matmul_config)
            w, x = r.randn(n, K, scale=K ** -0.5), r.randn(3, K)
            y = _mm.matmul(x, w, odt, out=r.nans(3, n, dtype=odt), phase=phase)
            out.append((f"{what} [{n}x{K}] {phase}", y, _mm.matmul_ref(x, w, odt), Acc(K)))
    return out


def _fp8_weight(r: _Rand, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random FP8 weight [..., N, K] (e4m3 codes of N(0, 1) values) and fp32 block scales of about K^-1/2."""
    q = r.randn(*shape, dtype=torch.float32).to(_fp8.FP8)
    s = (0.5 + r.rand(*_fp8.scale_shape(shape))) * shape[-1] ** -0.5
    return q, s


def _matmul_fp8(c: Qwen35Config, r: _Rand) -> Outputs:
    """The W8A16 matmul (FP8 models only): the LM-head-like and a K-split weight in the step tiling, the prefill
    tiling, a fused weight with a scale row map (pieces off the 128-row blocks), and the MoE experts' form."""
    H = c.hidden_size
    out = []
    for what, N, K, odt in linear_shapes(c):
        for phase in _mm.PHASES:
            n = _variant_n(N, K, _launch.get(f"matmul_fp8/{phase}", r.dtype, r.device), phase, _fp8.fp8_config)
            q, s = _fp8_weight(r, n, K)
            x = r.randn(3, K)
            y = _fp8.matmul_fp8(x, q, s, out_dtype=odt, out=r.nans(3, n, dtype=odt), phase=phase)
            out.append((f"{what} [{n}x{K}] {phase}", y, _fp8.matmul_fp8_ref(x, q, s, out_dtype=odt), Acc(K)))
    w, _ = _fp8.fuse([_fp8.mark(*_fp8_weight(r, n, H)) for n in (96, 200)])
    s, rows = _fp8.scales(w)
    x = r.randn(3, H)
    out.append(("fused, row map", _fp8.matmul_fp8(x, w, s, rows, out=r.nans(3, 296)),
                _fp8.matmul_fp8_ref(x, w, s, rows), Acc(H)))
    if c.is_moe:  # the model's E: one expert's weight and scales expanded to E (as `_grouped`)
        E, k, Im = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
        q, s = (t.expand(E, *t.shape[1:]) for t in _fp8_weight(r, 1, 2 * Im, H))
        x = r.randn(5, H)
        idx = torch.stack([torch.randperm(E, generator=r.g, device=r.device)[:k] for _ in range(5)])  # [5, k]
        order, offsets = _mm.group_by_expert(idx, E)
        rows = order // k
        out.append(("grouped", _fp8.grouped_matmul_fp8(x, q, s, offsets, rows),
                    _fp8.grouped_matmul_fp8_ref(x, q, s, offsets, rows), Acc(H)))
    return out


def _grouped(c: Qwen35Config, r: _Rand) -> Outputs:
    """The experts' gate|up and down at the model's E, top-k and sizes. The weight is one expert's, expanded to E
    (expert stride 0: Triton specialises it as it does the real stride, a multiple of 16), not E experts' memory."""
    E, k, H, Im = c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
    idx = torch.stack([torch.randperm(E, generator=r.g, device=r.device)[:k] for _ in range(5)])  # [5, k]
    order, offsets = _mm.group_by_expert(idx, E)
    rows = order // k
    x = r.randn(5, H)
    gu = r.randn(1, 2 * Im, H, scale=H ** -0.5).expand(E, -1, -1)
    y = _mm.grouped_matmul(x, gu, offsets, rows, out=r.nans(5 * k, 2 * Im))
    h = r.randn(5 * k, Im)
    down = r.randn(1, H, Im, scale=Im ** -0.5).expand(E, -1, -1)
    y2 = _mm.grouped_matmul(h, down, offsets, out=r.nans(5 * k, H))
    return [("gate_up", y, _mm.grouped_matmul_ref(x, gu, offsets, rows), Acc(H)),
            ("down", y2, _mm.grouped_matmul_ref(h, down, offsets), Acc(Im))]


def _moe_combine(c: Qwen35Config, r: _Rand) -> Outputs:
    N, k, H = 3, c.num_experts_per_tok, c.hidden_size
    y, inv = r.randn(N * k, H), torch.randperm(N * k, generator=r.g, device=r.device)
    w = torch.softmax(r.randn(N, k, dtype=torch.float32), -1).to(r.dtype)
    sh, sg = r.randn(N, H), r.randn(N, 1)
    got = _act.moe_combine(y, inv, w, sh, sg, out=r.nans(N, H))
    return [("combine", got, _act.moe_combine_ref(y, inv, w, sh, sg), Acc(k + 1))]


def _rms_norm(c: Qwen35Config, r: _Rand) -> Outputs:
    """The layer norms (rows of H) and the attention's q / k norms (rows of head_dim, [N, T, heads, hd] views)."""
    out = []
    shapes = [("hidden", (3, c.hidden_size))]
    if "full_attention" in c.layer_types or c.has_mtp:
        shapes += [("q norm", (2, 3, c.num_attention_heads, c.head_dim)),
                   ("k norm", (2, 3, c.num_key_value_heads, c.head_dim))]
    for what, shape in shapes:
        x, w = r.randn(*shape), r.randn(shape[-1], scale=0.1)
        out.append((what, _norm.rms_norm(x, w, c.rms_norm_eps, out=r.nans(*shape)),
                    _norm.rms_norm_ref(x, w, c.rms_norm_eps), Acc(shape[-1])))
    return out


def _add_rms_norm(c: Qwen35Config, r: _Rand) -> Outputs:
    H = c.hidden_size
    x, res, w = r.randn(3, H), r.randn(3, H), r.randn(H, scale=0.1)
    y, s = _norm.add_rms_norm(x, res, w, c.rms_norm_eps, out=r.nans(3, H), out_sum=r.nans(3, H))
    y_t, s_t = _norm.add_rms_norm_ref(x, res, w, c.rms_norm_eps)
    return [("norm", y, y_t, Acc(H)), ("sum", s, s_t)]


def _gated_rms_norm(c: Qwen35Config, r: _Rand) -> Outputs:
    nv, dv = c.linear_num_value_heads, c.linear_value_head_dim
    x, z, w = r.randn(3, nv, dv), r.randn(3, nv, dv), 1 + r.randn(dv, scale=0.1)
    return [("norm", _norm.gated_rms_norm(x, z, w, c.rms_norm_eps, out=r.nans(3, nv, dv)),
             _norm.gated_rms_norm_ref(x, z, w, c.rms_norm_eps), Acc(dv))]


def _attention(c: Qwen35Config, r: _Rand) -> Outputs:
    nh, nkv, hd, L, T = c.num_attention_heads, c.num_key_value_heads, c.head_dim, 296, 3
    kc, vc = r.randn(3, L, nkv, hd), r.randn(3, L, nkv, hd)
    q, gate = r.randn(2, T, nh, hd), r.randn(2, T, nh, hd)
    slot, pos0 = r.idx(2, 0), r.idx(290, 37)  # 293 keys: two KV splits; 40: one
    o = _attn.attention(q, kc, vc, slot, pos0, hd ** -0.5, gate, out=r.nans(2, T, nh, hd))
    return [("gated", o, _attn.attention_ref(q, kc, vc, slot, pos0, hd ** -0.5, gate), _attn_acc(hd, L, r.dtype))]


def _attention_prefill(c: Qwen35Config, r: _Rand) -> Outputs:
    nh, nkv, hd, L, T = c.num_attention_heads, c.num_key_value_heads, c.head_dim, 128, 40
    kc, vc = r.randn(3, L, nkv, hd), r.randn(3, L, nkv, hd)
    q, gate = r.randn(2, T, nh, hd), r.randn(2, T, nh, hd)
    slot, pos0 = r.idx(2, 0), r.idx(64, 3)  # a chunk on the grid, and one at any position
    o = _attnp.prefill_attention(q, kc, vc, slot, pos0, hd ** -0.5, gate, out=r.nans(2, T, nh, hd))
    return [("causal", o, _attnp.prefill_attention_ref(q, kc, vc, slot, pos0, hd ** -0.5, gate),
             _attn_acc(hd, L, r.dtype))]


def _attn_acc(hd: int, keys: int, dtype: torch.dtype) -> ops.Accumulation:
    """Attention's accumulation: q.k over hd, p.v over the keys; with 16-bit KV the kernel casts the probabilities to
    the KV dtype for the p.v dot (an operand its fp32 twin keeps)."""
    return Acc(hd + keys, ops.U_BF16 if dtype in (torch.bfloat16, torch.float16) else 0.0)


def _gdn_window(r: _Rand, shape: tuple[int, ...], dtype: torch.dtype, slot: torch.Tensor, T: int) -> torch.Tensor:
    """A [S, W, ...] pool of random states whose window slots 0..T-1 of `slot` (the ones a step writes) are NaN."""
    p = r.randn(*shape, scale=0.3, dtype=dtype)
    p[slot[:, None], torch.arange(T, device=r.device)[None, :]] = float("nan")
    return p


def _gdn_update(c: Qwen35Config, r: _Rand) -> Outputs:
    nk, dk, nv, dv, T = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_num_value_heads, \
        c.linear_value_head_dim, 2
    q, k, v = r.randn(2, T, nk, dk), r.randn(2, T, nk, dk), r.randn(2, T, nv, dv)
    g, beta = -r.rand(2, T, nv), r.rand(2, T, nv)
    slot, cur = r.idx(2, 0), r.idx(2, 2)  # reads window slot 2, writes 0 and 1
    rec = _gdn_window(r, (3, 3, nv, dk, dv), torch.float32, slot, T)
    rec_t = rec.clone()
    o = _gdn.gdn_update(q, k, v, g, beta, rec, slot, cur, qk_l2norm=True, out=r.nans(2, T, nv, dv))
    o_t = _gdn.gdn_update_ref(q, k, v, g, beta, rec_t, slot, cur, qk_l2norm=True)
    acc = Acc(dk * T)  # each token's update adds a dk-long dot into the state
    return [("output", o, o_t, acc), ("states", rec[slot, :T], rec_t[slot, :T], acc)]


def _gdn_prefill(c: Qwen35Config, r: _Rand) -> Outputs:
    nk, dk, nv, dv, T = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_num_value_heads, \
        c.linear_value_head_dim, 70
    q, k, v = r.randn(2, T, nk, dk), r.randn(2, T, nk, dk), r.randn(2, T, nv, dv)
    g, beta = -r.rand(2, T, nv), r.rand(2, T, nv)
    slot, cur, dst, lens = r.idx(2, 0), r.idx(1, 0), r.idx(0, 1), r.idx(T, 9)  # a chunk and a tail; a short row
    rec = r.randn(3, 3, nv, dk, dv, scale=0.3, dtype=torch.float32)
    rec[slot, dst] = float("nan")
    rec[2, 2] = float("nan")  # row 0's state at its block boundary (token 40) is kept here
    nb = _gdnp.NO_BOUND
    bounds = torch.tensor([[40, nb], [nb, nb]], dtype=torch.int32, device=r.device)  # [2, 2]
    keep = torch.tensor([[2, -1], [-1, -1]], dtype=torch.int32, device=r.device)  # [2, 2]
    rec_t = rec.clone()
    o = _gdnp.chunked_gdn(q, k, v, g, beta, rec, slot, cur, dst, lens, qk_l2norm=True, out_dtype=r.dtype,
                          out=r.nans(2, T, nv, dv), bounds=bounds, keep=keep)
    o_t = _gdnp.chunked_gdn_ref(q, k, v, g, beta, rec_t, slot, cur, dst, lens, qk_l2norm=True, bounds=bounds,
                                keep=keep)
    # each token's update adds a dk-long dot into the state; the dots' operand rounding follows the launch table's
    # precision (IEEE fp32 for every dtype, launch.py; TF32 would be U_TF32)
    ieee = _launch.get("gdn_prefill", r.dtype, r.device, dk=dk, dv=dv)["IEEE"]
    acc = Acc(dk * T, 0.0 if ieee else ops.U_TF32)
    return [("output", o[0], o_t[0], acc), ("short row", o[1, :9], o_t[1, :9], acc),
            ("states", rec[slot, dst], rec_t[slot, dst], acc), ("kept state", rec[2, 2], rec_t[2, 2], acc)]


def _conv_update(c: Qwen35Config, r: _Rand) -> Outputs:
    C, T = c.gdn_conv_dim, 2
    x, w = r.randn(2, T, C), r.randn(C, c.linear_conv_kernel_dim, scale=0.5)
    slot, cur = r.idx(2, 0), r.idx(2, 2)
    conv = _gdn_window(r, (3, 3, C, c.linear_conv_kernel_dim - 1), r.dtype, slot, T)
    conv_t = conv.float()
    y = _gdn.conv_update(x, conv, w, slot, cur, out=r.nans(2, T, C))
    y_t = _gdn.conv_update_ref(x.float(), conv_t, w.float(), slot, cur)  # the kernel sums the taps in fp32
    return [("output", y, y_t.to(r.dtype), Acc(c.linear_conv_kernel_dim)),
            ("windows", conv[slot, :T], conv_t[slot, :T].to(r.dtype))]


def _gdn_gates(c: Qwen35Config, r: _Rand) -> Outputs:
    nv = c.linear_num_value_heads
    a, b = r.randn(4, nv, scale=3.0), r.randn(4, nv, scale=3.0)
    neg_a, dtb = -r.rand(nv).exp(), r.randn(nv, dtype=torch.float32)
    g, beta = _act.gdn_gates(a, b, neg_a, dtb)
    g_t, beta_t = _act.gdn_gates_ref(a, b, neg_a, dtb)
    return [("g", g, g_t), ("beta", beta, beta_t)]


def _silu_mul(c: Qwen35Config, r: _Rand) -> Outputs:
    """At each MLP width of the model (the dense MLP's; a MoE's experts and shared expert)."""
    inners = [c.moe_intermediate_size, c.shared_expert_intermediate_size] if c.is_moe else [c.intermediate_size]
    out = []
    for inner in dict.fromkeys(i for i in inners if i):
        gu = r.randn(3, 2 * inner, scale=2.0)
        out.append((f"swiglu {inner}", _act.silu_mul(gu, out=r.nans(3, inner)), _act.silu_mul_ref(gu)))
    return out


def _argmax(c: Qwen35Config, r: _Rand) -> Outputs:
    lg = r.randn(3, c.vocab_size, scale=3.0, dtype=torch.float32)
    lg[0, [1, c.vocab_size - 1]] = 100.0  # a tie: the lowest index
    return [("greedy", _sample.argmax(lg, out=r.ints(3)), _sample.argmax_ref(lg))]


def _sample_(c: Qwen35Config, r: _Rand) -> Outputs:
    lg = r.randn(4, c.vocab_size, scale=3.0, dtype=torch.float32)
    inv_t = torch.tensor([0.0, 0.5, 1.0, 2.0], device=r.device)
    top_p = torch.tensor([1.0, 0.95, 0.9, 1.0], device=r.device)
    thr = _sample.sampling_thresholds(lg, inv_t, r.idx(0, 20, 0, 50), top_p, torch.zeros(4, device=r.device))
    seed, off = r.idx(1, 2, 3, 4), r.idx(0, 4, 8, 12)
    got = _sample.sample(lg, inv_t, thr, seed, off, out=r.ints(4))
    return [("race", got, _sample.sample_ref(lg, inv_t, thr, seed, off))]


#: kernel name (dispatch.KERNELS) -> its check; the order of the startup check
CHECKS: dict[str, Callable[[Qwen35Config, _Rand], Outputs]] = {
    "matmul": _matmul, "grouped_matmul": _grouped, "moe_combine": _moe_combine, "rms_norm": _rms_norm,
    "add_rms_norm": _add_rms_norm, "gated_rms_norm": _gated_rms_norm, "attention": _attention,
    "gdn_update": _gdn_update, "conv_update": _conv_update, "gdn_gates": _gdn_gates, "silu_mul": _silu_mul,
    "argmax": _argmax, "sample": _sample_, "gdn_prefill": _gdn_prefill, "attention_prefill": _attention_prefill,
    "matmul_fp8": _matmul_fp8,
}


def kernels_for(cfg: Qwen35Config, fp8: bool = False) -> list[str]:
    """The kernels `cfg`'s model runs (the MoE pair only for a MoE model, the GDN ones only with GDN layers, the
    W8A16 matmul only when `fp8`: the model holds FP8 weights)."""
    gdn = "linear_attention" in cfg.layer_types
    skip = set() if cfg.is_moe else {"grouped_matmul", "moe_combine"}
    if not fp8:
        skip.add("matmul_fp8")
    if not gdn:
        skip |= {"gdn_update", "conv_update", "gdn_gates", "gated_rms_norm", "gdn_prefill"}
    return [k for k in CHECKS if k not in skip]


def _one(name: str, cfg: Qwen35Config, device: torch.device) -> KernelCheck:
    t0 = time.monotonic()
    try:
        with torch.inference_mode():
            outs = CHECKS[name](cfg, _Rand(device, cfg.dtype))
            bad = [f"{o[0]}: {why}" for o in outs if (why := ops.mismatch(*o[1:])) is not None]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - any failure (compile, resources, launch) sends the op to its twin
        _usable(device, name, e)
        first = (str(e).strip().splitlines() or [""])[0]
        bad = [f"{type(e).__name__}: {first}" if first else type(e).__name__]
    return KernelCheck(name, not bad, "; ".join(bad), time.monotonic() - t0)


def _usable(device: torch.device, name: str, err: BaseException) -> None:
    """After a kernel raised on CUDA: the context must still work (an illegal address is sticky), else fatal."""
    if device.type != "cuda":
        return
    try:
        torch.cuda.synchronize(device)
        torch.zeros(1, device=device).add_(1).item()
    except Exception as e:  # noqa: BLE001
        raise KernelCheckFailed(f"the device is unusable after kernel {name} failed its startup check "
                                f"({type(err).__name__}: {err}); restart the server") from e


def check_kernels(cfg: Qwen35Config, device: torch.device | str,
                  on_each: Callable[[], object] | None = None, fp8: bool = False) -> list[KernelCheck]:
    """Check every kernel `cfg`'s model runs (`kernels_for(cfg, fp8)`), on `device` in cfg.dtype (module
    docstring). Each failure is logged (one line per kernel) and its op falls back to its twin for this process.
    `on_each()` after each kernel."""
    device = torch.device(device)
    out = []
    for name in kernels_for(cfg, fp8):
        c = _one(name, cfg, device)
        if not c.ok:
            ops.fall_back(name, c.detail)
            log.warning("kernel %s failed its startup check (%s): this process runs its torch twin instead, whose "
                        "results may depend on the batch", name, c.detail)
        out.append(c)
        if on_each is not None:
            on_each()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def startup(model: torch.nn.Module, runner: GraphRunner | object | None = None, *, strict: bool = False,
            progress: bool = False) -> Startup:
    """The startup checks of a model on the kernel path (CUDA; or CPU inside the test-only force_kernels()):
    every kernel against its twin, then, when `runner` is the scheduler's `GraphRunner`, every CUDA graph the
    pool allows (`GraphRunner.capture_all`; after the check, so graphs record the kernels that passed). Call it
    before any session holds a pool slot. One progress bar over both when `progress`; one summary line each.
    Raises `KernelCheckFailed` when `strict` and a kernel or a capture failed (after logging it). The torch
    path: Startup() and nothing done."""
    w = model.lm_head.weight
    if not ops.use_triton(w):
        return Startup()
    cfg = model.config
    fp8 = any(_fp8.is_fp8(p) for p in model.parameters())  # served as W8A16 (the loader keeps FP8 on this path)
    names = kernels_for(cfg, fp8)
    graphs = runner if isinstance(runner, GraphRunner) and runner.capture else None
    t0 = time.monotonic()
    bar = None
    if progress:
        from tqdm import tqdm

        total = len(names) + (len(graphs.step_keys()) if graphs is not None else 0)
        bar = tqdm(total=total, desc="startup: kernel self-check + CUDA graphs", unit="step")
    try:
        each = bar.update if bar is not None else None
        checks = check_kernels(cfg, w.device, on_each=each, fp8=fp8)
        failed = [c for c in checks if not c.ok]
        log.info("kernel self-check: %d of %d kernels match their twins on %s (%s) in %.1f s%s",
                 len(checks) - len(failed), len(checks), w.device, str(cfg.dtype).removeprefix("torch."),
                 time.monotonic() - t0, "" if not failed else "; on their torch twin: " +
                 ", ".join(c.kernel for c in failed))
        if strict and failed:
            raise KernelCheckFailed("--kernels strict: " + "; ".join(
                f"kernel {c.kernel} failed its startup check ({c.detail})" for c in failed))
        cap = graphs.capture_all(on_each=each) if graphs is not None else None
    finally:
        if bar is not None:
            bar.close()
    if cap is not None:
        log.info("CUDA graphs: %d of %d captured in %.1f s%s", len(cap.captured), len(cap.captured) + len(cap.eager),
                 cap.seconds, "" if not cap.eager else f"; eager (capture failed): {', '.join(cap.eager)}")
        if strict and cap.eager:
            raise KernelCheckFailed("--kernels strict: CUDA graph capture failed for " + "; ".join(
                f"{k} ({why})" for k, why in cap.eager.items()))
    rep = Startup(checks, cap, time.monotonic() - t0)
    log.info("startup on %s: %.1f s (kernel self-check and CUDA graph capture)", w.device, rep.seconds)
    return rep
