"""``prefill``: vLLM with NixlConnector as KV producer, fed metadata-only media like ``pd``.

The orchestrator sends it the request with ``max_tokens=1`` and ``kv_transfer_params``
``{"do_remote_decode": true}``; the final response carries the ``kv_transfer_params`` that ``decode``
needs to pull the KV through NIXL.
"""
from backend.triton.generate_model import MetadataOnlyModel


class TritonPythonModel(MetadataOnlyModel):
    TAKES_MEDIA = True  # P/D: an orchestrator that skips the encoders sends the client's media
    KV_ROLE = "kv_producer"
    # Finished requests keep the EngineCore stepping (a model-less step every ~1 ms) until decode has read
    # their KV; new requests and aborts still wake it at once, so the wait delays only freeing those blocks.
    IDLE_WAIT_MS = "10"
