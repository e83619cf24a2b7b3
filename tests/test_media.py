"""server/media.py: image URLs (data:, http(s) from a server on 127.0.0.1, file://) -> RGB images, and every
refusal a `MediaError` (an APIError 400) whose message names the image and the problem."""
from __future__ import annotations

import asyncio
import base64
import io
import os
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from PIL import Image, ImageFile

from server import media
from server.errors import APIError
from server.media import MediaError, MediaPolicy, image_part_url, load_image, load_images

RED, BLUE = (255, 0, 0), (0, 0, 255)


def _encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _png_header_only(width: int, height: int) -> bytes:
    """A small PNG whose IHDR declares `width` x `height` (RGB, 8 bit) with one tiny IDAT: a decompression bomb's
    header without the bomb."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


RED_PNG = _encode(Image.new("RGB", (8, 6), RED), "PNG")
NOISE_PNG = _encode(Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3)), "PNG")
TRUNCATED_PNG = NOISE_PNG[:len(NOISE_PNG) // 2]


def load(url: str, policy: MediaPolicy | None = None, index: int = 0, **kw) -> Image.Image:
    return asyncio.run(load_image(url, policy or MediaPolicy(), index, **kw))


def refused(url: str, policy: MediaPolicy | None = None, index: int = 0, **kw) -> str:
    """The message of the MediaError that loading `url` raises."""
    with pytest.raises(MediaError) as e:
        load(url, policy, index, **kw)
    assert e.value.status == 400
    return e.value.message


# -- a local image server ---------------------------------------------------------------------------------------

class _State:
    hits: dict[str, int] = {}
    drip_stopped: list[float] = []


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes, ctype: str = "image/png", length: bool = True,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        if length:
            self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        parts = urlsplit(self.path)
        _State.hits[parts.path] = _State.hits.get(parts.path, 0) + 1
        port = self.server.server_address[1]
        try:
            if parts.path == "/red.png":
                self._send(200, RED_PNG)
            elif parts.path == "/slow":
                time.sleep(float(parse_qs(parts.query)["s"][0]))
                self._send(200, RED_PNG)
            elif parts.path == "/drip":  # one byte every 50 ms: each read is quick, the whole fetch is not
                self.send_response(200)
                self.send_header("Content-Length", "200")
                self.end_headers()
                start = time.monotonic()
                try:
                    for _ in range(60):
                        self.wfile.write(b"\0")
                        self.wfile.flush()
                        time.sleep(0.05)
                except OSError:
                    _State.drip_stopped.append(time.monotonic() - start)
            elif parts.path == "/redirect":
                self._send(302, b"", headers={"Location": "/red.png"})
            elif parts.path == "/redirect-localhost":
                self._send(302, b"", headers={"Location": f"http://localhost:{port}/red.png"})
            elif parts.path == "/loop":
                self._send(302, b"", headers={"Location": "/loop"})
            elif parts.path == "/big":
                self._send(200, b"\0" * 5000)
            elif parts.path == "/big-nolen":  # HTTP/1.0, no Content-Length: the body ends when the connection closes
                self._send(200, b"\0" * 5000, length=False)
            elif parts.path == "/short":  # declares more than it sends
                self.send_response(200)
                self.send_header("Content-Length", str(len(RED_PNG) + 100))
                self.end_headers()
                self.wfile.write(RED_PNG)
            elif parts.path == "/truncated.png":
                self._send(200, TRUNCATED_PNG)
            elif parts.path == "/page":
                self._send(200, b"<!doctype html><html><body>not an image</body></html>", "text/html")
            elif parts.path == "/bmp":
                self._send(200, _encode(Image.new("RGB", (4, 4), RED), "BMP"), "image/bmp")
            elif parts.path == "/empty":
                self._send(200, b"")
            else:
                self._send(404, b"no such thing", "text/plain")
        except OSError:
            pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)


# -- data: URLs and decoding ---------------------------------------------------------------------------------------

def test_data_urls_of_the_four_formats():
    png = load(_data_url("image/png", RED_PNG))
    assert (png.mode, png.size, png.getpixel((3, 3))) == ("RGB", (8, 6), RED)
    webp = load(_data_url("image/webp", _encode(Image.new("RGB", (5, 7), BLUE), "WEBP", lossless=True)))
    assert (webp.mode, webp.size, webp.getpixel((0, 0))) == ("RGB", (5, 7), BLUE)
    jpeg = load(_data_url("image/jpeg", _encode(Image.new("RGB", (16, 16), RED), "JPEG", quality=95)))
    assert jpeg.mode == "RGB" and jpeg.size == (16, 16)
    r, g, b = jpeg.getpixel((8, 8))
    assert r > 240 and g < 15 and b < 15
    # an animated GIF: the first frame (red), not the second (blue)
    frames = [Image.new("RGB", (6, 6), RED), Image.new("RGB", (6, 6), BLUE)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    assert Image.open(io.BytesIO(buf.getvalue())).n_frames == 2
    gif = load(_data_url("image/gif", buf.getvalue()))
    assert (gif.mode, gif.size, gif.getpixel((2, 2))) == ("RGB", (6, 6), RED)
    # "image/jpg" (common in clients) and base64 broken over lines are taken
    b64 = base64.encodebytes(RED_PNG).decode()
    assert "\n" in b64.strip()
    assert load(f"data:image/jpg;base64,{b64}").size == (8, 6)


def test_exif_orientation_is_applied():
    im = Image.new("RGB", (40, 20), RED)
    im.paste(BLUE, (0, 0, 10, 20))  # blue on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    plain = load(_data_url("image/jpeg", _encode(im, "JPEG", quality=95)))
    rotated = load(_data_url("image/jpeg", _encode(im, "JPEG", quality=95, exif=exif.tobytes())))
    assert plain.size == (40, 20)
    assert rotated.size == (20, 40)
    top = rotated.getpixel((10, 3))  # the left edge, rotated clockwise, is on top
    assert top[2] > 200 and top[0] < 60


def test_transparency_is_composited_on_white():
    rgba = Image.new("RGBA", (4, 4), (0, 0, 0, 0))  # fully transparent black
    rgba.putpixel((1, 1), (255, 0, 0, 255))
    rgba.putpixel((2, 2), (255, 0, 0, 128))
    out = load(_data_url("image/png", _encode(rgba, "PNG")))
    assert out.mode == "RGB"
    assert out.getpixel((0, 0)) == (255, 255, 255)  # a plain convert("RGB") would give black
    assert out.getpixel((1, 1)) == RED
    r, g, b = out.getpixel((2, 2))
    assert r == 255 and 125 <= g <= 129 and g == b
    # a palette GIF with a transparent index, and grey + alpha
    p = Image.new("P", (4, 4), 0)
    p.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    p.putpixel((1, 1), 1)
    gif = load(_data_url("image/gif", _encode(p, "GIF", transparency=0)))
    assert gif.getpixel((0, 0)) == (255, 255, 255) and gif.getpixel((1, 1)) == RED
    la = load(_data_url("image/png", _encode(Image.new("LA", (3, 3), (0, 0)), "PNG")))
    assert la.getpixel((1, 1)) == (255, 255, 255)


def test_decompression_bomb_is_an_error():
    # declared 100000 x 100000: over twice Pillow's limit, Pillow's own error, turned into ours
    msg = refused(_data_url("image/png", _png_header_only(100_000, 100_000)), index=1)
    assert msg.startswith("image 2: ") and "decompression bomb" in msg and "89478485 pixels" in msg
    # declared 10000 x 10000: between Pillow's warning and its error; Pillow only warns, we refuse
    with pytest.warns(Image.DecompressionBombWarning):
        msg = refused(_data_url("image/png", _png_header_only(10_000, 10_000)))
    assert "10000x10000 = 100000000 pixels is over the limit of 89478485 pixels" in msg
    assert "decompression bomb" in msg
    # the policy's own limit, far below Pillow's
    msg = refused(_data_url("image/png", RED_PNG), MediaPolicy(max_pixels=40))
    assert "8x6 = 48 pixels is over the limit of 40 pixels" in msg


def test_truncated_and_unreadable_bytes():
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    msg = refused(_data_url("image/png", TRUNCATED_PNG))
    assert msg.startswith("image 1: truncated PNG data")
    jpeg = _encode(Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3)), "JPEG")
    assert "truncated JPEG data" in refused(_data_url("image/jpeg", jpeg[:len(jpeg) // 2]))
    # a format Pillow could parse but this server does not accept: named, never handed to its plugin
    msg = refused(_data_url("image/png", _encode(Image.new("RGB", (4, 4)), "BMP")))
    assert "not an image Pillow can read (format: BMP; accepted: PNG, JPEG, WebP, GIF)" in msg
    assert "format: text" in refused(_data_url("image/png", b"hello, world"))
    assert "format: PNG (corrupt header)" in refused(_data_url("image/png", b"\x89PNG\r\n\x1a\n" + b"\0" * 10))
    assert refused("data:image/png;base64,") == "image 1: the image is empty (0 bytes)"


def test_truncated_images_never_load_silently(monkeypatch):
    """Some other code setting Pillow's LOAD_TRUNCATED_IMAGES would make truncated files decode; refuse loudly."""
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
        load(_data_url("image/png", TRUNCATED_PNG))


def test_bad_data_urls():
    assert "not valid base64" in refused("data:image/png;base64,@@@@not-base64@@@@")
    assert "not valid base64" in refused("data:image/png;base64,iVBORw0KGgo")  # bad padding
    msg = refused(_data_url("text/plain", b"hello"))
    assert "media type 'text/plain' is not an image type" in msg and "image/png" in msg
    assert "without a media type" in refused(_data_url("", RED_PNG))
    assert "is not base64" in refused("data:image/png,rawbytes")
    assert "without a ','" in refused("data:image/png;base64")
    msg = refused(_data_url("image/png", RED_PNG), MediaPolicy(max_bytes=20))
    assert "over the limit of 20 bytes per image" in msg
    # a data URL is never echoed back whole
    long_url = _data_url("image/png", NOISE_PNG)
    msg = refused(long_url, MediaPolicy(max_pixels=10))
    assert long_url[30:60] not in msg


def test_unsupported_urls():
    assert "unsupported URL 'ftp://example.com/a.png'" in refused("ftp://example.com/a.png")
    assert "unsupported URL" in refused("/etc/passwd")
    assert "credentials" in refused("http://user:pw@127.0.0.1/a.png")
    assert "not a valid URL" in refused("http://127.0.0.1:99999/a.png")
    msg = refused("gopher://x/\n\x00" + "y" * 500)
    assert "\n" not in msg and "\x00" not in msg and len(msg) < 400


# -- http(s) --------------------------------------------------------------------------------------------------------

def test_http_image(server):
    im = load(f"{server}/red.png")
    assert (im.mode, im.size, im.getpixel((0, 0))) == ("RGB", (8, 6), RED)


def test_http_errors_name_the_problem(server):
    assert "truncated PNG data" in refused(f"{server}/truncated.png")
    msg = refused(f"{server}/page", index=2)
    assert msg.startswith("image 3: not an image Pillow can read (format: HTML")
    assert "format: BMP" in refused(f"{server}/bmp")
    assert refused(f"{server}/empty") == f"image 1: {server}/empty returned an empty body"
    assert f"fetch of {server}/missing failed: HTTP 404" in refused(f"{server}/missing")
    assert "the body ended after" in refused(f"{server}/short")
    refused_port = refused("http://127.0.0.1:1/a.png")
    assert "fetch of http://127.0.0.1:1/a.png failed" in refused_port


def test_http_byte_cap(server):
    small = MediaPolicy(max_bytes=1000)
    assert "is 5000 bytes, over the limit of 1000 bytes" in refused(f"{server}/big", small)
    assert "over the limit of 1000 bytes" in refused(f"{server}/big-nolen", small)


def test_http_timeout(server):
    t0 = time.monotonic()
    msg = refused(f"{server}/slow?s=2", MediaPolicy(fetch_timeout_s=0.3), index=1)
    assert msg == f"image 2: fetch of {server}/slow?s=2 timed out after 0.3 s"
    assert time.monotonic() - t0 < 1.5


def test_http_timeout_is_total_not_per_read(server):
    """Every read of /drip returns within 50 ms, so only a deadline over the whole fetch stops it; the fetching
    thread gives up by itself (the server sees the connection close), not only the awaiting coroutine."""
    _State.drip_stopped.clear()
    t0 = time.monotonic()
    assert "timed out after 0.4 s" in refused(f"{server}/drip", MediaPolicy(fetch_timeout_s=0.4))
    assert time.monotonic() - t0 < 1.5
    for _ in range(100):
        if _State.drip_stopped:
            break
        time.sleep(0.02)
    assert _State.drip_stopped and _State.drip_stopped[0] < 1.5


def test_redirects(server):
    before = _State.hits.get("/red.png", 0)
    msg = refused(f"{server}/redirect")
    assert msg == (f"image 1: {server}/redirect redirects (HTTP 302) to {server}/red.png; this server does not "
                   "follow redirects for images")
    assert _State.hits.get("/red.png", 0) == before  # not followed
    follow = MediaPolicy(allow_redirects=True, max_redirects=2)
    assert load(f"{server}/redirect", follow).size == (8, 6)
    assert "more than 2 redirects" in refused(f"{server}/loop", follow)
    # each hop is checked against the domain list
    only_ip = MediaPolicy(allow_redirects=True, allowed_media_domains=("127.0.0.1",))
    msg = refused(f"{server}/redirect-localhost", only_ip)
    assert "redirects to" in msg and "domain localhost is not in --allowed-media-domains" in msg


def test_allowed_domains(server):
    before = dict(_State.hits)
    msg = refused(f"{server}/red.png", MediaPolicy(allowed_media_domains=("images.example.com",)))
    assert msg == "image 1: domain 127.0.0.1 is not in --allowed-media-domains"
    assert _State.hits == before  # refused before any connection
    assert load(f"{server}/red.png", MediaPolicy(allowed_media_domains=["127.0.0.1"])).size == (8, 6)
    assert MediaPolicy(allowed_media_domains=["Images.Example.COM."]).allowed_media_domains == ("images.example.com",)
    assert MediaPolicy(allowed_media_domains=[]).allowed_media_domains is None  # empty: any host, as in vLLM
    assert MediaPolicy(allowed_media_domains=["[::1]"]).allowed_media_domains == ("::1",)


# -- file:// --------------------------------------------------------------------------------------------------------

def test_file_urls(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "red image.png").write_bytes(RED_PNG)
    (outside / "secret.png").write_bytes(RED_PNG)
    (allowed / "link.png").symlink_to(outside / "secret.png")
    (allowed / "sub").mkdir()
    os.mkfifo(allowed / "fifo.png")
    policy = MediaPolicy(allowed_local_media_path=str(allowed))

    assert load(f"file://{allowed}/red%20image.png", policy).size == (8, 6)
    assert load(f"file://localhost{allowed}/red%20image.png", policy).size == (8, 6)
    msg = refused(f"file://{allowed}/red%20image.png")
    assert msg == "image 1: file:// URLs are refused: the server was started without --allowed-local-media-path"
    msg = refused(f"file://{allowed}/../outside/secret.png", policy)
    assert "is outside --allowed-local-media-path" in msg
    assert "is outside --allowed-local-media-path" in refused(f"file://{allowed}/link.png", policy)
    assert "is outside --allowed-local-media-path" in refused("file:///etc/passwd", policy)
    assert refused(f"file://{allowed}/nope.png", policy).endswith("nope.png does not exist")
    t0 = time.monotonic()
    assert "is not a regular file" in refused(f"file://{allowed}/fifo.png", policy)  # and does not block
    assert time.monotonic() - t0 < 2
    assert "is not a regular file" in refused(f"file://{allowed}/sub", policy)
    assert "only local paths" in refused(f"file://otherhost{allowed}/red%20image.png", policy)
    assert "over the limit of 10 bytes" in refused(
        f"file://{allowed}/red%20image.png", MediaPolicy(allowed_local_media_path=str(allowed), max_bytes=10))


def test_policy_validation(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        MediaPolicy(allowed_local_media_path=str(tmp_path / "missing"))
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(ValueError, match="not a directory"):
        MediaPolicy(allowed_local_media_path=str(tmp_path / "f"))
    with pytest.raises(ValueError, match="fetch_timeout_s"):
        MediaPolicy(fetch_timeout_s=0)
    with pytest.raises(ValueError, match="not a string"):
        MediaPolicy(allowed_media_domains="example.com")  # type: ignore[arg-type]
    p = MediaPolicy()
    assert (p.fetch_timeout_s, p.allow_redirects, p.allowed_media_domains, p.allowed_local_media_path) == (
        5.0, False, None, None)
    with pytest.raises(AttributeError):
        p.max_bytes = 1  # type: ignore[misc]


# -- parts, errors, several images ---------------------------------------------------------------------------------

def test_image_part_url_shapes():
    url = "https://example.com/a.png"
    assert image_part_url({"type": "image_url", "image_url": {"url": url, "detail": "high"}}) == url
    assert image_part_url({"type": "image_url", "image_url": url}) == url
    assert image_part_url({"type": "input_image", "image_url": url, "detail": "auto"}) == url
    with pytest.raises(MediaError, match=r"^image 2: input_image by file_id is not supported") as e:
        image_part_url({"type": "input_image", "file_id": "file-abc"}, 1, param="input.0.content.1")
    assert e.value.param == "input.0.content.1"
    with pytest.raises(MediaError, match=r"^video_url is not supported yet"):
        image_part_url({"type": "video_url", "video_url": {"url": url}})
    with pytest.raises(MediaError, match=r"needs image_url.url, a non-empty string"):
        image_part_url({"type": "image_url", "image_url": {"detail": "low"}})
    with pytest.raises(MediaError, match=r"needs image_url, a non-empty string"):
        image_part_url({"type": "input_image", "image_url": 3})
    with pytest.raises(MediaError, match=r"'input_audio' is not an image part"):
        image_part_url({"type": "input_audio"})


def test_media_error_is_a_400_api_error():
    e = MediaError("image 1: nope", param="messages.0.content.1")
    assert isinstance(e, APIError) and e.status == 400
    body = e.body().model_dump()["error"]
    assert (body["message"], body["type"], body["param"]) == (
        "image 1: nope", "invalid_request_error", "messages.0.content.1")
    msg = refused(_data_url("text/plain", b"x"), param="messages.0.content.2")
    assert "text/plain" in msg


def test_load_images(server, tmp_path):
    (tmp_path / "a.png").write_bytes(_encode(Image.new("RGB", (3, 3), BLUE), "PNG"))
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path))
    urls = [f"{server}/red.png", _data_url("image/png", RED_PNG), f"file://{tmp_path}/a.png"]
    images = asyncio.run(load_images(urls, policy))
    assert [im.size for im in images] == [(8, 6), (8, 6), (3, 3)]
    assert images[2].getpixel((0, 0)) == BLUE
    # one bad image: its own index and param
    with pytest.raises(MediaError) as e:
        asyncio.run(load_images(urls[:2] + [f"{server}/page"], policy, params=["p0", "p1", "p2"]))
    assert e.value.message.startswith("image 3: not an image Pillow can read") and e.value.param == "p2"
    # the bound on all of a request's images together
    slow = MediaPolicy(fetch_timeout_s=5, total_timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(MediaError, match=r"^loading 2 images took longer than 0.3 s"):
        asyncio.run(load_images([f"{server}/slow?s=1", f"{server}/red.png"], slow))
    assert time.monotonic() - t0 < 1.0
    assert asyncio.run(load_images([], policy)) == []
    assert media.MEDIA_THREADS >= 1
