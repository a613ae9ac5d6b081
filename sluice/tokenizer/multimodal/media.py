"""Turn a client's image reference into checked bytes, and checked bytes into an RGB image.

A reference is a data URL, bare base64, a local file (only under the allowed folder) or,
when the server allows it, an http(s) URL. Everything a client can get wrong is a
ClientError that names the image (its 0-based position in the request) and the limit.
These functions block: call them from a worker thread, never on the event loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import os
import re
import socket
import stat
import time
from dataclasses import dataclass
from urllib.parse import SplitResult, unquote, urlsplit

import httpx
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from sluice.sampling import ClientError

MiB = 1024 * 1024
# Formats a client may send. Others (EPS runs Ghostscript, and many rarely used decoders)
# are refused before their decoder runs.
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG includes MPO
_NAT64_PREFIX = ipaddress.IPv6Network("64:ff9b::/96")
_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(slots=True)
class MediaLimits:
    max_images_per_request: int = 8
    max_image_bytes: int = 20 * MiB
    max_image_pixels: int = 4096 * 4096
    # A very thin image grows huge when a processor resizes its shortest edge up.
    max_image_aspect_ratio: float = 50.0
    allowed_local_media_path: str = ""  # "" refuses local files
    allow_remote_media: bool = False
    remote_timeout_s: float = 10.0
    remote_max_bytes: int | None = None  # None: max_image_bytes

    def __post_init__(self) -> None:
        if self.remote_max_bytes is None:
            self.remote_max_bytes = self.max_image_bytes


def refuse(index: int, problem: str) -> ClientError:
    return ClientError(f"image {index}: {problem}", "image_data")


def load_image_bytes(ref: str, limits: MediaLimits, index: int = 0) -> bytes:
    """The encoded image bytes `ref` points at, or a ClientError saying why not."""
    if not isinstance(ref, str) or not ref:
        raise refuse(index, "expected a non-empty string (data URL, base64, file path or URL)")
    if ref.startswith("data:"):
        return _load_data_url(ref, limits, index)
    scheme_match = _URL_SCHEME.match(ref)
    scheme = scheme_match.group(1).lower() if scheme_match else ""
    if scheme == "file" or _is_absolute_path(ref):
        return _load_local(ref, limits, index)
    if scheme:
        return _load_remote(ref, scheme, limits, index)
    return _decode_base64(ref, limits, index)


def _is_absolute_path(ref: str) -> bool:
    # Base64 starts with "/" only for a first byte 0xFC-0xFF: of the accepted formats
    # only JPEG (FF D8 FF), whose base64 always starts "/9j/". file:// is never ambiguous.
    return ref.startswith("/") and not ref.startswith("/9j/")


def decode_image(data: bytes, limits: MediaLimits, index: int = 0) -> Image.Image:
    """Decode to RGB, checking the pixel count from the header before the full decode."""
    # PIL warns above MAX_IMAGE_PIXELS and raises above twice that; refusing everything
    # above the warning threshold turns both into a ClientError without touching the
    # process-wide warning filters, which are not thread-safe.
    max_pixels = min(limits.max_image_pixels, Image.MAX_IMAGE_PIXELS or limits.max_image_pixels)
    try:
        image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except Image.DecompressionBombError as error:
        raise refuse(index, f"has too many pixels (at most {max_pixels}): {error}") from None
    except UnidentifiedImageError:
        raise refuse(index, f"could not be decoded: not a {', '.join(ALLOWED_FORMATS)} image") from None
    except Exception as error:  # noqa: BLE001 - decoders raise many types on bad input
        raise refuse(index, f"could not be decoded: {_reason(error)}") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise refuse(index, f"has an empty size {width}x{height}")
    if width * height > max_pixels:
        raise refuse(index, f"is {width}x{height} = {width * height} pixels, more than the limit of {max_pixels}")
    if max(width, height) / min(width, height) > limits.max_image_aspect_ratio:
        limit = limits.max_image_aspect_ratio
        raise refuse(index, f"is {width}x{height}, an aspect ratio above the limit of {limit:g}")
    try:
        image.load()  # the first frame of an animation
        # Upright as the camera's orientation tag says, as transformers' load_image does.
        upright: Image.Image = ImageOps.exif_transpose(image)
        if upright.mode == "RGB":
            return upright
        if upright.mode in _SIXTEEN_BIT_GRAY_MODES:
            upright = _to_eight_bits(upright)
        # PIL converts palette transparency via RGBA only.
        opaque = upright.convert("RGBA") if "transparency" in upright.info else upright
        return opaque.convert("RGB")
    except Image.DecompressionBombError as error:
        raise refuse(index, f"has too many pixels: {error}") from None
    except Exception as error:  # noqa: BLE001
        raise refuse(index, f"could not be decoded: {_reason(error)}") from None


# Grey of 16 bits a sample (a 16-bit PNG or TIFF; PIL reads some as 32-bit "I"), which PIL's
# convert() clips at 255, all but the darkest 1/256th of the range turning white.
_SIXTEEN_BIT_GRAY_MODES = ("I;16", "I;16L", "I;16B", "I")


def _to_eight_bits(image: Image.Image) -> Image.Image:
    """A 16-bit grey image scaled to 8 bits (its top byte), as PIL reduces 16-bit RGB."""
    samples = np.asarray(image).astype(np.int64)
    return Image.fromarray((np.clip(samples, 0, 65535) >> 8).astype(np.uint8))


def _reason(error: Exception) -> str:
    return str(error) or type(error).__name__


# --- inline data -----------------------------------------------------------------------


def _load_data_url(ref: str, limits: MediaLimits, index: int) -> bytes:
    header, comma, payload = ref.partition(",")
    if not comma:
        raise refuse(index, "malformed data URL: no ',' before the data")
    params = header[len("data:") :].split(";")
    media_type = params[0].strip().lower()
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise refuse(index, "data URLs must be base64-encoded (data:image/png;base64,...)")
    if media_type and not media_type.startswith("image/"):
        raise refuse(index, f"data URL media type {media_type!r} is not an image type")
    return _decode_base64(payload, limits, index)


def _decode_base64(text: str, limits: MediaLimits, index: int) -> bytes:
    # Reject by length before allocating the decoded copy; whitespace counts, which only
    # errs by a few bytes per line.
    if len(text) * 3 // 4 > limits.max_image_bytes:
        raise refuse(index, f"is larger than the limit of {limits.max_image_bytes} bytes")
    compact = "".join(text.split())
    compact += "=" * (-len(compact) % 4)
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise refuse(index, "is neither valid base64 nor a data URL, an absolute file path or an http(s) URL") from None
    if not data:
        raise refuse(index, "is empty")
    return data


# --- local files -----------------------------------------------------------------------


def _load_local(ref: str, limits: MediaLimits, index: int) -> bytes:
    if not limits.allowed_local_media_path:
        raise refuse(index, "local image files are not allowed (start the server with --allowed-local-media-path)")
    if ref.startswith("/"):
        path = ref
    else:
        parts = urlsplit(ref)
        if parts.netloc not in ("", "localhost"):
            raise refuse(index, f"file URLs must name a local path, not host {parts.netloc!r}")
        path = unquote(parts.path)
    root = os.path.realpath(limits.allowed_local_media_path)
    real = os.path.realpath(path)  # resolves '..' and symlinks before the check
    if os.path.commonpath([root, real]) != root:
        raise refuse(index, "local file is outside the allowed media folder")
    try:
        # Without blocking: opening a FIFO for reading waits for a writer, for ever.
        with os.fdopen(os.open(real, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise refuse(index, "local path is not a regular file")
            if info.st_size > limits.max_image_bytes:
                raise refuse(index, f"is larger than the limit of {limits.max_image_bytes} bytes")
            data = file.read(limits.max_image_bytes + 1)
    except FileNotFoundError:
        raise refuse(index, "local file not found") from None
    except IsADirectoryError:
        raise refuse(index, "local path is not a regular file") from None
    except OSError as error:
        raise refuse(index, f"local file could not be read ({type(error).__name__})") from None
    if len(data) > limits.max_image_bytes:  # it grew after fstat
        raise refuse(index, f"is larger than the limit of {limits.max_image_bytes} bytes")
    return data


# --- remote URLs -----------------------------------------------------------------------


def _load_remote(ref: str, scheme: str, limits: MediaLimits, index: int) -> bytes:
    if scheme not in ("http", "https"):
        raise refuse(index, f"URL scheme {scheme!r} is not supported (use http or https)")
    if not limits.allow_remote_media:
        raise refuse(index, "remote image URLs are not allowed (start the server with --allow-remote-media)")
    parts = urlsplit(ref)
    host = parts.hostname
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise refuse(index, "URL has an invalid port") from None
    if not host:
        raise refuse(index, "URL has no host")
    address = resolve_public_address(host, port, index)
    return _fetch_pinned(scheme, host, port, address, parts, limits, index)


def resolve_public_address(host: str, port: int, index: int = 0) -> str:
    """One address of `host`, after checking that every address it resolves to is public."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):
        raise refuse(index, f"host {host!r} could not be resolved") from None
    addresses = [str(info[4][0]) for info in infos]
    if not addresses:
        raise refuse(index, f"host {host!r} could not be resolved")
    for address in addresses:
        problem = address_problem(address)
        if problem:
            article = "an" if problem[0] in "aeiou" else "a"
            raise refuse(index, f"URL host {host!r} resolves to {article} {problem} address; only public ones allowed")
    return addresses[0]


def address_problem(address: str) -> str | None:
    """Why a resolved address must not be fetched from (e.g. "private"), or None."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 scope id
    except ValueError:
        return "malformed"
    candidates: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    if isinstance(ip, ipaddress.IPv6Address):
        # IPv4 addresses carried inside IPv6 reach the IPv4 host they embed.
        candidates += [a for a in (ip.ipv4_mapped, ip.sixtofour) if a is not None]
        if ip.teredo:
            candidates += list(ip.teredo)
        if ip in _NAT64_PREFIX:
            candidates.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    candidates.append(ip)
    for candidate in candidates:
        # Most specific first: Python counts loopback and link-local as private too.
        for name in ("unspecified", "loopback", "link_local", "multicast", "private", "reserved"):
            if getattr(candidate, f"is_{name}"):
                return name.replace("_", "-")
        if not candidate.is_global:  # e.g. 100.64.0.0/10, shared address space
            return "non-public"
    return None


def _fetch_pinned(
    scheme: str, host: str, port: int, address: str, parts: SplitResult, limits: MediaLimits, index: int
) -> bytes:
    """GET the URL from the checked address: no second DNS lookup, so no rebinding."""
    ip_host = f"[{address}]" if ":" in address else address
    target = f"{scheme}://{ip_host}:{port}{parts.path or '/'}" + (f"?{parts.query}" if parts.query else "")
    default_port = 443 if scheme == "https" else 80
    host_header = host if port == default_port else f"{host}:{port}"
    # identity: a compressed body could expand far past the byte cap in one chunk.
    headers = {"Host": host_header, "Accept": "image/*", "Accept-Encoding": "identity"}
    # TLS: SNI and certificate checks use the real host name, the TCP connection the IP.
    extensions = {"sni_hostname": host} if scheme == "https" else {}
    cap = limits.max_image_bytes if limits.remote_max_bytes is None else limits.remote_max_bytes
    deadline = time.monotonic() + limits.remote_timeout_s
    try:
        with httpx.Client(timeout=limits.remote_timeout_s, follow_redirects=False, trust_env=False) as client:
            request = client.build_request("GET", target, headers=headers, extensions=extensions)
            response = client.send(request, stream=True)
            try:
                status = response.status_code
                if 300 <= status < 400:
                    raise refuse(index, f"remote URL answered with a redirect ({status}); redirects are not followed")
                if status != 200:
                    raise refuse(index, f"remote URL answered HTTP {status}")
                declared = response.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > cap:
                    raise refuse(index, f"remote image is larger than the limit of {cap} bytes")
                body = bytearray()
                if response.headers.get("content-encoding", "identity").lower() != "identity":
                    raise refuse(index, "remote image was sent compressed (Content-Encoding); send it uncompressed")
                for chunk in response.iter_raw():
                    body += chunk
                    if len(body) > cap:
                        raise refuse(index, f"remote image is larger than the limit of {cap} bytes")
                    if time.monotonic() > deadline:
                        raise refuse(index, f"remote image took longer than {limits.remote_timeout_s:g} s to fetch")
            finally:
                response.close()
    except httpx.TimeoutException:
        raise refuse(index, f"remote image took longer than {limits.remote_timeout_s:g} s to fetch") from None
    except httpx.HTTPError as error:
        raise refuse(index, f"remote image could not be fetched ({type(error).__name__}: {error})") from None
    if not body:
        raise refuse(index, "remote image is empty")
    return bytes(body)
