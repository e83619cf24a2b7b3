"""Every Triton kernel the model calls, compiled for real CUDA targets without a GPU: sm_80 (A100), sm_89 (L4,
RTX 4090), sm_90 (H100, H200), sm_100 (B200) and sm_120 (RTX 50xx) with the ptxas that ships with triton, at
Qwen3.5's 0.8B, 9B, 27B and 35B-A3B shapes in bf16 and fp32 (`--dtype float32` serves on CUDA too), at each
target's launch-table config. Prints one row per compiled (kernel, config, specialisation, target): registers,
spills, shared memory against the device's limit and the table's static estimate (engine/model/ops/launch.py).

    python bench/compile_targets.py [--models 0.8B,9B] [--targets sm80,sm90] [--dtypes bf16] [--jobs 2]
                                    [--matrix] [--json out.json]
    python bench/compile_targets.py --render out.json [--matrix]     the tables of an earlier run

How (no GPU, no kernel is run): the kernel wrappers are called on "meta" tensors of the model's shapes inside
`launch.compile_target(cc)` (their configs are the target's) under a stand-in Triton driver whose "device" is the
target; Triton's own launch path binds the arguments and computes the specialisation (divisibility by 16, == 1, the
constexprs) exactly as on a GPU, and its `jit_cache_hook` hands the compile request here instead of compiling and
launching. Identical (kernel, specialisation, options, target) requests are compiled once, with
`triton.compile` (Triton's on-disk cache reused within and across runs). Registers and the stack frame (register
spills) are read from the cubin by triton's `cuobjdump`.

The launches follow the self-check's shapes (engine/selfcheck.py `linear_shapes`, the model's heads, norms, MLP
widths, experts and vocab): what the model's forward calls. Every dim of a Qwen3.5 model is a multiple of 16 except
the few the launches pass as they are (head counts, N = 1 of the shared-expert gate), so contiguous meta tensors
specialise like the model's views. Needs TRITON_INTERPRET unset (the kernels must be JIT functions, not the
interpreter's).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from engine.model.config import Qwen35Config
from engine.model.ops import launch

#: the targets: name -> compute capability (launch.DEVICE_CLASSES plus Blackwell's datacenter part)
TARGETS: dict[str, tuple[int, int]] = {"sm80": (8, 0), "sm89": (8, 9), "sm90": (9, 0), "sm100": (10, 0),
                                       "sm120": (12, 0)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
META = torch.device("meta")


def qwen35(name: str, dtype: torch.dtype = torch.bfloat16) -> Qwen35Config:
    """Qwen3.5 text config of `name` (shared/reference/qwen35-architecture.md section 1.3) with its MTP layer; four
    layers (three GDN, one attention: every kernel of the real depth)."""
    common = dict(vocab_size=248320, num_hidden_layers=4, head_dim=256, linear_num_key_heads=16,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                  mtp_num_hidden_layers=1, rms_norm_eps=1e-6, hidden_act="silu", full_attention_interval=4)
    own = {
        "0.8B": dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, linear_num_value_heads=16,
                     intermediate_size=3584, tie_word_embeddings=True),
        "9B": dict(hidden_size=4096, num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32,
                   intermediate_size=12288),
        "27B": dict(hidden_size=5120, num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48,
                    intermediate_size=17408),
        "35B-A3B": dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, linear_num_value_heads=32,
                        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                        shared_expert_intermediate_size=512, model_type="qwen3_5_moe_text"),
    }[name]
    return Qwen35Config.from_dict({"model_type": "qwen3_5_text", **common, **own}, dtype=dtype)


MODELS = ("0.8B", "9B", "27B", "35B-A3B")


# ------------------------------------------------------------------------------------------- capturing the launches

@dataclass
class Request:
    """One compile request as Triton's launch path made it."""

    kernel: str  # module._name
    entry: str  # the launch-table entry whose config it runs
    cfg: launch.Launch
    dtype: torch.dtype  # the dtype the config was chosen for
    dims: dict
    fn: object  # the JITFunction
    signature: dict
    constants: dict
    attrs: dict
    num_warps: int
    num_stages: int
    key: str  # Triton's specialisation key (argument types, divisibility, constexprs, options)
    shape: str  # what the launch was (model, op, shape)
    target: str  # a TARGETS name


class _Driver:
    """A stand-in Triton driver: the current "device" is the target being compiled for (nothing is launched)."""

    def __init__(self, cc: tuple[int, int]):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", cc[0] * 10 + cc[1], 32)

    def is_active(self) -> bool:
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return self.target.arch  # one binder cache per target

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return META

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError

    def get_benchmarker(self):
        raise NotImplementedError


@contextmanager
def capture(target: str, shape: Callable[[], str]) -> Iterator[list[Request]]:
    """Inside: kernel launches on meta tensors are recorded as compile requests for `target` (a TARGETS name; none
    is compiled or run). `shape()` names the launch being made."""
    from triton import knobs
    from triton.runtime.driver import driver

    cc = TARGETS[target]
    out: list[Request] = []
    chosen: list = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 - Triton's names
        jf = fn.jit_function
        name = f"{jf.fn.__module__.rsplit('.', 1)[-1]}.{jf.fn.__name__}"
        entry, dt, dims, cfg = next(c for c in reversed(chosen) if name in launch.TABLE[c[0]].kernels)
        out.append(Request(name, entry, cfg, dt, dims, jf, compile["signature"], compile["constants"],
                           compile["configs"][0], compile["num_warps"], compile["num_stages"], str(key), shape(),
                           target))
        return True  # handled: Triton neither compiles nor launches

    prev_hook = knobs.runtime.jit_cache_hook
    driver.set_active(_Driver(cc))
    knobs.runtime.jit_cache_hook = hook
    try:
        with launch.compile_target(cc) as got:
            chosen = got
            yield out
    finally:
        knobs.runtime.jit_cache_hook = prev_hook
        driver.set_active(None)


def launches(cfg: Qwen35Config, note: Callable[[str], None]) -> None:
    """Call every kernel wrapper the model's forward calls, on meta tensors at `cfg`'s shapes (`note(what)` before
    each): the dense GEMMs in both tilings (M = 1 and a prompt block), the MoE experts, every norm width, attention
    (decode / verify / drafts and prefill), GDN (step and chunked prefill, conv, gates), SwiGLU, the MoE combine,
    greedy and sampled picks over the vocab; the FP8 matmul (W8A16) at the same GEMM shapes."""
    from engine.model.ops import act, attention, attention_prefill, gdn_prefill, gdn_update, matmul, matmul_fp8, norm
    from engine.model.ops import sample as smp
    from engine.selfcheck import linear_shapes

    dt = cfg.dtype
    H, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    nk, dk, nv, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads, \
        cfg.linear_value_head_dim
    V = cfg.vocab_size

    def t(*shape: int, dtype: torch.dtype = dt) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=META)

    def i(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.int64, device=META)

    for what, N, K, odt in linear_shapes(cfg):
        for phase, M in (("step", 4), ("prefill", 256)):
            note(f"linear {what} [{N}x{K}] {phase}")
            matmul.matmul(t(M, K), t(N, K), odt, phase=phase)
            if dt != torch.float32:
                scale_shape = matmul_fp8.scale_shape((N, K))
                matmul_fp8.matmul_fp8(t(M, K), t(N, K, dtype=matmul_fp8.FP8), t(*scale_shape, dtype=torch.float32),
                                      out_dtype=odt, phase=phase)
    if cfg.is_moe:
        E, k, Im = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        offsets = torch.empty(E + 1, dtype=torch.int32, device=META)
        for what, N, K in (("experts gate|up", 2 * Im, H), ("experts down", H, Im)):
            note(f"grouped {what} [{E}x{N}x{K}]")
            matmul.grouped_matmul(t(4, K), t(E, N, K), offsets, i(4 * k) if K == H else None)
            if dt != torch.float32:
                matmul_fp8.grouped_matmul_fp8(t(4, K), t(E, N, K, dtype=matmul_fp8.FP8),
                                              t(E, *matmul_fp8.scale_shape((N, K)), dtype=torch.float32), offsets,
                                              i(4 * k) if K == H else None)
        note(f"moe_combine H={H} k={k}")
        act.moe_combine(t(4 * k, H), i(4 * k), t(4, k), t(4, H), t(4, 1))
    note(f"rms_norm H={H}")
    norm.rms_norm(t(4, H), t(H), 1e-6)
    norm.add_rms_norm(t(4, H), t(4, H), t(H), 1e-6)
    note(f"q/k norm hd={hd}")
    norm.rms_norm(t(2, 3, nh, hd), t(hd), 1e-6)
    note(f"gated norm dv={dv}")
    norm.gated_rms_norm(t(2, 3, nv, dv), t(2, 3, nv, dv), t(dv), 1e-6)
    inners = [cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size] if cfg.is_moe else \
        [cfg.intermediate_size]
    for inner in dict.fromkeys(inners):
        note(f"silu_mul I={inner}")
        act.silu_mul(t(4, 2 * inner))
    S, L = 8, 4096
    kc, vc = t(S, L, nkv, hd), t(S, L, nkv, hd)
    for T in (1, 4):
        note(f"attention nh={nh} nkv={nkv} hd={hd} T={T}")
        attention.attention(t(2, T, nh, hd), kc, vc, i(2), i(2), hd ** -0.5, t(2, T, nh, hd))
    note(f"attention_prefill nh={nh} nkv={nkv} hd={hd}")
    attention_prefill.prefill_attention(t(1, 256, nh, hd), kc, vc, i(1), i(1), hd ** -0.5, t(1, 256, nh, hd))
    W, C = 5, cfg.gdn_conv_dim
    rec = t(S, W, nv, dk, dv, dtype=torch.float32)
    for T in (1, 4):
        note(f"gdn_update nk={nk} nv={nv} T={T}")
        gdn_update.gdn_update(t(2, T, nk, dk), t(2, T, nk, dk), t(2, T, nv, dv), t(2, T, nv, dtype=torch.float32),
                              t(2, T, nv, dtype=torch.float32), rec, i(2), i(2), qk_l2norm=True, out_dtype=dt)
        note(f"conv_update C={C} T={T}")
        gdn_update.conv_update(t(2, T, C), t(S, W, C, cfg.linear_conv_kernel_dim - 1),
                               t(C, cfg.linear_conv_kernel_dim), i(2), i(2))
        note(f"gdn_gates nv={nv} T={T}")
        act.gdn_gates(t(2, T, nv), t(2, T, nv), t(nv, dtype=torch.float32), t(nv, dtype=torch.float32))
    note(f"gdn_prefill nk={nk} nv={nv}")
    gdn_prefill.chunked_gdn(t(1, 256, nk, dk), t(1, 256, nk, dk), t(1, 256, nv, dv),
                            t(1, 256, nv, dtype=torch.float32), t(1, 256, nv, dtype=torch.float32), rec, i(1), i(1),
                            i(1), torch.empty(1, dtype=torch.int32, device=META), qk_l2norm=True, out_dtype=dt)
    note(f"argmax / sample V={V}")
    lg = t(4, V, dtype=torch.float32)
    f = t(4, dtype=torch.float32)
    smp.argmax(lg)
    smp.sample(lg, f, f, i(4), i(4))


def requests(models: list[str], targets: list[str], dtypes: list[str]) -> list[Request]:
    """Every compile request of the models' launches for each target and dtype (duplicates included)."""
    out: list[Request] = []
    for tname in targets:
        for dname in dtypes:
            for mname in models:
                cfg = qwen35(mname, DTYPES[dname])
                where = [""]
                with capture(tname, lambda: where[0]) as got:
                    launches(cfg, lambda s: where.__setitem__(0, f"{mname} {dname}: {s}"))
                out += got
    return out


# ------------------------------------------------------------------------------------------------------- compiling

@dataclass
class Compiled:
    kernel: str
    entry: str
    target: str
    dtype: str
    config: str  # blocks, warps, stages
    shapes: list[str]  # the launches that share this binary
    regs: int
    spills: int  # stack frame + local memory bytes per thread: register spills
    smem: int  # bytes, Triton's allocation
    estimate: int  # the launch table's static estimate
    limit: int  # the device's opt-in shared memory per block
    seconds: float

    @property
    def ok(self) -> bool:
        return self.smem <= self.limit and self.smem <= self.estimate


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack frame + local memory bytes per thread) of the one kernel in `cubin`, from triton's cuobjdump.
    A Triton kernel has no local arrays and no calls, so any stack is register spills (ptxas -v: "N bytes stack
    frame, N bytes spill stores")."""
    from triton import knobs

    tool = Path(knobs.nvidia.ptxas.path).with_name("cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+)\s+STACK:(\d+).*?LOCAL:(\d+)", out)
    if m is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {out[-500:]}")
    return int(m.group(1)), int(m.group(2)) + int(m.group(3))


def _config(r: Request) -> str:
    blocks = ",".join(f"{k}={v}" for k, v in r.cfg.blocks)
    return f"{blocks} w{r.num_warps} s{r.num_stages}"


def compile_all(reqs: list[Request], on_each: Callable[[Compiled], None] | None = None,
                per_config: bool = False) -> list[Compiled]:
    """Compile each distinct (kernel, specialisation key, target) once; a failure raises (with the launch named).
    `per_config`: one specialisation per (kernel, constexprs and argument types, target): the launches that differ
    only in which integers are divisible by 16 share one binary (the CI test's budget)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    groups: dict[tuple, list[Request]] = {}
    for r in reqs:
        spec = (str(sorted(r.signature.items())), str(sorted(r.constants.items(), key=str))) if per_config else r.key
        groups.setdefault((r.kernel, spec, r.entry, r.target), []).append(r)
    out = []
    for (kernel, _, entry, tname), rs in groups.items():
        r = rs[0]
        cc = TARGETS[tname]
        t0 = time.monotonic()
        try:
            k = triton.compile(ASTSource(r.fn, r.signature, r.constants, r.attrs),
                               target=GPUTarget("cuda", cc[0] * 10 + cc[1], 32),
                               options=dict(num_warps=r.num_warps, num_stages=r.num_stages))
        except Exception as e:
            raise RuntimeError(f"{kernel} ({entry}, {_config(r)}) does not compile for {tname}: {r.shape}: "
                               f"{type(e).__name__}: {str(e)[:2000]}") from e
        regs, local = _resources(k.asm["cubin"])
        est = launch.smem_bytes(entry, r.cfg, r.dtype, **r.dims)
        c = Compiled(kernel, entry, tname, str(r.dtype).removeprefix("torch."), _config(r),
                     sorted({x.shape for x in rs}), regs, local, k.metadata.shared, est, launch.smem_limit(cc),
                     time.monotonic() - t0)
        out.append(c)
        if on_each is not None:
            on_each(c)
    return out


def _arch(name: str) -> int:
    cc = TARGETS[name]
    return cc[0] * 10 + cc[1]


# --------------------------------------------------------------------------------------------------------- report

def table(rows: list[Compiled]) -> str:
    """The markdown table of the compiled resources."""
    lines = ["| kernel | table entry | dtype | target | config | regs | spills (stack B) | smem KB | estimate KB | "
             "limit KB | launches |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(rows, key=lambda c: (c.kernel, c.entry, c.dtype, _arch(c.target), c.config)):
        lines.append(f"| {c.kernel} | {c.entry} | {c.dtype} | {c.target} | {c.config} | {c.regs} | {c.spills} | "
                     f"{c.smem / 1024:.1f} | {c.estimate / 1024:.1f} | {c.limit // 1024} | {len(c.shapes)} |")
    return "\n".join(lines)


def matrix(rows: list[Compiled]) -> str:
    """The condensed table: one row per (launch-table entry, dtype), one column per target; a cell is the most
    registers and the most shared memory over that config's specialisations, against the table's estimate."""
    targets = [t for t in TARGETS if any(c.target == t for c in rows)]
    cells: dict[tuple[str, str], dict[str, list[Compiled]]] = {}
    for c in rows:
        cells.setdefault((c.entry, c.dtype), {}).setdefault(c.target, []).append(c)
    lines = ["| table entry | dtype | binaries | " + " | ".join(f"{t}: regs, smem / est. KB" for t in targets)
             + " |", "|---|---|---|" + "---|" * len(targets)]
    for (entry, dt), by in sorted(cells.items()):
        row = [entry, dt, str(sum(len(cs) for cs in by.values()))]
        for t in targets:
            cs = by.get(t, [])
            spill = max((c.spills for c in cs), default=0)
            row.append("-" if not cs else f"{max(c.regs for c in cs)}, {max(c.smem for c in cs) / 1024:.1f} / "
                                          f"{max(c.estimate for c in cs) / 1024:.1f}"
                                          + (f", **spills {spill} B**" if spill else ""))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def summary(rows: list[Compiled], n_requests: int, seconds: float) -> str:
    kernels = sorted({c.kernel for c in rows})
    worst = max(rows, key=lambda c: c.regs)
    head = min(rows, key=lambda c: c.limit - c.smem)
    spills = [c for c in rows if c.spills]
    over = [c for c in rows if not c.ok]
    return (f"{len(rows)} binaries ({len(kernels)} kernels x their configs and specialisations x targets) from "
            f"{n_requests} launches, compiled in {seconds:.0f} s; max {worst.regs} registers ({worst.kernel}, "
            f"{worst.target}, {worst.config}); {len(spills)} binaries spill registers"
            + (" (most: {0.spills} B of stack per thread, {0.kernel} {0.dtype} on {0.target})".format(
                max(spills, key=lambda c: c.spills)) if spills else "")
            + f"; least shared-memory headroom {(head.limit - head.smem) / 1024:.1f} KB ({head.kernel}, {head.target}, "
            f"{head.smem / 1024:.1f} of {head.limit // 1024} KB); over the limit or the estimate: {len(over)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--jobs", type=int, default=1, help="compile the targets in this many processes")
    p.add_argument("--quiet", action="store_true", help="the summary line only, not the table")
    p.add_argument("--matrix", action="store_true", help="the condensed table (entry x target) instead of one row "
                                                         "per binary")
    p.add_argument("--per-config", action="store_true", help="one specialisation per kernel config and argument "
                                                             "types (launches differing only in divisibility share)")
    p.add_argument("--render", metavar="JSON", help="print the tables of an earlier --json run; compile nothing")
    args = p.parse_args(argv)
    if args.render:
        got = json.loads(Path(args.render).read_text())
        rows = [Compiled(**r) for r in got["rows"]]
        print(matrix(rows) if args.matrix else table(rows))
        print()
        print(summary(rows, got["launches"], got["seconds"]))
        return 0 if all(c.ok for c in rows) else 1
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error("unset TRITON_INTERPRET: the kernels must be JIT functions to compile for a target")
    t0 = time.monotonic()
    targets = args.targets.split(",")
    if args.jobs > 1 and len(targets) > 1:
        rows, n = _in_processes(args, [targets[i::args.jobs] for i in range(args.jobs)])
    else:
        reqs = requests(args.models.split(","), targets, args.dtypes.split(","))
        rows, n = compile_all(reqs, per_config=args.per_config), len(reqs)
    took = time.monotonic() - t0
    if not args.quiet:
        print(matrix(rows) if args.matrix else table(rows))
        print()
    print(summary(rows, n, took))
    if args.json:
        Path(args.json).write_text(json.dumps({"launches": n, "seconds": took,
                                               "rows": [dataclasses.asdict(c) for c in rows]}, indent=1))
    return 0 if all(c.ok for c in rows) else 1


def _in_processes(args: argparse.Namespace, groups: list[list[str]]) -> tuple[list[Compiled], int]:
    """Each group of targets compiled by its own `compile_targets.py` process (at once); their rows merged."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i, g in enumerate(x for x in groups if x):
            out = Path(tmp) / f"{i}.json"
            cmd = [sys.executable, __file__, "--models", args.models, "--dtypes", args.dtypes, "--targets",
                   ",".join(g), "--json", str(out), "--quiet"] + (["--per-config"] if args.per_config else [])
            procs.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), out))
        rows, n, errs = [], 0, []
        for proc, out in procs:
            _, err = proc.communicate()
            if not out.exists():
                errs.append(err[-3000:])
                continue
            got = json.loads(out.read_text())
            rows += [Compiled(**r) for r in got["rows"]]
            n += got["launches"]
        if errs:
            raise RuntimeError("a compile process failed:\n" + "\n".join(errs))
    return rows, n


if __name__ == "__main__":
    sys.exit(main())
