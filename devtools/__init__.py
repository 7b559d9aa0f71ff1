"""The developers' own tools, not the server's and not the client library's: the tiny random-weight checkpoints the
tests and CI serve (``devtools.tiny``) and diagnostics for investigations (``devtools.diagnostics``). Nothing in the
server (``backend/``, ``orchestrator/``, ``model_repository/``) imports this package (pyproject.toml's import contracts)."""
