"""tests/conftest.py's ModuleLocks on two real xdist workers: a ``solo`` module runs while no other module does (but
a unit-test module), two ``memory_heavy`` modules never at once, and the others side by side. A throwaway suite that
uses the project's hook records each module's start and end; without the locks its first two modules start
together."""
import json
import subprocess
import sys
import textwrap

from tests.conftest import ROOT

MODULE = textwrap.dedent("""
    import json, os, time
    import pytest
    {mark}

    def test_it(tmp_path_factory):
        start = time.monotonic()
        time.sleep({seconds})
        with open(os.environ["SPANS"], "a") as out:
            out.write(json.dumps([__name__, start, time.monotonic()]) + "\\n")
""")


def test_solo_and_memory_heavy_modules_run_apart_on_two_workers(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.conftest import pytest_runtest_protocol, MODULE_LOCKS  # noqa: F401\n"
        "def pytest_configure(config):\n"
        "    config.addinivalue_line('markers', 'solo: alone')\n"
        "    config.addinivalue_line('markers', 'memory_heavy: apart')\n")
    modules = {"test_a_solo": ("pytestmark = pytest.mark.solo", 1.0),
               "test_b_plain": ("", 2.0),
               "test_c_heavy": ("pytestmark = pytest.mark.memory_heavy", 1.0),
               "test_d_heavy": ("pytestmark = pytest.mark.memory_heavy", 1.0),
               "test_e_plain": ("", 0.5),
               "test_f_plain": ("", 0.5)}
    for name, (mark, seconds) in modules.items():
        (suite / f"{name}.py").write_text(MODULE.format(mark=mark, seconds=seconds))
    # a unit-test module (no server; collected first, "a" < "test_"): beside the solo module, on the other worker
    (suite / "a" / "unit").mkdir(parents=True)
    (suite / "a" / "unit" / "test_g_light.py").write_text(MODULE.format(mark="", seconds=1.5))
    spans_file = tmp_path / "spans.jsonl"
    (tmp_path / "base").mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder",
         "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "base" / "run"), str(suite)],
        cwd=suite, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "SPANS": str(spans_file), "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stdout + run.stderr
    spans = {name: (start, end) for name, start, end in map(json.loads, spans_file.read_text().splitlines())}
    assert set(spans) == set(modules) | {"test_g_light"}
    light, solo = spans["test_g_light"], spans["test_a_solo"]
    assert light[0] < solo[1] and solo[0] < light[1], spans

    def overlap(a, b):
        return spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]

    others = [name for name in modules if name != "test_a_solo"]
    assert not [name for name in others if overlap("test_a_solo", name)], spans
    assert not overlap("test_c_heavy", "test_d_heavy"), spans
    # the others still ran side by side (the locks do not serialise the whole suite)
    assert [(a, b) for a in others for b in others if a < b and overlap(a, b)], spans


def test_the_workers_take_unit_files_beside_the_solo_modules():
    from tests.conftest import SLOW_FIRST, SOLO, run_order

    units = [f"tests/unit/test_{i}.py" for i in range(8)] + ["tests/unit/triton/test_x.py"]
    files = ["tests/e2e/test_other.py", *units, SLOW_FIRST[1], SOLO[1], SLOW_FIRST[0], SOLO[0]]
    order = run_order(files)
    assert sorted(order) == sorted(files)
    # the first solo module, 6 of the 9 unit files (while it runs, the other worker takes those), the second solo
    # module, the other 3 (beside it), then the slowest files first, the rest last
    assert order == [SOLO[0], *units[:6], SOLO[1], *units[6:], SLOW_FIRST[0], SLOW_FIRST[1], "tests/e2e/test_other.py"]


def test_on_xdist_workers_the_unit_files_are_taken_first(tmp_path):
    # a throwaway suite with the project's ordering hook: its unit file, collected last ("z" > "test_"), is taken
    # first (no solo module here: the unit files lead); without the hook it would wait for a 2 s module to end
    suite = tmp_path / "suite"
    (suite / "z" / "unit").mkdir(parents=True)
    (suite / "conftest.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    for name, seconds in {"test_b_plain": 2.0, "test_c_plain": 2.0}.items():
        (suite / f"{name}.py").write_text(MODULE.format(mark="", seconds=seconds))
    (suite / "z" / "unit" / "test_u.py").write_text(MODULE.format(mark="", seconds=0.2))
    spans_file = tmp_path / "spans.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder",
         "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "base"), str(suite)],
        cwd=suite, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "SPANS": str(spans_file), "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stdout + run.stderr
    spans = {name: (start, end) for name, start, end in map(json.loads, spans_file.read_text().splitlines())}
    first = min(start for start, _ in spans.values())
    assert spans["test_u"][0] - first < 1.0, spans
