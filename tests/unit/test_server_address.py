import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from backend.deploy.server_address import (EndpointError, check_endpoint, endpoint_list, grpc_address, resolve,
                                           server_argv)


@pytest.mark.parametrize("argv, address", [
    (["tritonserver", "--model-repository=m"], "127.0.0.1:8001"),  # tritonserver's defaults
    (["tritonserver", "--model-repository", "m", "--grpc-port", "9001"], "127.0.0.1:9001"),
    (["tritonserver", "--grpc-port=9001", "--grpc-address=10.0.0.2"], "10.0.0.2:9001"),
    (["tritonserver", "--grpc-address", "0.0.0.0", "--grpc-port=7001"], "127.0.0.1:7001"),
    (["tritonserver", "--grpc-port=7001", "--grpc-port=7002"], "127.0.0.1:7002"),  # the last one wins
    (["tritonserver", "--grpc-address=::", "--grpc-port=7001"], "[::1]:7001"),
    (["tritonserver", "--allow-grpc=true", "--http-port=9000"], "127.0.0.1:8001"),
])
def test_grpc_address_from_the_server_command_line(argv, address):
    assert grpc_address(argv) == address


def test_a_server_without_grpc_fails_the_load_naming_the_stage_and_the_fix():
    for flag in (["--allow-grpc=false"], ["--allow-grpc", "0"]):
        with pytest.raises(EndpointError, match="stage pd is reached over this server's gRPC endpoint.*"
                                                "--allow-grpc=false.*stages.pd.endpoint"):
            resolve("pd", "local", ["tritonserver", *flag])


def test_explicit_endpoints_are_taken_as_given_and_checked():
    assert resolve("decode", "10.1.2.3:9001", ["tritonserver", "--allow-grpc=false"]) == "10.1.2.3:9001"
    for bad in ("host", "host:port", ":9001", "host:0", "host:70000"):
        with pytest.raises(EndpointError, match=f"stages.decode.endpoint: expected 'local' or host:port, got '{bad}'"):
            resolve("decode", bad)


def test_an_endpoint_may_list_one_address_per_replica():
    assert resolve("pd", "10.77.0.3:8001,10.77.0.4:8001") == "10.77.0.3:8001,10.77.0.4:8001"  # as given
    assert endpoint_list("a:1, b:2") == ["a:1", "b:2"] and endpoint_list("local") == [] and endpoint_list("") == []
    assert endpoint_list("[::1]:8001,pd.epd.svc.cluster.local:8001") == ["[::1]:8001", "pd.epd.svc.cluster.local:8001"]
    check_endpoint("encoder", "[::1]:8001,pd.epd.svc.cluster.local:8001")
    with pytest.raises(EndpointError, match="stages.pd.endpoint: expected 'local' or host:port, got 'a:1,': '' is not host:port"):
        check_endpoint("pd", "a:1,")
    with pytest.raises(EndpointError, match="stages.pd.endpoint: expected 'local' or host:port, got 'a:1,b:x'"):
        check_endpoint("pd", "a:1,b:x")
    with pytest.raises(EndpointError, match="stages.decode.endpoint: b:2 listed more than once"):
        check_endpoint("decode", "b:2,a:1,b:2")


def test_local_outside_tritonserver_is_refused_with_the_reason():
    with pytest.raises(EndpointError, match=r"stage prefill .*is not tritonserver"):
        resolve("prefill", "local")  # this test's parent is not a tritonserver


def test_server_argv_reads_a_tritonserver_process_s_command_line(tmp_path):
    fake = tmp_path / "tritonserver"  # a real process whose executable is named tritonserver: cat, reading its stdin
    shutil.copy("/bin/cat", fake)
    argv = [str(fake), "--", "-", "--grpc-port=9101"]  # (sleep exits at once on such arguments: a race)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        # until the exec is done: the kernel points /proc/<pid>/exe at the new executable before it sets the
        # command line (read in between, it is empty)
        while time.monotonic() < deadline and (os.readlink(f"/proc/{proc.pid}/exe") != str(fake)
                                               or not Path(f"/proc/{proc.pid}/cmdline").read_bytes()):
            time.sleep(0.01)
        assert server_argv(proc.pid) == argv and grpc_address(server_argv(proc.pid)) == "127.0.0.1:9101"
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(EndpointError, match=f"parent process {os.getpid()} \\(python"):
        server_argv(os.getpid())
