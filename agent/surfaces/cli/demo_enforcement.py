"""The demo's second act: limits that hold. A fresh simulated node whose pods run as real
processes in real container cgroups (``agent.emulators.enforcednode``): a fixed-share cap,
a burst-share container giving time back to a neighbour, a container over its memory
quota, and the agent SIGKILLed while it throttles (the watchdog thaws)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from agent.domain.annotations import POLICY
from agent.emulators.enforcednode import EnforcedNode, enforced_node, frozen, utilization, wait_for
from agent.surfaces.cli.demo_view import section
from agent.surfaces.cli.statusrender import render_status
from agent.surfaces.statusclient import fetch_status

SETTLE_S = 3.0


def run(workdir: Path) -> None:
    """Needs root and a cgroup v2 hierarchy; raises PlatformError where there is none."""
    core = str(max(os.sched_getaffinity(0)))  # keep the other cores for the agent and the demo
    section("enforcement: compute caps on real containers (1 simulated GPU = CPU core " + core + ")")
    with enforced_node(workdir, sim_cores=core, agent_args=("--device-guard", "off")) as node:
        _caps(node)
        _memory(node)
        _crash(node)


def _caps(node: EnforcedNode) -> None:
    burst = node.run_pod("burst-20", 20, annotations={POLICY: "burst-share"})
    time.sleep(SETTLE_S)
    (alone,) = utilization([burst], 3)
    print(f"pod burst-20 (burst-share, request 20) alone on the GPU borrows the idle time: used {alone:.0f}%")
    capped = node.run_pod("capped-30", 30, annotations={POLICY: "fixed-share"})
    time.sleep(SETTLE_S)
    used = utilization([burst, capped], 4)
    print(
        f"pod capped-30 (fixed-share 30) starts: burst-20 is brought back to its request: "
        f"burst-20 {used[0]:.0f}%, capped-30 {used[1]:.0f}%"
    )
    print("\n$ vcuda-agent status")
    print(render_status(fetch_status(node.state_dir / "status.sock")))


def _memory(node: EnforcedNode) -> None:
    print()
    grower = node.run_pod(
        "leaky",
        10,
        memory_mib=1024,
        busy=0.1,
        workload_mib=800,
        extra=("--grow-to-mib", "1500", "--grow-after", "1"),
    )
    record = node.runtime.sim_state_dir / "procs" / f"{grower.pid}.json"
    wait_for(lambda: '"memory_mib": 1500' in record.read_text(), 10, "the workload to grow")
    grew = time.monotonic()
    wait_for(lambda: grower.proc.poll() is not None, 5, "the process over its quota to be killed")
    events = wait_for(
        lambda: [e for e in node.api.events() if e.get("reason") == "GPUMemoryQuotaExceeded"], 5, "the Event"
    )
    after_ms = 1000 * (time.monotonic() - grew)
    print(f"pod leaky (vcuda-memory 1024) grew to 1500 MiB: its process was killed after {after_ms:.0f} ms")
    print(f"  Event {events[0]['reason']}: {events[0]['message']}")


def _crash(node: EnforcedNode) -> None:
    boxes = [c for c in node.runtime.containers if c.proc.poll() is None]
    wait_for(lambda: any(frozen(c.cgroup) for c in boxes), 5, "a frozen slice")
    node.agent.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    node.agent.wait()
    wait_for(lambda: not any(frozen(c.cgroup) for c in boxes), 5, "the watchdog to thaw everything")
    print(
        f"\nagent SIGKILLed while throttling {len(boxes)} containers: all thawed by the watchdog "
        f"after {1000 * (time.monotonic() - killed):.0f} ms"
    )
    node.start_agent()
    time.sleep(SETTLE_S)
    used = utilization(boxes, 3)
    print("agent restarted; control resumed: used " + " / ".join(f"{u:.0f}%" for u in used))
