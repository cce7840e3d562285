"""OpenAI ``image_url`` content parts of chat messages: base64 ``data:`` URLs only.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0..."}}

rocdraft fetches nothing: a remote URL (http, https, file, ...) is a 400 naming it. Each image
part becomes ``{"type": "image"}`` for the chat template (Qwen2-VL's template writes
``<|vision_start|><|image_pad|><|vision_end|>`` for it) and its bytes go with the prompt to
the engine, which decodes and checks them (rocdraft/core/multimodal.py).
"""
from __future__ import annotations

import base64
import binascii



class ImagePartError(ValueError):
    """A bad ``image_url`` part (the protocol answers it with a 400 naming the part)."""


def image_part_bytes(part: dict, where: str) -> bytes:
    """An ``image_url`` part -> the image file's bytes; ImagePartError for anything but a
    base64 data: URL."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise ImagePartError(f"{where}.image_url must be {{'url': 'data:image/...;base64,...'}}, "
                             f"got {str(value)[:60]!r}")
    if not url.startswith("data:"):
        raise ImagePartError(f"{where}: image_url {url[:80]!r} is not a data: URL; rocdraft "
                             f"fetches nothing, send the image as data:image/...;base64,...")
    header, _, payload = url.partition(",")
    if not header.endswith(";base64") or not payload:
        raise ImagePartError(f"{where}: image_url data: URL must be base64 "
                             f"(data:image/...;base64,...), got {header[:60]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImagePartError(f"{where}: image_url data: URL holds invalid base64") from None
