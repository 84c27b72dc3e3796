"""What only a real GPU can say about MPS mode: run on a lent GPU machine, CI never runs it.

1. The GPU alone: a PyTorch matmul loop (a queue of 20 launches per sync) for a few seconds
   gives the iterations per second of 100 % (no MPS).
2. ``nvidia-cuda-mps-control -f`` for the GPU, as the agent runs it (CUDA_VISIBLE_DEVICES =
   the GPU's UUID, pipe and log directories of our own), then clients with the
   ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` the agent hands out for caps of 30 and 60
   (``agent.platform.gpu.mpspartition``): one alone, then both together. Each client's
   share is its iterations per second over the alone-rate, measured by the client itself.
3. Meanwhile, what NVML says: whom ``nvmlDeviceGetProcessUtilization`` credits (the MPS
   server's pid, or the clients'), and the processes the compute and MPS process lists show.
4. ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1024M``: does an allocation of 2 GiB fail?
5. Whether the driver has ``nvmlDeviceSetMemoryLimits_v1`` (agent.platform.gpu.nvml_limits).
6. With ``--curve``: one client alone at each of 10..100 %, its throughput over the alone-rate
   (how throughput follows the percentage: TPC rounding, wave quantization).
7. With ``--tricks`` (what a tenant can do to the real daemon): the daemon's
   default set to 30 through its control socket, then a client that sets 100 in its own
   environment; a client in its own mount namespace that sees the pipe directory read-only,
   as a container does (does it still work?); and that client raising
   ``set_active_thread_percentage <server> 100`` through the read-only socket, then a new
   client's throughput.

    sudo python3 bench/gpu_mps_probe.py [--seconds 6] [--json OUT.json] [--curve] [--tricks]

Last line: ``RESULT alone30_pct=... alone60_pct=... pair30_pct=... pair60_pct=...
samples_credit=server|client|none memlimit_fails=yes|no driver_limits=yes|no`` (with
``--tricks``, also ``env100_over_default30_pct=... readonly_pipe_client=works|fails
lifted_by_tenant_pct=...``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.platform.gpu.mpspartition import partition_for, sm_count_for
from agent.platform.gpu.nvml_limits import limits_support

CURVE_PERCENTS = (10, 20, 25, 29, 30, 31, 40, 50, 60, 61, 75, 90, 100)
CLIENT = r"""
import os, sys, time, torch
seconds, out = float(sys.argv[1]), sys.argv[2]
a = torch.randn(4096, 4096, device="cuda")
b = torch.randn(4096, 4096, device="cuda")
for _ in range(20):
    c = a @ b
torch.cuda.synchronize()
open(out + ".ready", "w").close()
while not os.path.exists(out + ".go"):
    time.sleep(0.005)
n, start = 0, time.monotonic()
while time.monotonic() - start < seconds:
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize()
    n += 20
with open(out, "w") as f:
    f.write(f"{n / (time.monotonic() - start)}")
"""

MEMORY = r"""
import torch
try:
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    print("ALLOCATED 2 GiB")
except RuntimeError as err:
    print("FAILED", str(err).splitlines()[0][:200])
"""


def run_clients(
    percents: list[int | None],
    seconds: float,
    work: Path,
    env: dict[str, str],
    during: Callable[[], None] | None = None,
) -> list[float]:
    """Start one client per percentage (None: no MPS variable), release them together,
    return their iterations per second; ``during`` is called halfway through."""
    procs, outs = [], []
    for i, pct in enumerate(percents):
        out = work / f"client-{time.monotonic_ns()}-{i}"
        client_env = dict(env)
        if pct is not None:
            client_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(pct)
        procs.append(subprocess.Popen([sys.executable, "-c", CLIENT, str(seconds), str(out)], env=client_env))
        outs.append(out)
    deadline = time.monotonic() + 120
    while not all(Path(f"{o}.ready").exists() for o in outs):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"clients did not start: {[p.poll() for p in procs]}")
        time.sleep(0.05)
    for o in outs:
        Path(f"{o}.go").touch()
    if during is not None:
        time.sleep(seconds / 2)
        during()
    for p in procs:
        p.wait(timeout=seconds + 60)
    return [float(o.read_text()) for o in outs]


def nvml_view(nvml: Any, handle: Any, since: int) -> dict[str, Any]:
    try:
        samples = nvml.nvmlDeviceGetProcessUtilization(handle, since)
    except nvml.NVMLError as err:
        samples, error = [], str(err)
    else:
        error = ""
    compute = [(p.pid, p.usedGpuMemory) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)]
    try:
        mps = [(p.pid, p.usedGpuMemory) for p in nvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)]
    except (nvml.NVMLError, AttributeError) as err:
        mps = [("error", str(err))]
    by_pid: dict[int, list[int]] = {}
    for s in samples:
        by_pid.setdefault(int(s.pid), []).append(int(s.smUtil))
    return {"samples_by_pid": by_pid, "sample_error": error, "compute": compute, "mps": mps}


def gpu_facts(nvml: Any, handle: Any) -> dict[str, Any]:
    name, uuid = nvml.nvmlDeviceGetName(handle), nvml.nvmlDeviceGetUUID(handle)
    name = name.decode() if isinstance(name, bytes) else name
    return {
        "gpu": name,
        "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
        "sm_count_table": sm_count_for(name),
        "driver": nvml.nvmlSystemGetDriverVersion(),
        "driver_limits": limits_support(nvml) or "supported",
        "mps_control": shutil.which("nvidia-cuda-mps-control"),
    }


def start_daemon(control: str, mps_env: dict[str, str], uuid: str, pipe: Path) -> subprocess.Popen[bytes]:
    daemon = subprocess.Popen([control, "-f"], env={**mps_env, "CUDA_VISIBLE_DEVICES": uuid})
    deadline = time.monotonic() + 10
    while not (pipe / "control").exists():
        if time.monotonic() > deadline or daemon.poll() is not None:
            raise RuntimeError(f"the MPS daemon did not come up ({daemon.poll()})")
        time.sleep(0.02)
    return daemon


# A client in its own mount namespace that sees the pipe directory read-only (argv: the pipe
# directory, then the command to run), as a container with the agent's mounts does.
READ_ONLY_PIPE = r"""
set -e
pipe="$1"; shift
mount --bind "$pipe" "$pipe"
mount -o remount,bind,ro "$pipe"
exec "$@"
"""


def control(command: str, lines: list[str], env: dict[str, str], *, read_only: bool = False) -> str:
    """What ``nvidia-cuda-mps-control`` prints for ``lines`` (read_only: sent from a mount
    namespace where the pipe directory is read-only)."""
    argv = [command]
    if read_only:
        argv = ["unshare", "-m", "sh", "-c", READ_ONLY_PIPE, "sh", env["CUDA_MPS_PIPE_DIRECTORY"], command]
    done = subprocess.run(
        argv, input="\n".join(lines) + "\n", env=env, capture_output=True, text=True, timeout=30
    )
    return (done.stdout + done.stderr).strip()


def tricks(report: dict[str, Any], seconds: float, work: Path, env: dict[str, str]) -> None:
    """Step 7 of the module docstring, into ``report["tricks"]``."""
    command, full = report["mps_control"], report["full_rate"]
    out: dict[str, Any] = {}
    report["tricks"] = out
    # The default binds servers started later; the running server (earlier clients') too.
    lines = ["set_default_active_thread_percentage 30"]
    lines += [
        f"set_active_thread_percentage {pid} 30" for pid in control(command, ["get_server_list"], env).split()
    ]
    out["set_30"] = control(command, lines, env)
    rate = run_clients([100], seconds, work, env)[0]
    out["env100_over_default30_pct"] = 100 * rate / full
    print(f"tricks: default 30, client env 100: {out['env100_over_default30_pct']:.1f} %", flush=True)
    ro_env = {**env, "VCUDA_PROBE_RO": "1"}
    try:
        ro = subprocess.run(
            ["unshare", "-m", "sh", "-c", READ_ONLY_PIPE, "sh", env["CUDA_MPS_PIPE_DIRECTORY"],
             sys.executable, "-c", CLIENT_ONCE],
            env=ro_env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        out["readonly_pipe_client"] = "works" if ro.returncode == 0 and "OK" in ro.stdout else "fails"
        out["readonly_pipe_output"] = (ro.stdout + ro.stderr).strip()[-400:]
    except (OSError, subprocess.TimeoutExpired) as err:
        out["readonly_pipe_client"], out["readonly_pipe_output"] = "fails", str(err)
    print(f"tricks: client with a read-only pipe directory: {out['readonly_pipe_client']}", flush=True)
    servers = control(command, ["get_server_list"], env).split()
    out["server_list"] = servers
    if servers:
        lines = [f"set_active_thread_percentage {servers[0]} 100"]
        out["tenant_command"] = control(command, lines, env, read_only=True)
        out["lifted_by_tenant_pct"] = 100 * run_clients([None], seconds, work, env)[0] / full
        print(f"tricks: after a tenant's command: {out['lifted_by_tenant_pct']:.1f} %", flush=True)


CLIENT_ONCE = r"""
import torch
a = torch.randn(1024, 1024, device="cuda")
torch.cuda.synchronize()
print("OK", float((a @ a).sum()))
"""


def under_mps(
    nvml: Any,
    handle: Any,
    report: dict[str, Any],
    seconds: float,
    work: Path,
    *,
    curve: bool = False,
    with_tricks: bool = False,
) -> None:
    """Steps 2 to 4 of the module docstring, into ``report``."""
    control, uuid, full = report["mps_control"], report["uuid"], report["full_rate"]
    pipe, logs = work / "pipe", work / "log"
    pipe.mkdir()
    logs.mkdir()
    mps_env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    started = time.monotonic()
    daemon = start_daemon(control, mps_env, uuid, pipe)
    report["daemon_up_s"] = round(time.monotonic() - started, 3)
    try:
        parts = {cap: partition_for(cap, report["sm_count_table"]) for cap in (30, 60)}
        report["percents"] = {cap: part.percent for cap, part in parts.items()}
        client_env = {**mps_env, "CUDA_VISIBLE_DEVICES": uuid}
        report["alone"] = {
            cap: 100 * run_clients([part.percent], seconds, work, client_env)[0] / full
            for cap, part in parts.items()
        }
        print(f"MPS alone, caps 30 / 60: {report['alone']} % of the GPU", flush=True)
        since = int(time.time() * 1_000_000)

        def look() -> None:  # while both clients run: whom NVML shows, with what memory
            report["nvml_during"] = nvml_view(nvml, handle, since)

        rates = run_clients([parts[30].percent, parts[60].percent], seconds, work, client_env, look)
        report["pair"] = [100 * r / full for r in rates]
        print(f"MPS pair, caps 30 + 60: {report['pair']} % of the GPU", flush=True)
        report["nvml"] = nvml_view(nvml, handle, since)
        if curve:
            report["curve"] = {
                pct: 100 * run_clients([pct], 2.0, work, client_env)[0] / full for pct in CURVE_PERCENTS
            }
            print(f"throughput by percentage: {report['curve']}", flush=True)
        server = subprocess.run(["pgrep", "-f", "nvidia-cuda-mps-server"], capture_output=True, text=True)
        report["server_pids"] = sorted(int(p) for p in server.stdout.split())
        mem = subprocess.run(
            [sys.executable, "-c", MEMORY],
            env={**client_env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1024M"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        report["memlimit"] = (mem.stdout + mem.stderr).strip()[-400:]
        print(f"pinned limit 1024M, 2 GiB asked: {report['memlimit']}", flush=True)
        if with_tricks:
            tricks(report, seconds, work, client_env)
    finally:
        subprocess.run([control], input="quit\n", text=True, env=mps_env, timeout=30, check=False)
        try:
            daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            daemon.kill()
        control_log = logs / "control.log"
        report["control_log"] = control_log.read_text()[-1500:] if control_log.exists() else ""


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--json", help="write everything measured here")
    parser.add_argument("--curve", action="store_true", help="also: throughput alone at 10..100 %")
    parser.add_argument("--tricks", action="store_true", help="also: what a tenant can do to the daemon")
    args = parser.parse_args()
    import pynvml as nvml  # noqa: PLC0415  (on the GPU machine only)

    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    report = gpu_facts(nvml, handle)
    print(json.dumps(report), flush=True)
    work = Path(tempfile.mkdtemp(prefix="mps-probe-"))
    report["full_rate"] = run_clients([None], args.seconds, work, dict(os.environ))[0]
    print(f"alone, no MPS: {report['full_rate']:.1f} matmuls/s", flush=True)
    if report["mps_control"] is None:
        print("RESULT no_mps_control=1")
        return 1
    under_mps(nvml, handle, report, args.seconds, work, curve=args.curve, with_tricks=args.tricks)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, default=str), flush=True)
    credited = set(report["nvml"]["samples_by_pid"])
    credit = "none" if not credited else ("server" if credited <= set(report["server_pids"]) else "client")
    alone, pair = report["alone"], report["pair"]
    print(
        f"RESULT alone30_pct={alone[30]:.1f} alone60_pct={alone[60]:.1f} pair30_pct={pair[0]:.1f} "
        f"pair60_pct={pair[1]:.1f} samples_credit={credit} "
        f"memlimit_fails={'yes' if 'FAILED' in report['memlimit'] else 'no'} "
        f"driver_limits={'yes' if report['driver_limits'] == 'supported' else 'no'}"
        + _tricks_result(report.get("tricks"))
    )
    return 0


def _tricks_result(tricks: dict[str, Any] | None) -> str:
    if tricks is None:
        return ""
    lifted = tricks.get("lifted_by_tenant_pct")
    return (
        f" env100_over_default30_pct={tricks['env100_over_default30_pct']:.1f}"
        f" readonly_pipe_client={tricks['readonly_pipe_client']}"
        f" lifted_by_tenant_pct={'na' if lifted is None else f'{lifted:.1f}'}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
