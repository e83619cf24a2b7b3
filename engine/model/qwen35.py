"""Qwen3.5 text decoder (dense and MoE) + its MTP (NextN) head, in torch.

Module and parameter names follow the HF checkpoint (`model.*`, `lm_head.*`, `mtp.*`) so a state dict loads
unchanged. Hybrid stack: Gated DeltaNet ("linear_attention") and gated full attention layers, pre-norm with
zero-centred (1+w) RMSNorm. One forward handles three cases, chosen by the caller:
  * no cache (training / oracle): causal over the batch, chunked GDN;
  * cache, record=False (prefill, plain decode): KV written at pos0.., GDN state carried
    (T == 1 -> recurrent step, T > 1 -> chunked form);
  * cache, record=True (spec verify): GDN runs the recurrent step per token and keeps every per-position
    state so the cache can roll back to any prefix in O(state).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .config import Qwen35Config
from .moe import MLP, SparseMoeBlock
from .ops.gdn import causal_conv_window, gdn_chunked, gdn_recurrent, gdn_recurrent_step, l2norm

if TYPE_CHECKING:
    from ..cache import GdnLayerCache, KVBuffer, ModelCache


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32, cast back to x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype != torch.float64 else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.to(y.dtype))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """GDN output norm: plain-scale RMSNorm of x (norm before gate) times silu(z)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        xf = x.float() if dt != torch.float64 else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * y.to(dt)
        return (y * F.silu(z.to(y.dtype if dt == torch.float64 else torch.float32))).to(dt)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX RoPE tables for integer `positions` [T]: cos, sin [T, rotary_dim] (computed in fp32, cast to dtype)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device).float() / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, R/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, R]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first R dims of each head (rotate_half style). x: [B, T, heads, hd]; cos/sin: [T, R]."""
    R = cos.shape[-1]
    xr, xp = x[..., :R], x[..., R:]
    x1, x2 = xr[..., : R // 2], xr[..., R // 2:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    rot = torch.cat([-x2, x1], dim=-1)
    return torch.cat([xr * c + rot * s, xp], dim=-1)


class GatedAttention(nn.Module):
    """Gated GQA full attention: q|gate per head, q/k RMSNorm, partial RoPE, sigmoid(gate) before o_proj."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rotary_dim, self.theta = cfg.rotary_dim, cfg.rope_theta
        H = cfg.hidden_size
        self.q_proj = nn.Linear(H, 2 * self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, H, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, pos0: int, kv: "KVBuffer | None",
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, H] -> [B, T, H]. With `kv`, K/V are written at rows pos0.. and attention spans [0, pos0+T).
        `rope` = precomputed (cos, sin) for positions pos0..pos0+T-1 (shared by all layers of one forward)."""
        B, T, _ = x.shape
        qg = self.q_proj(x).view(B, T, self.nh, 2 * self.hd)
        q, gate = qg[..., : self.hd], qg[..., self.hd:].reshape(B, T, self.nh * self.hd)
        q = self.q_norm(q)  # [B, T, nh, hd]
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd))  # [B, T, nkv, hd]
        v = self.v_proj(x).view(B, T, self.nkv, self.hd)
        positions = torch.arange(pos0, pos0 + T, device=x.device)
        cos, sin = rope if rope is not None else rope_cos_sin(positions, self.rotary_dim, self.theta, x.dtype)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        if kv is None:
            mask, is_causal = None, T > 1
        else:
            kv.k[:, pos0:pos0 + T] = k
            kv.v[:, pos0:pos0 + T] = v
            S = pos0 + T
            k, v = kv.k[:, :S], kv.v[:, :S]  # [B, S, nkv, hd]
            is_causal = False
            mask = None if T == 1 else (torch.arange(S, device=x.device)[None, :] <= positions[:, None])  # [T, S]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           is_causal=is_causal, scale=self.hd ** -0.5, enable_gqa=self.nh != self.nkv)
        o = o.transpose(1, 2).reshape(B, T, self.nh * self.hd)  # [B, T, nh*hd]
        return self.o_proj(o * torch.sigmoid(gate))


class GatedDeltaNet(nn.Module):
    """Qwen3.5 linear-attention mixer (separate in_proj_qkv / z / b / a, depthwise causal conv, gated delta rule)."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.nk, self.dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        self.nv, self.dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        self.kc = cfg.linear_conv_kernel_dim
        H, C = cfg.hidden_size, cfg.gdn_conv_dim
        self.in_proj_qkv = nn.Linear(H, C, bias=False)
        self.in_proj_z = nn.Linear(H, self.nv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(H, self.nv, bias=False)
        self.in_proj_a = nn.Linear(H, self.nv, bias=False)
        self.conv1d = nn.Conv1d(C, C, self.kc, groups=C, bias=False, padding=self.kc - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.nv * self.dv, H, bias=False)

    def forward(self, x: torch.Tensor, st: "GdnLayerCache | None", record_at: int | None) -> torch.Tensor:
        """x: [B, T, H] -> [B, T, H]. `st` carries conv/recurrent state; `record_at` = window slot of token 0
        when per-position states must be kept (spec verify), else None."""
        B, T, _ = x.shape
        dt = x.dtype
        sdt = torch.float64 if dt == torch.float64 else torch.float32
        qkv = self.in_proj_qkv(x).transpose(1, 2)  # [B, C, T]
        z = self.in_proj_z(x).view(B, T, self.nv, self.dv)
        b, a = self.in_proj_b(x), self.in_proj_a(x)  # [B, T, nv]
        w = self.conv1d.weight[:, 0, :]  # [C, Kc]
        conv_state = st.conv if st is not None else qkv.new_zeros(B, qkv.shape[1], self.kc - 1)
        y, window = causal_conv_window(qkv, conv_state, w)  # [B, C, T], [B, C, Kc-1+T]
        y = y.transpose(1, 2)  # [B, T, C]
        Kd = self.nk * self.dk
        q = y[..., :Kd].reshape(B, T, self.nk, self.dk)
        k = y[..., Kd:2 * Kd].reshape(B, T, self.nk, self.dk)
        v = y[..., 2 * Kd:].reshape(B, T, self.nv, self.dv)
        beta = torch.sigmoid(b).to(sdt)
        g = -self.A_log.to(sdt).exp() * F.softplus(a.to(sdt) + self.dt_bias.to(sdt))  # [B, T, nv]
        r = self.nv // self.nk
        if r > 1:
            q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
        q = l2norm(q.to(sdt)) * (self.dk ** -0.5)
        k = l2norm(k.to(sdt))
        v = v.to(sdt)
        if st is None:
            o, _ = gdn_chunked(q, k, v, g, beta, None)
        elif record_at is not None:
            o, s = gdn_recurrent(q, k, v, g, beta, st.rec, st.win_rec[record_at + 1:record_at + 1 + T])
            # conv state after token t = window[..., t+1 : t+Kc]: all T of them in one strided copy
            st.win_conv[record_at + 1:record_at + 1 + T].copy_(
                window.unfold(-1, self.kc - 1, 1)[:, :, 1:T + 1].permute(2, 0, 1, 3))
            st.rec.copy_(s)
            st.conv.copy_(window[..., T:])
        else:
            if T == 1:
                o, s = gdn_recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], st.rec)
                o = o[:, None]
            else:
                o, s = gdn_chunked(q, k, v, g, beta, st.rec)
            st.rec.copy_(s)
            st.conv.copy_(window[..., T:])
        o = self.norm(o.to(dt), z)  # [B, T, nv, dv]
        return self.out_proj(o.reshape(B, T, self.nv * self.dv))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: mixer (GDN or gated attention) then MLP / MoE."""

    def __init__(self, cfg: Qwen35Config, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = SparseMoeBlock(cfg) if cfg.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, pos0: int, layer_cache, record_at: int | None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, layer_cache, record_at)
        else:
            h = self.self_attn(h, pos0, layer_cache, rope)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    """`model.*`: embeddings, the decoder stack and the final norm."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MtpHead(nn.Module):
    """`mtp.*`: NextN head. x = fc([norm_e(embed(tok)); norm_h(hidden)]) -> one full-attention layer -> norm."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, "full_attention")])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, pos0: int, kv: "KVBuffer | None") -> torch.Tensor:
        """emb, hidden: [B, T, H] (embedding of token i+1, trunk hidden of row i) -> head hidden after mtp.norm."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x = self.layers[0](x, pos0, kv, None)
        return self.norm(x)


class Qwen35ForCausalLM(nn.Module):
    """Text model + lm_head (+ MTP head when the config has one)."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.config = cfg
        self.model = TextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = MtpHead(cfg) if cfg.has_mtp else None

    def forward_hidden(self, ids: torch.Tensor, pos0: int = 0, cache: "ModelCache | None" = None,
                       record: bool = False) -> torch.Tensor:
        """ids [B, T] -> pre-final-norm hidden [B, T, H]. With `cache` (B == 1) tokens sit at positions pos0..;
        record=True keeps per-position GDN states (cache.snapshot() must have opened a window)."""
        x = self.model.embed_tokens(ids)
        record_at = None
        if cache is not None and record:
            record_at = cache.window_slot(pos0, ids.shape[1])
        cfg = self.config
        rope = rope_cos_sin(torch.arange(pos0, pos0 + ids.shape[1], device=ids.device), cfg.rotary_dim, cfg.rope_theta,
                            x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, pos0, None if cache is None else cache.layers[i], record_at, rope)
        return x

    def logits(self, h_post: torch.Tensor) -> torch.Tensor:
        """Post-norm hidden [..., H] -> fp32 logits [..., V]."""
        return self.lm_head(h_post).float()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Cache-free causal forward (training / oracle): ids [B, T] -> logits [B, T, V]."""
        return self.logits(self.model.norm(self.forward_hidden(ids)))

    def mtp_forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, pos0: int = 0,
                    kv: "KVBuffer | None" = None) -> torch.Tensor:
        """MTP rows: next_ids [B, T] (token i+1), hidden [B, T, H] (trunk hidden at i), rows at positions pos0.. ->
        head hidden [B, T, H] (post mtp.norm). Logits: `self.logits(result)`."""
        assert self.mtp is not None, "model has no MTP head"
        return self.mtp(self.model.embed_tokens(next_ids), hidden, pos0, kv)
