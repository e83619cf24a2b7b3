"""Fused RMSNorms (qwen35.py numerics) and device token choice (argmax, exponential-race sampling) vs their
twins (TRITON_INTERPRET=1 on CPU); the twins vs the model modules and engine/sampling.py."""
import pytest
import torch

from engine.model.ops import norm as nm
from engine.model.ops import sample as sp
from engine.model.qwen35 import GatedRMSNorm, RMSNorm
from engine.sampling import SpecSampling, probs_from_logits
from tests.ops_util import DEVICE, DTYPES, assert_bitwise, assert_close, nans, needs_triton, rand

EPS = 1e-6


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
def test_norm_twins_are_the_model_modules(dtype):
    g = torch.Generator().manual_seed(8)
    x, z = rand(4, 3, 48, dtype=dtype, gen=g), rand(4, 3, 48, dtype=dtype, gen=g)
    norm, gated = RMSNorm(48, EPS).to(DEVICE, dtype), GatedRMSNorm(48, EPS).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(rand(48, gen=g, scale=0.1))
        gated.weight.copy_(1 + rand(48, gen=g, scale=0.1))
        assert_bitwise(nm.rms_norm_ref(x, norm.weight, EPS), norm(x), "rms_norm_ref vs RMSNorm")
        assert_bitwise(nm.gated_rms_norm_ref(x, z, gated.weight, EPS), gated(x, z), "gated twin vs GatedRMSNorm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_written_out_rms_is_torchs_rms_norm_bit_for_bit(dtype):
    """The twins spell torch's CPU rms_norm out op by op (it is faster so); the numbers must not move (CPU: a
    GPU's F.rms_norm is a fused kernel with its own rounding)."""
    g = torch.Generator().manual_seed(10)
    for shape in [(1, 1, 256), (4, 3, 48), (8, 4, 4, 32), (2, 17, 1024)]:
        for scale in (1e-3, 1.0, 1e3):
            x, w = rand(*shape, dtype=dtype, gen=g, scale=scale).cpu(), rand(shape[-1], dtype=dtype, gen=g).cpu()
            F = torch.nn.functional
            assert_bitwise(nm._rms(x, EPS), F.rms_norm(x, (shape[-1],), None, EPS), f"{shape} x{scale}")
            assert_bitwise(nm.rms_norm_ref(x, w, EPS), F.rms_norm(x, (shape[-1],), 1 + w, EPS), f"{shape} w")
    # 1 + w is kept per weight version: an in-place edit of the weight is seen, inside inference mode too
    x, w = rand(3, 64, dtype=dtype, gen=g).cpu(), rand(64, dtype=dtype, gen=g).cpu()
    for _ in range(2):
        with torch.inference_mode():
            assert_bitwise(nm.rms_norm_ref(x, w, EPS), torch.nn.functional.rms_norm(x, (64,), 1 + w, EPS), "edit")
        w.mul_(-0.5)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_kernels_match_twins_and_rows_are_invariant(dtype):
    g = torch.Generator().manual_seed(9)
    H = 200  # not a power of two
    x, res, z = rand(7, H, dtype=dtype, gen=g), rand(7, H, dtype=dtype, gen=g), rand(7, H, dtype=dtype, gen=g)
    w = rand(H, dtype=dtype, gen=g, scale=0.1)
    y = nm.rms_norm(x, w, EPS, out=nans(7, H, dtype=dtype))
    assert_close(y, nm.rms_norm_ref(x, w, EPS))
    assert_bitwise(nm.rms_norm(x[3:4], w, EPS)[0], y[3], "row 3 alone vs in 7 rows")
    y2, s2 = nm.add_rms_norm(x, res, w, EPS, out=nans(7, H, dtype=dtype), out_sum=nans(7, H, dtype=dtype))
    y2_ref, s2_ref = nm.add_rms_norm_ref(x, res, w, EPS)
    assert_bitwise(s2, s2_ref, "residual sum (one rounding in the model dtype)")
    assert_close(y2, y2_ref)
    yg = nm.gated_rms_norm(x, z, 1 + w, EPS, out=nans(7, H, dtype=dtype))
    assert_close(yg, nm.gated_rms_norm_ref(x, z, 1 + w, EPS))
    # per-head q_norm on a strided view (q of q_proj's [q | gate] per head), 4-D
    qg = rand(2, 3, 4, 32, dtype=dtype, gen=g)
    q = qg[..., :16]
    assert_close(nm.rms_norm(q, w[:16], EPS), nm.rms_norm_ref(q, w[:16], EPS))


@needs_triton
def test_argmax_ties_take_the_lowest_index_across_chunks():
    V = sp.CHUNK + 904  # two chunks
    g = torch.Generator().manual_seed(10)
    lg = rand(5, V, gen=g)
    lg[1, [7, sp.CHUNK + 3]] = 50.0  # tie across chunks
    lg[2, [sp.CHUNK + 1, sp.CHUNK + 2]] = 50.0  # tie inside the second chunk
    lg[3] = float("-inf")  # fully masked row -> 0, as torch.argmax
    lg[4, -1] = float("inf")
    got = sp.argmax(lg, out=torch.full((5,), -1, dtype=torch.int64, device=DEVICE))
    assert got.tolist() == sp.argmax_ref(lg).tolist()
    assert got[1:].tolist() == [7, sp.CHUNK + 1, 0, V - 1]
    assert sp.argmax(lg.to(torch.bfloat16)).tolist() == sp.argmax_ref(lg.to(torch.bfloat16)).tolist()


@needs_triton
def test_sample_kernel_equals_twin_draw_for_draw():
    """Same Philox stream in the kernel and the twin: the same tokens for greedy rows, plain sampling,
    temperature, top-k / top-p / min-p cuts; the chosen tokens respect the cut."""
    g = torch.Generator().manual_seed(11)
    N, V = 12, 300
    lg = rand(N, V, gen=g, scale=2.0)
    inv_t = torch.tensor([0, 1, 1, 2, 0.5, 1, 1, 1, 1, 1, 3, 1.0], device=DEVICE)
    top_k = torch.tensor([0, 0, 5, 0, 0, 1, 0, 0, 3, 0, 0, 0], device=DEVICE)
    top_p = torch.tensor([1, 1, 1, 1, 1, 1, .5, 1, .9, 1, .2, 1.0], device=DEVICE)
    min_p = torch.tensor([0, 0, 0, 0, 0, 0, 0, .3, 0, 0, 0, 0.0], device=DEVICE)
    thr = sp.sampling_thresholds(lg, inv_t, top_k, top_p, min_p)
    seed = torch.arange(N, device=DEVICE) * 1000 + 7
    for off in (0, 1, 2 ** 33 + 5):
        offset = torch.full((N,), off, dtype=torch.int64, device=DEVICE)
        got = sp.sample(lg, inv_t, thr, seed, offset)
        assert got.tolist() == sp.sample_ref(lg, inv_t, thr, seed, offset).tolist()
        assert got[0] == lg[0].argmax() and got[5] == lg[5].argmax()  # greedy row; top_k = 1
        assert ((lg * inv_t[:, None]).gather(1, got[:, None])[:, 0] >= thr).all()


def test_sampling_thresholds_keep_what_probs_from_logits_keeps():
    g = torch.Generator().manual_seed(12)
    lg = rand(6, 50, gen=g, scale=2.0)
    params = [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.3, 0, 1.0, 0.05), (1.0, 10, 0.9, 0.02),
              (2.0, 50, 0.999, 0.0)]
    inv_t = torch.tensor([1 / p[0] for p in params], device=DEVICE)
    thr = sp.sampling_thresholds(lg, inv_t, torch.tensor([p[1] for p in params], device=DEVICE),
                                 torch.tensor([p[2] for p in params], device=DEVICE),
                                 torch.tensor([p[3] for p in params], device=DEVICE))
    for i, (t, k, p, m) in enumerate(params):
        kept = probs_from_logits(lg[i].cpu(), SpecSampling(temperature=t, top_k=k, top_p=p, min_p=m)) > 0
        assert torch.equal((lg[i] * inv_t[i] >= thr[i]).cpu(), kept), params[i]


def test_sample_twin_draws_follow_the_filtered_softmax():
    """2000 draws (one offset each) of a 6-token row at temperature 0.8 with top_k 4: frequencies within
    5 sigma of softmax over the 4 kept tokens; cut tokens never drawn; the Philox uniforms look uniform."""
    lg = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -3.0]], device=DEVICE).expand(2000, -1).contiguous()
    n = lg.shape[0]
    inv_t = torch.full((n,), 1 / 0.8, device=DEVICE)
    thr = sp.sampling_thresholds(lg, inv_t, torch.full((n,), 4, device=DEVICE), torch.ones(n, device=DEVICE),
                                 torch.zeros(n, device=DEVICE))
    toks = sp.sample_ref(lg, inv_t, thr, torch.full((n,), 42, device=DEVICE), torch.arange(n, device=DEVICE))
    freq = torch.bincount(toks.cpu(), minlength=6).double() / n
    p = torch.softmax(lg[0].cpu().double() / 0.8, -1)
    p[[2, 5]] = 0
    p /= p.sum()
    assert (freq - p).abs().max() < 5 * (p * (1 - p) / n).sqrt().max()
    assert freq[2] == 0 and freq[5] == 0
    u = sp.philox_uniform(torch.tensor([1, 2], device=DEVICE), torch.tensor([0, 0], device=DEVICE),
                          torch.arange(20000, device=DEVICE))
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])  # different seeds, different streams
