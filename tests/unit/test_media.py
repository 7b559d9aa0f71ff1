import base64
import os

import pytest

from backend.errors import InvalidInput
from backend.media import MediaLimits, decode_image, load_image_url
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


@pytest.mark.parametrize("url", ["http://example.com/a.png", "ftp://x/y", "no-scheme"])
def test_other_url_schemes_are_refused(url):
    with pytest.raises(InvalidInput, match="unsupported URL scheme"):
        load_image_url(url, "messages[0].content[0].image_url", LIMITS)
