"""Images in a chat request: which parts are images, whether this server takes them, and the engine's inputs.

A chat request's image parts (Chat Completions' `image_url`, the Responses API's `input_image`) become, in request
order, `ImageRef`s (URL + the part's place, for errors) and `{"type": "image"}` parts for the chat template, which
renders each in place as `<|vision_start|><|image_pad|><|vision_end|>`. `ImageServing` (one per server) then
decides whether the request may have them (a vision tower, --language-model-only, --limit-mm-per-prompt), with which
pixel bounds (the checkpoint's, over them --mm-processor-kwargs, over those the request's `mm_processor_kwargs`),
loads them under the server's `MediaPolicy` (server/media.py), resizes each into an `ImageInput`
(engine/images.py) and expands the prompt's one pad per image into that image's n_tokens pads, so the engine gets
the prompt ids it runs. Every refusal is a 400 naming the problem and, where there is one, the part.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from PIL import Image

from config.settings import SettingsError, pixel_bounds
from engine.images import ImageConfig, ImageError, ImageInput, expand_image_pads, prepare_input
from engine.tokenizer import IMAGE_PART, IMAGE_PART_TYPES
from server.errors import APIError
from server.media import MediaPolicy, image_part_url, load_images

#: Content part types that carry an image (`IMAGE_PARTS`: Chat Completions', the Responses API's) and a video
#: (refused for now).
IMAGE_PARTS = IMAGE_PART_TYPES
VIDEO_PARTS = ("video_url", "input_video")
#: Text part types (chat's `text`; the Responses API's `input_text` / `output_text` arrive converted to `text`).
TEXT_PARTS = ("text",)
#: Roles whose messages may not hold images (Qwen's templates: "System message cannot contain images.").
SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True)
class ImageRef:
    """One image part of a request, in request order: its URL and the part's dotted place (`messages.0.content.1`)."""

    url: str
    param: str


def message_content(parts: Sequence[Any], index: int, role: str, refs: list[ImageRef]) -> str | list[dict[str, Any]]:
    """The template content of message `index`'s list `parts` (pydantic parts or dicts with `type`, `text`,
    `image_url`...), appending its images to `refs`. Text only: the texts joined by newlines (as before images
    existed, so text requests keep their prompts); with images: text parts and `IMAGE_PART`s in order.
    Raises a 400 for a video part (not supported yet), an image in a system message, a part without its text or
    URL, or a part of another type."""
    out: list[dict[str, Any]] = []
    has_image = False
    for j, part in enumerate(parts):
        d = part.model_dump() if hasattr(part, "model_dump") else dict(part)
        kind, where = d.get("type"), f"messages.{index}.content.{j}"
        if kind in TEXT_PARTS:
            if not isinstance(d.get("text"), str):
                raise APIError(400, f"{where}: a text part needs text, a string", param=where)
            out.append({"type": "text", "text": d["text"]})
        elif kind in IMAGE_PARTS or kind in VIDEO_PARTS:
            if kind in IMAGE_PARTS and role in SYSTEM_ROLES:
                raise APIError(400, f"{where}: a {role} message cannot contain images (put them in a user message)",
                               param=where)
            url = image_part_url(d, len(refs), param=where)  # a video part: 400 "video_url is not supported yet"
            refs.append(ImageRef(url, where))
            out.append(dict(IMAGE_PART))
            has_image = True
        else:
            raise APIError(400, f"{where}: only text and image content parts are supported, got "
                                f"{str(kind)[:64]!r}", param=where)
    return out if has_image else "\n".join(p["text"] for p in out)


@dataclass(frozen=True)
class ImageServing:
    """What the server does with images: `config` is the checkpoint's image config with --mm-processor-kwargs'
    pixel bounds applied (None: images are refused and `refusal` says why), `policy` how they are loaded,
    `max_images` the most one prompt may hold (--limit-mm-per-prompt)."""

    config: ImageConfig | None
    refusal: str | None
    policy: MediaPolicy
    max_images: int

    @classmethod
    def build(cls, model_dir: str | Path, *, language_model_only: bool, max_images: int,
              mm_processor_kwargs: Mapping[str, Any] | None, policy: MediaPolicy) -> ImageServing:
        """The server's image handling for `model_dir` as its files say (`served_by` then says what the engine
        loaded). Raises SettingsError naming --mm-processor-kwargs when its bounds do not fit the checkpoint's,
        ConfigError for an unusable preprocessor_config.json."""
        cfg = ImageConfig.from_checkpoint(model_dir)
        if cfg is not None and mm_processor_kwargs:
            try:
                cfg = cfg.with_pixels(*pixel_bounds(mm_processor_kwargs, "--mm-processor-kwargs"))
            except ImageError as e:
                raise SettingsError(f"--mm-processor-kwargs: {e}") from None
        refusal = None
        if language_model_only:
            refusal = "the server runs with --language-model-only (text only)"
        elif cfg is None:
            refusal = "the model has no vision tower (its config.json has no vision_config)"
        return cls(None if refusal else cfg, refusal, policy, max_images)

    def served_by(self, vision: bool) -> ImageServing:
        """This, refusing images when the engine's model has no vision tower (`vision` False: the checkpoint holds
        no model.visual.* weights, or --language-model-only)."""
        if vision or self.config is None:
            return self
        return replace(self, config=None, refusal="the model has no vision tower (no model.visual.* weights)")

    def describe(self) -> str:
        """One line for the startup log."""
        if self.config is None:
            return f"images: refused ({self.refusal})"
        return (f"images: up to {self.max_images} per prompt, {self.config.min_pixels} to {self.config.max_pixels} "
                f"pixels each")

    def check(self, refs: Sequence[ImageRef], mm_processor_kwargs: Mapping[str, Any] | None) -> ImageConfig:
        """The image config a request with these images gets (the request's `mm_processor_kwargs` applied); 400 when
        the server takes no images, for more than `max_images`, or for bad `mm_processor_kwargs`."""
        if self.config is None:
            raise APIError(400, f"{refs[0].param}: this server does not take images: {self.refusal}",
                           param=refs[0].param)
        if len(refs) > self.max_images:
            raise APIError(400, f"at most {self.max_images} image(s) per prompt (--limit-mm-per-prompt), got "
                                f"{len(refs)}", param="messages")
        if not mm_processor_kwargs:
            return self.config
        try:
            return self.config.with_pixels(*pixel_bounds(mm_processor_kwargs))
        except ValueError as e:  # ImageError too
            raise APIError(400, f"mm_processor_kwargs: {str(e).removeprefix('mm_processor_kwargs: ')}",
                           param="mm_processor_kwargs") from None

    async def load(self, refs: Sequence[ImageRef]) -> list[Image.Image]:
        """The decoded images (server/media.py, concurrently, under `policy`); a `MediaError` 400 naming the first
        that fails."""
        return await load_images([r.url for r in refs], self.policy, params=[r.param for r in refs])

    @staticmethod
    def inputs(images: Sequence[Image.Image], cfg: ImageConfig, refs: Sequence[ImageRef]) -> tuple[ImageInput, ...]:
        """Each decoded image resized for the tower (`prepare_input`; blocking: run it off the event loop); 400
        naming the image for one the model cannot take (an aspect ratio over 200)."""
        out = []
        for k, (im, ref) in enumerate(zip(images, refs, strict=True)):
            try:
                out.append(prepare_input(im, cfg))
            except ImageError as e:
                raise APIError(400, f"image {k + 1}: {e}", param=ref.param) from None
        return tuple(out)

    @staticmethod
    def expand(ids: Sequence[int], inputs: Sequence[ImageInput], cfg: ImageConfig) -> list[int]:
        """The prompt with its k-th image pad repeated inputs[k].n_tokens times."""
        return expand_image_pads(ids, [x.n_tokens for x in inputs], cfg.image_token_id)

    @staticmethod
    def check_pads(ids: Sequence[int], refs: Sequence[ImageRef], cfg: ImageConfig) -> None:
        """The rendered prompt holds exactly one image pad per image (400 otherwise: a chat template that does not
        render image parts, or image tokens written in the messages' text)."""
        found = sum(1 for t in ids if t == cfg.image_token_id)
        if found != len(refs):
            raise APIError(400, f"the prompt holds {found} image placeholder(s) (<|image_pad|>) for {len(refs)} "
                                "image(s): the chat template must render each image part once, and message text "
                                "may not contain image tokens", param="messages")
