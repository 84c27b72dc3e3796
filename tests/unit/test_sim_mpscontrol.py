"""The simulated MPS control daemon behaves as NVIDIA documents it (docs/reference.md, "The MPS
control daemon"): the daemon's defaults, a client's own environment only lowering them, the control commands,
settings that apply to servers or clients created afterwards, one server per user id."""

from __future__ import annotations

import pytest

from agent.platform.gpu.mpspartition import throughput_curve_for
from agent.platform.gpu.sim.contextopen import mps_share
from agent.platform.gpu.sim.engineconfig import EngineConfig
from agent.platform.gpu.sim.mpscontrol import MpsControl, parse_size

DAEMON = 4242
GIB = 1 << 30


def test_defaults_are_100_percent_and_no_memory_limit() -> None:
    control = MpsControl(DAEMON)
    assert control.command("get_default_active_thread_percentage") == "100.0"
    assert control.command("get_default_device_pinned_mem_limit 0") == "0"
    limits = control.admit(100, uid=0, env_percentage=None, env_pinned=None)
    assert limits is not None and limits.percentage == 100.0 and limits.pinned_bytes is None


def test_the_clients_environment_only_lowers_the_daemons_limit() -> None:
    control = MpsControl(DAEMON)
    assert control.command("set_default_active_thread_percentage 30") == ""
    assert control.command("set_default_device_pinned_mem_limit 0 2G") == ""
    cheat = control.admit(100, uid=0, env_percentage=100.0, env_pinned=8 * GIB)
    modest = control.admit(101, uid=0, env_percentage=10.0, env_pinned=GIB)
    assert cheat is not None and (cheat.percentage, cheat.pinned_bytes) == (30.0, 2 * GIB)
    assert modest is not None and (modest.percentage, modest.pinned_bytes) == (10.0, GIB)


def test_defaults_apply_to_the_next_server_and_server_settings_to_later_clients() -> None:
    control = MpsControl(DAEMON)
    first = control.admit(100, uid=0, env_percentage=None, env_pinned=None)
    assert first is not None and first.percentage == 100.0
    control.command("set_default_active_thread_percentage 20")
    same_server = control.admit(101, uid=0, env_percentage=None, env_pinned=None)
    assert same_server is not None and same_server.percentage == 100.0  # the server predates it
    assert control.command("get_server_list") == str(DAEMON)
    assert control.command(f"set_active_thread_percentage {DAEMON} 40") == ""
    assert control.command(f"get_active_thread_percentage {DAEMON}") == "40.0"
    later = control.admit(102, uid=0, env_percentage=None, env_pinned=None)
    assert later is not None and later.percentage == 40.0
    assert first.percentage == 100.0  # an existing client keeps what it started with
    assert control.command(f"get_client_list {DAEMON}") == "100\n101\n102"


def test_per_server_pinned_memory_limit_for_later_clients() -> None:
    control = MpsControl(DAEMON)
    control.admit(100, uid=0, env_percentage=None, env_pinned=None)
    assert control.command(f"set_device_pinned_mem_limit {DAEMON} 0 1024M") == ""
    assert control.command(f"get_device_pinned_mem_limit {DAEMON} 0") == "1024M"
    later = control.admit(101, uid=0, env_percentage=None, env_pinned=None)
    assert later is not None and later.pinned_bytes == GIB


def test_a_client_of_another_uid_waits_until_the_servers_clients_are_done() -> None:
    control = MpsControl(DAEMON)
    control.command("set_default_active_thread_percentage 50")
    assert control.admit(100, uid=1000, env_percentage=None, env_pinned=None) is not None
    assert control.admit(200, uid=2000, env_percentage=None, env_pinned=None) is None
    assert not control.may_admit(2000) and control.waiting == {200: 2000}
    assert control.admit(101, uid=1000, env_percentage=None, env_pinned=None) is not None
    control.release(100)
    control.release(101)
    assert control.may_admit(2000)
    control.command("set_default_active_thread_percentage 25")  # the next server takes it
    limits = control.admit(200, uid=2000, env_percentage=None, env_pinned=None)
    assert limits is not None and limits.percentage == 25.0
    assert control.server is not None and control.server.uid == 2000 and not control.waiting


def test_start_server_and_quit() -> None:
    control = MpsControl(DAEMON)
    assert control.command("start_server -uid 1000") == ""
    assert control.server is not None and control.server.uid == 1000
    assert control.command("quit") == "" and control.quit_requested


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("set_default_active_thread_percentage 0", "not in (0, 100]"),
        ("set_default_active_thread_percentage 101", "not in (0, 100]"),
        ("set_default_active_thread_percentage lots", "not a number"),
        ("set_active_thread_percentage 1 50", "no server with PID 1"),
        ("set_default_device_pinned_mem_limit 0 2Q", "not a size"),
        ("get_client_list", "expected 1 argument"),
        ("rm -rf /", "unknown command"),
    ],
)
def test_bad_commands_are_answered_with_an_error_and_change_nothing(line: str, error: str) -> None:
    control = MpsControl(DAEMON)
    reply = control.command(line)
    assert reply.startswith("Error") and error in reply
    assert control.default_percentage == 100.0 and control.default_pinned == {}


def test_sizes() -> None:
    assert parse_size("2G") == 2 * GIB
    assert parse_size("1024M") == GIB
    assert parse_size("512") == 512 << 20
    assert parse_size("1gb") == GIB


def test_an_mps_client_runs_at_the_throughput_its_product_was_recorded_giving() -> None:
    h200 = EngineConfig(mps_curve=throughput_curve_for("NVIDIA H200"))
    assert mps_share(30, h200) == pytest.approx(0.248)  # 30 % of the SMs, 24.8 % of the work
    assert mps_share(35, h200) == pytest.approx(0.2951, abs=1e-3)  # what a cap of 30 is given
    assert mps_share(30, EngineConfig()) == pytest.approx(38 / 132)  # no curve: whole TPCs
