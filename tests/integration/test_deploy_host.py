"""The host facts the DaemonSet's choices rest on (deploy/README.md), checked on this kernel:

- kubelet's pod-resources socket can be used through a read-only mount, so that volume is
  mounted read-only;
- the process connector (cn_proc) refuses a listener outside the host's network namespace,
  hence hostNetwork;
- the ioctl tracer loads and attaches with CAP_BPF + CAP_PERFMON and no CAP_SYS_ADMIN.

Each runs in a child process given its own namespace (unshare) or capability set (setpriv).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.privileged

CONNECT_THROUGH_RO_MOUNT = """
import errno, json, os, socket, subprocess, sys, threading
src, dst = sys.argv[1], sys.argv[2]
server = socket.socket(socket.AF_UNIX)
server.bind(os.path.join(src, "kubelet.sock"))
server.listen(1)
def answer():
    conn, _ = server.accept()
    conn.sendall(b"pong")
    conn.close()
threading.Thread(target=answer, daemon=True).start()
subprocess.run(["mount", "--bind", "-o", "ro", src, dst], check=True)
try:
    open(os.path.join(dst, "x"), "w")
    write = 0
except OSError as err:
    write = err.errno
client = socket.socket(socket.AF_UNIX)
client.connect(os.path.join(dst, "kubelet.sock"))
print(json.dumps({"write_errno": write, "reply": client.recv(4).decode()}))
"""

SUBSCRIBE_TO_PROCESS_EVENTS = """
import json, subprocess
from agent.platform.procevents import ProcEventSource, ProcEventsUnavailable
try:
    source = ProcEventSource()
except ProcEventsUnavailable as err:
    print(json.dumps({"subscribed": False, "reason": str(err)}))
else:
    subprocess.run(["true"])
    print(json.dumps({"subscribed": True, "events": len(source.read(2.0))}))
    source.close()
"""

ATTACH_TRACER = """
import json
from agent.platform.bpf.ioctl_tracer import KPROBE_FUNCTIONS, IoctlTracer
from agent.platform.bpf.probe import probe_bpf
caps = int(next(l for l in open("/proc/self/status") if l.startswith("CapEff:")).split()[1], 16)
support = probe_bpf()
result = {"caps": caps, "status": support.status.value, "attached": False}
if support.usable:
    function = support.kprobe_function or KPROBE_FUNCTIONS[0]
    tracer = IoctlTracer(mode=support.attach_mode, kprobe_function=function)
    tracer.start()
    result["attached"] = True
    tracer.stop()
print(json.dumps(result))
"""
CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 21, 38, 39


def needs(*tools: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: namespaces, mounts and capabilities")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (util-linux)")


def run_json(*argv: str) -> dict[str, object]:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, f"{argv[:3]} failed:\n{out.stderr[-2000:]}"
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_the_pod_resources_socket_works_through_a_read_only_mount(tmp_path: Path) -> None:
    needs("unshare", "mount")
    src, dst = tmp_path / "pod-resources", tmp_path / "seen-by-agent"
    src.mkdir()
    dst.mkdir()
    result = run_json(
        "unshare", "--mount", "--propagation", "private",
        sys.executable, "-c", CONNECT_THROUGH_RO_MOUNT, str(src), str(dst),
    )  # fmt: skip
    assert result == {"write_errno": 30, "reply": "pong"}, "EROFS for files, yet the socket connects"


def test_process_events_need_the_host_network_namespace() -> None:
    needs("unshare")
    host = run_json(sys.executable, "-c", SUBSCRIBE_TO_PROCESS_EVENTS)
    assert host["subscribed"] is True and isinstance(host["events"], int) and host["events"] > 0
    pod_network = run_json("unshare", "--net", sys.executable, "-c", SUBSCRIBE_TO_PROCESS_EVENTS)
    assert pod_network["subscribed"] is False
    assert "hostNetwork" in str(pod_network["reason"])


@pytest.mark.slow
def test_the_tracer_needs_cap_bpf_and_cap_perfmon_not_cap_sys_admin() -> None:
    needs("setpriv")
    everything = run_json(sys.executable, "-c", ATTACH_TRACER)
    if everything["status"] != "ok":
        pytest.skip(f"the ioctl tracer cannot run here even as root: {everything['status']}")
    drop = "-sys_admin"
    result = run_json(
        "setpriv", "--bounding-set", drop, "--inh-caps", drop, sys.executable, "-c", ATTACH_TRACER
    )
    caps = int(str(result["caps"]))
    assert not caps & (1 << CAP_SYS_ADMIN) and caps & (1 << CAP_BPF) and caps & (1 << CAP_PERFMON)
    assert result == {"caps": caps, "status": "ok", "attached": True}
    drop = "-sys_admin,-bpf,-perfmon"
    result = run_json(
        "setpriv", "--bounding-set", drop, "--inh-caps", drop, sys.executable, "-c", ATTACH_TRACER
    )
    assert result["status"] == "not-permitted" and result["attached"] is False
