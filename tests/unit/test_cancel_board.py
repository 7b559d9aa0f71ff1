"""orchestrator.cancel_board: in-band cancels, within one instance and across the instances of a model."""
import asyncio
import os
import time

import pytest

from orchestrator.cancel_board import CancelBoard


def test_a_cancel_reaches_a_request_running_here_without_touching_the_board(tmp_path):
    board = CancelBoard(tmp_path / "board")
    check = board.watch("a")
    other = board.watch("b")
    assert not check() and not other()
    assert board.cancel("a") == "here"
    assert check() and not other()
    assert not (tmp_path / "board").exists()


def test_a_cancel_for_a_sibling_instance_goes_through_the_shared_board(tmp_path):
    holder, receiver = CancelBoard(tmp_path / "board"), CancelBoard(tmp_path / "board")
    check = holder.watch("req-1")
    assert receiver.cancel("req-1") == "shared"
    assert check()
    holder.finish("req-1")  # the holder removes the claimed cancel
    assert os.listdir(tmp_path / "board") == []


def test_a_cancel_that_arrives_before_its_request_still_cancels_it(tmp_path):
    board = CancelBoard(tmp_path / "board")
    assert board.cancel("early") == "shared"
    assert board.watch("early")()


def test_a_cancel_after_the_request_finished_here_is_dropped(tmp_path):
    board = CancelBoard(tmp_path / "board")
    board.watch("done")
    board.finish("done")
    assert board.cancel("done") == "finished"
    assert not (tmp_path / "board").exists()


def test_hostile_ids_cannot_name_paths_outside_the_board(tmp_path):
    board = CancelBoard(tmp_path / "board")
    for rid in ("../../etc/passwd", "/abs", "x" * 5000, "\x00"):
        assert board.cancel(rid) == "shared"
    names = os.listdir(tmp_path / "board")
    assert len(names) == 4 and all(len(n) == 32 and n.isalnum() for n in names)
    assert sorted(os.listdir(tmp_path)) == ["board"]


def test_unclaimed_cancels_are_swept_and_close_removes_the_board(tmp_path, monkeypatch):
    board = CancelBoard(tmp_path / "board")
    board.cancel("orphan")
    path = next((tmp_path / "board").iterdir())
    old = time.time() - 2 * CancelBoard.STALE_SECONDS
    os.utime(path, (old, old))
    monkeypatch.setattr(board, "_swept", time.monotonic() - 2 * CancelBoard.STALE_SECONDS)
    board.cancel("fresh")  # a write sweeps what is stale
    assert len(os.listdir(tmp_path / "board")) == 1
    board.close()
    assert not (tmp_path / "board").exists()


def test_tracking_finishes_the_request_however_it_ends(tmp_path):
    board = CancelBoard(tmp_path / "board")

    async def fails():
        raise RuntimeError("boom")

    board.watch("r")
    with pytest.raises(RuntimeError):
        asyncio.run(board.tracking("r", fails()))
    assert board.cancel("r") == "finished"
