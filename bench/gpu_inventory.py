"""What bench/gpu_suite.py records about the machine before it measures anything
(``inventory.json``): the GPU and driver, each GPU's MIG support (read only: gpu_mig.py),
which NVML calls the driver's library has and which of them answer on GPU 0, one raw answer
of each per-process and device sampling call, MPS, cgroups, BPF, Python and PyTorch.

Every fact is read on its own and a failure is written down as the fact ("error: ..."): an
inventory of a machine that lacks half of this is still the inventory. No NVIDIA driver
(no pynvml, no libnvidia-ml, no device) is reported as the reason, for the suite to stop on.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from gpu_mig import mig_facts

CGROUP = Path("/sys/fs/cgroup")
GPU_UTILIZATION_SAMPLES = 1  # NVML_GPU_UTILIZATION_SAMPLES, should the binding lack the name
NVML_NOT_FOUND = 6
TORCH_PROBE = (
    "import json, sys, torch\n"
    "ok = torch.cuda.is_available()\n"
    "print(json.dumps({'torch': torch.__version__, 'cuda_available': ok, 'torch_cuda': torch.version.cuda,"
    " 'device': torch.cuda.get_device_name(0) if ok else None}))\n"
)
SYMBOLS = (
    "nvmlDeviceGetProcessUtilization",
    "nvmlDeviceGetProcessesUtilizationInfo",
    "nvmlDeviceGetSamples",
    "nvmlGpmQueryDeviceSupport",
    "nvmlDeviceSetMemoryLimits_v1",
    "nvmlDeviceGetAccountingMode",
)


def _guard(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or the error as the fact."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001  (the error is the fact recorded)
        return f"error: {type(err).__name__}: {err}"


# The host -------------------------------------------------------------------------------------
def cgroup_facts(mounts: Path = Path("/proc/self/mounts")) -> dict[str, Any]:
    """v2 (``/sys/fs/cgroup`` is cgroup2), hybrid (v1 there, v2 at ``unified``), v1, or none."""
    types: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in mounts.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3 and fields[1].startswith(str(CGROUP)):
                types[fields[1]] = fields[2]
    root_type = types.get(str(CGROUP))
    if root_type == "cgroup2":
        version, v2 = "v2", str(CGROUP)
    elif types.get(str(CGROUP / "unified")) == "cgroup2":
        version, v2 = "hybrid", str(CGROUP / "unified")
    elif "cgroup" in types.values():
        version, v2 = "v1", None
    else:
        version, v2 = "none", None
    return {"version": version, "v2_root": v2, "mounts": types}


def v2_root() -> Path | None:
    found = cgroup_facts()["v2_root"]
    return None if found is None else Path(found)


def bpf_raw_load() -> str:
    """Load the smallest BPF program there is (a socket filter: r0 = 0; exit) with the bpf()
    syscall: whether this process may load BPF programs at all, with or without bcc."""
    numbers = {"x86_64": 321, "aarch64": 280}
    number = numbers.get(platform.machine())
    if number is None:
        return f"not tried: bpf() syscall number unknown for {platform.machine()}"
    insns = (ctypes.c_uint64 * 2)(0x00000000000000B7, 0x0000000000000095)  # mov64 r0, 0; exit
    license_ = ctypes.create_string_buffer(b"GPL")
    attr = (ctypes.c_uint8 * 128)()
    words = ctypes.cast(attr, ctypes.POINTER(ctypes.c_uint32))
    words[0], words[1] = 1, 2  # BPF_PROG_TYPE_SOCKET_FILTER, two instructions
    ctypes.c_uint64.from_buffer(attr, 8).value = ctypes.addressof(insns)
    ctypes.c_uint64.from_buffer(attr, 16).value = ctypes.addressof(license_)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(number, 5, ctypes.byref(attr), ctypes.c_uint(128))  # BPF_PROG_LOAD
    if fd < 0:
        errno = ctypes.get_errno()
        return f"error: bpf(BPF_PROG_LOAD) failed: {os.strerror(errno)} (errno {errno})"
    os.close(fd)
    return "ok"


def bpf_facts() -> dict[str, Any]:
    """The raw load above, and the agent's own feature probe for its ioctl tracer (bcc,
    privileges, kernel headers, tracefs), which needs no GPU."""
    facts: dict[str, Any] = {"raw_load": _guard(bpf_raw_load)}
    try:
        probe = importlib.import_module("agent.platform.bpf.probe")
        support = probe.probe_bpf()
        facts["tracer"] = {
            "status": support.status.value,
            "reason": support.reason,
            "kernel": support.kernel_release,
            "headers": None if support.headers is None else str(support.headers),
            "tracefs": None if support.tracefs is None else str(support.tracefs),
            "kprobes": support.kprobes,
            "nvidia_module": support.nvidia_module,
        }
    except Exception as err:  # noqa: BLE001  (an agent that does not import here is a fact too)
        facts["tracer"] = f"error: {type(err).__name__}: {err}"
    try:
        importlib.import_module("agent.platform.bpf.loaded").find_bcc()
        facts["bcc"] = "present"
    except Exception as err:  # noqa: BLE001  (recorded)
        facts["bcc"] = f"absent: {err}"
    return facts


def torch_facts(python: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """PyTorch as the workers will see it (a child: importing torch here would cost seconds
    and a CUDA context in the process that does the measuring)."""
    try:
        done = subprocess.run([python, "-c", TORCH_PROBE], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"torch probe exited {done.returncode}: {last}"}
    try:
        found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as err:
        return {"error": f"torch probe printed {done.stdout[-200:]!r}: {err}"}
    return found


def host_facts(python: str, *, with_torch: bool = True) -> dict[str, Any]:
    return {
        "python": {"version": sys.version.split()[0], "executable": sys.executable},
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cgroup": _guard(cgroup_facts),
        "bpf": _guard(bpf_facts),
        "mps_control": shutil.which("nvidia-cuda-mps-control"),
        "mps_v3": _guard(mps_v3_facts),
        "torch": torch_facts(python) if with_torch else "not probed",
    }


def mps_v3_facts(capacity: Path | None = None) -> dict[str, Any]:
    """What the agent's MPS v3 detection finds here (agent.platform.mpsv3), and the raw
    dmem.capacity, so that the first lent GPU with an r615+ driver records both."""
    from agent.platform.mpsv3 import DMEM_CAPACITY, probe_v3  # noqa: PLC0415  (the agent, only here)

    capacity = capacity or DMEM_CAPACITY
    control = shutil.which("nvidia-cuda-mps-control")
    v3, detail = probe_v3([control]) if control else (False, "no nvidia-cuda-mps-control")
    try:
        dmem: Any = capacity.read_text(errors="replace").splitlines()[:32]
    except OSError as err:
        dmem = f"absent: {err}"
    return {"v3": v3, "detail": detail, "dmem_capacity": dmem}


# NVML ----------------------------------------------------------------------------------------
def open_nvml() -> tuple[ModuleType | None, str | None]:
    """(initialized pynvml, None) or (None, why there is no usable NVIDIA driver)."""
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError as err:
        driver = Path("/proc/driver/nvidia/version")
        seen = "present" if driver.exists() else "absent"
        return None, f"pynvml (nvidia-ml-py) is not importable: {err}; {driver} {seen}"
    try:
        nvml.nvmlInit()
    except Exception as err:  # noqa: BLE001  (NVMLError, or a ctypes error: the reason to stop on)
        return None, f"nvmlInit failed: {err}"
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except Exception as err:  # noqa: BLE001  (the reason to stop on)
        _shutdown(nvml)
        return None, f"nvmlDeviceGetCount failed: {err}"
    if count == 0:
        _shutdown(nvml)
        return None, "NVML sees no GPU"
    return nvml, None


def _shutdown(nvml: ModuleType) -> None:
    with contextlib.suppress(Exception):
        nvml.nvmlShutdown()


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_error_code(err: BaseException) -> int | None:
    value = getattr(err, "value", None)
    return value if isinstance(value, int) else None


def sample_value(value: Any, value_type: int) -> float | int:
    """The member of NVML's value union that ``value_type`` names (GPU utilization: uint)."""
    member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
    got = getattr(value, member.get(value_type, "uiVal"))
    return float(got) if value_type == 0 else int(got)


def process_utilization(nvml: ModuleType, handle: Any, since_us: int) -> list[list[int]]:
    """Raw ``nvmlDeviceGetProcessUtilization``: [pid, timeStamp µs, smUtil, memUtil] per
    entry; NOT_FOUND (nothing newer than ``since_us``) is the empty list it means."""
    try:
        got = nvml.nvmlDeviceGetProcessUtilization(handle, since_us)
    except nvml.NVMLError as err:
        # pynvml raises NVMLError(SUCCESS) when the size query finds no sample at all.
        if nvml_error_code(err) in (0, NVML_NOT_FOUND):
            return []
        raise
    return [[int(s.pid), int(s.timeStamp), int(s.smUtil), int(s.memUtil)] for s in got]


def device_samples(nvml: ModuleType, handle: Any, since_us: int) -> list[list[int | float]]:
    """Raw ``nvmlDeviceGetSamples(GPU_UTILIZATION_SAMPLES)``: [timeStamp µs, value] each."""
    kind = getattr(nvml, "NVML_GPU_UTILIZATION_SAMPLES", GPU_UTILIZATION_SAMPLES)
    try:
        value_type, got = nvml.nvmlDeviceGetSamples(handle, kind, since_us)
    except nvml.NVMLError as err:
        if nvml_error_code(err) == NVML_NOT_FOUND:
            return []
        raise
    return [[int(s.timeStamp), sample_value(s.sampleValue, int(value_type))] for s in got]


def _symbol(nvml: ModuleType, name: str) -> str:
    lookup = getattr(nvml, "_nvmlGetFunctionPointer", None)
    if lookup is None:
        return "unknown (the binding has no _nvmlGetFunctionPointer)"
    try:
        lookup(name)
    except Exception as err:  # noqa: BLE001  (NVMLError FUNCTION_NOT_FOUND, recorded)
        return f"absent: {err}"
    return "present"


def _calls(nvml: ModuleType, handle: Any) -> dict[str, Any]:
    """Each sampling call once on GPU 0, its outcome as the fact."""
    now_us = int(time.time() * 1e6)

    def processes_info() -> Any:
        got = nvml.nvmlDeviceGetProcessesUtilizationInfo(handle, 0)
        return [[int(s.pid), int(s.timeStamp), int(s.smUtil), int(s.memUtil)] for s in got]

    def samples() -> Any:
        got = device_samples(nvml, handle, 0)
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(got)]
        return {
            "count": len(got),
            "median_gap_us": statistics.median(gaps) if gaps else None,
            "first": got[:3],
            "last": got[-3:],
        }

    def gpm() -> Any:
        return {"isSupportedDevice": int(nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)}

    return {
        "nvmlDeviceGetProcessUtilization": {
            "since_0": _guard(process_utilization, nvml, handle, 0),
            "since_recent": {
                "since": now_us - 1_000_000,
                "samples": _guard(process_utilization, nvml, handle, now_us - 1_000_000),
            },
        },
        "nvmlDeviceGetProcessesUtilizationInfo": _guard(processes_info),
        "nvmlDeviceGetSamples": _guard(samples),
        "nvmlGpmQueryDeviceSupport": _guard(gpm),
        "nvmlDeviceGetAccountingMode": _guard(lambda: int(nvml.nvmlDeviceGetAccountingMode(handle))),
        "nvmlDeviceSetMemoryLimits_v1": "not called (symbol lookup only)",
    }


def _memory_limits(nvml: ModuleType) -> str:
    try:
        limits = importlib.import_module("agent.platform.gpu.nvml_limits")
    except Exception as err:  # noqa: BLE001  (recorded)
        return f"error: cannot import agent.platform.gpu.nvml_limits: {err}"
    why = limits.limits_support(nvml)
    return "supported" if why is None else f"unsupported: {why}"


def nvml_inventory(nvml: ModuleType) -> dict[str, Any]:
    """The GPUs and the sampling calls of an initialized NVML."""
    facts: dict[str, Any] = {
        "binding": getattr(nvml, "__file__", "?"),
        "driver": _guard(lambda: text(nvml.nvmlSystemGetDriverVersion())),
        "cuda_driver": _guard(_cuda_version, nvml),
        "gpus": [],
    }
    for index in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        facts["gpus"].append(
            {
                "index": index,
                "name": _guard(lambda h=handle: text(nvml.nvmlDeviceGetName(h))),
                "uuid": _guard(lambda h=handle: text(nvml.nvmlDeviceGetUUID(h))),
                "memory_mib": _guard(lambda h=handle: int(nvml.nvmlDeviceGetMemoryInfo(h).total) >> 20),
                "compute_mode": _guard(lambda h=handle: int(nvml.nvmlDeviceGetComputeMode(h))),
                "mig": _guard(mig_facts, nvml, handle),  # read only: never a mode change or an instance
            }
        )
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    facts["symbols"] = {
        name: {"binding": hasattr(nvml, name), "library": _symbol(nvml, name)} for name in SYMBOLS
    }
    facts["calls_gpu0"] = _calls(nvml, handle)
    facts["memory_limits"] = _memory_limits(nvml)
    return facts


def _cuda_version(nvml: ModuleType) -> int:
    for name in ("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"):
        call = getattr(nvml, name, None)
        if call is not None:
            with contextlib.suppress(Exception):
                return int(call())
    raise RuntimeError("neither nvmlSystemGetCudaDriverVersion_v2 nor _v1 answered")


def sim_inventory(backend: Any) -> dict[str, Any]:
    """The same facts from the simulated GPUs (agent.platform.gpu.sim.backend)."""
    now_us = int(time.time() * 1e6)

    def proc(since: int) -> Any:
        return [[s.pid, s.timestamp_us, s.sm_util, None] for s in backend.process_samples(0, since)]

    def samples() -> Any:
        got = backend.device_samples(0, 0)
        gaps = [b.timestamp_us - a.timestamp_us for a, b in itertools.pairwise(got)]
        return {"count": len(got), "median_gap_us": statistics.median(gaps) if gaps else None}

    return {
        "binding": "agent.platform.gpu.sim.backend.SimulatedBackend",
        "driver": "simulated",
        "cuda_driver": None,
        "gpus": [
            {"index": g.index, "name": g.model, "uuid": g.uuid, "memory_mib": g.memory_mib}
            for g in backend.gpus()
        ],
        "sample_period_s": _guard(backend.sample_period_s, 0),
        "calls_gpu0": {
            "nvmlDeviceGetProcessUtilization": {
                "since_0": _guard(proc, 0),
                "since_recent": {"since": now_us - 1_000_000, "samples": _guard(proc, now_us - 1_000_000)},
            },
            "nvmlDeviceGetSamples": _guard(samples),
            "nvmlDeviceGetUtilizationRates": _guard(backend.device_utilization, 0),
        },
        "memory_limits": _guard(lambda: backend.memory_limits_support() or "supported"),
    }
