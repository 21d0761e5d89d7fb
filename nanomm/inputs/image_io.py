"""Untrusted images in, decoded PIL images out: accept a PIL image, path, bytes or data URL, refuse the rest early.

This is the loading half of the first stage of the request path; `nanomm/inputs/image.py` does the Qwen2-VL
preprocessing (RGB, smart_resize, normalise, patchify) on what `load_image` returns. lessons/01-preprocessing.md
(section 5, "Bad input fails early, with a name") explains the decisions below.

Decisions a reader should know:
  - Bad input raises `InvalidInputError` naming the input (`name`), before any big allocation. The source image's
    width*height is checked from the header, before decoding, against `max_image_pixels` (default: Pillow's own
    default limit, 89,478,485 pixels). Pillow's global `Image.MAX_IMAGE_PIXELS` is never changed; it still
    applies on top, so the effective limit is the smaller of the two.
  - Files and bytes may be PNG, JPEG (and MPO, phone JPEGs), GIF, WEBP, BMP, TIFF or AVIF. Other formats that
    Pillow could open (EPS runs Ghostscript, for one) are refused: decoding untrusted data should use few decoders.
  - URLs are not fetched here: `LLM` and the server fetch http(s) URLs from allowed hosts first
    (nanomm/inputs/media_fetch.py) and pass the bytes; a URL that reaches this function is refused.
  - Animated images (GIF, APNG, WEBP): the first frame is used. A PIL image is used as given (its current frame).
  - EXIF orientation is applied to the files, bytes and data URLs decoded here, so a phone photo is served
    upright (as vLLM serves it). This departs from transformers' processor given `Image.open(path)`, which
    ignores the tag; it matches HF's own `load_image` for paths. A PIL image is used as given: whoever opened it
    decides (`PIL.ImageOps.exif_transpose`). The parity tests use images without EXIF, where both agree.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import os
from pathlib import Path

from PIL import Image, ImageOps

from nanomm.errors import InvalidInputError

MAX_ASPECT_RATIO = 200  # HF's smart_resize refuses anything longer and thinner
PILLOW_MAX_IMAGE_PIXELS = 89_478_485  # Pillow's default Image.MAX_IMAGE_PIXELS (1024**3 // 4 // 3)
EXIF_ORIENTATION = 0x0112  # the EXIF tag; 1 = upright, 2-8 = a turn and/or a mirror
SUPPORTED_FORMATS = ("PNG", "JPEG", "MPO", "GIF", "WEBP", "BMP", "TIFF", "AVIF")


def load_image(image, name: str = "image", *, max_image_pixels: int = PILLOW_MAX_IMAGE_PIXELS) -> Image.Image:
    """A PIL image, a path (str / PathLike), bytes or a data URL -> a fully decoded PIL image in its original mode.

    Size and aspect ratio are checked from the header before any pixel is decoded. Raises InvalidInputError,
    mentioning `name`, for anything that is not a usable image.
    """
    if isinstance(image, Image.Image):
        _check_size(image.size, name, max_image_pixels)
        with _decoding(name):
            image.load()  # a lazily opened PIL image is decoded here; an in-memory one is a no-op
        return image
    data = encoded_bytes(image, name)
    if data is not None:
        return _decode(data, name, max_image_pixels)
    if isinstance(image, str) and image.startswith(("http://", "https://")):
        raise InvalidInputError(f"{name}: URLs are not fetched here ({_short(image)}); pass its path or bytes, or "
                                "give LLM allowed_media_domains (nanomm-serve --allowed-media-domains)")
    raise InvalidInputError(f"{name}: an image must be a PIL image, a file path, bytes or a data:image/...;base64 URL, "
                            f"got {type(image).__module__}.{type(image).__qualname__}")


def encoded_bytes(image, name: str = "image") -> bytes | None:
    """The encoded bytes of bytes, a data URL or a file path, not decoded (the processor cache hashes them);
    None for anything else (a PIL image, a URL, a wrong type), which `load_image` takes or refuses itself."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, str) and image.startswith("data:"):
        return _data_url_payload(image, name)
    if isinstance(image, str) and image.startswith(("http://", "https://")):
        return None
    if isinstance(image, (str, os.PathLike)):
        return _read_file(image, name)
    return None


def _decode(data: bytes, name: str, max_image_pixels: int) -> Image.Image:
    if not data:
        raise InvalidInputError(f"{name}: the image data is empty (0 bytes)")
    with _decoding(name):
        # Image.open is lazy: it parses the header, so the size is known before the pixels are allocated.
        im = Image.open(io.BytesIO(data), formats=_open_formats())
        _check_size(im.size, name, max_image_pixels)
        im.load()  # the first frame, for animated images
        if im.getexif().get(EXIF_ORIENTATION, 1) == 1:
            return im
        return ImageOps.exif_transpose(im)  # turned or flipped upright; a quarter turn swaps width and height


def _open_formats() -> list[str]:
    Image.init()  # registers every plugin, so asking for a format that this Pillow build lacks cannot KeyError
    return [f for f in SUPPORTED_FORMATS if f in Image.OPEN]


@contextlib.contextmanager
def _decoding(name: str):
    """Turn everything Pillow can raise on bad data into InvalidInputError.

    No warning filters are touched (warnings.catch_warnings is process-wide and not thread-safe, and images
    decode on a worker pool): the decompression-bomb guard is our own header check, `_check_size`, which runs
    before any pixel is decoded. Pillow's own DecompressionBombError (over twice its limit) is still caught.
    """
    with decode_errors(name, "the image", f"an image in a supported format ({', '.join(SUPPORTED_FORMATS)})"):
        yield


@contextlib.contextmanager
def decode_errors(name: str, what: str, expected: str):
    """Pillow's (or a decoder's) exceptions on bad data -> an InvalidInputError naming the input: `what` is it
    ("the image"), `expected` what it should have been. Shared by images and videos (inputs/video_io.py)."""
    try:
        yield
    except InvalidInputError:
        raise
    except Image.DecompressionBombError as e:
        raise InvalidInputError(f"{name}: {what} is over Pillow's decompression-bomb pixel limit ({e})") from e
    except Image.UnidentifiedImageError as e:
        raise InvalidInputError(f"{name}: not {expected}") from e
    except Exception as e:  # corrupt data surfaces as OSError, EOFError, SyntaxError, ValueError, struct.error, ...
        raise InvalidInputError(f"{name}: {what} is truncated or corrupt and cannot be decoded "
                                f"({type(e).__name__}: {e})") from e


def _check_size(size: tuple[int, int], name: str, max_image_pixels: int) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise InvalidInputError(f"{name}: the image has zero size ({width}x{height})")
    if width * height > max_image_pixels:
        raise InvalidInputError(f"{name}: the image is {width}x{height} = {width * height:,} pixels, over the pixel "
                                f"limit of {max_image_pixels:,} (max_image_pixels, a decompression-bomb guard)")
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise InvalidInputError(f"{name}: the image is {width}x{height}, an aspect ratio over {MAX_ASPECT_RATIO}:1, "
                                "which Qwen2-VL preprocessing cannot handle")


def _read_file(path, name: str) -> bytes:
    """Read the whole file: decoding from memory leaves no file handle open, even for animated images."""
    p = Path(path)
    try:
        is_dir, exists, is_file = p.is_dir(), p.exists(), p.is_file()
    except (OSError, ValueError) as e:  # a name too long for the filesystem, an embedded NUL, ...
        hint = " (base64 image data needs a 'data:image/<type>;base64,' prefix)" if len(str(path)) > 255 else ""
        reason = e.strerror if isinstance(e, OSError) and e.strerror else _short(str(e))  # never the whole path
        raise InvalidInputError(f"{name}: {_short(str(path))} is not a usable file path{hint}: {reason}") from None
    if is_dir:
        raise InvalidInputError(f"{name}: {_short(str(path))} is a directory, not an image file")
    if not exists:
        raise InvalidInputError(f"{name}: no such file {_short(str(path))}")
    if not is_file:  # FIFOs and devices (/dev/zero) could block or never end
        raise InvalidInputError(f"{name}: {_short(str(path))} is not a regular file")
    try:
        return p.read_bytes()
    except OSError as e:  # permissions, I/O errors
        raise InvalidInputError(f"{name}: cannot read file {_short(str(path))}: {e}") from e


def _data_url_payload(url: str, name: str) -> bytes:
    """'data:image/png;base64,iVBOR...' -> the decoded bytes. The media type is not trusted: the bytes decide."""
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise InvalidInputError(f"{name}: malformed data URL {_short(url)}; expected data:image/<type>;base64,<data>")
    if not header.startswith("data:image/"):
        raise InvalidInputError(f"{name}: the data URL is not an image ({_short(header)}); "
                                "expected data:image/<type>;base64,<data>")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidInputError(f"{name}: the data URL's base64 payload is invalid ({e})") from e


def _short(text: str, limit: int = 80) -> str:
    """repr() of a caller's string, cut short: a bad 10 MB data URL must not end up in an error message."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"
