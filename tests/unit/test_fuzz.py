"""Fuzz (hypothesis, derandomized so CI runs the same cases) over what parses untrusted input: the request
parser, the sampling parameters and the layout metadata schema. Whatever comes in, the answer is a parsed
value or InvalidInput naming a field, never another exception (which a model would report as INTERNAL)."""
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.protocol.errors import InvalidInput
from backend.protocol.layout import LayoutMetadata
from backend.request.media import MediaLimits
from backend.request.generate import EncodedMedia, LayoutMedia, RawGenerateInputs, RequestLimits, parse_generate_request
from backend.request.sampling import parse_sampling
from tests.unit.test_layout import layout

FUZZ = settings(max_examples=400, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODEL = "qwen2_vl:abc"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12)
message_parts = st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "image_url", "video", 3, None])},
                                      optional={"text": json_values, "image_url": json_values | st.fixed_dictionaries(
                                          {"url": st.sampled_from(["data:image/png;base64,AAAA", "file:///etc/passwd",
                                                                   "http://example.com/a.png", "data:,x", ""])})})
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", 7]),
                                           "content": st.text(max_size=20) | st.lists(message_parts, max_size=3) | json_values}),
                    max_size=3)
sampling_docs = st.dictionaries(st.sampled_from(["temperature", "top_p", "top_k", "max_tokens", "seed", "stop",
                                                 "ignore_eos", "n", "stop_token_ids", "bogus", "min_tokens"]),
                                json_values, max_size=5)


def _json_or_text(values):
    return st.one_of(values.map(json.dumps), st.text(max_size=40), st.none())


def _parses_or_names_a_field(call):
    try:
        call()
    except InvalidInput as exc:
        assert exc.field and str(exc)


@FUZZ
@given(text=st.none() | st.text(max_size=40), msgs=_json_or_text(messages),
       images=st.lists(st.binary(max_size=64), max_size=5), sampling=_json_or_text(sampling_docs),
       kv=_json_or_text(json_values), stream=st.booleans())
def test_request_parser_with_media(text, msgs, images, sampling, kv, stream):
    raw = RawGenerateInputs(prompt=text, messages=msgs, images=tuple(images), sampling=sampling,
                            kv_transfer_params=kv, stream=stream)
    resolver = EncodedMedia(MediaLimits(max_item_bytes=48, allowed_local_media_path=""))
    _parses_or_names_a_field(lambda: parse_generate_request(raw, resolver, RequestLimits(max_images=4)))


@FUZZ
@given(text=st.none() | st.text(max_size=40), layouts=st.lists(_json_or_text(json_values).map(lambda v: v or ""), max_size=3))
def test_request_parser_with_layouts(text, layouts):
    raw = RawGenerateInputs(prompt=text, image_layouts=tuple(layouts))
    _parses_or_names_a_field(lambda: parse_generate_request(raw, LayoutMedia(MODEL), RequestLimits(max_images=4)))


@FUZZ
@given(doc=_json_or_text(sampling_docs))
def test_sampling_parameters(doc):
    _parses_or_names_a_field(lambda: parse_sampling(doc))


@FUZZ
@given(path=st.lists(st.sampled_from(["content_key", "modality", "model", "dtype", "shape", "image", "grid_thw",
                                      "handle", "version", "transport", "agent_name", "agent_metadata", "descriptors",
                                      "lease_id", "nbytes", "expires_at", "host", "pid", "shm_path", "offset",
                                      "ipc_handle", "pool_bytes", "tag_table", "tag_slot"]), min_size=1, max_size=2),
       value=json_values | st.sampled_from(["nixl", "shared_memory", "cuda_ipc", "image"]), drop=st.booleans(),
       transport=st.sampled_from(["nixl", "shared_memory", "cuda_ipc"]))
def test_layout_schema_mutations(path, value, drop, transport):
    doc = json.loads(layout(transport).to_json())
    target = doc
    for key in path[:-1]:
        target = target.get(key) if isinstance(target.get(key), dict) else target
    if drop:
        target.pop(path[-1], None)
    else:
        target[path[-1]] = value
    _parses_or_names_a_field(lambda: LayoutMetadata.from_json(json.dumps(doc), "image_layouts[0]", expected_model=MODEL))
