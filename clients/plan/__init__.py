"""Planning the E:P:D split for an SLO (issue 40; docs/planning.md): stage profiles measured against a running
deployment (``measure``), a discrete-event simulator of a topology under a workload (``simulate``, on SimPy), its check
against measured runs (``validate``), a planner that picks the replicas per stage and writes the
topology and its Kubernetes base (``planner``), and the at-scale comparison on paper (``scale``).

Here, under ``clients/``, because it is what an operator runs against a server and for a deployment (profiles are
measured with the benchmark client's requests, ``clients.bench.load``); it imports ``backend.deploy`` to read and write
topologies and Kubernetes bases, and nothing in the server imports it (import-linter).
"""
