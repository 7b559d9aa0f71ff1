"""The reuse benchmark's (``clients.bench.reuse``) pure parts: its arguments, the deployments it renders, the check of
answers against the baseline's, the agent's turns, and the one table (a full run starts two servers: minutes, so its
smallest configuration is not run here; docs/benchmarks.md has the command and a run's table)."""
from __future__ import annotations

import pytest

from clients.bench.reuse import deployments, parse_args, set_parameter, topology_for
from clients.bench.report import Sample
from clients.bench.reuse_agent import OFF, ON, conversations, summary
from clients.bench.reuse_parts import Checker, moved, phase_summary
from clients.bench.reuse_table import change, markdown


def test_every_part_by_default_and_the_deployments_they_need():
    args = parse_args([])
    assert args.parts == ["reassignment", "cold", "agent", "lookup", "cost"] and args.pauses == [0.0, 5.0, 30.0]
    assert (args.requests, args.images, args.cold, args.turns) == (128, 4, 16, 10)
    assert deployments(args) == ["caches", "tier"]
    assert deployments(parse_args(["--parts", "agent"])) == ["caches"]
    assert deployments(parse_args(["--parts", "cost"])) == ["tier"]


@pytest.mark.parametrize("argv, message", [
    (["--parts", "reassignment,bogus"], "--parts"), (["--images", "8"], "--images"), (["--requests", "0"], "--requests"),
    (["--pauses", "0,-5"], "--pauses"), (["--pauses", "soon"], "could not convert"),
    (["--image-sizes", "224"], "--image-sizes"), (["--screenshot-size", "10x10"], "--screenshot-size")])
def test_bad_arguments_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_the_caches_deployment_is_the_topology_without_its_tier_with_room_for_the_agent():
    args = parse_args(["--turns", "9"])
    caches, tier = topology_for(args, "caches"), topology_for(args, "tier")
    assert caches.tier == {} and tier.tier["bytes"] == 268435456
    assert caches.stages == tier.stages and caches.limits["max_images"] == tier.limits["max_images"] == 9
    assert caches.checkpoint == tier.checkpoint and caches.checkpoint.is_absolute()


def test_a_parameter_the_topology_has_no_key_for_goes_into_the_rendered_config(tmp_path):
    config = tmp_path / "config.pbtxt"
    config.write_text('name: "encoder"\nparameters { key: "pool_bytes" value: { string_value: "1" } }\n')
    set_parameter(config, "cache_bytes", 2097152)
    assert config.read_text().endswith('parameters { key: "cache_bytes" value: { string_value: "2097152" } }\n')
    with pytest.raises(ValueError, match="cache_bytes is rendered already"):
        set_parameter(config, "cache_bytes", 1)


def sample(index: int, text: str, tokens: int = 16, ttft: float = 0.1, **timings) -> Sample:
    return Sample(ttft, ttft + 0.2, tokens, dict(timings), tokens, text, index)


def test_answers_are_checked_against_the_baseline_and_a_mismatch_counts():
    checker = Checker()
    checker.add_references(["a", "b"], [sample(1, "yes"), sample(0, "no")], [])
    assert checker.check("phase 1", ["a", "b"], [sample(0, "no"), sample(1, "yes")], [], "caches") == 0
    assert checker.check("phase 2", ["a", "b"], [sample(1, "yes", tokens=15)], ["UNAVAILABLE"], "caches") == 2
    assert checker.check("new", ["c"], [sample(0, "x")], [], "tier") == 1
    assert checker.tally == {"caches": [4, 2], "tier": [1, 1]}
    assert any("!= llm 'yes'" in p for p in checker.problems) and any("no llm answer" in p for p in checker.problems)
    assert checker.check("short", ["a", "b"], [sample(0, "no")], [], "tier") == 1  # one answer missing


def test_a_phase_summary_and_counter_movement():
    got = phase_summary([sample(i, "t", ttft=(i + 1) / 10, encode_ms=5.0 * i) for i in range(10)], ["e"], 2.0, 1)
    assert got["requests"] == 11 and got["errors"] == 1 and got["problems"] == 1
    assert got["ttft_p50_ms"] == 550.0 and got["ttft_p90_ms"] == 910.0 and got["encode_p50_ms"] == 22.5
    assert moved({"a": 1.0}, {"a": 4.0, "b": 2.0}) == {"a": 3.0, "b": 2.0}


def test_an_agent_turn_resends_every_earlier_screenshot_and_only_on_carries_the_session():
    on, off = conversations(5.0, 0, (64, 48), 8)
    turn = on.request(3)
    assert len(turn.images) == 3 and turn.images[:2] == on.request(2).images
    assert [m["role"] for m in turn.messages] == ["user", "assistant", "user", "assistant", "user"]
    assert sum(part == {"type": "image"} for m in turn.messages if m["role"] == "user" for part in m["content"]) == 3
    assert turn.parameters["epd_demand_aware"] is True and turn.parameters["session_id"]
    assert off.request(3).parameters is None and not set(off.request(3).images) & set(turn.images)


def test_an_agent_summary_leaves_out_the_first_turn():
    records = [{"mode": ON, "turn": k, "encodes": 1.0, "items": k, "held": k - 1, "ttft_ms": 100.0 + k,
                "gap_s": None if k == 1 else 5.5, "background_errors": 0, "error": []} for k in (1, 2, 3)]
    records += [{"mode": OFF, "turn": k, "encodes": float(k), "items": k, "held": 0, "ttft_ms": 200.0,
                 "gap_s": None if k == 1 else 6.0, "background_errors": 1, "error": []} for k in (1, 2, 3)]
    on, off = summary(records, ON), summary(records, OFF)
    assert (on["encodes"], on["items"], on["held"], on["only_new"], on["turns"]) == (2.0, 5, 3, 2, 2)
    assert on["to_encoder"] == 2 and off["to_encoder"] == 5
    assert (off["encodes"], off["only_new"], off["errors"], off["gap_s"]) == (5.0, 0, 2, 6.0)


def results() -> dict:
    counts = lambda encodes, hits=0.0: {"epd_encoder_items_total": encodes, "epd_tier_hits_total": hits,
                                        "epd_tier_waits_total": 1.0}
    phase = lambda ttft, encodes, hits=0.0: {"ttft_p50_ms": ttft, "ttft_p90_ms": ttft * 2, "encode_p50_ms": 10.0,
                                             "counts": counts(encodes, hits)}
    return {"settings": {"requests": 4, "images": 2, "cold": 16, "turns": 2, "concurrency": 4},
            "reassignment": {"caches": {"phase1": phase(100.0, 8.0), "reload_s": 20.0, "phase2": phase(100.0, 8.0)},
                             "tier": {"phase1": phase(110.0, 8.0), "reload_s": 21.0, "phase2": phase(50.0, 0.0, 8.0)}},
            "cold": {"caches": {"counts": counts(2.0), "ttft_p50_ms": 1.0}, "tier": {"counts": counts(1.0)}},
            "agent": {"skipped": "no reuse: block yet"},
            "checks": {"tally": {"caches": [9, 0], "tier": [9, 1]}, "problems": ["tier: request 3: epd 'a' != llm 'b'"]}}


def test_the_table_puts_both_deployments_side_by_side_with_the_change():
    table = markdown(results())
    rows = {line.split(" | ")[1]: line for line in table.splitlines() if line.startswith("| ")}
    reencodes = next(line for key, line in rows.items() if "re-encodes" in key)
    assert "| 8 | 0 | 8 -> 0 | 8 -> 0 |" in reencodes
    assert "| 200.0 | 100.0 | -50% | >= 40% lower |" in rows["phase 2 TTFT p90, ms"]
    assert "| 2 | 1 | 2 -> 1 | 1 |" in next(line for key, line in rows.items() if "cold requests" in key)
    assert "no reuse: block yet" in rows["skipped"]
    checks = next(line for key, line in rows.items() if "equal llm" in key)
    assert "9 of 9 equal" in checks and "8 of 9 equal, **1 MISMATCHED/FAILED**" in checks
    assert table.rstrip().endswith("- tier: request 3: epd 'a' != llm 'b'")


def test_change_is_relative_to_the_first_value():
    assert change(200.0, 100.0) == "-50%" and change(100.0, 150.0) == "+50%"
    assert change(None, 1.0) == change(0, 1.0) == change(1.0, None) == "-"


def test_the_agent_rows_show_each_turn_of_both_modes():
    turn = lambda mode, k, encodes, held: {"mode": mode, "turn": k, "encodes": encodes, "items": k, "held": held,
                                           "lookup_ms": 1.0, "ttft_ms": 50.0 * k, "gap_s": None if k == 1 else 5.0,
                                           "background_errors": 0, "error": []}
    records = [turn(OFF, 1, 1.0, 0), turn(OFF, 2, 2.0, 0), turn(ON, 1, 1.0, 0), turn(ON, 2, 1.0, 1)]
    done = {"settings": {"turns": 2}, "agent": {"5": {"turns": records, "on": summary(records, ON),
                                                      "off": summary(records, OFF)}}}
    rows = {line.split(" | ")[1]: line for line in markdown(done).splitlines() if line.startswith("| ")}
    assert "| 2 | 1 | 2 -> 1 | 1 (the new screenshots) |" in rows["turns 2-2: encodes (tower outputs)"]
    assert "| 2 / 0 | 1 / 1 |" in rows["items sent to the encoder / served from the consumer's copy"]
    turn2 = next(line for key, line in rows.items() if key.startswith("turn 2:"))
    assert "| enc 2 · E 2 · held 0 · 100.0 ms | enc 1 · E 1 · held 1 · 100.0 ms |" in turn2


def test_the_lookup_part_reads_off_against_on_and_the_lookups_own_time():
    from clients.bench.reuse_table import lookup_rows

    results = {"lookup": {"on": {"requests": 4, "ttft_p50_ms": 105.0, "ttft_p90_ms": 130.0},
                          "off": {"requests": 4, "ttft_p50_ms": 100.0, "ttft_p90_ms": 120.0},
                          "lookup_p50_ms": 3.2, "lookup_p90_ms": 4.0, "held": 0}}
    first, second = lookup_rows(results)
    assert first[2:5] == ("100.0 / 120.0", "105.0 / 130.0", "+5%") and "3.2 / 4.0; 0" in second[3]
    assert lookup_rows({}) == []
