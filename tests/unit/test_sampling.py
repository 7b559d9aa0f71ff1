import json

import pytest

from backend.protocol.errors import ErrorCode, InvalidInput
from backend.request.sampling import parse_sampling


def test_valid_parameters_are_typed():
    out = parse_sampling('{"temperature": "0.5", "max_tokens": "16", "top_p": 0.9, "seed": 3,'
                                    ' "ignore_eos": "true", "stop": "x", "stop_token_ids": [2]}')
    assert out == {"temperature": 0.5, "max_tokens": 16, "top_p": 0.9, "seed": 3, "ignore_eos": True,
                   "stop": ["x"], "stop_token_ids": [2]}


@pytest.mark.parametrize("value, count", [(0, 0), (3, 3), ("5", 5), (-1, -1), (20, 20), (100, 100)])
def test_logprobs_are_a_count_of_top_tokens_or_minus_one(value, count):
    """vLLM's range: >= 0 or -1 (the whole vocabulary); the engine's max_logprobs bounds it above (it answers more
    with INVALID_ARG naming the key: tests/e2e/test_openai.py)."""
    assert parse_sampling(json.dumps({"logprobs": value})) == {"logprobs": count}


@pytest.mark.parametrize("text", [None, "", "   "])
def test_absent_parameters_mean_engine_defaults(text):
    assert parse_sampling(text) == {}


@pytest.mark.parametrize("text, field, fragment", [
    ('{"max_tokens": -1}', "sampling_parameters.max_tokens", ">= 1"),
    ('{"max_tokens": 0}', "sampling_parameters.max_tokens", ">= 1"),
    ('{"max_tokens": 2.5}', "sampling_parameters.max_tokens", "integer"),
    ('{"max_tokens": true}', "sampling_parameters.max_tokens", "number"),
    ('{"temperature": -0.1}', "sampling_parameters.temperature", ">= 0"),
    ('{"temperature": "hot"}', "sampling_parameters.temperature", "number"),
    ('{"temperature": NaN}', "sampling_parameters.temperature", "finite"),
    ('{"top_p": 0}', "sampling_parameters.top_p", "> 0"),
    ('{"top_p": 1.5}', "sampling_parameters.top_p", "<= 1"),
    ('{"ignore_eos": 1}', "sampling_parameters.ignore_eos", "true or false"),
    ('{"stop": [1]}', "sampling_parameters.stop", "string"),
    ('{"max_tokens": 4, "min_tokens": 5}', "sampling_parameters.min_tokens", "max_tokens"),
    ('{"best_of": 2}', "sampling_parameters.best_of", "unknown parameter"),
    ('{"logprobs": -2}', "sampling_parameters.logprobs", "-1 (all)"),
    ('{"logprobs": 1.5}', "sampling_parameters.logprobs", "integer"),
    ('{"logprobs": true}', "sampling_parameters.logprobs", "number"),
    ('{"max_tokens": 16', "sampling_parameters", "not valid JSON"),
    ('[1, 2]', "sampling_parameters", "JSON object"),
])
def test_bad_parameters_name_the_field(text, field, fragment):
    with pytest.raises(InvalidInput) as info:
        parse_sampling(text)
    assert info.value.field == field
    assert fragment in str(info.value)
    assert info.value.code is ErrorCode.INVALID_ARG


def test_structured_outputs_take_one_constraint_as_vllm_names_it():
    schema = {"type": "object"}
    assert parse_sampling(json.dumps({"structured_outputs": {"json": schema}})) == {"structured_outputs": {"json": schema}}
    assert parse_sampling(json.dumps({"structured_outputs": {"json_object": True}}))["structured_outputs"] == {
        "json_object": True}
    for bad, field in (({"json": schema, "regex": "a"}, "structured_outputs"), ({"xml": 1}, "structured_outputs"),
                       ({"json_object": False}, "structured_outputs.json_object"), ({"json": 3}, "structured_outputs.json"),
                       ({"choice": []}, "structured_outputs.choice"), ({"regex": ""}, "structured_outputs.regex")):
        with pytest.raises(InvalidInput) as info:
            parse_sampling(json.dumps({"structured_outputs": bad}))
        assert info.value.field == f"sampling_parameters.{field}", bad
