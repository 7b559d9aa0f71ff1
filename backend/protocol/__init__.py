"""The wire, declared once: what crosses a stage boundary, and the vocabulary every layer shares. No Triton import.

- ``generate``: the generate interface's tensors and request parameters (config.pbtxt, tensor I/O, stage requests,
  the client library all derive from it);
- ``layout``: the layout metadata of an encoded item (schema version, per-modality fields, typed transfer handles);
- ``errors``: the domain errors and their versioned envelope on the wire;
- ``stages``: the stage roles (``Stage``, each with its ``RoleSpec``) and the two disaggregations;
- ``modality``: the media modalities, each declared once (images today);
- ``settings``: each model kind's config.pbtxt parameters, typed, with their defaults (the renderer's too);
- ``versions``: the version guard of every patch of vLLM, torch and NIXL internals.
"""
