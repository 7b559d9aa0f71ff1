"""Each model kind's config.pbtxt parameters (backend.protocol.settings): what the renderer writes parses into the
kind's settings, a misspelled or ill-typed parameter fails the load naming it, and the defaults are the renderer's."""
from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from backend.deploy import server_address
from backend.deploy.render import render_files
from backend.deploy.schema import LIMIT_DEFAULTS, ModelKind, TRANSFER_DEFAULTS
from backend.deploy.topology import load
from backend.protocol.settings import (LOCAL, ColocatedSettings, ConfigError, EncoderSettings, EngineSettings, LlmSettings,
                                       PdSettings, PrefillSettings,
                                       KvEngineSettings, ProxySettings, parameter_fields, parse_settings)
from backend.protocol.stages import Disaggregation, Stage

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGIES = ["default", "cpu-e-pd-colocated", "cpu-e-p-d-colocated", "cpu-e-p-d-one-process", "cpu-e-pd", "cpu-e-p-d", "cpu-e-pd-tier"]
_PARAMETER = re.compile(r'^parameters \{ key: "([^"]*)" value: \{ string_value: "([^"]*)" \} \}$', re.M)


def triton_config(pbtxt: str) -> dict:
    """The ``parameters`` of a rendered config.pbtxt in the JSON form Triton hands a Python model."""
    return {"parameters": {key: {"string_value": value} for key, value in _PARAMETER.findall(pbtxt)}}


def rendered(name: str, tmp_path: Path) -> list[tuple[str, ModelKind, dict]]:
    topology = load(ROOT / "topologies" / f"{name}.yaml", "cpu")
    files = render_files(topology, tmp_path / name)
    return [(model, kind, triton_config(files[f"{model}/config.pbtxt"])) for model, kind in topology.models().items()]


def as_written(value) -> str:
    """A setting as config.pbtxt spells it."""
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, Disaggregation):
        return value.value
    return "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_every_rendered_config_parses_into_its_kind_s_settings(name, tmp_path):
    for model, kind, config in rendered(name, tmp_path):
        settings = parse_settings(kind.settings, model, config)
        assert config["parameters"], model
        for key, entry in config["parameters"].items():  # each written parameter is read as written
            value, text = getattr(settings, parameter_fields(kind.settings)[key]), entry["string_value"]
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert value == float(text), (model, key)
            else:
                assert as_written(value) == text, (model, key)


def test_the_kinds_read_the_settings_of_their_role():
    assert {kind: kind.settings for kind in ModelKind} == {
        ModelKind.LLM: LlmSettings, ModelKind.PD: PdSettings, ModelKind.PREFILL: PrefillSettings,
        ModelKind.DECODE: KvEngineSettings, ModelKind.ENCODER: EncoderSettings, ModelKind.EPD: ProxySettings,
        ModelKind.EPD_DISAGG: ProxySettings, ModelKind.COLOCATED: ColocatedSettings,
        ModelKind.COLOCATED_PREFILL: ColocatedSettings}


def test_rendered_values_reach_the_settings_typed(tmp_path):
    models = {model: parse_settings(kind.settings, model, config) for model, kind, config in rendered("default", tmp_path)}
    assert models["encoder"].pool_bytes == 64 << 20 and models["encoder"].lease_seconds == 30.0
    assert models["epd"].disaggregation is Disaggregation.E_PD and models["epd_disagg"].disaggregation is Disaggregation.E_P_D
    assert models["epd"].max_images == 4 and models["epd"].request_timeout_seconds == 300.0
    assert models["prefill"].nixl_side_channel_port is None and models["decode"].nixl_poll_delay_us == 5000
    colocated = dict((m, parse_settings(k.settings, m, c)) for m, k, c in rendered("cpu-e-p-d-colocated", tmp_path))
    assert colocated["epd"].disaggregation is Disaggregation.E_P_D and colocated["epd"].targets() == {Stage.DECODE: ("decode", LOCAL)}
    # the field is disaggregation; its config.pbtxt parameter keeps the name model repositories already use
    assert parameter_fields(ProxySettings)["topology"] == "disaggregation" and "disaggregation" not in parameter_fields(ProxySettings)


def test_an_unknown_parameter_fails_naming_it():
    config = {"parameters": {"engine_args": {"string_value": "model.json"}, "stream_interval_msx": {"string_value": "5"}}}
    with pytest.raises(ConfigError, match=r"^pd: unknown parameter 'stream_interval_msx' in config.pbtxt \(known: "
                                          r"engine_args, engine_nice, max_audio_seconds, max_image_pixels, max_item_bytes, max_video_frames, "
                                          r"max_video_seconds, priority_levels, "
                                          r"stream_interval_ms\)$"):
        parse_settings(EngineSettings, "pd", config)
    with pytest.raises(ConfigError, match="encoder: unknown parameter 'nixl_poll_delay_us'"):  # not the encoder's
        parse_settings(EncoderSettings, "encoder", {"parameters": {"nixl_poll_delay_us": {"string_value": "5000"}}})


@pytest.mark.parametrize("cls, key, value, expected", [
    (ProxySettings, "metadata_only", "yes", "expected true or false, got 'yes'"),
    (ProxySettings, "metadata_only", "True", "expected true or false, got 'True'"),
    (EncoderSettings, "encoder_compile", "1", "expected true or false, got '1'"),
    (EncoderSettings, "pool_bytes", "64MB", "expected an integer, got '64MB'"),
    (KvEngineSettings, "nixl_side_channel_port", "x", "expected an integer, got 'x'"),
    (ProxySettings, "request_timeout_seconds", "soon", "expected a number, got 'soon'"),
    (ColocatedSettings, "topology", "EPD", "expected one of E\\+PD, E/P/D, got 'EPD'"),
])
def test_an_ill_typed_parameter_fails_naming_it(cls, key, value, expected):
    with pytest.raises(ConfigError, match=f"^epd: parameter '{key}' in config.pbtxt: {expected}$"):
        parse_settings(cls, "epd", {"parameters": {key: {"string_value": value}}})


def test_values_convert_one_way():
    def parse(cls, **values):
        return parse_settings(cls, "m", {"parameters": {k: {"string_value": v} for k, v in values.items()}})

    assert parse(ProxySettings, allowed_media_domains=" a.com, B.org,,").allowed_media_domains == ("a.com", "B.org")
    assert parse(ProxySettings, allowed_media_domains="").allowed_media_domains == ()
    assert parse(ProxySettings, metadata_only="false").metadata_only is False
    assert parse(KvEngineSettings, nixl_side_channel_port="", engine_idle_wait_ms="").nixl_side_channel_port is None
    assert parse(KvEngineSettings, nixl_side_channel_port="5600").nixl_side_channel_port == 5600
    assert parse(KvEngineSettings, engine_idle_wait_ms="2.5").engine_idle_wait_ms == 2.5
    assert parse(EngineSettings) == EngineSettings()  # no parameters: the declared defaults


def test_defaults_are_the_renderer_s():
    assert TRANSFER_DEFAULTS == {"pool_bytes": EncoderSettings.pool_bytes, "lease_seconds": EncoderSettings.lease_seconds,
                                 "alloc_timeout_seconds": EncoderSettings.alloc_timeout_seconds,
                                 "nixl_poll_delay_us": KvEngineSettings.nixl_poll_delay_us,
                                 "kv_lease_seconds": KvEngineSettings.kv_lease_seconds}
    assert LIMIT_DEFAULTS == {"max_images": ProxySettings.max_images, "max_image_pixels": EngineSettings.max_image_pixels,
                              "max_item_bytes": EncoderSettings.max_item_bytes, "max_videos": ProxySettings.max_videos,
                              "max_video_frames": EngineSettings.max_video_frames,
                              "max_video_seconds": EncoderSettings.max_video_seconds,
                              "max_audios": ProxySettings.max_audios, "max_audio_seconds": EngineSettings.max_audio_seconds,
                              "request_timeout_seconds": ColocatedSettings.request_timeout_seconds}
    assert LOCAL == server_address.LOCAL
    # a topology that leaves transfer and limits out renders the defaults the models would take anyway
    for model, kind, config in rendered("cpu-e-pd-colocated", Path("/r")) + rendered("cpu-e-p-d", Path("/r")):
        settings, default = parse_settings(kind.settings, model, config), kind.settings()
        for field in fields(kind.settings):
            if field.name in {**TRANSFER_DEFAULTS, **LIMIT_DEFAULTS} and field.name in config["parameters"]:
                assert getattr(settings, field.name) == getattr(default, field.name), (model, field.name)
