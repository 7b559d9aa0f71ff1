"""clients.bench.crossover's pure parts: the grid, the ratios, the tables and heat map, a run that goes on from an
earlier one's rows (only with the same settings)."""
import json
import math

import pytest

from clients.bench import crossover


def row(deployment, images, tokens, req_per_s, ttft_p90):
    return {"deployment": deployment, "images": images, "max_tokens": tokens, "req_per_s": req_per_s,
            "ttft_p50_ms": ttft_p90 / 2, "ttft_p90_ms": ttft_p90, "tpot_p50_ms": 5.0, "errors": 0,
            "gpu_busy_pct": [80.0]}


ROWS = [row("llm", 0, 16, 10.0, 100.0), row("epd", 0, 16, 8.0, 150.0),
        row("llm", 4, 16, 4.0, 2000.0), row("epd", 4, 16, 6.0, 1000.0), row("llm", 4, 128, 3.0, 0.0)]


def test_the_grid_is_images_major_in_the_order_given():
    assert crossover.cells([4, 0], [16, 128]) == [(4, 16), (4, 128), (0, 16), (0, 128)]


def test_ratios_are_epd_over_llm_and_missing_where_a_side_is_missing_or_zero():
    assert crossover.ratio(ROWS, 0, 16, "req_per_s") == 0.8
    assert crossover.ratio(ROWS, 4, 16, "ttft_p90_ms") == 0.5
    assert crossover.ratio(ROWS, 4, 128, "req_per_s") is None  # no epd row
    assert crossover.ratio([row("llm", 1, 16, 1.0, 0.0), row("epd", 1, 16, 1.0, 5.0)], 1, 16, "ttft_p90_ms") is None
    assert crossover.ratio([row("llm", 1, 16, math.nan, 1.0), row("epd", 1, 16, 1.0, 5.0)], 1, 16, "req_per_s") is None


def test_the_table_holds_every_row_and_both_ratio_grids(tmp_path):
    text = crossover.table(ROWS, [0, 4], [16, 128])
    assert text.count("| llm |") == 3 and text.count("| epd |") == 2
    assert "| 0 | 0.80 | - |" in text and "| 4 | 1.50 | - |" in text  # requests/s
    assert "| 0 | 1.50 | - |" in text and "| 4 | 0.50 | - |" in text  # TTFT p90
    crossover.heat_map(ROWS, [0, 4], [16, 128], tmp_path / "map.png", "test")
    assert (tmp_path / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_goes_on_from_an_earlier_one_with_the_same_settings_only(tmp_path):
    args = crossover.parse_args(["--images", "0,4", "--max-tokens", "16,128", "--out", str(tmp_path)])
    crossover.write(args, ROWS)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"] == ROWS and (tmp_path / "crossover.md").exists() and (tmp_path / "crossover.png").exists()
    rows = crossover.done_rows(tmp_path / "results.json", crossover.settings(args))
    run = crossover.Crossover(args, rows)
    assert [cell for _, cell in run.todo()] == [(0, 128), (4, 128)]  # (4, 128) has llm's row only: run again whole
    assert len(run.rows) == 4 and all(r["max_tokens"] == 16 for r in run.rows)  # its lone row dropped
    other = crossover.parse_args(["--requests", "8", "--out", str(tmp_path)])
    assert crossover.done_rows(tmp_path / "results.json", crossover.settings(other)) == []
    smaller_kv = crossover.parse_args(["--images", "0,4", "--max-tokens", "16,128", "--kv-cache-gib", "8",
                                       "--out", str(tmp_path)])
    assert crossover.done_rows(tmp_path / "results.json", crossover.settings(smaller_kv)) == []
    crossover.write(smaller_kv, ROWS)
    assert "KV budget per engine (GiB) 8.0" in (tmp_path / "crossover.md").read_text()


def test_options_that_shape_a_server_started_here_are_refused_with_url(capsys):
    assert crossover.parse_args(["--url", "127.0.0.1:8001"]).url == "127.0.0.1:8001"
    for given in (["--checkpoint", "/tmp/ckpt"], ["--compile"], ["--machine", "gpu"], ["--image-preprocess", "gpu"],
                  ["--kv-cache-gib", "8"]):
        with pytest.raises(SystemExit):
            crossover.parse_args(["--url", "127.0.0.1:8001", *given])
        assert f"{given[0]}: shape the server started here" in capsys.readouterr().err
