"""Images at the Qwen3.5-0.8B shape: time to first token of a one-image chat request through `nextn serve` against
transformers' forward, the vision encoder's share of it, and what arriving images cost 4 running text streams.
Figures from one run (bench/RESULTS.md records them with this command).

    python bench/vision.py [--sizes 512,1024] [--repeat 2] [--decode-tokens 48] [--decode-images 2] [--cpu-threads N]
                           [--hf-threads N]

Checkpoint: bench/prefix.py's 0.8B-shaped random text checkpoint (the real 248,320-entry vocabulary and tokenizer,
tied embeddings, MTP weights) rewritten in the vision-language layout (`Qwen3_5ForConditionalGeneration`: nested
text_config with M-RoPE sections, `model.language_model.*`) with a random vision tower of the 0.8B's published
vision config (depth 12, hidden 768, 12 heads, intermediate 3072, patch 16, temporal 2, merge 2, out_hidden 1024,
48 x 48 position table), Qwen3.5's preprocessor_config.json (256^2 .. 4096^2 pixels, mean = std = 0.5) and the real
tokenizer's vision ids; built once under ~/.cache/nextn/bench. Both transformers and nextn load it. fp32 (the cpu
dtype).

ttft: for each size, a fresh generated picture per sample (different pixels each time, so neither the encoder cache
nor the prefix cache can serve it) as a PNG `data:` URL in a chat request (max_tokens 1, streamed, greedy): the time
to the chunk carrying the token; then transformers on another fresh picture of the same size: its image processor
(PIL backend) + `Qwen3_5ForConditionalGeneration` forward with `logits_to_keep=1`, at the server's torch thread
count (`--hf-threads`; `--cpu-threads` sets the server's). Interleaved nextn / transformers, best of `--repeat`. The encoder's share is the delta of
nextn_mm_encoder_seconds_total over that request's TTFT; transformers' vision tower is timed by hooks on
`model.visual`.

decode: 4 concurrent streaming text chat requests (`--decode-tokens` each, ignore_eos) alone, then again while
`--decode-images` 1024x1024 image requests (max_tokens 1) arrive one after another: per-stream tokens per second
and inter-chunk gaps, and the ratio (`--decode-tokens 0`: skipped).

The server is `nextn serve` with its defaults (bench/soak.py's ServerProcess: one torch thread, the C kernels' two).
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.prefix import CACHE, _metric, qwen08b_checkpoint  # noqa: E402
from bench.soak import ServerProcess  # noqa: E402

VISION_08B = {"depth": 12, "hidden_size": 768, "num_heads": 12, "intermediate_size": 3072}
VISION_IDS = {"vision_start_token_id": 248053, "vision_end_token_id": 248054, "image_token_id": 248056,
              "video_token_id": 248057}
TORCH_THREADS = 1  # ServerProcess runs the server with OMP_NUM_THREADS=1 (its default on 2 cores too)


# ---------------------------------------------------------------------------------------------- checkpoint
def vl08b_checkpoint() -> Path:
    """bench/prefix.py's 0.8B-shaped random checkpoint in the VL layout with a 0.8B-shaped random vision tower
    (built once)."""
    d = CACHE / "qwen35-0.8b-vl-random"
    if (d / "model.safetensors").is_file() and (d / "preprocessor_config.json").is_file():
        return d
    from safetensors.torch import load_file, save_file

    from tests.vl_util import preprocessor_config, random_tower, vision_config

    text = qwen08b_checkpoint()
    d.mkdir(parents=True, exist_ok=True)
    print(f"building {d} (once) ...", flush=True)
    raw = json.loads((text / "config.json").read_text())
    text_cfg = {k: v for k, v in raw.items() if k != "architectures"}
    text_cfg["rope_parameters"] = {**text_cfg["rope_parameters"], "mrope_section": [11, 11, 10],
                                   "mrope_interleaved": True}
    vc = vision_config(out_hidden_size=text_cfg["hidden_size"], **VISION_08B)
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text_cfg,
           "vision_config": vc, "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
           "eos_token_id": raw["eos_token_id"], **VISION_IDS}
    sd = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
          for k, v in load_file(str(text / "model.safetensors")).items()}
    sd.update({"model.visual." + k: v.contiguous() for k, v in random_tower(vc, seed=9).state_dict().items()})
    for f in text.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, d / f.name)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    (d / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2))
    save_file(sd, str(d / "model.safetensors.tmp"), metadata={"format": "pt"})
    (d / "model.safetensors.tmp").rename(d / "model.safetensors")
    return d


# ---------------------------------------------------------------------------------------------- pictures
def picture(size: int, seed: int):
    """A generated RGB picture, size x size: a colour gradient and a dozen random shapes (every seed differs)."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    c0, c1 = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    t = (0.5 * (x + y))[..., None]
    im = Image.fromarray((c0 * (1 - t) + c1 * t).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(im)
    for _ in range(12):
        x0, y0 = rng.integers(0, size * 3 // 4, 2)
        w, h = rng.integers(size // 16, size // 4, 2)
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((int(x0), int(y0), int(x0 + w), int(y0 + h)), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    return im


def data_url(im) -> str:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


QUESTION = "What is in this picture?"


def image_messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


# ---------------------------------------------------------------------------------------------- requests
def stream_chat(url: str, body: dict, on_chunk=None) -> tuple[float, float, dict]:
    """POST a streaming chat request; (time to the first chunk with content or a finish reason, total time, usage).
    on_chunk(t) is called at each such chunk (perf_counter time)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}}
    usage: dict = {}
    first = None
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=3600) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            ch = chunk.get("choices") or []
            if ch and (ch[0]["delta"].get("content") or ch[0].get("finish_reason")):
                now = time.perf_counter()
                first = first if first is not None else now - t0
                if on_chunk is not None:
                    on_chunk(now)
    return first if first is not None else float("nan"), time.perf_counter() - t0, usage


# ---------------------------------------------------------------------------------------------- ttft
def ttft(srv: ServerProcess, d: Path, sizes: list[int], repeat: int, hf_threads: int) -> list[str]:
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(hf_threads)
    hf = AutoModelForImageTextToText.from_pretrained(str(d), dtype=torch.float32).eval()
    hf_enc: list[float] = []  # transformers' vision tower time, from hooks around hf.model.visual
    hf.model.visual.register_forward_pre_hook(lambda *_: hf_enc.append(-time.perf_counter()))
    hf.model.visual.register_forward_hook(lambda *_: hf_enc.append(hf_enc.pop() + time.perf_counter()))
    proc = Qwen2VLImageProcessorPil.from_pretrained(str(d))
    tok = AutoTokenizer.from_pretrained(str(d))
    pad = VISION_IDS["image_token_id"]
    text_ids = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                          "text": QUESTION}]}],
                                       add_generation_prompt=True, tokenize=True, enable_thinking=False)
    text_ids = list(text_ids["input_ids"] if isinstance(text_ids, dict) or hasattr(text_ids, "keys") else text_ids)
    assert text_ids.count(pad) == 1, "the template should render one image pad"

    def hf_sample(size: int, seed: int) -> tuple[float, float, float, int]:
        im = picture(size, seed)
        with torch.inference_mode():
            t0 = time.perf_counter()
            enc = proc(images=[im], return_tensors="pt")
            grid = enc["image_grid_thw"]
            n = int(grid.prod()) // 4
            i = text_ids.index(pad)
            x = torch.tensor([text_ids[:i] + [pad] * n + text_ids[i + 1:]])
            t1 = time.perf_counter()
            hf(input_ids=x, pixel_values=enc["pixel_values"], image_grid_thw=grid,
               mm_token_type_ids=(x == pad).long(), attention_mask=torch.ones_like(x), logits_to_keep=1)
            t2 = time.perf_counter()
        return t2 - t0, t2 - t1, hf_enc[-1], x.shape[1]

    def nextn_sample(size: int, seed: int) -> tuple[float, float, int]:
        url = data_url(picture(size, seed))
        enc0 = _metric(srv.url, "nextn_mm_encoder_seconds_total")
        first, _, usage = stream_chat(srv.url, {"model": srv.model, "messages": image_messages(url), "max_tokens": 1})
        return first, _metric(srv.url, "nextn_mm_encoder_seconds_total") - enc0, usage.get("prompt_tokens", 0)

    nextn_sample(256, 10**6)  # warm-up (kernel build, first-request paths); not counted
    rows = []
    seed = 0
    for size in sizes:
        best_n = best_h = None
        for _ in range(repeat):
            seed += 1
            s = nextn_sample(size, seed)
            best_n = s if best_n is None or s[0] < best_n[0] else best_n
            seed += 1
            h = hf_sample(size, seed)
            best_h = h if best_h is None or h[0] < best_h[0] else best_h
            print(f"{size}x{size}: nextn serve {s[0]:.2f} s (encoder {s[1]:.2f} s, {s[2]} prompt tokens), "
                  f"transformers {h[0]:.2f} s (forward {h[1]:.2f} s, vision tower {h[2]:.2f} s, {h[3]} tokens)", flush=True)
        rows.append(f"| {size}x{size} | {best_n[2]} | {best_n[0]:.2f} | {best_n[1]:.2f} ({100 * best_n[1] / best_n[0]:.0f}%) "
                    f"| {best_h[0]:.2f} | {best_h[2]:.2f} | {best_h[0] / best_n[0]:.2f}x |")
    del hf
    return rows


# ---------------------------------------------------------------------------------------------- decode
def decode(srv: ServerProcess, tokens: int, n_images: int) -> list[str]:
    def streams(with_images: bool) -> tuple[list[float], list[float], int]:
        times: list[list[float]] = [[] for _ in range(4)]
        usage: list[dict] = [{} for _ in range(4)]
        done = threading.Event()

        def one(i: int) -> None:
            body = {"model": srv.model, "max_tokens": tokens, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Stream {i}: tell me a long story about the sea."}]}
            usage[i] = stream_chat(srv.url, body, times[i].append)[2]

        sent = 0

        def images() -> None:
            nonlocal sent
            while sent < n_images and not done.is_set():
                url = data_url(picture(1024, 5000 + sent))
                stream_chat(srv.url, {"model": srv.model, "messages": image_messages(url), "max_tokens": 1})
                sent += 1

        th = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in th:
            t.start()
        img = threading.Thread(target=images)
        if with_images:
            while not any(times) and all(t.is_alive() for t in th):  # the streams are decoding first
                time.sleep(0.05)
            img.start()
        for t in th:
            t.join()
        done.set()
        if with_images:
            img.join()
        tps = [(u.get("completion_tokens", 0) - 1) / (ts[-1] - ts[0]) for u, ts in zip(usage, times) if len(ts) > 1]
        gaps = [b - a for ts in times for a, b in zip(ts, ts[1:])]
        return tps, gaps, sent

    rows = []
    base = None
    for label, with_images in (("alone", False), ("while images arrive", True)):
        tps, gaps, sent = streams(with_images)
        mean = statistics.mean(tps)
        base = base if base is not None else mean
        print(f"4 streams {label}: {mean:.2f} tok/s per stream, median gap {statistics.median(gaps) * 1e3:.0f} ms, "
              f"max gap {max(gaps):.2f} s, {sent} image requests", flush=True)
        rows.append(f"| {label} ({sent} images) | {mean:.2f} | {statistics.median(gaps) * 1e3:.0f} | "
                    f"{max(gaps):.2f} | {mean / base:.2f}x |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="512,1024")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--decode-images", type=int, default=2)
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="the server's --cpu-threads (torch threads; default: its own, 1 on 2 cores)")
    ap.add_argument("--hf-threads", type=int, default=None,
                    help="transformers' torch threads (default: the server's torch thread count)")
    args = ap.parse_args()
    extra = [] if args.cpu_threads is None else ["--cpu-threads", str(args.cpu_threads)]
    if args.hf_threads is None:
        args.hf_threads = TORCH_THREADS if args.cpu_threads is None else args.cpu_threads
    d = vl08b_checkpoint()
    t0 = time.perf_counter()
    with ServerProcess(d, *extra, ready_timeout=900) as srv:
        ttft_rows = ttft(srv, d, [int(s) for s in args.sizes.split(",")], args.repeat, args.hf_threads)
        decode_rows = decode(srv, args.decode_tokens, args.decode_images) if args.decode_tokens > 0 else []
    print(f"\n### One-image TTFT, Qwen3.5-0.8B shape (random weights, vision depth 12 / hidden 768), fp32, "
          f"{args.hf_threads} torch thread(s) for transformers\n")
    print("| image | prompt tokens | nextn serve TTFT (s) | of which encoder (s) | transformers processor + forward (s) "
          "| of which vision tower (s) | transformers / nextn |\n|---|---|---|---|---|---|---|")
    print("\n".join(ttft_rows))
    if decode_rows:
        print(f"\n### 4 text streams ({args.decode_tokens} tokens each) while 1024x1024 image requests arrive\n")
        print("| streams | tok/s per stream | median gap (ms) | max gap (s) | vs alone |\n|---|---|---|---|---|")
        print("\n".join(decode_rows))
    print(f"\nwall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
