import base64
import http.server
import os
import threading
import time

import pytest

from backend.protocol.errors import InvalidInput
from backend.request.image import decode_image, load_image_url, read_image_url
from backend.request.media import MediaLimits
from tests.images import image_bytes

LIMITS = MediaLimits()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_decodes_png_and_jpeg_to_rgb(fmt):
    image = decode_image(image_bytes(40, 30, fmt=fmt), "image[0]", LIMITS)
    assert image.size == (40, 30) and image.mode == "RGB"


def test_accepts_base64_of_an_image():
    image = decode_image(base64.b64encode(image_bytes(20, 10)), "image[0]", LIMITS)
    assert image.size == (20, 10)


@pytest.mark.parametrize("data, fragment", [
    (b"", "empty image"),
    (b"definitely not an image", "nor base64"),
    (image_bytes(40, 30)[:60], "cannot decode"),
    (base64.b64encode(b"not an image either"), "not a recognised image format"),
])
def test_bad_bytes_are_invalid_input_naming_the_item(data, fragment):
    with pytest.raises(InvalidInput) as info:
        decode_image(data, "image[2]", LIMITS)
    assert info.value.field == "image[2]"
    assert fragment in str(info.value)


def test_pixel_and_byte_limits():
    with pytest.raises(InvalidInput, match="pixel limit"):
        decode_image(image_bytes(100, 100), "image[0]", MediaLimits(max_image_pixels=9_999))
    with pytest.raises(InvalidInput, match="byte limit"):
        decode_image(image_bytes(100, 100), "image[0]", MediaLimits(max_item_bytes=100))


def test_data_url():
    url = "data:image/png;base64," + base64.b64encode(image_bytes(16, 12)).decode()
    assert load_image_url(url, "m", LIMITS).size == (16, 12)
    with pytest.raises(InvalidInput, match="unsupported media type"):
        load_image_url("data:text/plain;base64,aGVsbG8=", "m", LIMITS)
    with pytest.raises(InvalidInput, match="must be base64"):
        load_image_url("data:image/png,rawdata", "m", LIMITS)


def test_file_urls_only_inside_the_allowed_directory(tmp_path):
    allowed, outside = tmp_path / "media", tmp_path / "secret"
    allowed.mkdir(), outside.mkdir()
    (allowed / "ok.png").write_bytes(image_bytes(8, 8))
    (outside / "x.png").write_bytes(image_bytes(8, 8))
    os.symlink(outside / "x.png", allowed / "escape.png")
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    assert load_image_url(f"file://{allowed}/ok.png", "m", limits).size == (8, 8)
    for url in (f"file://{outside}/x.png", f"file://{allowed}/../secret/x.png", f"file://{allowed}/escape.png"):
        with pytest.raises(InvalidInput, match="outside the allowed media directory"):
            load_image_url(url, "m", limits)
    with pytest.raises(InvalidInput, match="cannot read"):
        load_image_url(f"file://{allowed}/missing.png", "m", limits)
    with pytest.raises(InvalidInput, match="disabled"):
        load_image_url(f"file://{allowed}/ok.png", "m", LIMITS)


@pytest.mark.parametrize("url", ["ftp://x/y", "gopher://x/y", "no-scheme"])
def test_other_url_schemes_are_refused(url):
    with pytest.raises(InvalidInput, match="unsupported URL scheme"):
        load_image_url(url, "messages[0].content[0].image_url", LIMITS)


class _Media(http.server.BaseHTTPRequestHandler):
    PNG = None

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/slow.png":
            time.sleep(1.0)
        if self.path == "/moved.png":
            self.send_response(302)
            self.send_header("Location", "http://example.com/x.png")
            self.end_headers()
            return
        body = {"/img.png": self.PNG, "/big.png": self.PNG * 50, "/slow.png": self.PNG}.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def media_server():
    _Media.PNG = image_bytes(64, 48, seed=1)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Media)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_media_only_from_allowed_hosts_with_size_timeout_and_no_redirects(media_server):
    allowed = MediaLimits(allowed_media_domains=("127.0.0.1",), max_item_bytes=len(image_bytes(64, 48, seed=1)) * 2,
                          url_timeout=0.3)
    assert read_image_url(f"{media_server}/img.png", "image", allowed) == image_bytes(64, 48, seed=1)
    cases = [(MediaLimits(), "/img.png", "http(s) media URLs are disabled"),
             (MediaLimits(allowed_media_domains=("example.com",)), "/img.png", "'127.0.0.1' is not in allowed_media_domains"),
             (allowed, "/moved.png", "HTTP 302"),
             (allowed, "/missing.png", "HTTP 404"),
             (allowed, "/big.png", "over the"),
             (allowed, "/slow.png", "within 0.3 s")]
    for limits, path, fragment in cases:
        with pytest.raises(InvalidInput) as info:
            read_image_url(f"{media_server}{path}", "messages[0].content[0].image_url", limits)
        assert info.value.field == "messages[0].content[0].image_url" and fragment in str(info.value), (path, str(info.value))
