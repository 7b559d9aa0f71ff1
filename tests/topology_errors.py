"""Topology texts that must be refused at load, each with the message that names what is wrong."""
from __future__ import annotations

import pytest


def assert_refused(tmp_path, variants, **load_args) -> None:
    """Each ``(text, message)`` of ``variants``, written to a file and loaded (``backend.deploy.topology.load`` with
    ``load_args``), raises ``TopologyError`` matching ``message``."""
    from backend.deploy.schema import TopologyError
    from backend.deploy.topology import load

    for text, message in variants:
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(TopologyError, match=message):
            load(path, **load_args)
