"""Embedding transfer through NIXL: a producer pool of leased, registered buffers and a consumer
that pulls with a NIXL READ. Roles: ``agent`` (creating NIXL agents), ``producer`` (pool + leases),
``consumer`` (pull + release notification), ``same_host`` (the consumer's shared-memory and CUDA IPC readers),
``cuda_ipc`` (CUDA IPC allocations and copies), ``announce`` (pools announced to consumers on this host). The handle
format lives in ``backend.protocol.layout``.
"""
