"""E2E fixtures: one real tritonserver for the session, started as the README tells users to start it
(``.venv/bin/tritonserver --model-repository model_repository`` with its own port flags: free ports on 127.0.0.1, the
caller's environment without anything a harness might set for the orchestrators), always stopped, and checked for
leaked /dev/shm files and processes afterwards; reference outputs from in-process vLLM."""
from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from backend.deploy.local_server import DEFAULT_REPOSITORY, Ports, ROOT, TritonServer, VENV, group_members
from backend.protocol.generate import GenerateInputs
from clients.triton_client import GenerateResult, generate
from tests.timeline import made_during


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _shm_of_this_process() -> set[str]:
    """/dev/shm files this test process maps itself (UCX, used by the tests' own NIXL agents)."""
    with open("/proc/self/maps") as maps:
        return {os.path.basename(line.split()[-1]) for line in maps if "/dev/shm/" in line}


def held_shm(pid: int) -> set[str]:
    """/dev/shm entries the process ``pid`` and its descendants map now (the server, its stubs, their
    EngineCores): sampled just before a server stops, these are the entries that server must not leave."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return set()
    entries = _shm_inodes()
    return {name for proc in procs for name in _mapped_by(proc.pid, entries)}


def left_behind(held: set[str], settle: float = 2.0) -> set[str]:
    """Of ``held`` (``held_shm`` before the stop), those still in /dev/shm ``settle`` seconds after it and
    mapped by no live process. Attributing entries to the server's own processes keeps the check right on
    a machine where other checkouts' servers create and remove /dev/shm entries at the same time."""
    time.sleep(settle)
    mapped = set()
    entries = _shm_inodes()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        mapped |= _mapped_by(int(pid), entries)
    return {name for name in held if name not in mapped and os.path.exists(f"/dev/shm/{name}")}


def _mapped_by(pid: int, entries: dict[str, int] | None = None) -> set[str]:
    """The /dev/shm entries ``pid`` maps, matched by inode: a POSIX semaphore (``sem.mp-*``) is mapped under the
    temporary name it was made with (``/dev/shm/sem.XXXXXX (deleted)``), not under its own. ``entries``: the
    entries' inodes (``_shm_inodes``), when the caller asks for many processes."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            inodes = {int(line.split()[4]) for line in maps if "/dev/shm/" in line}
    except OSError:
        return set()
    return {name for name, inode in (entries or _shm_inodes()).items() if inode in inodes}


def _shm_inodes() -> dict[str, int]:
    inodes = {}
    for name in _shm():
        try:
            inodes[name] = os.stat(f"/dev/shm/{name}").st_ino
        except OSError:
            pass
    return inodes


def orphaned_shm(new: set[str]) -> set[str]:
    """Of ``new`` /dev/shm entries, those no live process maps (a server still running beside the one
    under test, e.g. the session server, legitimately holds its own)."""
    mapped: set[str] = set()
    entries = _shm_inodes()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        mapped |= _mapped_by(int(pid), entries)
    return {name for name in new if name not in mapped and os.path.exists(f"/dev/shm/{name}")
            and not _live_announcements(name)}


def _live_announcements(name: str) -> bool:
    """An encoders' announcement directory (``backend.transfer.announce``: a directory, which no process maps) of a
    tritonserver still running: another checkout's server on this machine, not one this session stopped."""
    from backend.transfer.announce import PREFIX

    pid = name.removeprefix(PREFIX)
    return name.startswith(PREFIX) and pid.isdigit() and os.path.exists(f"/proc/{pid}")


def settled_orphans(before: set[str], seconds: float = 5.0) -> set[str]:
    """``orphaned_shm`` of the entries new since ``before``, once they stop disappearing (a resource tracker
    unlinks the semaphores of a process that exited a moment after it; other users of this machine come
    and go too), or after ``seconds``."""
    import time

    deadline = time.monotonic() + seconds
    while (left := orphaned_shm(_shm() - before)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def clone_model(repo: Path, model: str, name: str, parameters: dict[str, str] | None = None, instances: int | None = None,
                drop: tuple[str, ...] = ()) -> None:
    """``repo/model`` copied as ``repo/name`` with ``parameters`` set, the parameters whose keys start with one of
    ``drop`` removed and, if given, ``instances`` CPU instances: variants of one rendered stage served beside it in
    one server (an engine start each saved where a test would otherwise start a server per variant)."""
    import re

    from backend.deploy.render import copy_model

    config = copy_model(repo, model, repo, name)
    text = config.read_text()
    if instances is not None:
        text, found = re.subn(r"instance_group \[ \{ count: \d+ kind: KIND_CPU \} \]",
                              f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]", text)
        assert found == 1, (name, "instance_group")
    for key, value in (parameters or {}).items():
        text, found = re.subn(rf'(parameters {{ key: "{key}" value: {{ string_value: )"[^"]*"', rf'\1"{value}"', text)
        assert found == 1, (name, key)
    for prefix in drop:
        text = re.sub(rf'parameters {{ key: "{prefix}[^"]*" value: {{ string_value: "[^"]*" }} }}\n', "", text)
    config.write_text(text)


SESSION_TOPOLOGY = ROOT / "topologies" / "default.yaml"  # what model_repository/ (the session server's) is rendered from


def assert_session_engines(topology, stages) -> None:
    """``topology``'s engines of ``stages`` are rendered with the session server's engine arguments (checkpoint and
    limits per prompt included): that server's engine of the stage (its ``llm`` for ``llm``) answers as theirs would."""
    from backend.deploy.render import GENERATED_KEY, render_engine_args
    from backend.deploy.topology import load

    session = load(SESSION_TOPOLOGY, "cpu")
    args = lambda t, stage: {k: v for k, v in json.loads(render_engine_args(t, stage, ROOT)).items() if k != GENERATED_KEY}
    for stage in stages:
        assert args(topology, stage) == args(session, stage), f"{topology.name}: its {stage} is not the session server's"


def render_on_session_engines(topology, server, repo: Path) -> list[str]:
    """Render ``topology``'s encoders and orchestrators into ``repo``, its engine stages (pd, prefill, decode) reached
    at the session server's gRPC endpoint instead of engines of its own: a module server that varies only the encoder
    or the orchestrator saves an engine start per engine stage (~20 s of CPU each). The session server's engines are
    the same checkpoint and engine arguments (checked), so answers are those of engines of its own; its ``llm`` is the
    baseline to ask (an ``llm`` of the topology is not rendered). Returns the models written."""
    from dataclasses import replace

    from backend.deploy.render import render
    from backend.deploy.schema import REMOTE_STAGES

    engines = {stage for stage in REMOTE_STAGES if stage in topology.stages}
    assert_session_engines(topology, engines)
    topology = replace(topology, stages={name: replace(spec, endpoint=server.grpc_url) if name in engines else spec
                                         for name, spec in topology.stages.items()})
    return render(topology, repo, [name for name, kind in topology.models().items() if kind.engine is None or kind.colocated])


def user_env() -> dict[str, str]:
    """The caller's environment without anything a test harness might have set for the orchestrators."""
    return {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}


def readme_command(ports: Ports) -> list[str]:
    """The README's ``.venv/bin/tritonserver --model-repository model_repository --http-port ...`` on ``ports``."""
    return [str(VENV / "bin" / "tritonserver"), "--model-repository", str(DEFAULT_REPOSITORY),
            "--http-port", str(ports.http), "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics)]


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("triton") / "server.log"
    srv = TritonServer(log_path=log, env=user_env(), argv=readme_command)  # ports picked again if one is taken
    before = _shm()
    try:
        srv.start(timeout=300)
    except Exception:
        print(log.read_text()[-5000:] if log.exists() else "(no log)")
        raise
    held: set[str] = set()
    try:
        yield srv
    finally:
        held = held_shm(srv.proc.pid) - _shm_of_this_process()
        members = group_members(srv.proc.pid)
        srv.stop()
        print(f"\ntritonserver ready in {srv.ready_seconds:.1f} s, stopped in {srv.stop_seconds:.1f} s; log {log}")
    check_clean_stop(srv, log, members)
    assert not srv.stragglers, f"processes outlived tritonserver: {srv.stragglers}"
    assert not srv.leftover_shm, f"stubs killed at exit left their /dev/shm regions: {srv.leftover_shm}"
    leaked = left_behind(held)
    assert not leaked, f"/dev/shm entries leaked by the server: {sorted(leaked)}"
    new = settled_orphans(before)  # every entry new since the start that no live process holds, semaphores too
    assert not new, f"/dev/shm entries left after the server stopped: {[made_during('/dev/shm/' + n) for n in sorted(new)]}"


STOP_SECONDS = 20.0  # SIGTERM to exit (4 engines unloading at once, 7-10 s measured), Triton's own exit timeout being 30 s


def check_clean_stop(srv: TritonServer, log: Path, members: list[int]) -> None:
    """After a whole session of requests (``test_shutdown.py``'s refusals and cancels among them), SIGTERM stopped the
    session server well under Triton's 30 s exit timeout: every model unloaded, tritonserver exited 0, and no private
    IPC directory of its stubs' engines is left (``backend.engine.host.private_ipc_dir``). Triton 2.51's gRPC frontend
    once leaked a stream cancelled around its final response, which kept a model from unloading: 30 s stops
    (docs/results/robustness.md, "Shutdown")."""
    assert not srv.died, srv.died
    text = log.read_text(errors="replace")
    assert "Exit timeout expired" not in text, text[-3000:]
    assert srv.stop_seconds < STOP_SECONDS, f"stop took {srv.stop_seconds:.1f} s; log tail: {text[-3000:]}"
    assert srv.proc.returncode == 0, srv.proc.returncode
    models = [d.name for d in DEFAULT_REPOSITORY.iterdir() if (d / "config.pbtxt").is_file()]
    assert all(f"successfully unloaded '{model}'" in text for model in models), text[-3000:]
    tmp = Path(tempfile.gettempdir())
    left = [p.name for p in tmp.glob("epd-vllm-ipc-*") if int(p.name.split("-")[3]) in members]
    assert not left, f"the stubs' vLLM IPC directories left in {tmp}: {left}"


class Reference:
    """Runs cases through ``tests.vllm_reference`` in one subprocess and caches the outputs."""

    def __init__(self, workdir: Path):
        self.workdir = workdir

    def run(self, cases: list[dict]) -> list[dict]:
        cases_path, out_path = self.workdir / "cases.json", self.workdir / "out.json"
        cases_path.write_text(json.dumps([{**c, "images": [base64.b64encode(b).decode() for b in c.get("images", [])]}
                                          for c in cases]))
        proc = subprocess.run([sys.executable, "-m", "tests.vllm_reference", str(cases_path), str(out_path)],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(out_path.read_text())


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    return Reference(tmp_path_factory.mktemp("reference"))


def metric(server, name: str, *, wait_s: float | None = None, **labels) -> float:
    """The value of ``name`` on the server's metrics endpoint, summed over the series carrying every one of
    ``labels`` (a model's instances each have their own series); ``wait_s`` as ``metrics``."""
    return metrics(server, (name,), wait_s=wait_s, **labels)[name]


def metrics(server, names, *, wait_s: float | None = None, **labels) -> dict[str, float]:
    """Several metrics as ``metric`` reads one, all from one scrape (one moment). A model's custom metrics appear at
    its first request or ``LOAD_MARGIN_SECONDS`` after its load (``backend.triton.counter_batch.after_load``), so a
    series not there yet is waited for ``wait_s`` (default: that margin and 5 s more; 0 where "not there" is an
    answer: a series made when first counted)."""
    from backend.triton.counter_batch import LOAD_MARGIN_SECONDS

    want = [f'{k}="{v}"' for k, v in labels.items()]
    deadline = time.monotonic() + (LOAD_MARGIN_SECONDS + 5 if wait_s is None else wait_s)
    while True:
        text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
        out, missing = {}, []
        for name in names:
            values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith(name + "{") and all(w in line for w in want)]
            if values:
                out[name] = sum(values)
            else:
                missing.append(name)
        if not missing:
            return out
        if time.monotonic() > deadline:
            raise AssertionError(f"{missing[0]}{labels} not exported")
        time.sleep(0.25)


P_D = {"epd_encode": False}  # P/D: no encoder stage; prefill and decode process the media themselves
# E+PD; E/P/D (encoders -> prefill -> NIXL KV -> decode); P/D, the same prefill and decode without the encoders
EPD_DEPLOYMENTS = pytest.mark.parametrize("model, parameters", [("epd", None), ("epd_disagg", None), ("epd_disagg", P_D)],
                                          ids=["E+PD", "E/P/D", "P/D"])


def assert_same_answer(got, want) -> None:
    """The same text, prompt and output token counts and finish reason (a deployment against the baseline)."""
    assert got.text == want.text
    assert (got.num_input_tokens, got.num_output_tokens, got.finish_reason) == (
        want.num_input_tokens, want.num_output_tokens, want.finish_reason)


def assert_same_logprobs(got: list[dict], want: list[dict], tol: float = 1e-4) -> None:
    """The same tokens with the same top tokens, every log probability within ``tol`` (entries as the generate
    interface returns them, or OpenAI's chat ``logprobs.content`` as dicts: both have ``token``, ``logprob`` and
    ``top_logprobs`` of ``token`` and ``logprob``)."""
    assert [e["token"] for e in got] == [e["token"] for e in want]
    for g, w in zip(got, want):
        assert abs(g["logprob"] - w["logprob"]) <= tol, (g, w)
        assert [t["token"] for t in g["top_logprobs"]] == [t["token"] for t in w["top_logprobs"]], (g, w)
        tops = zip(g["top_logprobs"], w["top_logprobs"])
        assert all(abs(a["logprob"] - b["logprob"]) <= tol for a, b in tops), (g, w)


def asker(greedy: dict):
    """``ask(server, model, protocol="grpc", **GenerateInputs fields)``: one request, sampled with ``greedy`` unless the
    inputs say otherwise, over gRPC or HTTP."""
    def ask(server, model: str, protocol: str = "grpc", **inputs) -> GenerateResult:
        inputs.setdefault("sampling", greedy)
        url = server.grpc_url if protocol == "grpc" else server.http_url
        return generate(url, model, GenerateInputs(**inputs), protocol=protocol, timeout=180)
    return ask


@contextlib.contextmanager
def openai_endpoint(grpc_url: str, models: str | None = None, wait: bool = True, extra: tuple[str, ...] = ()):
    """``python -m frontend.openai`` on a free port in front of ``grpc_url`` (``models``: its ``--models``), its base
    URL yielded once its /health answers (200 or 503: it is up; ``wait``: once it is 200); stopped (and checked
    stopped) after. ``extra``: more arguments (``--tokenizer``)."""
    import urllib.error

    from backend.deploy.ports import free_ports

    (port,) = free_ports(1)
    argv = [sys.executable, "-m", "frontend.openai", "--port", str(port), "--grpc-url", grpc_url]
    proc = subprocess.Popen(argv + (["--models", models] if models else []) + list(extra), cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                    break
            except urllib.error.HTTPError:
                if not wait:
                    break
                time.sleep(0.2)
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        else:
            raise AssertionError("the OpenAI endpoint did not become healthy")
        yield base
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) is not None
