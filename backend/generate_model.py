"""The Triton adapter shared by the vLLM-hosting models (``llm``, ``pd``): read config once, host the
engine, convert tensors, hand each parsed request to ``backend.serving``. Each ``model.py`` subclasses
``GenerateModel`` and names what differs (how media are resolved, what runs before generation).

Imported by ``model.py`` files only (it imports ``triton_io``, hence ``pb_utils``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import triton_python_backend_utils as pb_utils

from backend.engine import EngineHost, load_engine_args
from backend.media import MediaLimits, decode_counter
from backend.request import GenerateRequest, MediaResolver, RequestLimits, parse_generate_request
from backend.serving import stream_generation
from backend.triton_io import (ABORT_PARAMETER, ERROR_CODES_PARAMETER, STAGE_REQUEST_ID_PARAMETER, RequestMetrics,
                               TritonSink, read_generate_inputs, request_parameters, send_error)


def parameter(config: dict, key: str, default: str) -> str:
    return config.get("parameters", {}).get(key, {}).get("string_value", default)


class GenerateModel:
    """Subclasses implement ``make_resolver`` and may override ``prepare`` (runs on the engine loop
    before generation; its errors fail that request only) and ``extra_engine_args``."""

    def initialize(self, args: dict[str, Any]) -> None:
        self.config = json.loads(args["model_config"])
        self.name = args["model_name"]
        if not pb_utils.using_decoupled_model_transaction_policy(self.config):
            raise pb_utils.TritonModelException(f"{self.name} must use the decoupled transaction policy")
        model_dir = Path(args["model_repository"])
        self.engine_args = {**load_engine_args(model_dir / parameter(self.config, "engine_args", "model.json")),
                            **self.extra_engine_args()}
        self.limits = RequestLimits(
            max_images=int(self.engine_args.get("limit_mm_per_prompt", {}).get("image", 8)),
            media=MediaLimits(
                max_image_pixels=int(parameter(self.config, "max_image_pixels", "16000000")),
                max_item_bytes=int(parameter(self.config, "max_item_bytes", str(32 << 20))),
                allowed_local_media_path=self.engine_args.get("allowed_local_media_path", ""),
            ),
        )
        self.resolver = self.make_resolver()
        self.metrics = RequestMetrics(self.name)
        self.host = EngineHost.start(self.engine_args)

    def make_resolver(self) -> MediaResolver:
        raise NotImplementedError

    def extra_engine_args(self) -> dict[str, Any]:
        return {}

    async def prepare(self, request: GenerateRequest) -> GenerateRequest:
        return request

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            params = request_parameters(request)
            tag = bool(params.get(ERROR_CODES_PARAMETER))
            if params.get(ABORT_PARAMETER):  # an orchestrator's client went away: stop that request
                self.host.submit(self.host.abort(str(params[ABORT_PARAMETER])))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            try:
                parsed = parse_generate_request(read_generate_inputs(request), self.resolver, self.limits)
            except Exception as exc:
                send_error(sender, exc, tag)
                continue
            finally:
                self.metrics.media_decodes(decode_counter.count)
            request_id = params.get(STAGE_REQUEST_ID_PARAMETER)
            self.host.submit(stream_generation(self.host, parsed, TritonSink(sender, tag), self.metrics,
                                               request_id=str(request_id) if request_id else None, prepare=self.prepare))
        return None

    def finalize(self) -> None:
        self.host.shutdown()
        # Metric families must go while the stub's shared memory is alive (else a segfault at exit).
        del self.metrics
