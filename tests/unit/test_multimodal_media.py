"""Image references a client sends are loaded, checked and preprocessed, or refused with a
ClientError naming the problem. Refused remote URLs never open a connection."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import httpx
import msgspec
import numpy as np
import pytest
from PIL import Image

from sluice.sampling import ClientError
from sluice.tokenizer.multimodal import media
from sluice.tokenizer.multimodal.media import MediaLimits, decode_image, load_image_bytes
from sluice.tokenizer.multimodal.processor import (
    ImageProcessor,
    MultimodalProcessor,
    ProcessedImage,
    image_hash,
    pixels_to_tensor,
)


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def sample_image(width: int = 48, height: int = 40) -> Image.Image:
    pixels = np.arange(width * height * 3, dtype=np.uint8).reshape(height, width, 3)
    return Image.fromarray(pixels, "RGB")


PNG = encode(sample_image())
B64 = base64.b64encode(PNG).decode()


def refused(match: str):
    return pytest.raises(ClientError, match=match)


# --- inline data and local files ----------------------------------------------------------


def test_base64_and_data_url_load_and_decode_to_the_same_rgb_image():
    limits = MediaLimits()
    assert load_image_bytes(B64, limits) == PNG
    assert load_image_bytes(f"data:image/png;base64,{B64}", limits) == PNG
    assert load_image_bytes(B64.rstrip("="), limits) == PNG  # clients that drop the padding
    image = decode_image(PNG, limits)
    assert image.mode == "RGB" and image.size == (48, 40)
    assert image.tobytes() == sample_image().tobytes()


def test_jpeg_base64_starting_with_a_slash_is_base64_not_a_path(tmp_path):
    jpeg = encode(sample_image(), "JPEG")
    text = base64.b64encode(jpeg).decode()
    assert text.startswith("/9j/")
    for limits in (MediaLimits(), MediaLimits(allowed_local_media_path=str(tmp_path))):
        assert load_image_bytes(text, limits) == jpeg
        assert load_image_bytes(text.rstrip("="), limits) == jpeg


def test_rgba_and_palette_images_decode_to_rgb():
    rgba = Image.new("RGBA", (8, 8), (10, 20, 30, 128))
    assert decode_image(encode(rgba), MediaLimits()).mode == "RGB"
    assert decode_image(encode(rgba.convert("P")), MediaLimits()).mode == "RGB"


@pytest.mark.parametrize("file_format", ["PNG", "TIFF"])
def test_a_16_bit_grey_image_keeps_its_shades(file_format):
    """PIL's convert() clipped 16-bit grey samples at 255: all but the darkest 1/256th of
    the range came out white."""
    ramp = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 1024).astype(np.uint16)  # 0 .. 64,512
    buffer = io.BytesIO()
    Image.fromarray(ramp).save(buffer, format=file_format)
    decoded = np.asarray(decode_image(buffer.getvalue(), MediaLimits()))
    assert decoded.shape == (8, 8, 3)
    assert (decoded == (ramp >> 8).astype(np.uint8)[..., None]).all()


def test_an_image_with_an_orientation_tag_decodes_upright():
    """A phone's photo stored sideways with EXIF Orientation 6 (rotate 90 degrees clockwise to
    view), as transformers' load_image turns it."""
    stored = sample_image(48, 40)
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    stored.save(buffer, format="JPEG", exif=exif, quality=100)
    decoded = decode_image(buffer.getvalue(), MediaLimits())
    assert decoded.size == (40, 48)
    assert decoded.size == stored.transpose(Image.Transpose.ROTATE_270).size


def test_bad_inline_data_is_refused():
    with refused("image 0: is neither valid base64"):
        load_image_bytes("not base64 at all!", MediaLimits())
    with refused("must be base64-encoded"):
        load_image_bytes("data:image/png,rawdata", MediaLimits())
    with refused("not an image type"):
        load_image_bytes(f"data:text/html;base64,{B64}", MediaLimits())


def test_local_file_under_the_allowed_folder_loads(tmp_path):
    (tmp_path / "cat.png").write_bytes(PNG)
    limits = MediaLimits(allowed_local_media_path=str(tmp_path))
    assert load_image_bytes(str(tmp_path / "cat.png"), limits) == PNG
    assert load_image_bytes(f"file://{tmp_path}/cat.png", limits) == PNG


def test_local_files_are_refused_without_an_allowed_folder(tmp_path):
    (tmp_path / "cat.png").write_bytes(PNG)
    with refused("local image files are not allowed .*--allowed-local-media-path"):
        load_image_bytes(str(tmp_path / "cat.png"), MediaLimits())
    with refused("local image files are not allowed"):
        load_image_bytes(f"file://{tmp_path}/cat.png", MediaLimits())


def test_paths_escaping_the_allowed_folder_are_refused(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (tmp_path / "secret.png").write_bytes(PNG)
    (tmp_path / "media-evil").mkdir()  # shares the prefix "media" but is outside it
    (tmp_path / "media-evil" / "x.png").write_bytes(PNG)
    os.symlink(tmp_path / "secret.png", allowed / "link.png")
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    for ref in (
        str(tmp_path / "secret.png"),
        f"{allowed}/../secret.png",
        f"file://{allowed}/../secret.png",
        str(allowed / "link.png"),
        str(tmp_path / "media-evil" / "x.png"),
        "/etc/passwd",
    ):
        with refused("outside the allowed media folder"):
            load_image_bytes(ref, limits)
    with refused("local file not found"):
        load_image_bytes(str(allowed / "missing.png"), limits)
    with refused("not a regular file"):
        load_image_bytes(str(allowed), limits)
    os.mkfifo(allowed / "fifo.png")  # opening it to read would wait for a writer, for ever
    with refused("not a regular file"):
        load_image_bytes(str(allowed / "fifo.png"), limits)


# --- size and content limits ------------------------------------------------------------


def test_undecodable_bytes_are_refused():
    with refused("image 3: could not be decoded"):
        decode_image(b"GIF89a but not really an image", MediaLimits(), index=3)
    with refused("could not be decoded"):
        decode_image(PNG[: len(PNG) // 2], MediaLimits())  # truncated


def test_formats_outside_the_allowed_list_are_refused():
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"
    with refused("could not be decoded"):
        decode_image(eps, MediaLimits())


def test_oversized_bytes_are_refused(tmp_path):
    limits = MediaLimits(max_image_bytes=len(PNG) - 1, allowed_local_media_path=str(tmp_path))
    with refused(f"larger than the limit of {len(PNG) - 1} bytes"):
        load_image_bytes(B64, limits)
    with refused("larger than the limit"):
        load_image_bytes(f"data:image/png;base64,{B64}", limits)
    (tmp_path / "big.png").write_bytes(PNG)
    with refused("larger than the limit"):
        load_image_bytes(str(tmp_path / "big.png"), limits)


def test_too_many_pixels_are_refused_from_the_header():
    with refused(r"48x40 = 1920 pixels, more than the limit of 1000"):
        decode_image(PNG, MediaLimits(max_image_pixels=1000))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height but holds no pixel data: a decompression bomb's header."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_decompression_bomb_is_refused_without_decoding():
    # Beyond PIL's own bomb limit: open() raises, which must become a ClientError.
    with refused("too many pixels"):
        decode_image(png_header_only(100_000, 100_000), MediaLimits(max_image_pixels=10**12))
    # Beyond our limit only.
    with refused("more than the limit of"):
        decode_image(png_header_only(5000, 5000), MediaLimits())


def test_extreme_aspect_ratio_is_refused():
    thin = encode(Image.new("RGB", (1000, 2)))
    with refused("aspect ratio above the limit of 50"):
        decode_image(thin, MediaLimits())


# --- remote URLs ------------------------------------------------------------------------


@pytest.fixture
def no_connections(monkeypatch):
    """Fail the test if anything opens a connection."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a refused URL must not open a connection")

    monkeypatch.setattr(socket, "create_connection", forbidden)
    monkeypatch.setattr(socket.socket, "connect", forbidden)
    monkeypatch.setattr(httpx.Client, "send", forbidden)


def test_remote_urls_are_refused_by_default(no_connections):
    with refused("image 0: remote image URLs are not allowed .*--allow-remote-media"):
        load_image_bytes("https://example.com/cat.png", MediaLimits())


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://127.0.0.1:1/x.png", "loopback"),
        ("http://localhost/x", "loopback"),
        ("http://10.0.0.1/x", "private"),
        ("http://192.168.1.1/x", "private"),
        ("http://169.254.169.254/latest", "link-local"),
        ("http://[::1]/x", "loopback"),
        ("http://[::ffff:127.0.0.1]/x", "loopback"),
        ("http://[fe80::1]/x", "link-local"),
        ("http://0.0.0.0/x", "unspecified"),
        ("http://224.0.0.1/x", "multicast"),
        ("http://100.64.0.1/x", "non-public"),
    ],
)
def test_non_public_addresses_are_refused_without_connecting(no_connections, url, problem):
    with refused(f"resolves to an? {problem} address"):
        load_image_bytes(url, MediaLimits(allow_remote_media=True))


def test_other_schemes_are_refused(no_connections):
    with refused("URL scheme 'ftp' is not supported"):
        load_image_bytes("ftp://example.com/x", MediaLimits(allow_remote_media=True))
    with refused("URL scheme 'gopher' is not supported"):
        load_image_bytes("gopher://example.com/x", MediaLimits(allow_remote_media=True))


def fake_dns(monkeypatch, *addresses: str):
    def getaddrinfo(host, port, *args, **kwargs):
        family = lambda a: socket.AF_INET6 if ":" in a else socket.AF_INET  # noqa: E731
        return [(family(a), socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_a_name_with_any_private_address_is_refused(monkeypatch, no_connections):
    fake_dns(monkeypatch, "93.184.215.14", "10.1.2.3")
    with refused("'images.example' resolves to a private address"):
        load_image_bytes("https://images.example/cat.png", MediaLimits(allow_remote_media=True))


class ImageServer(BaseHTTPRequestHandler):
    requests_seen: ClassVar[list[dict]] = []

    def do_GET(self):
        ImageServer.requests_seen.append({"path": self.path, "host": self.headers["Host"]})
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest")
            self.end_headers()
        elif self.path == "/cat.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)
        elif self.path == "/endless":  # no Content-Length: only the streamed cap stops it
            self.send_response(200)
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"\0" * 1024)
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ImageServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def loopback_allowed(monkeypatch):
    """The local test server is on 127.0.0.1, which the address check refuses."""
    monkeypatch.setattr(media, "address_problem", lambda address: None)


def test_remote_fetch_connects_to_the_checked_address_with_the_real_host_header(
    monkeypatch, image_server, loopback_allowed
):
    real_getaddrinfo = socket.getaddrinfo
    answers = iter(["127.0.0.1", "10.9.9.9"])  # a rebinding name: the second answer is internal
    name_lookups = []

    def rebinding_dns(host, port, *args, **kwargs):
        if host != "images.example":
            return real_getaddrinfo(host, port, *args, **kwargs)  # numeric: no DNS query
        name_lookups.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding_dns)
    ImageServer.requests_seen.clear()
    url = f"http://images.example:{image_server}/cat.png"
    assert load_image_bytes(url, MediaLimits(allow_remote_media=True)) == PNG
    assert name_lookups == ["images.example"]  # resolved once, then connected to that address
    assert ImageServer.requests_seen == [{"path": "/cat.png", "host": f"images.example:{image_server}"}]


def test_remote_redirect_is_refused(image_server, loopback_allowed):
    with refused(r"redirect \(302\); redirects are not followed"):
        load_image_bytes(f"http://127.0.0.1:{image_server}/redirect", MediaLimits(allow_remote_media=True))


def test_remote_errors_and_oversized_bodies_are_refused(image_server, loopback_allowed):
    limits = MediaLimits(allow_remote_media=True, remote_max_bytes=10_000)
    with refused("answered HTTP 404"):
        load_image_bytes(f"http://127.0.0.1:{image_server}/missing", limits)
    with refused("remote image is larger than the limit of 10000 bytes"):
        load_image_bytes(f"http://127.0.0.1:{image_server}/endless", limits)
    small = MediaLimits(allow_remote_media=True, remote_max_bytes=len(PNG) - 1)
    with refused("larger than the limit"):  # from Content-Length, before reading the body
        load_image_bytes(f"http://127.0.0.1:{image_server}/cat.png", small)


# --- hashing and preprocessing ----------------------------------------------------------


def test_same_image_in_two_encodings_hashes_equal(tmp_path):
    (tmp_path / "cat.png").write_bytes(PNG)
    limits = MediaLimits(allowed_local_media_path=str(tmp_path))
    from_file = decode_image(load_image_bytes(str(tmp_path / "cat.png"), limits), limits)
    from_data_url = decode_image(load_image_bytes(f"data:image/png;base64,{B64}", limits), limits)
    from_bmp = decode_image(encode(sample_image(), "BMP"), limits)
    assert image_hash(from_file) == image_hash(from_data_url) == image_hash(from_bmp)
    assert -(2**63) <= image_hash(from_file) < 2**63
    other = sample_image().transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    assert image_hash(other) != image_hash(from_file)
    # Same bytes, other shape: a different image.
    flat = Image.frombytes("RGB", (40, 48), sample_image().tobytes())
    assert image_hash(flat) != image_hash(from_file)


CLIP_CONFIG = {
    "image_processor_type": "CLIPImageProcessor",
    "crop_size": {"height": 32, "width": 32},
    "size": {"shortest_edge": 32},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3,
    "rescale_factor": 1 / 255,
}


@pytest.fixture(scope="module")
def clip_processor(tmp_path_factory) -> ImageProcessor:
    folder = tmp_path_factory.mktemp("clip")
    (folder / "preprocessor_config.json").write_text(json.dumps(CLIP_CONFIG))
    processor = ImageProcessor.from_model(str(folder))
    assert processor is not None
    return processor


def test_a_model_folder_without_an_image_processor_gives_none(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert ImageProcessor.from_model(str(tmp_path)) is None


def test_preprocess_returns_float32_nchw(clip_processor):
    out = clip_processor.preprocess([sample_image(48, 40), sample_image(100, 64)])
    assert out.shape == (2, 3, 32, 32)
    assert out.dtype == np.float32 and out.flags.c_contiguous


def test_process_runs_off_the_event_loop_and_round_trips_to_a_tensor(clip_processor, tmp_path):
    (tmp_path / "cat.png").write_bytes(PNG)
    limits = MediaLimits(allowed_local_media_path=str(tmp_path))
    threads = []
    real_preprocess = clip_processor.preprocess

    def recording_preprocess(images):
        threads.append(threading.get_ident())
        with pytest.raises(RuntimeError):
            asyncio.get_running_loop()  # no event loop in this thread
        return real_preprocess(images)

    processor = MultimodalProcessor(clip_processor, limits)
    processor.image_processor = type("Recording", (), {"preprocess": staticmethod(recording_preprocess)})()

    async def run():
        return threading.get_ident(), await processor.process([B64, str(tmp_path / "cat.png")])

    try:
        loop_thread, results = asyncio.run(run())
    finally:
        processor.close()
    assert len(threads) == 2 and loop_thread not in threads
    first, second = results
    assert first.shape == [3, 32, 32] and first.dtype == "float32"
    assert first.original_size == [40, 48]
    assert first.hash == second.hash
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(first), type=ProcessedImage)
    tensor = pixels_to_tensor(wire)
    expected = real_preprocess([sample_image()])[0]
    assert tuple(tensor.shape) == (3, 32, 32)
    assert np.array_equal(tensor.numpy(), expected)


def test_process_refuses_too_many_images_and_reports_bad_ones(clip_processor):
    processor = MultimodalProcessor(clip_processor, MediaLimits(max_images_per_request=2))
    try:
        with refused("3 images, more than max_images_per_request=2"):
            asyncio.run(processor.process([B64] * 3))
        with refused("image 1: could not be decoded"):
            asyncio.run(processor.process([B64, base64.b64encode(b"garbage").decode()]))
    finally:
        processor.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a certificate")
def test_https_sends_the_real_host_name_as_sni_and_verifies_the_certificate(tmp_path, monkeypatch, loopback_allowed):
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=images.example",
         "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")],
        check=True, capture_output=True,
    )  # fmt: skip
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    server_names = []
    context.sni_callback = lambda sock, name, ctx: server_names.append(name)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept_one():
        conn, _ = listener.accept()
        try:
            context.wrap_socket(conn, server_side=True).close()
        except (ssl.SSLError, OSError):
            pass  # the client rejects the self-signed certificate
        finally:
            conn.close()

    thread = threading.Thread(target=accept_one, daemon=True)
    thread.start()
    fake_dns(monkeypatch, "127.0.0.1")
    try:
        with refused("remote image could not be fetched .*CERTIFICATE_VERIFY_FAILED"):
            load_image_bytes(f"https://images.example:{port}/cat.png", MediaLimits(allow_remote_media=True))
    finally:
        thread.join(timeout=5)
        listener.close()
    assert server_names == ["images.example"]
