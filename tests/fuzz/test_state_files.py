"""State the agent reads back from disk at start: the freeze journal (also read by the
watchdog, which thaws what it lists), the MPS grants (grants.json) and each MPS control
daemon's record (daemon.json). A crash, a full disk or an old agent can leave any bytes there.

Property: loading never raises (a bad file is logged and treated as empty, entry by entry for
the journal), and what is loaded is usable: typed, absolute paths the kernel accepts, pids that
can be signalled safely. The journal also keeps every entry it loaded through its next write.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from agent.control.mpssharing import MpsSharing
from agent.platform.freezejournal import FreezeJournal
from agent.platform.mpsdaemon import MpsDaemon, stop_recorded_daemons
from agent.platform.procfs import ProcFS
from agent.settings import SharingMode, SharingSettings
from tests.fuzz.strategies import DEEP, deep_json, dumps, json_bytes, json_values, mutations, raw_bytes
from tests.fuzz.tally import count
from tests.unit.kubefixtures import make_gpus

JOURNAL = {
    "version": 1,
    "agentPid": 1234,
    "cgroups": ["/sys/fs/cgroup/kubepods.slice/a.scope", "/sys/fs/cgroup/kubepods.slice/b.scope"],
    "processes": [{"pid": 4321, "startTicks": 98765, "key": "ns/pod/c"}, {"pid": 99, "startTicks": 0}],
}


def contents(doc: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """Bytes a state file may hold: a mutation of a valid document, any JSON, deep JSON, junk."""
    return st.one_of(
        mutations(doc).map(lambda m: dumps(m.doc).encode()),
        json_bytes,
        deep_json.map(str.encode),
        raw_bytes,
        json_values.map(lambda v: json.dumps({**doc, "cgroups": [v], "processes": [v]}).encode()),
    )


@given(data=contents(JOURNAL))
@example(data=DEEP.encode())  # json.loads: RecursionError escaped the ValueError handler
@example(data=b'{"version": 1, "cgroups": ["/sys/fs/cgroup/a\\u0000b"]}')  # open() refuses NUL
@example(data=b'{"version": 1, "cgroups": ["/sys/fs/cgroup/\\ud800"]}')  # no file name encodes it
def test_freeze_journal(data: bytes) -> None:
    count("freezejournal")
    with tempfile.TemporaryDirectory(prefix="vcuda-fuzz-") as tmp:
        path = Path(tmp) / "freeze.json"
        path.write_bytes(data)
        loaded = FreezeJournal(path).entries()
        for cgroup in loaded.cgroups:  # thaw_everything writes <cgroup>/cgroup.freeze
            assert cgroup.is_absolute() and "\0" not in str(cgroup)
            os.fsencode(cgroup)
        for process in loaded.processes:  # signal_identity sends SIGCONT to process.pid
            assert type(process.pid) is int and process.pid > 1
            assert type(process.start_ticks) is int and process.start_ticks >= 0
            assert isinstance(process.key, str)
        journal = FreezeJournal(path)
        journal.add_cgroup(Path("/sys/fs/cgroup/new.scope"))  # the next write keeps what was there
        kept = FreezeJournal(path).entries()
        assert set(loaded.cgroups) | {Path("/sys/fs/cgroup/new.scope")} == set(kept.cgroups)
        assert set(loaded.processes) == set(kept.processes)


GRANTS = {
    "uid-1/c": {
        "gpu": 0,
        "percent": 50,
        "sms": 66,
        "effective_percent": 50.0,
        "memory_mib": 4096,
        "pipe_dir": "/run/vcuda-mps/GPU-0/pipe",
        "log_dir": "/run/vcuda-mps/GPU-0/log",
    },
    "uid-2/d": {
        "gpu": 0,
        "percent": 30,
        "sms": None,
        "effective_percent": 30.0,
        "memory_mib": None,
        "pipe_dir": "/p",
        "log_dir": "/l",
    },
}


@given(data=contents(GRANTS))
@example(
    data=b'{"u/c": {"gpu": Infinity, "percent": 1, "effective_percent": 1, "pipe_dir": "/", "log_dir": "/"}}'
)
@example(
    data=b'{"u/c": {"gpu": 0, "percent": 1, "effective_percent": 1'
    + b"0" * 400
    + b', "pipe_dir": "/", "log_dir": "/"}}'
)
@example(data=DEEP.encode())
@example(  # a string would reach CUDA_MPS_PINNED_DEVICE_MEM_LIMIT as "0=1GM"
    data=b'{"uid-1/c": {"gpu": 0, "percent": 50, "effective_percent": 50, "memory_mib": "1G", '
    b'"pipe_dir": "/p", "log_dir": "/l"}}'
)
def test_mps_grants(data: bytes) -> None:
    count("mps.grants")
    with tempfile.TemporaryDirectory(prefix="vcuda-fuzz-") as tmp:
        root = Path(tmp)
        (root / "grants.json").write_bytes(data)
        sharing = MpsSharing(
            SharingSettings(mode=SharingMode.MPS, mps_root=root, advisory_limits=True),
            gpus=make_gpus(1),
            command=[],
            mode=lambda: SharingMode.MPS,
        )
        for key in GRANTS:
            grant = sharing.grant(*key.split("/"))
            if grant is None:
                continue
            # What Allocate hands the container (CUDA_MPS_* values) and status shows.
            assert type(grant.gpu) is int and type(grant.partition.percent) is int
            assert isinstance(grant.partition.effective_percent, float)
            assert grant.partition.sms is None or type(grant.partition.sms) is int
            assert grant.memory_mib is None or type(grant.memory_mib) is int
            assert isinstance(grant.pipe_dir, Path) and isinstance(grant.log_dir, Path)
            grant.describe()


DAEMON = {"pid": 4242, "start_ticks": 123456}


@given(data=contents(DAEMON))
@example(data=b'{"pid": Infinity, "start_ticks": 1}')  # int(inf): OverflowError
@example(data=b'{"pid": 1e400, "start_ticks": 1}')
@example(data=DEEP.encode())
def test_mps_daemon_record(data: bytes) -> None:
    count("mps.daemon")
    with tempfile.TemporaryDirectory(prefix="vcuda-fuzz-") as tmp:
        root = Path(tmp)
        (root / "GPU-0").mkdir()
        (root / "GPU-0" / "daemon.json").write_bytes(data)
        # An empty /proc: no recorded daemon is alive, so nothing is ever signalled here.
        procfs = ProcFS(root / "proc")
        assert MpsDaemon(0, "GPU-0", [], root, procfs=procfs).adopt_recorded() is False
        assert stop_recorded_daemons(root, procfs) == 0
