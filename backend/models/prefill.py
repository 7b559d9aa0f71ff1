"""``prefill``: vLLM with NixlConnector as KV producer, fed metadata-only media like ``pd``.

The orchestrator sends it the request with ``max_tokens=1`` and ``kv_transfer_params``
``{"do_remote_decode": true}``; the final response carries the ``kv_transfer_params`` that ``decode``
needs to pull the KV through NIXL.
"""
from backend.generate_model import MetadataOnlyModel


class TritonPythonModel(MetadataOnlyModel):
    KV_ROLE = "kv_producer"
