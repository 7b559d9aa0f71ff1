import base64
import io
import json
import struct

from PIL import Image

from backend.protocol.generate import GenerateInputs
from clients.bench.perf_analyzer import export_samples, input_entry, make_inputs
from clients.bench.report import Sample


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


def test_an_entry_carries_every_input_of_a_request():
    values = GenerateInputs(prompt="p", images=[b"one", b"three"], sampling={"max_tokens": 3}).as_values()
    entry = input_entry(values)
    assert set(entry) == set(values)
    assert _elements(entry["image"]["b64"]) == [b"one", b"three"] and entry["image"]["shape"] == [2]
    assert entry["text_input"] == {"content": ["p"], "shape": [1]}
    assert entry["stream"] == {"content": [values["stream"]], "shape": [1]}
    assert json.loads(entry["sampling_parameters"]["content"][0]) == {"max_tokens": 3}


def _request(sent, times, texts, finish="length", **last):
    outputs = [{"text_output": t, "finish_reason": ""} for t in texts]
    if outputs:
        outputs[-1].update(finish_reason=finish, **last)
    return {"timestamp": sent, "response_timestamps": times, "response_outputs": outputs}


def test_export_samples_time_the_first_text_and_the_final_response():
    ms = 1_000_000
    requests = [
        _request(0, [5 * ms, 9 * ms, 20 * ms], ["", "a", ""], num_output_tokens=3, timings='{"encode": 1.5}'),
        _request(0, [4 * ms, 30 * ms], ["b", ""], num_output_tokens=4_000_000_000),  # a misread count
        _request(0, [4 * ms], ["c"], finish=""),  # no final response: not a sample
    ]
    samples = export_samples(requests, max_tokens=16)
    assert samples == [Sample(0.009, 0.020, 3, {"encode": 1.5}, 3), Sample(0.004, 0.030, 16, {}, 2)]
