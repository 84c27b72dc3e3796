"""A MIG tenant cannot reach past its instance: queueing deep work on its instance leaves a
neighbour instance's throughput as it was alone (the simulated GPU's own MIG engines, in
virtual time: exact and deterministic), pointing CUDA at the parent GPU finds no GPU to run on
(the real GPU server), and the device nodes of another instance stay closed to its container
(the agent's device guard against the real kernel). Naming another instance's UUID in
CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES is harmless on a node for that last reason:
CUDA needs that instance's /dev/nvidia-caps nodes, which the container's device cgroup denies
(the simulated GPU does not model device nodes, so that half is proven on the kernel)."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.control.deviceguard import DeviceGuard, GuardTarget
from agent.platform.cgroups.detect import CgroupDriver
from agent.platform.cgroups.devices_v2 import BpfDeviceRules
from agent.platform.cgroups.layout import UNIFIED
from agent.platform.cgroups.paths import CgroupResolver
from agent.platform.gpu.migprofiles import product
from agent.platform.gpu.migstate import MigDevice
from agent.platform.gpu.sim.backend import SimulatedBackend
from agent.platform.gpu.sim.engine import GpuEngine
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.migops import MigEngine, MigHost
from agent.platform.gpu.sim.nodefile import SimGpuSlot, SimNode
from agent.platform.gpu.sim.programs import (
    GraphLaunch,
    Launch,
    PatternSpec,
    Program,
    WorkloadStats,
    pattern_program,
)
from agent.platform.gpu.sim.virtual import VirtualNode, VirtualProcess
from agent.settings import GuardMode
from tests.integration.cgroup_trees import CgroupTree, cgroup_tree

H100_SMS = 132
GEOMETRY = ("3g.40gb", "2g.20gb")
WARMUP_S, WINDOW_S = 1.0, 30.0  # virtual seconds
STREAMS = 8  # the tenant's contexts, each with a full queue of long kernels
VICTIM = PatternSpec("train")  # steps of 20 kernels of 2 ms, a sync after each
DEEP = PatternSpec("burn", kernel_ms=200.0)


# -- throughput, in virtual time ---------------------------------------------------------------


def mig_devices() -> dict[str, MigEngine]:
    """The simulated GPU server's MIG side for one H100-80GB in MIG mode with ``GEOMETRY``,
    built as ``sim-gpu --mig 0:3g.40gb,2g.20gb`` builds it: each device's own engine."""
    config = EngineConfig()
    slot = SimGpuSlot(0, "GPU-6d1f0c2a-0000-4000-8000-000000000000", "NVIDIA H100 80GB HBM3", 81559,
                      config.sample_period_s, False)  # fmt: skip
    node = SimNode("mig-tenant", "1xH100-80GB", os.getpid(), (slot,))
    host = MigHost(node, [config], [GpuEngine(config, 0.0, 0.0)], 0.0, [product("H100-80GB")])
    host.enable(0, GEOMETRY, 0.0)
    return {host.gpus[0].gi(d.gi).profile.name: d for d in host.engines_of(0)}


def on_instance(program: Program, rate: float) -> Program:
    """``program`` as the GPU server runs it on a MIG device: its kernel times are seconds of
    the whole GPU and take ``1 / rate`` as long on the device's SMs (server.py does the same)."""
    op = next(program)
    while True:
        if isinstance(op, Launch):
            op = Launch(op.count, op.kernel_s / rate)
        elif isinstance(op, GraphLaunch):
            op = GraphLaunch(op.kernels, op.kernel_s / rate)
        at = yield op
        try:
            op = program.send(at)
        except StopIteration:
            return


def program(spec: PatternSpec) -> Program:
    return pattern_program(spec, WorkloadStats())


def throughput(node: VirtualNode, proc: VirtualProcess, rate: float) -> float:
    """Percent of the whole GPU's work ``proc`` did over the window (after the warm-up)."""
    node.run_until(WARMUP_S)
    before = proc.ctx.ran
    node.run_until(WARMUP_S + WINDOW_S)
    return 100 * (proc.ctx.ran - before) * rate / WINDOW_S


def victim_on_mig(with_tenant: bool) -> tuple[float, float]:
    """The 2g victim's throughput, and the 3g tenant's (0 without it), in percent of the GPU."""
    devices = mig_devices()
    two, three = devices["2g.20gb"], devices["3g.40gb"]
    node = VirtualNode([two.engine.config, three.engine.config])
    node.engines = [two.engine, three.engine]  # the MIG devices' own engines, nothing shared
    victim = node.spawn(0, on_instance(program(VICTIM), two.rate))
    tenant = (
        [node.spawn(1, on_instance(program(DEEP), three.rate)) for _ in range(STREAMS)] if with_tenant else []
    )
    got = throughput(node, victim, two.rate)
    work = sum(p.ctx.ran for p in tenant) * three.rate
    return got, 100 * work / (WARMUP_S + WINDOW_S)


def test_a_deep_queue_in_one_instance_leaves_the_neighbours_throughput_unchanged() -> None:
    alone, _ = victim_on_mig(with_tenant=False)
    beside, tenant = victim_on_mig(with_tenant=True)
    assert alone == pytest.approx(100 * 32 / H100_SMS, abs=1.0)  # the 2g's 32 SMs, minus host gaps
    assert abs(beside - alone) <= 3.0, (alone, beside)
    # The tenant keeps its 3g busy, never past its 60 SMs (its 8 contexts' time-slice switches
    # cost it some of them).
    assert 30.0 < tenant <= 100 * 60 / H100_SMS

    # The same tenants on the whole GPU, time-sliced: the measurement sees interference.
    node = VirtualNode([EngineConfig()])
    victim = node.spawn(0, program(VICTIM))
    shared_alone = throughput(node, victim, 1.0)
    node = VirtualNode([EngineConfig()])
    victim = node.spawn(0, program(VICTIM))
    for _ in range(STREAMS):
        node.spawn(0, program(DEEP))
    assert throughput(node, victim, 1.0) < shared_alone - 3.0


# -- the parent GPU, on the real GPU server ----------------------------------------------------


@pytest.fixture
def backend(short_dir: Path) -> Iterator[SimulatedBackend]:
    sim = SimulatedBackend(
        "1xH100-80GB", "mig-node", short_dir / "sim", server_args=("--mig", "0:" + ",".join(GEOMETRY))
    )
    yield sim
    sim.close()


def test_naming_the_parent_gpu_runs_nothing(backend: SimulatedBackend) -> None:
    parent = backend.gpus()[0].uuid
    cmd = [sys.executable, "-m", "agent", "sim-workload", "--sim-state-dir", str(backend.root.root)]
    cmd += ["--gpu", "0", "--duration", "1"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": parent, "NVIDIA_VISIBLE_DEVICES": parent}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "GPU 0 is in MIG mode" in done.stderr + done.stdout
    assert not any(backend.process_memory(0))


# -- another instance's device nodes, on the real kernel ---------------------------------------

EPERM, ENXIO = errno.EPERM, errno.ENXIO  # ENXIO: the cgroup let the open through (no driver here)
CAPS_MAJOR, UVM_MAJOR = 241, 240  # free on this machine; named in the fake /proc/devices
UID = "5b0c3a1e-2d4f-4e6a-8b7c-9d0e1f2a3b4c"
CID = "ab" * 32
POD = f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID.replace('-', '_')}.slice"
LABEL = "default/mig-2g/c"


@pytest.fixture
def tree() -> Iterator[CgroupTree]:
    with cgroup_tree() as made:
        yield made


def cap_nodes(tmp_path: Path, devices: list[MigDevice]) -> dict[str, Path]:
    """/dev/nvidia0, nvidiactl, uvm and every capability node: config (1), monitor (2) and
    each instance's GI and CI access nodes; and a /proc with the NVIDIA majors."""
    made = {"nvidia0": (195, 0), "nvidiactl": (195, 255), "nvidia-uvm": (UVM_MAJOR, 0)}
    made |= {"cap-config": (CAPS_MAJOR, 1), "cap-monitor": (CAPS_MAJOR, 2)}
    for d in devices:
        assert d.gi_cap_minor is not None and d.ci_cap_minor is not None
        made |= {
            f"{d.profile}-gi": (CAPS_MAJOR, d.gi_cap_minor),
            f"{d.profile}-ci": (CAPS_MAJOR, d.ci_cap_minor),
        }
    paths = {}
    for name, (major, minor) in made.items():
        paths[name] = tmp_path / name
        os.mknod(paths[name], stat.S_IFCHR | 0o666, os.makedev(major, minor))
    proc = tmp_path / "proc"
    proc.mkdir()
    majors = f"195 nvidia\n{UVM_MAJOR} nvidia-uvm\n{CAPS_MAJOR} nvidia-caps\n"
    (proc / "devices").write_text(f"Character devices:\n{majors}\nBlock devices:\n")
    paths["proc"] = proc
    return paths


@pytest.mark.privileged
def test_another_instances_device_nodes_stay_closed_to_the_container(
    backend: SimulatedBackend, tree: CgroupTree, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("loading BPF programs needs root")
    devices = {d.profile: d for d in backend.mig(0).devices}
    mine, other = devices["2g.20gb"], devices["3g.40gb"]
    assert mine.gi_cap_minor is not None and mine.ci_cap_minor is not None
    nodes = cap_nodes(tmp_path, list(devices.values()))
    scope = tree.mkdir(UNIFIED, f"{POD}/cri-containerd-{CID}.scope")
    target = GuardTarget(
        UID, "BestEffort", CID, frozenset({0}), LABEL, frozenset({mine.gi_cap_minor, mine.ci_cap_minor})
    )
    rules = BpfDeviceRules()
    rules.load()
    try:
        resolver = CgroupResolver(tree.layout, CgroupDriver.SYSTEMD)
        guard = DeviceGuard(
            lambda: [target], resolver, rules, mode=GuardMode.ENFORCE, proc_root=nodes["proc"]
        )
        probe = tree.prober()
        probe.join(scope)
        assert guard.reconcile_once().applied == [LABEL]
        opened = {name: probe.open_errno(path) for name, path in nodes.items() if name != "proc"}
    finally:
        rules.close()
    assert opened == {
        "nvidia0": ENXIO,
        "nvidiactl": ENXIO,
        "nvidia-uvm": ENXIO,
        f"{mine.profile}-gi": ENXIO,
        f"{mine.profile}-ci": ENXIO,
        f"{other.profile}-gi": EPERM,  # the neighbour instance
        f"{other.profile}-ci": EPERM,
        "cap-config": EPERM,  # creating or destroying instances
        "cap-monitor": EPERM,
    }
