"""Token choice on the device: greedy argmax and sampling, over logit rows [N, V] (the LM head's fp32 output).

Greedy: `argmax` = torch.argmax semantics (ties -> lowest index), in two passes (per-chunk max, then an
in-order merge), so it costs one read of the logits and never syncs the host.

Sampling: an exponential race. With scaled logits s_j = logit_j * inv_temperature and independent
E_j ~ Exp(1), argmax_j (s_j - log E_j) is distributed as softmax(s) (the Gumbel-max trick); tokens whose
s_j is below the row's `threshold` take no part, which is how top-k / top-p / min-p apply
(`sampling_thresholds` computes them, device-side). Rows with inv_temperature == 0 are greedy.
The noise is counter-based and reproducible: E_j of row i comes from Philox-4x32-10 keyed by seed[i] with
counter (j, offset[i] low, offset[i] high, 0), u = (r + 0.5) * 2^-32 in (0, 1), E = -log1p(-u). The same
(seed, offset, logits) give the same token on any launch shape; a runtime draws a fresh offset per
sampled position and stream (e.g. offset = position * 4 + stream for draft / target / residual / accept).
The same race samples any unnormalised distribution w (e.g. a rejection residual max(p - q, 0)): pass
log(w) as the logits with inv_temperature 1 (log 0 = -inf never wins).

Twins: `argmax_ref`, `sample_ref` (bit-identical Philox in int64 torch ops, `philox_uniform`), so kernel
and twin pick the same tokens up to last-ulp differences of log() at exact near-ties.
"""
from __future__ import annotations

import torch

from . import launch
from ._triton import HAS_TRITON, cdiv, check_triton, tl, triton

CHUNK = launch.RACE_CHUNK  # logits per program in the first pass
_M32 = 0xFFFFFFFF
_PHILOX_KEY = (0x9E3779B9, 0xBB67AE85)
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
_SMALL_U = 2.0 ** -10  # below it -log1p(-u) is evaluated by its series


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """Twin: [N, V] -> [N] int64, ties -> lowest index."""
    return logits.argmax(dim=-1)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product a * b, a a uint32 constant, b uint32 values in int64 (no
    int64 overflow: a is split in 16-bit halves)."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    p_hi, p_lo = a_hi * b, a_lo * b  # < 2^48 each
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & _M32
    return hi, lo


def philox_uniform(seed: torch.Tensor, offset: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """u in (0, 1) fp32 [N, len(cols)]: Philox-4x32-10 (triton's tl.philox) keyed by seed [N] int64 with
    counter (cols, offset low, offset high, 0), word 0 mapped to (r + 0.5) * 2^-32. Pure torch int64 ops."""
    seed, offset = seed.to(torch.int64)[:, None], offset.to(torch.int64)[:, None]
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    c0 = cols.to(torch.int64)[None, :].expand(seed.shape[0], -1)
    c1 = (offset & _M32).expand_as(c0)
    c2 = ((offset >> 32) & _M32).expand_as(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _mulhilo(_PHILOX_ROUND[1], c2)
        hi_a, lo_a = _mulhilo(_PHILOX_ROUND[0], c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY[0]) & _M32, (k1 + _PHILOX_KEY[1]) & _M32
    return (c0.to(torch.float32) + 0.5) * 2.0 ** -32


def exp_noise(u: torch.Tensor) -> torch.Tensor:
    """E = -log1p(-u) ~ Exp(1) for u ~ U(0, 1), accurate for small u (where the race is decided)."""
    return torch.where(u < _SMALL_U, u * (1.0 + u * (0.5 + u * (1.0 / 3.0))), -torch.log(1.0 - u))


def sampling_thresholds(logits: torch.Tensor, inv_temperature: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Per-row cut [N] on scaled logits s = logits * inv_temperature for `sample`: tokens with s < cut are out.

    Semantics of engine/sampling.probs_from_logits, applied in that order on the softmax of s (fp32 here):
    top_k (0 = off; keeps p >= the k-th largest), min_p (p >= min_p * max p), top_p (the smallest
    descending prefix of the remaining mass reaching top_p; 1 = off). As a threshold, tokens tied with the
    last kept one are kept too. Greedy rows (inv_temperature 0) get -inf. One sort per row, no host sync."""
    s = logits.float() * inv_temperature.float()[:, None]
    ss = torch.sort(s, dim=-1, descending=True).values  # [N, V]
    V = ss.shape[-1]
    p = torch.softmax(ss, dim=-1)
    k = torch.where(top_k > 0, top_k.clamp(max=V), V).to(torch.int64)
    keep = ss >= ss.gather(1, (k - 1)[:, None])
    keep &= p >= min_p.float()[:, None] * p[:, :1]
    pk = torch.where(keep, p, 0.0)
    cs = pk.cumsum(-1)
    keep &= (cs - pk) < top_p.float()[:, None] * cs[:, -1:]
    cut = torch.where(keep, ss, float("inf")).amin(-1)
    return torch.where(inv_temperature > 0, cut, float("-inf"))


def sample_ref(logits: torch.Tensor, inv_temperature: torch.Tensor, threshold: torch.Tensor, seed: torch.Tensor,
               offset: torch.Tensor) -> torch.Tensor:
    """Twin of `sample`: [N] int64 token ids (same arguments)."""
    x = logits.float()
    s = x * inv_temperature.float()[:, None]
    s = torch.where(s >= threshold.float()[:, None], s, float("-inf"))
    u = philox_uniform(seed, offset, torch.arange(x.shape[-1], device=x.device))
    score = torch.where(inv_temperature[:, None] > 0, s - torch.log(exp_noise(u)), x)
    return score.argmax(dim=-1)


if HAS_TRITON:

    @triton.jit
    def _race_chunk_kernel(logits, inv_t, thr, seed, offset, part_v, part_i, V, sl, NCH,
                           CHUNK: tl.constexpr, SAMPLE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        ch = tl.program_id(1)
        cols = ch * CHUNK + tl.arange(0, CHUNK)
        ok = cols < V
        x = tl.load(logits + row * sl + cols, mask=ok, other=float("-inf")).to(tl.float32)
        score = x
        if SAMPLE:
            it = tl.load(inv_t + row).to(tl.float32)
            if it > 0:
                s = x * it
                s = tl.where(s >= tl.load(thr + row).to(tl.float32), s, float("-inf"))
                off = tl.load(offset + row).to(tl.int64)
                zero = tl.zeros((CHUNK,), tl.uint32)
                r, _, _, _ = tl.philox(tl.load(seed + row).to(tl.int64), cols.to(tl.uint32),
                                       zero + (off & 0xFFFFFFFF).to(tl.uint32),
                                       zero + ((off >> 32) & 0xFFFFFFFF).to(tl.uint32), zero)
                u = (r.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2^-32
                e = tl.where(u < 0.0009765625, u * (1.0 + u * (0.5 + u * (1.0 / 3.0))), -tl.log(1.0 - u))
                score = tl.where(ok, s - tl.log(e), float("-inf"))
        best, idx = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(part_v + row * NCH + ch, best)
        tl.store(part_i + row * NCH + ch, ch * CHUNK + idx)

    @triton.jit
    def _race_merge_kernel(part_v, part_i, out, NCH, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        v = tl.load(part_v + row * NCH + c, mask=c < NCH, other=float("-inf"))
        best = tl.argmax(v, axis=0, tie_break_left=True)  # lowest chunk among equal maxima -> lowest index
        tl.store(out + row, tl.load(part_i + row * NCH + best).to(tl.int64))


def _race(logits: torch.Tensor, sample: bool, inv_t: torch.Tensor | None = None, thr: torch.Tensor | None = None,
          seed: torch.Tensor | None = None, offset: torch.Tensor | None = None,
          out: torch.Tensor | None = None) -> torch.Tensor:
    check_triton(logits)
    N, V = logits.shape
    assert logits.stride(-1) == 1
    out = out if out is not None else torch.empty(N, dtype=torch.int64, device=logits.device)
    if N == 0:
        return out
    nch = cdiv(V, CHUNK)
    part_v = torch.empty(N, nch, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(N, nch, dtype=torch.int32, device=logits.device)
    d = logits
    _race_chunk_kernel[(N, nch)](logits, d if inv_t is None else inv_t, d if thr is None else thr,
                                 d if seed is None else seed, d if offset is None else offset, part_v, part_i, V,
                                 logits.stride(0), nch, SAMPLE=sample,
                                 **launch.get("race/chunk", logits.dtype, logits.device).kwargs())
    _race_merge_kernel[(N,)](part_v, part_i, out, nch,
                             **launch.get("race/merge", logits.dtype, logits.device, nch=nch).kwargs())
    return out


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: greedy token per row. logits [N, V] (fp32/bf16, last dim contiguous) -> [N] int64, ties ->
    lowest index (as torch.argmax; rows must hold no NaN). `out`: a preallocated [N] int64."""
    return _race(logits, False, out=out)


def sample(logits: torch.Tensor, inv_temperature: torch.Tensor, threshold: torch.Tensor, seed: torch.Tensor,
           offset: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: one token per row by the exponential race (module docstring). logits [N, V]; inv_temperature
    [N] fp32 (0 -> greedy row); threshold [N] fp32 on the scaled logits (-inf = no filter; from
    `sampling_thresholds`); seed, offset [N] int64. -> [N] int64. No host sync."""
    return _race(logits, True, inv_temperature, threshold, seed, offset, out=out)
