"""``prefill``: vLLM with NixlConnector as KV producer, fed metadata-only media like ``pd``.

The orchestrator sends it the request with ``max_tokens=1`` and ``kv_transfer_params``
``{"do_remote_decode": true}``; the final response carries the ``kv_transfer_params`` that ``decode``
needs to pull the KV through NIXL. P/D: an orchestrator that skips the encoders sends the client's media;
the EngineCore's idle wait defaults to the role's (``backend.protocol.stages``).
"""
from backend.protocol.settings import PrefillSettings
from backend.protocol.stages import Stage
from backend.triton.counter_batch import after_load
from backend.triton.generate_model import MetadataOnlyModel


@after_load
class TritonPythonModel(MetadataOnlyModel):
    ROLE = Stage.PREFILL
    SETTINGS = PrefillSettings
