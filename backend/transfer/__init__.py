"""Embedding transfer through NIXL: a producer pool of leased, registered buffers and a consumer
that pulls with a NIXL READ. Roles: ``agent`` (creating NIXL agents), ``producer`` (pool + leases),
``consumer`` (pull + release notification, NIXL READ for any handle no same-host reader takes), ``transports`` (the
transport registry: one module per handle transport, ``nixl``, ``shared_memory``, ``cuda_ipc``, each with its producer
and consumer sides), ``region`` (a lease's region layout), ``same_host`` (the consumer's memfd mappings), ``cuda_ipc``
(CUDA IPC allocations and copies), ``announce`` (pools announced to consumers on this host). The handle format lives
in ``backend.protocol.handles``.
"""
