"""Images of a request: an `image_url` part's URL -> a decoded RGB `PIL.Image.Image`, under a `MediaPolicy`.

Sources (vLLM's set): `data:` base64 URLs of PNG, JPEG, WebP or GIF; http(s) URLs, fetched with the stdlib
(urllib in this module's own thread pool, so a slow image server never holds the threads that parse requests)
under a byte cap, a per-fetch timeout from the moment the fetch starts, redirects off unless the policy allows
them (and then every hop is checked again), and an optional host allow-list (`--allowed-media-domains`);
`file://` URLs only under `--allowed-local-media-path`, with '..' and symlinks resolved before the check and the
final open refusing a symlink.

Decoding: Pillow restricted to the four formats (no other plugin ever parses request bytes); the pixel count is
checked from the header before any raster is allocated (the decompression bomb guard: an error, never Pillow's
warning alone); a truncated file is an error (Pillow's `ImageFile.LOAD_TRUNCATED_IMAGES` must stay False); a GIF
or animated WebP gives its first frame; EXIF orientation is applied (`ImageOps.exif_transpose`); transparency is
composited on white as transformers' `convert_to_rgb` does (a band "A" or a `transparency` entry -> RGBA ->
alpha-composited on opaque white -> RGB; vLLM's `rgba_to_rgb` also uses white), other modes convert to RGB.

Every refusal is a `MediaError`: an `APIError` 400 whose message names the image (1-based, in request order) and
the problem, so a route that lets it propagate answers with an OpenAI error body.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import http.client
import io
import os
import stat
import string
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import SplitResult, quote, urlsplit

from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from server.errors import APIError

__all__ = ["MEDIA_THREADS", "MIME_FORMATS", "MediaError", "MediaPolicy", "decode_image", "image_part_url",
           "load_image", "load_images"]

#: Pillow formats a request's bytes may be decoded as, and the `data:` media types that name them ("image/jpg" is
#: not registered but common in clients).
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MIME_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
                "image/gif": "GIF"}
_ACCEPTED = "PNG, JPEG, WebP, GIF"
#: Threads that fetch and decode images, shared by all requests (vLLM's VLLM_MEDIA_LOADING_THREAD_COUNT default).
MEDIA_THREADS = 8
#: Bytes per read of an http body: each read returns what one recv gives, so the deadline is checked between them.
_READ_CHUNK = 1 << 16
#: Characters of a URL an error message shows.
_SHOW_CHARS = 200
_USER_AGENT = "nextn"
_T = TypeVar("_T")


class MediaError(APIError):
    """A request's image could not be used; the client gets a 400 with `message` (and `param` when known)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, message, param=param)


@dataclass(frozen=True)
class MediaPolicy:
    """Limits on loading a request's images; one per server, built from the CLI at startup.

    allowed_media_domains: vLLM's `--allowed-media-domains`: when set (non-empty), an http(s) URL's host (and every
        redirect hop's) must be one of them, compared exactly, case-insensitively (vLLM compares `hostname`
        exactly too); None or empty: any host.
    allowed_local_media_path: vLLM's `--allowed-local-media-path`: `file://` URLs are served only from under this
        directory (it must exist; stored resolved); None: `file://` is refused.
    max_bytes: the encoded size cap of one image (http body, file, decoded `data:` payload). vLLM has no image byte
        cap (llama.cpp caps http images at 10 MB); 20 MiB here.
    fetch_timeout_s: one http fetch (connect, headers and body), counted from when the fetch starts; vLLM's
        VLLM_IMAGE_FETCH_TIMEOUT default (5 s).
    allow_redirects: follow http redirects (each hop checked against the scheme and the domain list). Off here; on
        in vLLM by default (VLLM_MEDIA_URL_ALLOW_REDIRECTS=1), whose security notes recommend turning it off so
        that a redirect cannot leave the allowed domains.
    max_redirects: hops followed when redirects are allowed.
    max_pixels: width x height of one image, checked from the header before decoding. Pillow's own
        DecompressionBombWarning threshold (Image.MAX_IMAGE_PIXELS = 89,478,485): what Pillow would only warn
        about is refused (Pillow's error comes only at twice that).
    total_timeout_s: all of one request's images together, queueing for the shared threads included.
    """

    allowed_media_domains: tuple[str, ...] | None = None
    allowed_local_media_path: str | None = None
    max_bytes: int = 20 * 2**20
    fetch_timeout_s: float = 5.0
    allow_redirects: bool = False
    max_redirects: int = 5
    max_pixels: int = 89_478_485
    total_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "fetch_timeout_s", "total_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MediaPolicy.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_redirects < 0:
            raise ValueError(f"MediaPolicy.max_redirects must be >= 0, got {self.max_redirects!r}")
        domains = self.allowed_media_domains
        if isinstance(domains, str):
            raise ValueError("MediaPolicy.allowed_media_domains must be a sequence of host names, not a string")
        hosts = tuple(_host(d) for d in domains or ())
        object.__setattr__(self, "allowed_media_domains", hosts or None)  # empty: no restriction, as in vLLM
        if self.allowed_local_media_path:
            root = Path(self.allowed_local_media_path)
            if not root.is_dir():
                raise ValueError(f"--allowed-local-media-path {self.allowed_local_media_path}: "
                                 f"{'not a directory' if root.exists() else 'does not exist'}")
            object.__setattr__(self, "allowed_local_media_path", str(root.resolve(strict=True)))
        else:
            object.__setattr__(self, "allowed_local_media_path", None)


def image_part_url(part: Mapping[str, Any], index: int = 0, *, param: str | None = None) -> str:
    """The image URL of one content part, in either API's shape: Chat Completions' ``{"type": "image_url",
    "image_url": {"url": ..., "detail": ...}}`` (a bare string ``image_url`` is taken too) or the Responses API's
    ``{"type": "input_image", "image_url": ..., "detail": ...}``. `detail` is accepted and ignored. `index` is the
    image's 0-based position in the request (messages say ``image {index + 1}``).

    Raises `MediaError`: a video part ("video_url is not supported yet"), an `input_image` by `file_id` (there is
    no Files API), a part that is not an image part, or a missing or non-string URL."""
    kind = part.get("type")
    if kind in ("video_url", "input_video"):
        raise MediaError(f"{kind} is not supported yet (images only)", param)
    if kind not in ("image_url", "input_image"):
        raise MediaError(f"content part type {_show(str(kind))!r} is not an image part", param)
    where = f"image {index + 1}: "
    value = part.get("image_url")
    if value is None and kind == "input_image" and part.get("file_id") is not None:
        raise MediaError(f"{where}input_image by file_id is not supported (this server has no Files API); send "
                         "image_url as a data: URL or an http(s) URL", param)
    if isinstance(value, Mapping):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        field = "image_url.url" if kind == "image_url" else "image_url"
        raise MediaError(f"{where}{kind} part needs {field}, a non-empty string", param)
    return value


async def load_image(url: str, policy: MediaPolicy, index: int = 0, *, param: str | None = None) -> Image.Image:
    """Fetch (or read, or base64-decode) and decode one image: an RGB `PIL.Image.Image`, EXIF orientation applied.

    `index` is the image's 0-based position in the request (messages say ``image {index + 1}``); `param` goes into
    the error. Runs in this module's thread pool; bounded by `policy.total_timeout_s` (queueing included) and, for
    http, by `policy.fetch_timeout_s` from when the fetch starts. Raises `MediaError` on every refusal."""
    return await _bounded(_load(url, policy, index, param), policy, 1)


async def load_images(urls: Sequence[str], policy: MediaPolicy, *,
                      params: Sequence[str | None] | None = None) -> list[Image.Image]:
    """`load_image` for each URL (0-based indices in order), concurrently on the shared threads, all within
    `policy.total_timeout_s`. Returns the images in order; on the first error the others are cancelled (a fetch
    already running finishes in its thread within its own timeout) and that `MediaError` is raised."""
    if params is not None and len(params) != len(urls):
        raise ValueError(f"load_images: {len(params)} params for {len(urls)} urls")
    tasks = [asyncio.ensure_future(_load(u, policy, i, params[i] if params else None)) for i, u in enumerate(urls)]
    try:
        return list(await _bounded(asyncio.gather(*tasks), policy, len(urls)))
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        for t in tasks:  # mark every outcome retrieved: the first error is the one raised
            if t.done() and not t.cancelled():
                t.exception()


def decode_image(data: bytes, policy: MediaPolicy, index: int = 0, *, param: str | None = None) -> Image.Image:
    """Decode an image's encoded bytes (PNG, JPEG, WebP or GIF; first frame) to RGB, EXIF orientation applied and
    transparency composited on white. Blocking (call it off the event loop). Raises `MediaError`: empty, over
    `policy.max_bytes`, not one of the four formats, over `policy.max_pixels`, truncated or corrupt."""
    where = f"image {index + 1}: "
    if not data:
        raise MediaError(f"{where}the image is empty (0 bytes)", param)
    if len(data) > policy.max_bytes:
        raise MediaError(f"{where}{len(data)} bytes is over the limit of {policy.max_bytes} bytes per image", param)
    if ImageFile.LOAD_TRUNCATED_IMAGES:  # set by some other code in this process: truncated files would pass
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True in this process; refusing to decode images")
    try:
        im = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as e:
        raise MediaError(f"{where}over the limit of {policy.max_pixels} pixels (decompression bomb guard; Pillow: "
                         f"{_show(str(e))})", param) from None
    except UnidentifiedImageError:
        raise MediaError(f"{where}not an image Pillow can read (format: {_sniff(data)}; accepted: {_ACCEPTED})",
                         param) from None
    except Exception as e:  # noqa: BLE001 -- any parser failure on untrusted bytes is the request's error
        raise MediaError(f"{where}corrupt image header ({type(e).__name__}: {_show(str(e))})", param) from None
    with im:
        w, h = im.size
        if w < 1 or h < 1:
            raise MediaError(f"{where}{im.format} image has no pixels ({w}x{h})", param)
        if w * h > policy.max_pixels:
            raise MediaError(f"{where}{w}x{h} = {w * h} pixels is over the limit of {policy.max_pixels} pixels "
                             "(decompression bomb guard)", param)
        try:
            im.load()  # the first frame only
            return _to_rgb(ImageOps.exif_transpose(im), _has_alpha(im))
        except Exception as e:  # noqa: BLE001 -- truncated or corrupt data, a bad EXIF block, an odd mode
            what = "truncated" if "truncated" in str(e) else "corrupt"
            raise MediaError(f"{where}{what} {im.format} data ({type(e).__name__}: {_show(str(e))})",
                             param) from None


# -- loading -------------------------------------------------------------------------------------------------------

async def _bounded(aw: Any, policy: MediaPolicy, n: int) -> Any:
    try:
        return await asyncio.wait_for(aw, policy.total_timeout_s)
    except TimeoutError:
        raise MediaError(f"loading {n} image{'s' if n != 1 else ''} took longer than {policy.total_timeout_s:g} s "
                         "(fetching, decoding and waiting for the server's image threads together)") from None


async def _load(url: str, policy: MediaPolicy, index: int, param: str | None) -> Image.Image:
    where = f"image {index + 1}: "
    if not isinstance(url, str):
        raise MediaError(f"{where}the URL must be a string", param)
    scheme = url[:url.find(":")].lower() if ":" in url[:16] else ""
    if scheme == "data":
        return await _in_pool(_from_data_url, url, policy, index, param)
    if scheme in ("http", "https"):
        parts = _http_url(url, policy, index, param)
        data = await _fetch(parts, policy, index, param)
        return await _in_pool(decode_image, data, policy, index, param=param)
    if scheme == "file":
        return await _in_pool(_from_file_url, url, policy, index, param)
    raise MediaError(f"{where}unsupported URL {_show(url)!r}: use a data: URL (base64), http(s):// or file://",
                     param)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix="nextn-media")
        return _POOL


async def _in_pool(fn: Callable[..., _T], *args: Any, **kw: Any) -> _T:
    return await asyncio.get_running_loop().run_in_executor(_pool(), lambda: fn(*args, **kw))


async def _fetch(parts: SplitResult, policy: MediaPolicy, index: int, param: str | None) -> bytes:
    """The body of an http(s) URL, timed from when a pool thread starts the fetch (queueing is the caller's
    total bound). On timeout the thread stops by itself: its socket times out and its read loop checks the
    deadline."""
    loop = asyncio.get_running_loop()
    started = asyncio.Event()

    def work() -> bytes:
        try:
            loop.call_soon_threadsafe(started.set)
        except RuntimeError:  # the loop is gone: nobody waits for this fetch
            return b""
        return _http_get(parts, policy, index, param, time.monotonic() + policy.fetch_timeout_s)

    fut = loop.run_in_executor(_pool(), work)
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # an abandoned fetch's error is not logged
    try:
        await started.wait()
        return await asyncio.wait_for(asyncio.shield(fut), policy.fetch_timeout_s)
    except TimeoutError:
        raise _timed_out(parts, policy, index, param) from None
    finally:
        fut.cancel()  # still queued: never starts; running: no effect


def _timed_out(parts: SplitResult, policy: MediaPolicy, index: int, param: str | None) -> MediaError:
    return MediaError(f"image {index + 1}: fetch of {_show(parts.geturl())} timed out after "
                      f"{policy.fetch_timeout_s:g} s", param)


def _http_url(url: str, policy: MediaPolicy, index: int, param: str | None, *,
              redirected_from: str | None = None) -> SplitResult:
    """Parse and check an http(s) URL (the request's own or a redirect's target): scheme, host, no credentials,
    the domain allow-list."""
    where = f"image {index + 1}: " + (f"{_show(redirected_from)} redirects to " if redirected_from else "")
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port  # .port raises ValueError on a bad port
    except ValueError as e:
        raise MediaError(f"{where}{_show(url)!r} is not a valid URL ({e})", param) from None
    if parts.scheme.lower() not in ("http", "https"):
        raise MediaError(f"{where}{_show(url)!r}, which is not http(s)", param)
    if not host:
        raise MediaError(f"{where}{_show(url)!r}, a URL without a host", param)
    if parts.username is not None or parts.password is not None:
        raise MediaError(f"{where}a URL with credentials (user:password@), which is refused", param)
    allowed = policy.allowed_media_domains
    if allowed and _host(host) not in allowed:
        raise MediaError(f"{where}domain {_show(_host(host))} is not in --allowed-media-domains", param)
    return parts


def _http_get(parts: SplitResult, policy: MediaPolicy, index: int, param: str | None, deadline: float) -> bytes:
    """GET with the stdlib: only http/https handlers, our redirect rule, a socket timeout on connect and each
    read, a deadline between reads, and a bounded body."""
    where = f"image {index + 1}: "
    url = parts.geturl()
    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.ProxyHandler(), urllib.request.HTTPHandler(), urllib.request.HTTPSHandler(),
                    urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPErrorProcessor(),
                    _Redirects(policy, index, param)):
        opener.add_handler(handler)
    req = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT, "Accept": "image/*"})
    try:
        with opener.open(req, timeout=policy.fetch_timeout_s) as resp:
            size = resp.headers.get("Content-Length")
            if size is not None and size.strip().isdigit() and int(size) > policy.max_bytes:
                raise MediaError(f"{where}{_show(url)} is {int(size)} bytes, over the limit of {policy.max_bytes} "
                                 "bytes per image", param)
            body = bytearray()
            while True:
                if time.monotonic() > deadline:
                    raise _timed_out(parts, policy, index, param)
                chunk = resp.read1(min(_READ_CHUNK, policy.max_bytes + 1 - len(body)))
                if not chunk:
                    break
                body += chunk
                if len(body) > policy.max_bytes:
                    raise MediaError(f"{where}{_show(url)} is over the limit of {policy.max_bytes} bytes per image",
                                     param)
            if size is not None and size.strip().isdigit() and len(body) != int(size):
                raise MediaError(f"{where}fetch of {_show(url)} failed: the body ended after {len(body)} of "
                                 f"{int(size)} bytes", param)
    except urllib.error.HTTPError as e:
        e.close()
        raise MediaError(f"{where}fetch of {_show(url)} failed: HTTP {e.code} {_show(e.reason)}", param) from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise _timed_out(parts, policy, index, param) from None
        raise MediaError(f"{where}fetch of {_show(url)} failed: {_show(str(e.reason))}", param) from None
    except TimeoutError:
        raise _timed_out(parts, policy, index, param) from None
    except (OSError, http.client.HTTPException, ValueError) as e:  # a reset connection, a malformed response, ...
        raise MediaError(f"{where}fetch of {_show(url)} failed: {type(e).__name__}: {_show(str(e))}",
                         param) from None
    if not body:
        raise MediaError(f"{where}{_show(url)} returned an empty body", param)
    return bytes(body)


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Refuses redirects unless the policy allows them; then checks each hop (scheme, domain) and counts hops."""

    def __init__(self, policy: MediaPolicy, index: int, param: str | None) -> None:
        self.policy, self.index, self.param, self.hops = policy, index, param, 0

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> urllib.request.Request | None:
        where = f"image {self.index + 1}: "
        fp.close()
        if not self.policy.allow_redirects:
            raise MediaError(f"{where}{_show(req.full_url)} redirects (HTTP {code}) to {_show(newurl)}; this server "
                             "does not follow redirects for images", self.param)
        self.hops += 1
        if self.hops > self.policy.max_redirects:
            raise MediaError(f"{where}{_show(req.full_url)}: more than {self.policy.max_redirects} redirects",
                             self.param)
        _http_url(newurl, self.policy, self.index, self.param, redirected_from=req.full_url)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _from_data_url(url: str, policy: MediaPolicy, index: int, param: str | None) -> Image.Image:
    """`data:<image type>[;param...];base64,<payload>` -> decoded image."""
    where = f"image {index + 1}: "
    comma = url.find(",")
    if comma < 0:
        raise MediaError(f"{where}data URL without a ',' before its data", param)
    head = url[5:comma].split(";")
    mime = head[0].strip().lower()
    if not mime:
        raise MediaError(f"{where}data URL without a media type (use data:image/png;base64,...)", param)
    if mime not in MIME_FORMATS:
        raise MediaError(f"{where}data URL media type {_show(mime)!r} is not an image type this server reads "
                         f"({', '.join(MIME_FORMATS)})", param)
    if head[-1].strip().lower() != "base64":
        raise MediaError(f"{where}data URL is not base64 (only data:<type>;base64,<data> is supported)", param)
    payload = "".join(url[comma + 1:].split())  # line breaks and spaces some encoders insert
    if len(payload) // 4 * 3 > policy.max_bytes + 2:
        raise MediaError(f"{where}data URL holds about {len(payload) // 4 * 3} bytes, over the limit of "
                         f"{policy.max_bytes} bytes per image", param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"{where}data URL is not valid base64 ({_show(str(e))})", param) from None
    return decode_image(data, policy, index, param=param)


def _from_file_url(url: str, policy: MediaPolicy, index: int, param: str | None) -> Image.Image:
    """`file:///path` -> decoded image, only from under `policy.allowed_local_media_path`."""
    where = f"image {index + 1}: "
    root = policy.allowed_local_media_path
    if root is None:
        raise MediaError(f"{where}file:// URLs are refused: the server was started without "
                         "--allowed-local-media-path", param)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"{where}file:// URL names host {_show(parts.netloc)!r}; only local paths "
                         "(file:///path) are read", param)
    path = Path(urllib.request.url2pathname(parts.path))
    if not path.is_absolute():
        raise MediaError(f"{where}file:// URL path {_show(str(path))!r} is not absolute", param)
    try:
        resolved = path.resolve()  # '..' and every symlink on the way, before the check
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise MediaError(f"{where}cannot resolve {_show(str(path))} ({type(e).__name__})", param) from None
    if not resolved.is_relative_to(root):
        raise MediaError(f"{where}{_show(str(path))} is outside --allowed-local-media-path (after resolving '..' "
                         "and symlinks)", param)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(resolved, flags)  # O_NOFOLLOW: the final name cannot have become a symlink since; O_NONBLOCK:
    except FileNotFoundError:        # a FIFO cannot block the open
        raise MediaError(f"{where}{_show(str(path))} does not exist", param) from None
    except OSError as e:
        raise MediaError(f"{where}cannot open {_show(str(path))} ({e.strerror})", param) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MediaError(f"{where}{_show(str(path))} is not a regular file", param)
        if st.st_size > policy.max_bytes:
            raise MediaError(f"{where}{_show(str(path))} is {st.st_size} bytes, over the limit of "
                             f"{policy.max_bytes} bytes per image", param)
        with open(fd, "rb", closefd=False) as f:
            data = f.read(policy.max_bytes + 1)
    finally:
        os.close(fd)
    return decode_image(data, policy, index, param=param)


# -- decoding helpers --------------------------------------------------------------------------------------------

def _has_alpha(im: Image.Image) -> bool:
    return "A" in im.getbands() or im.info.get("transparency") is not None


def _to_rgb(im: Image.Image, alpha: bool) -> Image.Image:
    """transformers' `convert_to_rgb` rule: transparency composited on opaque white, else a plain convert."""
    if alpha:
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, im.convert("RGBA")).convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")


#: Leading bytes -> format name, to say what a refused body is.
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "PNG (corrupt header)"), (b"\xff\xd8\xff", "JPEG (corrupt header)"),
          (b"GIF8", "GIF (corrupt header)"), (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"),
          (b"%PDF", "PDF"), (b"\x00\x00\x01\x00", "ICO"), (b"8BPS", "PSD"), (b"\xff\x0a", "JPEG XL"),
          (b"\x00\x00\x00\x0cJXL ", "JPEG XL"))


def _sniff(data: bytes) -> str:
    """A short name for what `data` looks like, for the error message."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP (corrupt header)"
    if data[4:8] == b"ftyp":
        return f"ISO media ({_show(data[8:12].decode('latin-1'))}: HEIF/AVIF/MP4)"
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    head = data[:64].lstrip().lower()
    if head.startswith((b"<!doctype html", b"<html")):
        return "HTML"
    if head.startswith((b"<svg", b"<?xml")):
        return "SVG/XML"
    if head.startswith((b"{", b"[")):
        return "JSON"
    if head and all(32 <= c < 127 or c in b"\t\r\n" for c in head):
        return "text"
    return "unknown"


# -- small helpers -------------------------------------------------------------------------------------------------

def _host(name: str) -> str:
    """A host name as compared against the allow-list: lower case, no trailing dot, an IPv6 literal unbracketed."""
    return name.strip().rstrip(".").lower().removeprefix("[").removesuffix("]")


def _show(text: str) -> str:
    """A URL or other request text fit for an error message: a data URL by its length only, anything else cut to
    `_SHOW_CHARS` with spaces, control and non-ASCII characters percent-encoded (cannot forge a log line)."""
    if text[:5].lower() == "data:":
        return f"a data URL of {len(text)} characters"
    shown = quote(text[:_SHOW_CHARS], safe=string.punctuation)
    return shown + ("..." if len(text) > _SHOW_CHARS else "")
