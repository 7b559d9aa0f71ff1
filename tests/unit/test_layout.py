import json
import time

import pytest

from backend.protocol.errors import InvalidInput
from backend.protocol.layout import SCHEMA_VERSION, LayoutMetadata, TransferHandle


def layout(**overrides) -> LayoutMetadata:
    handle = TransferHandle("enc-1", b"\x00meta\xff", b"descs", "00ab", 4 * 128 * 4, time.time() + 30)
    fields = dict(content_key="k1", modality="image", model="qwen2_vl:abc", dtype="float32", shape=(4, 128),
                  image_grid_thw=(1, 4, 4), handle=handle)
    return LayoutMetadata(**{**fields, **overrides})


def test_round_trip_is_plain_json_with_numeric_arrays():
    original = layout()
    text = original.to_json()
    doc = json.loads(text)
    assert doc["version"] == SCHEMA_VERSION and doc["shape"] == [4, 128] and doc["image_grid_thw"] == [1, 4, 4]
    assert LayoutMetadata.from_json(text, "image_layouts[0]", expected_model="qwen2_vl:abc") == original


@pytest.mark.parametrize("mutate, field, fragment", [
    (lambda d: d.update(version=2), "image_layouts[0].version", "unsupported layout schema version 2"),
    (lambda d: d.update(model="other:1"), "image_layouts[0].model", "this consumer serves"),
    (lambda d: d.update(dtype="int8"), "image_layouts[0].dtype", "unsupported dtype"),
    (lambda d: d.update(shape=[4]), "image_layouts[0].shape", "tokens, hidden"),
    (lambda d: d.update(image_grid_thw=[1, 0, 4]), "image_layouts[0].image_grid_thw", "positive"),
    (lambda d: d["handle"].update(nbytes=3), "image_layouts[0].handle.nbytes", "does not match"),
    (lambda d: d["handle"].pop("lease_id"), "image_layouts[0].handle", "malformed transfer handle"),
    (lambda d: d.pop("content_key"), "image_layouts[0]", "malformed layout"),
])
def test_consumer_refuses_what_it_does_not_understand(mutate, field, fragment):
    doc = json.loads(layout().to_json())
    mutate(doc)
    with pytest.raises(InvalidInput) as info:
        LayoutMetadata.from_json(json.dumps(doc), "image_layouts[0]", expected_model="qwen2_vl:abc")
    assert info.value.field == field and fragment in str(info.value)


def test_not_json():
    with pytest.raises(InvalidInput, match="not valid JSON"):
        LayoutMetadata.from_json("{", "image_layouts[0]")
