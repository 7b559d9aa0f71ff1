"""Embedding transfer through NIXL: a producer pool of leased, registered buffers and a consumer
that pulls with a NIXL READ. Roles: ``agent`` (creating NIXL agents), ``producer`` (pool + leases),
``consumer`` (pull + release notification). The handle format lives in ``backend.protocol.layout``.
"""
