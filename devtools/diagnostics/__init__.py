"""Diagnostics and experiments off the production path: the memory watcher inside an EngineCore (``memdebug``, a vLLM
plugin of its own) and the transfer harness's producer and consumer processes (``pool_process``)."""
