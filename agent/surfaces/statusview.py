"""The status document that ``vcuda-agent status`` shows: its schema and typed builders.

The agent answers ``GET /status`` on its status socket (``surfaces/statusserver.py``)
with one JSON object, schema version 1 (``SCHEMA_VERSION``). Keys are camelCase, like
the Kubernetes objects next to them. An example::

    {"version": 1, "node": "n1", "time": 1763800000.0,
     "agent": {"pid": 1, "uptimeSeconds": 12.3, "backend": "simulated", "enforcement": "on",
               "actuator": "freezer", "memoryMode": "kill", "periodSeconds": 0.25,
               "watchdog": "running", "bpf": "ok", "freezeJournal": "ok", "dra": "off",
               "visibleDevicesHole": {"state": "closed", "detail": "..."}},
     "gpus": [{"index": 0, "uuid": "GPU-...", "model": "NVIDIA H100 80GB HBM3", "health": "Healthy",
               "degraded": null,
               "utilizationPercent": 55, "memoryUsedMiB": 1024, "memoryTotalMiB": 81559,
               "coresAllocated": 80,
               "containers": [{"namespace": "default", "pod": "p", "container": "c",
                               "policy": "fixed-share", "requestCores": 30, "capPercent": 30,
                               "ceilingPercent": 30, "whole": false, "usedPercent": 29.5,
                               "targetPercent": 30, "duty": 0.31, "cycleSeconds": 1.0,
                               "drainSeconds": 0.03, "frozen": false,
                               "memoryUsedMiB": 512, "memoryQuotaMiB": 1024, "throttled": true,
                               "computeHeldBy": "freezer", "computeDetail": "sharing mode is freezer",
                               "memoryHeldBy": "kill", "memoryDetail": "...", "problem": null}],
               "sharing": "freezer", "sharingReason": "sharing mode is freezer", "mpsDaemon": null}],
     "recentActions": [{"time": 1763800000.0, "container": "default/p/c",
                        "action": "killed pid 123", "detail": "..."}]}

Fields:

- ``version``: this schema's version; a reader refuses nothing but says when it is newer.
- ``node``: the node name. ``time``: when the snapshot was taken, Unix seconds (wall clock).
- ``agent``: ``pid``; ``uptimeSeconds``; ``backend`` (``nvml`` | ``simulated``);
  ``enforcement`` (``on`` | ``off``: off measures only); ``actuator`` (``freezer`` |
  ``signals`` | ``auto``: what pauses containers); ``memoryMode`` (``kill`` | ``deny`` |
  ``audit``); ``periodSeconds`` (the control period; a duty cycle is 1 to 8 of them);
  ``watchdog`` (``running`` | ``off`` | ``dead``); ``bpf`` (``ok``, ``off`` or why it is
  unavailable, free text); ``freezeJournal`` (``ok``, or why the last write of the freeze
  journal failed, e.g. the disk is full: until one succeeds, no container that the journal
  does not list yet is frozen); ``dra`` (``off``, or the DRA driver's state: kubelet
  registration, claims prepared, the ResourceSlice's generation and devices);
  ``visibleDevicesHole`` (``{state, detail}``: whether a pod's own ``NVIDIA_VISIBLE_DEVICES``
  gets it every GPU from the NVIDIA container runtime, read from the toolkit's config.toml:
  ``open``, ``closed`` or ``unknown``, and why; deploy/README.md says how to close it).
- ``gpus[]``: ``index``, ``uuid``, ``model``, ``health`` (``Healthy`` | ``Unhealthy``),
  ``degraded`` (null, or why the agent cannot read the GPU now: a backend call stuck past
  its deadline, naming the NVML function, or reads failing for a while; meanwhile its
  containers are not throttled, and it stays Healthy for kubelet),
  ``utilizationPercent`` (whole GPU, 0..100), ``memoryUsedMiB``, ``memoryTotalMiB``,
  ``coresAllocated`` (vcuda-core in the ledger, 0..100), ``containers[]``; ``sharing``
  (``mps`` | ``freezer``: how its shares are held) and ``sharingReason`` (why);
  ``mpsDaemon`` (``{state, pid, restarts, error}`` of its MPS control daemon, or null);
  ``mig`` (null for a GPU without MIG, else ``{mode, pending, devices[]}``: ``mode`` and
  ``pending`` are ``enabled`` | ``disabled``, ``pending`` the mode a GPU reset applies; each
  device ``{gi, ci, profile, uuid, placement ("start:size" on the memory slices), memoryMiB,
  smCount, health (``Healthy`` | ``Unhealthy``: an XID on its GPU instance), healthReason,
  capDevices (the /dev/nvidia-caps nodes it needs)}``; ``strategy``, the node config's MIG
  strategy; ``shares``, null or why the GPU offers no vcuda-core/vcuda-memory; ``geometry``,
  null or ``{wanted, state (applied | pending | waiting | refused), reason}``: docs/mig.md).
- ``containers[]``: ``namespace``/``pod``/``container``; ``policy`` (the container's cap
  policy, e.g. ``fixed-share``); ``requestCores`` (vcuda-core on this GPU); ``capPercent``
  (the cap it is held to); ``ceilingPercent`` (the most it may use when the policy lets it
  borrow idle time); ``whole`` (a whole GPU: never capped); ``usedPercent`` (measured
  over the control window); ``targetPercent`` (what the controller aims at now);
  ``duty`` (share of each duty cycle it runs, 0..1); ``cycleSeconds`` (its GPU's duty
  cycle while it is throttled, else null); ``drainSeconds`` (GPU seconds it is seen to run
  after each freeze, at least; null until measured); ``frozen`` (paused right now);
  ``memoryUsedMiB``; ``memoryQuotaMiB`` (its vcuda-memory); ``throttled`` (the
  controller is holding it below what it would use); ``computeHeldBy`` (``mps+freezer``:
  an MPS active-thread limit with the duty cycles on top, ``freezer``, ``none``) and
  ``computeDetail``; ``memoryHeldBy`` (``mps``: a pinned memory limit, ``driver``: an NVML
  per-cgroup limit, else the guard's ``kill`` | ``deny`` | ``audit``, ``none``) and
  ``memoryDetail``; ``problem`` (null, or why the controller cannot act on it now, e.g. a
  freeze skipped because the freeze journal cannot be written).
- ``guardExemptions[]``: the pods the device guard leaves alone, each ``namespace``/``pod``
  and ``reason`` (the agent's own pod, the admin's exempt namespaces, or a quantity above
  zero of a GPU resource another device plugin offers on this node).
- ``recentActions[]``, oldest first: ``time`` (Unix seconds), ``container``
  (``namespace/pod/container``, or ``""`` for node-wide actions), ``action`` (short,
  e.g. ``killed pid 123``), ``detail`` (free text).

``null`` means "not known" or "does not apply": a container with no sample yet has
``usedPercent: null``; whole-GPU containers have ``null`` cap, ceiling, target and duty;
no vcuda-memory request gives ``memoryQuotaMiB: null``; a lost GPU reports ``null``
utilization and memory used. Readers must accept keys they do not know (additions do
not change the version; renames and removals do).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TypedDict

from agent.clock import Clock, SystemClock
from agent.surfaces.migstatus import MigStatus

SCHEMA_VERSION = 1


class HoleInfo(TypedDict):
    state: str
    detail: str


class AgentInfo(TypedDict):
    pid: int
    uptimeSeconds: float
    backend: str
    enforcement: str
    actuator: str
    memoryMode: str
    periodSeconds: float
    watchdog: str
    bpf: str
    freezeJournal: str
    dra: str
    visibleDevicesHole: HoleInfo


class ContainerStatus(TypedDict):
    namespace: str
    pod: str
    container: str
    policy: str
    requestCores: int
    capPercent: float | None
    ceilingPercent: float | None
    whole: bool
    usedPercent: float | None
    targetPercent: float | None
    duty: float | None
    cycleSeconds: float | None
    drainSeconds: float | None
    frozen: bool
    memoryUsedMiB: int | None
    memoryQuotaMiB: int | None
    throttled: bool
    computeHeldBy: str
    computeDetail: str
    memoryHeldBy: str
    memoryDetail: str
    problem: str | None
    unholdable: str | None  # why its cap cannot be held by freezing (None: it can, or not held)


class MpsDaemonInfo(TypedDict):
    state: str
    pid: int | None
    restarts: int
    error: str


class GpuStatus(TypedDict):
    index: int
    uuid: str
    model: str
    health: str
    degraded: str | None
    utilizationPercent: float | None
    memoryUsedMiB: int | None
    memoryTotalMiB: int
    coresAllocated: int
    containers: list[ContainerStatus]
    sharing: str
    sharingReason: str
    mpsDaemon: MpsDaemonInfo | None
    mig: MigStatus | None


class ActionRecord(TypedDict):
    time: float
    container: str
    action: str
    detail: str


class GuardExemption(TypedDict):
    namespace: str
    pod: str
    reason: str


class StatusDocument(TypedDict):
    version: int
    node: str
    time: float
    agent: AgentInfo
    gpus: list[GpuStatus]
    guardExemptions: list[GuardExemption]
    recentActions: list[ActionRecord]


def container_name(namespace: str, pod: str, container: str) -> str:
    """How ``recentActions[].container`` names a container."""
    return f"{namespace}/{pod}/{container}"


def agent_info(
    *,
    pid: int,
    uptime_s: float,
    backend: str,
    enforcing: bool,
    actuator: str,
    memory_mode: str,
    period_s: float,
    watchdog: str,
    bpf: str,
    freeze_journal: str = "ok",
    dra: str = "off",
    visible_devices_hole: tuple[str, str] = ("unknown", "not checked"),
) -> AgentInfo:
    """``actuator``/``memory_mode`` take the settings' StrEnums as they are."""
    return AgentInfo(
        pid=pid,
        uptimeSeconds=round(uptime_s, 3),
        backend=str(backend),
        enforcement="on" if enforcing else "off",
        actuator=str(actuator),
        memoryMode=str(memory_mode),
        periodSeconds=period_s,
        watchdog=str(watchdog),
        bpf=str(bpf),
        freezeJournal=freeze_journal,
        dra=dra,
        visibleDevicesHole=HoleInfo(state=str(visible_devices_hole[0]), detail=visible_devices_hole[1]),
    )


def container_status(
    *,
    namespace: str,
    pod: str,
    container: str,
    policy: str,
    request_cores: int,
    whole: bool = False,
    cap_percent: float | None = None,
    ceiling_percent: float | None = None,
    used_percent: float | None = None,
    target_percent: float | None = None,
    duty: float | None = None,
    cycle_s: float | None = None,
    drain_s: float | None = None,
    frozen: bool = False,
    memory_used_mib: int | None = None,
    memory_quota_mib: int | None = None,
    throttled: bool = False,
    compute_held_by: tuple[str, str] = ("freezer", ""),
    memory_held_by: tuple[str, str] = ("kill", ""),
    problem: str | None = None,
    unholdable: str | None = None,
) -> ContainerStatus:
    """A container on one GPU; for ``whole`` GPUs the control fields are forced to null."""
    if whole:
        cap_percent = ceiling_percent = target_percent = duty = cycle_s = drain_s = None
    return ContainerStatus(
        namespace=namespace,
        pod=pod,
        container=container,
        policy=str(policy),
        requestCores=request_cores,
        capPercent=cap_percent,
        ceilingPercent=ceiling_percent,
        whole=whole,
        usedPercent=None if used_percent is None else round(used_percent, 2),
        targetPercent=None if target_percent is None else round(target_percent, 2),
        duty=None if duty is None else round(duty, 4),
        cycleSeconds=cycle_s,
        drainSeconds=None if drain_s is None else round(drain_s, 4),
        frozen=frozen,
        memoryUsedMiB=memory_used_mib,
        memoryQuotaMiB=memory_quota_mib,
        throttled=throttled,
        computeHeldBy=compute_held_by[0],
        computeDetail=compute_held_by[1],
        memoryHeldBy=memory_held_by[0],
        memoryDetail=memory_held_by[1],
        problem=problem or None,
        unholdable=unholdable or None,
    )


def gpu_status(
    *,
    index: int,
    uuid: str,
    model: str,
    healthy: bool,
    memory_total_mib: int,
    cores_allocated: int,
    utilization_percent: float | None = None,
    memory_used_mib: int | None = None,
    containers: list[ContainerStatus] | None = None,
    sharing: tuple[str, str] = ("freezer", ""),
    mps_daemon: MpsDaemonInfo | None = None,
    degraded: str | None = None,
    mig: MigStatus | None = None,
) -> GpuStatus:
    return GpuStatus(
        index=index,
        uuid=uuid,
        model=model,
        health="Healthy" if healthy else "Unhealthy",
        degraded=degraded,
        utilizationPercent=utilization_percent,
        memoryUsedMiB=memory_used_mib,
        memoryTotalMiB=memory_total_mib,
        coresAllocated=cores_allocated,
        containers=list(containers or []),
        sharing=sharing[0],
        sharingReason=sharing[1],
        mpsDaemon=mps_daemon,
        mig=mig,
    )


def action_record(time: float, container: str, action: str, detail: str = "") -> ActionRecord:
    return ActionRecord(time=time, container=container, action=action, detail=detail)


def status_document(
    *,
    node: str,
    time: float,
    agent: AgentInfo,
    gpus: list[GpuStatus],
    recent_actions: list[ActionRecord] | None = None,
    guard_exemptions: list[GuardExemption] | None = None,
) -> StatusDocument:
    """The whole document, stamped with ``SCHEMA_VERSION``; GPUs sorted by index."""
    return StatusDocument(
        version=SCHEMA_VERSION,
        node=node,
        time=time,
        agent=agent,
        gpus=sorted(gpus, key=lambda g: g["index"]),
        guardExemptions=list(guard_exemptions or []),
        recentActions=list(recent_actions or []),
    )


class ActionLog:
    """The last ``limit`` actions, for ``recentActions``; safe to record from any thread."""

    def __init__(self, limit: int = 50, clock: Clock | None = None) -> None:
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._records: deque[ActionRecord] = deque(maxlen=limit)

    def record(self, container: str, action: str, detail: str = "") -> ActionRecord:
        entry = action_record(self._clock.wall(), container, action, detail)
        with self._lock:
            self._records.append(entry)
        return entry

    def snapshot(self) -> list[ActionRecord]:
        """Oldest first; copies, so the caller may serialize them while others record."""
        with self._lock:
            return [ActionRecord(**r) for r in self._records]
