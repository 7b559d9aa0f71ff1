"""An OpenAI-compatible HTTP endpoint in front of tritonserver: ``/v1/chat/completions`` (text, image, video parts;
streaming as Server-Sent Events), ``/v1/completions``, ``/v1/models``, ``/health``, ``/metrics``. Each request becomes
one generate request on tritonserver's gRPC streaming endpoint, to the model its ``model`` names (``llm``, ``epd``,
``epd_disagg``, ...); chat ``messages`` travel as they came (media bytes are not decoded or re-encoded here: the
models parse and validate them, and their errors come back as OpenAI error objects naming the field).

``translate``: OpenAI request bodies to the generate interface and responses back (no I/O); ``app``: the FastAPI
application; ``python -m frontend.openai``: the server (``make serve`` starts it beside tritonserver).
"""
