"""The agent process's heap: keep the cyclic garbage collector off the start-up objects.

A full (generation 2) collection walks every tracked object. After start-up the agent holds
about 150 000 of them that never become garbage (the modules of the Kubernetes client,
gRPC, protobuf, bcc; the settings; the inventory), and a full pass over them stalled every
thread for 110-140 ms on a 2-core VM (docs/benchmarks.md): an Allocate waits, a control
period is late, a container stays frozen that long past its turn. ``freeze_startup_heap`` collects once and
moves what survives into the permanent generation (``gc.freeze``), so later passes walk only
what was made since. Objects frozen this way are still freed by reference counting; only a
reference cycle among them would never be collected, which is why it runs once, when the
start-up objects are all that the heap holds.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze what survives; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
