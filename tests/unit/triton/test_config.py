"""``backend.triton.config``: a model's ``config.pbtxt`` (Triton's JSON form, as ``initialize`` gets it) read once."""
import json

import pytest

from backend.protocol.settings import LlmSettings, ProxySettings
from backend.triton.config import in_process_endpoint, instance_count, load_settings


def args(parameters: dict, name: str = "llm") -> dict:
    config = {"parameters": {key: {"string_value": value} for key, value in parameters.items()}}
    return {"model_name": name, "model_config": json.dumps(config)}


def test_settings_are_parsed_once_typed(pb):
    settings = load_settings(LlmSettings, args({"stream_interval_ms": "5", "max_video_frames": "2"}))
    assert settings.stream_interval_ms == 5.0 and settings.max_video_frames == 2
    assert load_settings(ProxySettings, args({}, "epd")).generator_model == "pd"  # none given: the defaults


@pytest.mark.parametrize("parameters, named", [({"stream_interval_msx": "5"}, "'stream_interval_msx'"),
                                               ({"max_video_frames": "many"}, "'max_video_frames'")])
def test_a_bad_parameter_fails_the_load_naming_model_and_parameter(pb, parameters, named):
    with pytest.raises(pb.TritonModelException) as caught:
        load_settings(LlmSettings, args(parameters))
    assert str(caught.value).startswith("llm: ") and named in str(caught.value)


@pytest.mark.parametrize("groups, count", [(None, 1), ([], 1), ([{"kind": "KIND_CPU"}], 1),
                                           ([{"count": 2}, {"count": 3, "kind": "KIND_GPU"}], 5),
                                           ([{"kind": "KIND_CPU"}, {"count": 2}], 3)])
def test_instance_count_sums_the_instance_groups(groups, count):
    assert instance_count({} if groups is None else {"instance_group": groups}) == count


def test_the_in_process_endpoint_is_found_by_its_entry_point_not_imported(pb):
    from frontend.openai.in_process import serve_for

    assert in_process_endpoint("openai") is serve_for  # the project's pyproject registers it (pip install -e .)
    with pytest.raises(pb.TritonModelException, match="no in-process endpoint 'grpc-web' is installed"):
        in_process_endpoint("grpc-web")
