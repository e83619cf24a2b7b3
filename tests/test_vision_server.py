"""Images over the API (issue 40, server side): a real uvicorn server on 127.0.0.1 serving a tiny random
vision-language checkpoint (tests/vl_util.py) with the demo's tokenizer (its <|vision_start|> 2057, <|vision_end|>
2058, <|image_pad|> 2060), driven with the official `openai` client.

- An image_url part (data: URL, http(s) from a server on 127.0.0.1) or a Responses `input_image` is served: the
  prompt holds the image's pads in place, usage.prompt_tokens counts them, mm_processor_kwargs (the server's and the
  request's) change how many; the context check runs on the expanded prompt.
- Every bad input is a 400 whose message names the problem (undecodable, truncated, unsupported format,
  decompression bomb, a domain outside --allowed-media-domains, a fetch timeout, file:// without an allowed path,
  video_url, an image in a system message, more images than --limit-mm-per-prompt, bad mm_processor_kwargs,
  --language-model-only, a checkpoint without a vision tower), and the next good request is answered exactly as
  before.
- The chat template renders image parts in place (ours, the demo's copy, and a template that reads parts the way
  Qwen's official one does); the engine process carries a job's images.
"""
from __future__ import annotations

import base64
import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from unittest import mock
from urllib.parse import parse_qs, urlsplit

import httpx
import numpy as np
import openai
import pytest
from PIL import Image, ImageDraw

from config.settings import ServeSettings, resolve
from engine.images import ImageConfig, prepare_input
from engine.tokenizer import Tokenizer
from server.cli import build_server
from tests.server_fixtures import DEMO_DIR, NEXTN, ServerThread, free_port, tiny_checkpoint
from tests.vl_util import make_vl_checkpoint

#: The demo tokenizer's vision ids (models/demo/tokenizer.json's added tokens) and its vocabulary size.
DEMO_VISION_IDS = {"vision_start_token_id": 2057, "vision_end_token_id": 2058, "image_token_id": 2060,
                   "video_token_id": 2061}
DEMO_VOCAB = 2112
PAD, START, END = 2060, 2057, 2058
MAX_MODEL_LEN = 256
LIMIT = 2
#: The server's --mm-processor-kwargs: a 64 x 64 picture becomes 128 x 128 (8 x 8 patches: 16 image tokens).
SERVER_MIN_PIXELS = 128 * 128


def _png(im: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def shapes(color: str = "red", n: int = 2) -> Image.Image:
    """A 64 x 64 picture of `n` circles of `color` on white."""
    im = Image.new("RGB", (64, 64), "white")
    draw = ImageDraw.Draw(im)
    for i in range(n):
        draw.ellipse((4 + 30 * i, 20, 28 + 30 * i, 44), fill=color)
    return im


def _bomb_header(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height with almost no data: a decompression bomb's header."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


RED = _png(shapes("red"))
BLUE = _png(shapes("blue", 1))
NOISE = _png(Image.frombytes("RGB", (64, 64), np.random.default_rng(0).integers(0, 256, 64 * 64 * 3, np.uint8)
                             .tobytes()))


class _Images(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        parts = urlsplit(self.path)
        body, ctype = {"/red.png": (RED, "image/png"), "/bmp": (_png(shapes(), "BMP"), "image/bmp"),
                       "/page": (b"<html>not an image</html>", "text/html")}.get(parts.path, (b"", ""))
        if parts.path == "/slow":
            time.sleep(float(parse_qs(parts.query)["s"][0]))
            body, ctype = RED, "image/png"
        try:
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", ctype or "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass


@pytest.fixture(scope="module")
def images_host():
    """An image server on 127.0.0.1 (the only host --allowed-media-domains lets the test server fetch from), with
    any proxy variables of the environment blanked while it serves (the fetches go straight to it)."""
    no_proxy = {f"{name}_proxy": "" for name in ("http", "https", "all", "HTTP", "HTTPS", "ALL")}
    with ThreadingHTTPServer(("127.0.0.1", 0), _Images) as httpd, mock.patch.dict(os.environ, no_proxy):
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
        httpd.shutdown()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    """A tiny VL checkpoint (dense, MTP, vision tower) with the demo's tokenizer and its vision ids."""
    out = make_vl_checkpoint(tmp_path_factory.mktemp("vl") / "vl", vocab_size=DEMO_VOCAB)
    raw = json.loads((out / "config.json").read_text())
    raw.update(DEMO_VISION_IDS)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEMO_DIR / name, out / name)
    return out


class VLServer(ServerThread):
    """`ServerThread` over a checkpoint directory of our choosing (in-process worker)."""

    def __init__(self, model_dir: Path, **settings) -> None:  # noqa: D107 - ServerThread's, another checkpoint
        from engine.loader import load_model

        model = load_model(model_dir, language_model_only=settings.get("language_model_only", False))
        s = ServeSettings(**{"model_dir": model_dir, "port": free_port(), "device": "cpu", "dtype": "float32",
                             "log_level": "warning", "engine_process": False, **settings})
        self.settings, _ = resolve(s, cuda_available=False, has_mtp=model.config.has_mtp,
                                   max_position_embeddings=model.config.max_position_embeddings)
        self.server = build_server(self.settings, model, Tokenizer.from_dir(model_dir))
        self.worker = self.server.worker
        self.url, self.model = self.settings.url, self.settings.served_model_name
        self.base_url = self.url + "/v1"
        self._thread = threading.Thread(target=self.server.run, name="uvicorn-vl", daemon=True)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    """The test server's --allowed-local-media-path, holding red.png."""
    out = tmp_path_factory.mktemp("media")
    (out / "red.png").write_bytes(RED)
    return out


@pytest.fixture(scope="module")
def srv(vl_dir, images_host, media_dir):
    with VLServer(vl_dir, max_model_len=MAX_MODEL_LEN, limit_mm_per_prompt={"image": LIMIT},
                  mm_processor_kwargs={"min_pixels": SERVER_MIN_PIXELS}, allowed_media_domains=("127.0.0.1",),
                  allowed_local_media_path=media_dir, media_fetch_timeout=0.5, num_speculative_tokens=2) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)


def ask(*parts: dict, text: str = "What is in this picture?", system: str | list | None = None) -> list[dict]:
    """One user message: the image parts, then the question."""
    msgs = [{"role": "system", "content": system}] if system is not None else []
    return msgs + [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def image(url: str, **kw) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **kw}}


NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def chat(client, srv, messages, extra_body=None, **kw):
    """A greedy chat completion with thinking off (the answer is `content`)."""
    return client.chat.completions.create(model=srv.model, messages=messages, max_tokens=kw.pop("max_tokens", 4),
                                          temperature=0, extra_body={**NO_THINK, **(extra_body or {})}, **kw)


def n_image_tokens(vl_dir: Path, data: bytes, min_pixels: int | None = SERVER_MIN_PIXELS,
                   max_pixels: int | None = None) -> int:
    cfg = ImageConfig.from_checkpoint(vl_dir)
    return prepare_input(Image.open(io.BytesIO(data)).convert("RGB"), cfg, min_pixels, max_pixels).n_tokens


# ----------------------------------------------------------------------------------------------- serving images


def test_image_pads_in_place_and_counted_in_usage(srv, client, vl_dir):
    tok = Tokenizer.from_dir(vl_dir)
    text_ids = tok.encode_chat([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}]}],
                               enable_thinking=False)
    n = n_image_tokens(vl_dir, RED)
    assert n == 16  # 64 x 64 -> 128 x 128 under the server's --mm-processor-kwargs min_pixels
    r = chat(client, srv, ask(image(_data_url(RED), detail="high"), text="Hi?"), extra_body={"return_token_ids": True})
    ids = r.prompt_token_ids  # vLLM's extra field
    at = ids.index(START)
    assert ids[at + 1:at + 1 + n] == [PAD] * n and ids[at + 1 + n] == END
    assert ids[:at + 1] + [PAD] + ids[at + 1 + n:] == text_ids  # the template's one pad, expanded in place
    assert r.usage.prompt_tokens == len(text_ids) - 1 + n == len(ids)
    assert r.usage.prompt_tokens_details.image_tokens == n
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_http_file_image_and_two_images(srv, client, vl_dir, images_host, media_dir):
    one = chat(client, srv, ask(image(_data_url(RED))))
    for url in (images_host + "/red.png", (media_dir / "red.png").as_uri()):  # the same picture, fetched or read
        other = chat(client, srv, ask(image(url)))
        assert other.usage.prompt_tokens == one.usage.prompt_tokens
        assert other.choices[0].message.content == one.choices[0].message.content
    two = chat(client, srv, ask(image(_data_url(RED)), image(_data_url(BLUE))))
    assert two.usage.prompt_tokens == one.usage.prompt_tokens + n_image_tokens(vl_dir, BLUE) + 2  # + its 3 markers


def test_mm_processor_kwargs_change_the_token_count(srv, client, vl_dir):
    base = chat(client, srv, ask(image(_data_url(RED))))
    small = chat(client, srv, ask(image(_data_url(RED))),
                 extra_body={"mm_processor_kwargs": {"min_pixels": 64 * 64, "max_pixels": 64 * 64}})
    assert n_image_tokens(vl_dir, RED, 64 * 64, 64 * 64) == 4
    assert base.usage.prompt_tokens - small.usage.prompt_tokens == 16 - 4
    assert small.usage.prompt_tokens_details.image_tokens == 4


def test_context_length_is_checked_after_expansion(srv, client):
    big = {"mm_processor_kwargs": {"min_pixels": 512 * 512}}  # 256 image tokens: over the 256-token context
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, srv, ask(image(_data_url(RED))), extra_body=big)
    assert "maximum context length" in e.value.message and "for images" in e.value.message
    assert e.value.body["code"] == "context_length_exceeded"


def test_streaming_with_an_image(srv, client):
    full = chat(client, srv, ask(image(_data_url(RED))), max_tokens=6)
    chunks = list(client.chat.completions.create(model=srv.model, messages=ask(image(_data_url(RED))), max_tokens=6,
                                                 temperature=0, stream=True, extra_body=NO_THINK,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_responses_input_image(srv, client, vl_dir):
    chat_r = chat(client, srv, ask(image(_data_url(RED))), max_tokens=5)
    parts = [{"type": "input_image", "image_url": _data_url(RED), "detail": "auto"},
             {"type": "input_text", "text": "What is in this picture?"}]
    r = client.responses.create(model=srv.model, max_output_tokens=5, temperature=0, reasoning={"effort": "none"},
                                input=[{"role": "user", "content": parts}])
    assert r.usage.input_tokens == chat_r.usage.prompt_tokens
    assert r.output_text == chat_r.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="file_id") as e:
        client.responses.create(model=srv.model, max_output_tokens=2, instructions="Be brief.", input=[
            {"role": "user", "content": "Hi"},
            {"role": "user", "content": [{"type": "input_text", "text": "This:"},
                                         {"type": "input_image", "file_id": "file-123"}]}])
    assert e.value.body["param"] == "input.1.content.1"  # the place in the Responses request, not chat's


def test_metrics_count_encoded_images_and_encoder_cache_hits(srv, client):
    picture = _png(shapes("green", 3))  # a picture no other test sends
    encoded, hits = srv.metric("nextn_mm_images_encoded_total"), srv.metric("nextn_mm_encoder_cache_hits_total")
    chat(client, srv, ask(image(_data_url(picture))), max_tokens=1)
    assert srv.metric("nextn_mm_images_encoded_total") == encoded + 1
    assert srv.metric("nextn_mm_encoder_seconds_total") > 0
    chat(client, srv, ask(image(_data_url(picture)), text="And now?"), max_tokens=1)
    assert srv.metric("nextn_mm_images_encoded_total") == encoded + 1  # the repeat came from the encoder cache
    assert srv.metric("nextn_mm_encoder_cache_hits_total") == hits + 1


def test_image_counters_follow_the_engines_cumulative_stats():
    from engine.images import VisionStats
    from metrics.prometheus import ServingMetrics

    m = ServingMetrics("m", 0)
    assert b"nextn_mm_" not in m.render()[0]  # a server without a vision tower has no image families
    for encoded, hits, seconds in ((0, 0, 0.0), (2, 1, 0.5), (2, 1, 0.5), (5, 3, 1.25)):
        m.set_vision(VisionStats(images_encoded=encoded, encoder_cache_hits=hits, encoder_seconds=seconds))
    body = m.render()[0].decode()
    for name, want in (("images_encoded", 5), ("encoder_cache_hits", 3), ("encoder_seconds", 1.25)):
        line = next(x for x in body.splitlines() if x.startswith(f"nextn_mm_{name}_total{{"))
        assert float(line.rsplit(" ", 1)[1]) == want, line


# ------------------------------------------------------------------------------------- bad input: 400s, unharmed


def _bad(images_host: str) -> list[tuple[str, list[dict], dict, str]]:
    """(id, messages, extra body, what the 400's message must say)."""
    return [
        ("undecodable", ask(image(_data_url(b"\x00\x01 definitely not a picture" * 8))), {}, "not an image Pillow"),
        ("truncated", ask(image(_data_url(NOISE[:len(NOISE) // 2]))), {}, "truncated"),
        ("unsupported-format", ask(image(images_host + "/bmp")), {}, "format: BMP"),
        ("unsupported-mime", ask(image(_data_url(b"BM....", "image/bmp"))), {}, "image/bmp"),
        ("decompression-bomb", ask(image(_data_url(_bomb_header(20000, 20000)))), {}, "decompression bomb"),
        ("not-an-allowed-domain", ask(image(images_host.replace("127.0.0.1", "localhost") + "/red.png")), {},
         "not in --allowed-media-domains"),
        ("fetch-timeout", ask(image(images_host + "/slow?s=2")), {}, "timed out"),
        ("html-not-image", ask(image(images_host + "/page")), {}, "HTML"),
        ("file-outside-allowed-path", ask(image("file:///etc/hostname")), {}, "outside --allowed-local-media-path"),
        ("video", ask({"type": "video_url", "video_url": {"url": _data_url(RED)}}), {}, "video_url is not supported"),
        ("system-image", ask(system=[image(_data_url(RED))]), {}, "system message cannot contain images"),
        ("over-the-limit", ask(*[image(_data_url(RED))] * (LIMIT + 1)), {}, f"at most {LIMIT} image"),
        ("bad-kwargs", ask(image(_data_url(RED))), {"mm_processor_kwargs": {"min_pixel": 4}}, "unknown key"),
        ("min-over-max", ask(image(_data_url(RED))), {"mm_processor_kwargs": {"min_pixels": 9000, "max_pixels": 10}},
         "max_pixels"),
        ("aspect-ratio", ask(image(_data_url(_png(Image.new("RGB", (1000, 4)))))), {}, "aspect ratio"),
        ("no-url", ask({"type": "image_url", "image_url": {"url": ""}}), {}, "image_url.url"),
        ("truncate-prompt", ask(image(_data_url(RED))), {"truncate_prompt_tokens": 10}, "truncate_prompt_tokens"),
    ]


BAD_IDS = [b[0] for b in _bad("http://127.0.0.1:1")]


GOOD = ask(image(_data_url(RED)), text="Which colour?")


@pytest.fixture(scope="module")
def reference(srv, client):
    """The answer to a good image request before any bad input was sent."""
    return chat(client, srv, GOOD, max_tokens=3, logprobs=True)


@pytest.mark.parametrize("case", BAD_IDS)
def test_bad_image_inputs_are_400s_and_the_server_is_unharmed(srv, client, images_host, reference, case):
    _, messages, extra, says = next(b for b in _bad(images_host) if b[0] == case)
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, srv, messages, extra_body=extra or None)
    assert e.value.status_code == 400 and says.lower() in e.value.message.lower(), e.value.message
    assert srv.worker.alive
    after = chat(client, srv, GOOD, max_tokens=3, logprobs=True)
    assert after.choices[0].message.content == reference.choices[0].message.content
    assert [t.logprob for t in after.choices[0].logprobs.content] == \
        [t.logprob for t in reference.choices[0].logprobs.content]
    assert after.usage.prompt_tokens == reference.usage.prompt_tokens


def test_image_settings_forms_and_startup_refusals(vl_dir, tmp_path):
    from config.settings import SettingsError, load_settings
    from server.cli import build_parser, image_serving, settings_from_args

    args = build_parser().parse_args(["serve", str(vl_dir), "--allowed-media-domains", "a.example", "b.example",
                                      "--limit-mm-per-prompt", '{"image": {"count": 3}, "video": 0}',
                                      "--mm-processor-kwargs", '{"size": {"longest_edge": 65536}}'])
    s = settings_from_args(args, environ={"NEXTN_MM_ENCODER_CACHE_MB": "64"})
    assert s.allowed_media_domains == ("a.example", "b.example") and s.limit_mm_per_prompt == {"image": 3, "video": 0}
    assert s.encoder_cache_bytes == 64 * 2**20
    images = image_serving(s)
    assert images.max_images == 3 and images.config.max_pixels == 65536 and images.policy.allowed_media_domains == (
        "a.example", "b.example")
    env = load_settings({"model_dir": vl_dir}, environ={"NEXTN_ALLOWED_MEDIA_DOMAINS": "a.example, b.example"})
    assert env.allowed_media_domains == ("a.example", "b.example")
    for bad, says in (({"limit_mm_per_prompt": '{"images": 2}'}, "unknown modality"),
                      ({"mm_processor_kwargs": '{"max_pixel": 2}'}, "unknown key")):
        with pytest.raises(SettingsError, match=says):
            load_settings({"model_dir": vl_dir, **bad}, environ={})
    for bad, says in (({"mm_processor_kwargs": {"min_pixels": 2**30}}, "--mm-processor-kwargs"),
                      ({"allowed_local_media_path": tmp_path / "absent"}, "does not exist")):
        with pytest.raises(SettingsError, match=says):  # `nextn serve` exits 2 with this line
            image_serving(ServeSettings(model_dir=vl_dir, **bad))
    assert image_serving(ServeSettings(model_dir=vl_dir, language_model_only=True)).config is None
    text_only = image_serving(ServeSettings(model_dir=tiny_checkpoint()))
    assert text_only.config is None and "no vision tower" in text_only.refusal


def test_tokenize_refuses_images_by_name(srv):
    r = httpx.post(srv.url + "/tokenize", json={"model": srv.model, "messages": ask(image(_data_url(RED)))})
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]


# ---------------------------------------------------------------------- servers that take no images


def test_language_model_only_refuses_images_and_serves_text(vl_dir):
    with VLServer(vl_dir, max_model_len=MAX_MODEL_LEN, language_model_only=True, num_speculative_tokens=0) as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--language-model-only"):
            chat(c, s, ask(image(_data_url(RED))))
        assert chat(c, s, [{"role": "user", "content": "Hello"}]).usage.completion_tokens >= 1
        assert not s.worker.vision


@pytest.fixture(scope="module")
def text_only_export(vl_dir, tmp_path_factory) -> Path:
    """The VL checkpoint's layout and config (vision_config included) without its model.visual.* weights."""
    out = make_vl_checkpoint(tmp_path_factory.mktemp("export") / "vl", vocab_size=DEMO_VOCAB, vision=False)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(vl_dir / name, out / name)
    return out


@pytest.mark.parametrize("checkpoint", ["text-only", "vision-config-without-weights"])
def test_checkpoint_without_a_vision_tower_refuses_images(checkpoint, text_only_export):
    server = ServerThread() if checkpoint == "text-only" else VLServer(text_only_export, max_model_len=MAX_MODEL_LEN)
    with server as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no vision tower") as e:
            chat(c, s, ask(image(_data_url(RED))))
        assert e.value.body["param"] == "messages.0.content.0"
        assert chat(c, s, [{"role": "user", "content": "Hello"}]).usage.completion_tokens >= 1


# ----------------------------------------------------------------------------------------------- chat template


def test_templates_render_image_parts_in_place(vl_dir):
    ours = (Path(__file__).resolve().parents[1] / "engine" / "chat_template.jinja").read_text()
    assert json.loads((DEMO_DIR / "tokenizer_config.json").read_text())["chat_template"] == ours
    tok = Tokenizer.from_dir(vl_dir)
    parts = [{"type": "text", "text": "A"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,x"}},
             {"type": "text", "text": "B"}]
    rendered = tok.apply_chat_template([{"role": "user", "content": parts}], enable_thinking=False)
    assert "<|im_start|>user\nA<|vision_start|><|image_pad|><|vision_end|>B<|im_end|>" in rendered
    assert "base64" not in rendered
    with pytest.raises(ValueError, match="System message cannot contain images"):
        tok.apply_chat_template([{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "x"}])
    # a template that reads parts as Qwen's official one does (`'image' in item or 'image_url' in item or
    # item.type == 'image'`, else `item.text`) gets the shapes it expects: the URL never reaches it
    qwen_like = ("{% for m in messages %}{% for item in m.content %}{% if 'image' in item or 'image_url' in item "
                 "or item.type == 'image' %}[IMG{{ item.image_url is defined }}]{% elif 'text' in item %}"
                 "{{ item.text }}{% endif %}{% endfor %}{% endfor %}")
    qwen = Tokenizer.from_dir(vl_dir)
    qwen.chat_template = qwen_like
    assert qwen.apply_chat_template([{"role": "user", "content": parts}]) == "A[IMGFalse]B"


@pytest.mark.slow
def test_engine_process_serves_images_as_the_in_process_worker(srv, client, vl_dir):
    """The images cross the pipe to the engine process (numpy pictures), its image counters come back through the
    relay, and the answer is the in-process worker's, token for token."""
    messages = ask(image(_data_url(_png(shapes("purple", 2)))), text="Which colour?")
    want = chat(client, srv, messages, max_tokens=6, extra_body={"return_token_ids": True})
    with VLServer(vl_dir, max_model_len=MAX_MODEL_LEN, engine_process=True, num_speculative_tokens=2,
                  mm_processor_kwargs={"min_pixels": SERVER_MIN_PIXELS}) as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0)
        got = chat(c, s, messages, max_tokens=6, extra_body={"return_token_ids": True})
        assert s.worker.vision
        assert s.metric("nextn_mm_images_encoded_total") == 1
    assert got.choices[0].token_ids == want.choices[0].token_ids
    assert got.prompt_token_ids == want.prompt_token_ids and got.usage.prompt_tokens == want.usage.prompt_tokens


@pytest.mark.slow
def test_nextn_serve_exits_2_on_pixel_bounds_the_checkpoint_refuses(vl_dir):
    r = subprocess.run(NEXTN + ["serve", str(vl_dir), "--no-engine-process", "--port", str(free_port()),
                                "--mm-processor-kwargs", '{"min_pixels": 1073741824}'],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("nextn serve: error: --mm-processor-kwargs: min_pixels")


def test_engine_process_carries_a_jobs_images(vl_dir):
    from server.engine_proc import _JobSpec

    inp = prepare_input(shapes(), ImageConfig.from_checkpoint(vl_dir))
    spec = _JobSpec(0, 0, [1, 2], 4, None, [], None, None, None, False, 0.0, (inp,))
    back = pickle.loads(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)).images[0]
    assert np.array_equal(back.rgb, inp.rgb) and back.grid_thw == inp.grid_thw and back.hash == inp.hash


def test_the_bundled_demo_answers_the_readmes_picture(tmp_path):
    """README's Images examples against the demo as `nextn serve` starts it (plus --allowed-local-media-path): the
    picture its one-liner draws is "two red circles." by a data: URL, by file:// and through the Responses API, with
    36 image tokens of 57 prompt tokens."""
    im = Image.new("RGB", (256, 256), "white")
    d = ImageDraw.Draw(im)
    d.ellipse((30, 90, 110, 170), fill="red")
    d.ellipse((146, 90, 226, 170), fill="red")
    path = tmp_path / "circles.png"
    im.save(path)
    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    question = {"type": "text", "text": "What is in this picture?"}
    with ServerThread(demo=True, allowed_local_media_path=tmp_path) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="EMPTY")
        for image in (url, "file://" + str(path)):
            r = client.chat.completions.create(model=srv.model, max_tokens=32, temperature=0, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}, question]}])
            assert r.choices[0].message.content == "two red circles.", (image[:30], r.choices[0].message)
            assert (r.usage.prompt_tokens, r.usage.prompt_tokens_details.image_tokens) == (57, 36)
        r = client.responses.create(model=srv.model, temperature=0, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": url}, {"type": "input_text", "text": "What is in this picture?"}]}])
        assert r.output_text == "two red circles.", r.output_text
