import base64
import io
import json
import struct

from PIL import Image

from clients.perf_analyzer import make_inputs


def _elements(b64: str) -> list[bytes]:
    raw, out = base64.b64decode(b64), []
    while raw:
        (size,) = struct.unpack("<I", raw[:4])
        out.append(raw[4:4 + size])
        raw = raw[4 + size:]
    return out


def test_input_data_holds_real_images_in_triton_bytes_form():
    doc = make_inputs(entries=3, images=2, sizes=[(64, 48), (112, 112)], prompts=["a", "b"], max_tokens=5)
    assert len(doc["data"]) == 3
    first = doc["data"][0]
    assert first["text_input"] == {"content": ["a"], "shape": [1]} and doc["data"][1]["text_input"]["content"] == ["b"]
    assert json.loads(first["sampling_parameters"]["content"][0]) == {"temperature": 0.0, "max_tokens": 5, "ignore_eos": True}
    assert first["stream"]["content"] == [True] and first["image"]["shape"] == [2]
    images = [Image.open(io.BytesIO(e)) for e in _elements(first["image"]["b64"])]
    assert [im.size for im in images] == [(64, 48), (112, 112)]


def test_text_only_inputs_have_no_image_tensor():
    doc = make_inputs(entries=1, images=0, sizes=[(64, 48)], prompts=["a"], max_tokens=5)
    assert "image" not in doc["data"][0]
