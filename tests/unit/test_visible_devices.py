"""The NVIDIA_VISIBLE_DEVICES hole: the toolkit's config.toml read from real files (absent,
unreadable, malformed, each setting), the verdict for each device-list strategy, its
re-reading, and how ``vcuda-agent status`` shows it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.clock import VirtualClock
from agent.control.visibledevices import VisibleDevicesCheck
from agent.domain.visibledevices import HoleState, envvar_hole
from agent.platform.toolkitconfig import ENVVAR_KEY, default_paths, read_toolkit_config
from agent.surfaces.cli.statusrender import render_status
from agent.surfaces.statusview import agent_info, status_document

# What `nvidia-ctk config default` writes, trimmed: the key commented out (true by default)
# and CDI mode on, which alone does not close the hole.
NVIDIA_CTK_DEFAULT = """\
#accept-nvidia-visible-devices-as-volume-mounts = false
#accept-nvidia-visible-devices-envvar-when-unprivileged = true
disable-require = false
supported-driver-capabilities = "compat32,compute,display,graphics,ngx,utility,video"

[nvidia-container-cli]
environment = []
ldconfig = "@/sbin/ldconfig.real"
load-kmods = true

[nvidia-container-runtime]
log-level = "info"
mode = "cdi"
runtimes = ["docker-runc", "runc", "crun"]

[nvidia-container-runtime.modes.cdi]
default-kind = "nvidia.com/gpu"
"""
CLOSED = f"{ENVVAR_KEY} = false\naccept-nvidia-visible-devices-as-volume-mounts = true\n"


def config(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def verdict(strategy: str, *paths: Path) -> tuple[HoleState, str]:
    found = envvar_hole([read_toolkit_config(p) for p in paths], strategy)
    return found.state, found.detail


@pytest.mark.parametrize("strategy", ["mounts", "cdi"])
def test_the_default_config_leaves_it_open_even_in_cdi_mode(tmp_path: Path, strategy: str) -> None:
    state, detail = verdict(strategy, config(tmp_path, NVIDIA_CTK_DEFAULT))
    assert state is HoleState.OPEN
    assert f"{ENVVAR_KEY} is unset (true by default)" in detail
    assert "NVIDIA_VISIBLE_DEVICES=all" in detail and f"set {ENVVAR_KEY} = false" in detail


def test_true_is_open(tmp_path: Path) -> None:
    state, detail = verdict("mounts", config(tmp_path, f"{ENVVAR_KEY} = true\n"))
    assert state is HoleState.OPEN
    assert f"{ENVVAR_KEY} = true" in detail


@pytest.mark.parametrize("strategy", ["mounts", "cdi"])
def test_false_is_closed(tmp_path: Path, strategy: str) -> None:
    state, detail = verdict(strategy, config(tmp_path, CLOSED + NVIDIA_CTK_DEFAULT))
    assert state is HoleState.CLOSED, detail
    assert f"{ENVVAR_KEY} = false" in detail
    # Volume-mount requests stay possible for a pod allowed hostPath /dev/null: said, not hidden.
    assert "hostPath" in detail


def test_the_key_in_a_section_is_not_read_there(tmp_path: Path) -> None:
    text = f"[nvidia-container-runtime]\n{ENVVAR_KEY} = false\n"
    state, detail = verdict("mounts", config(tmp_path, text))
    assert state is HoleState.OPEN
    assert "under [nvidia-container-runtime]" in detail
    # `echo ... >> config.toml` lands in the file's last table.
    appended = config(tmp_path, NVIDIA_CTK_DEFAULT + CLOSED, "appended.toml")
    state, detail = verdict("mounts", appended)
    assert state is HoleState.OPEN
    assert "under [nvidia-container-runtime.modes.cdi]" in detail


def test_the_envvar_strategy_needs_the_hole(tmp_path: Path) -> None:
    state, detail = verdict("envvar", config(tmp_path, f"{ENVVAR_KEY} = true\n"))
    assert state is HoleState.OPEN
    assert "envvar strategy needs this" in detail and "--device-list-strategy mounts or cdi" in detail
    state, detail = verdict("envvar", config(tmp_path, CLOSED, "closed.toml"))
    assert state is HoleState.CLOSED
    assert "device nodes without driver files" in detail


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (f"{ENVVAR_KEY} = fals\n", "not valid TOML"),
        ("[nvidia-container-runtime\nmode = 'cdi'\n", "not valid TOML"),
        (f'{ENVVAR_KEY} = "false"\n', "not true or false"),
    ],
    ids=["bad-value", "bad-table", "string"],
)
def test_a_malformed_config_is_unknown_with_why(tmp_path: Path, text: str, why: str) -> None:
    state, detail = verdict("mounts", config(tmp_path, text))
    assert state is HoleState.UNKNOWN
    assert why in detail and str(tmp_path / "config.toml") in detail


def test_binary_and_huge_files_are_unknown(tmp_path: Path) -> None:
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert "not UTF-8" in read_toolkit_config(binary).problem  # type: ignore[operator]
    huge = tmp_path / "huge.toml"
    huge.write_bytes(b"#" * (2 << 20))
    assert "larger than" in read_toolkit_config(huge).problem  # type: ignore[operator]
    assert verdict("mounts", binary)[0] is HoleState.UNKNOWN


def test_an_unreadable_path_is_unknown(tmp_path: Path) -> None:
    (tmp_path / "config.toml").mkdir()  # root reads any file; a directory it cannot read as one
    state, detail = verdict("mounts", tmp_path / "config.toml")
    assert state is HoleState.UNKNOWN
    assert "cannot read it" in detail


def test_no_config_anywhere_is_unknown_and_names_where_it_looked(tmp_path: Path) -> None:
    paths = default_paths(tmp_path)
    state, detail = verdict("mounts", *paths)
    assert state is HoleState.UNKNOWN
    assert "no NVIDIA container toolkit config" in detail
    assert all(str(p) in detail for p in paths)
    assert str(paths[1]).endswith("usr/local/nvidia/toolkit/.config/nvidia-container-runtime/config.toml")


def test_every_config_present_must_close_it(tmp_path: Path) -> None:
    closed = config(tmp_path, CLOSED, "closed.toml")
    opened = config(tmp_path, NVIDIA_CTK_DEFAULT, "open.toml")
    broken = config(tmp_path, "= nothing\n", "broken.toml")
    absent = tmp_path / "absent.toml"
    assert verdict("mounts", closed, absent)[0] is HoleState.CLOSED
    assert verdict("mounts", closed, opened)[0] is HoleState.OPEN
    assert verdict("mounts", closed, broken)[0] is HoleState.UNKNOWN
    assert verdict("mounts", broken, opened)[0] is HoleState.OPEN


def test_the_check_rereads_after_its_interval_and_logs_each_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = config(tmp_path, NVIDIA_CTK_DEFAULT)
    clock = VirtualClock()
    check = VisibleDevicesCheck([path], "mounts", clock=clock, interval_s=30.0)
    with caplog.at_level(logging.INFO, logger="agent.control.visibledevices"):
        assert check.verdict().state is HoleState.OPEN
        path.write_text(CLOSED)  # the admin closes it
        clock.advance(10.0)
        assert check.verdict().state is HoleState.OPEN  # not read again yet
        clock.advance(20.0)
        assert check.verdict().state is HoleState.CLOSED
        clock.advance(30.0)
        assert check.verdict().state is HoleState.CLOSED
    records = [(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records]
    assert records == [
        ("WARNING", "NVIDIA_VISIBLE_DEVICES hole open"),
        ("INFO", "NVIDIA_VISIBLE_DEVICES hole closed"),
    ]


def test_status_shows_an_open_hole_and_keeps_quiet_about_a_closed_one(tmp_path: Path) -> None:
    def rendered(state: str, detail: str) -> str:
        agent = agent_info(
            pid=1,
            uptime_s=1.0,
            backend="simulated",
            enforcing=True,
            actuator="freezer",
            memory_mode="kill",
            period_s=0.25,
            watchdog="running",
            bpf="ok",
            visible_devices_hole=(state, detail),
        )
        assert agent["visibleDevicesHole"] == {"state": state, "detail": detail}
        return render_status(status_document(node="n1", time=0.0, agent=agent, gpus=[]))

    found = envvar_hole([read_toolkit_config(config(tmp_path, NVIDIA_CTK_DEFAULT))], "mounts")
    text = rendered(found.state.value, found.detail)
    assert f"NVIDIA_VISIBLE_DEVICES hole open: {found.detail}" in text.splitlines()
    assert "NVIDIA_VISIBLE_DEVICES hole" not in rendered("closed", "x = false")
