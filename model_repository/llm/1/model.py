"""``llm``: the single-engine baseline. One in-process vLLM AsyncLLM, given the raw media.

Adapter only (see DESIGN.md): read config once, convert tensors, map errors. The request contract is
``backend.request``; streaming and cancellation are ``backend.serving``.
"""
import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from backend.engine import EngineHost, load_engine_args
from backend.media import MediaLimits
from backend.request import DecodeMedia, RequestLimits, parse_generate_request
from backend.serving import stream_generation
from backend.triton_io import RequestMetrics, TritonSink, read_generate_inputs, send_error


def _parameter(config: dict, key: str, default: str) -> str:
    return config.get("parameters", {}).get(key, {}).get("string_value", default)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("the llm model must use the decoupled transaction policy")
        model_dir = Path(args["model_repository"])
        engine_args = load_engine_args(model_dir / _parameter(config, "engine_args", "model.json"))
        self.limits = RequestLimits(
            max_images=int(engine_args.get("limit_mm_per_prompt", {}).get("image", 8)),
            media=MediaLimits(
                max_image_pixels=int(_parameter(config, "max_image_pixels", "16000000")),
                max_item_bytes=int(_parameter(config, "max_item_bytes", str(32 << 20))),
                allowed_local_media_path=engine_args.get("allowed_local_media_path", ""),
            ),
        )
        self.media = DecodeMedia(self.limits.media)
        self.metrics = RequestMetrics(args["model_name"])
        self.host = EngineHost.start(engine_args)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = parse_generate_request(read_generate_inputs(request), self.media, self.limits)
            except Exception as exc:
                send_error(sender, exc)
                continue
            self.host.submit(stream_generation(self.host, parsed, TritonSink(sender), self.metrics))
        return None

    def finalize(self):
        self.host.shutdown()
        # Metric families must go while the stub's shared memory is alive (else a segfault at exit).
        del self.metrics
