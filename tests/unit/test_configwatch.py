"""Reloading the node config: new valid configs are taken, invalid ones refused."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from agent.control.configwatch import ConfigWatch
from agent.domain.nodeconfig import ClusterConfig, NodeConfig, load_config

NODE = "gpu-node-1"


def write(path: Path, scaling: Any, driver: str = "systemd") -> None:
    config = {"nodeConfig": [{"name": NODE, "deviceMemoryScaling": scaling, "cgroupDriver": driver}]}
    path.write_text(json.dumps(config))


@pytest.fixture
def watch(tmp_path: Path) -> ConfigWatch:
    path = tmp_path / "config.json"
    write(path, 0.9)
    return ConfigWatch(path, NODE, load_config(path), period_s=0.01)


def test_starts_with_the_initial_config(watch: ConfigWatch) -> None:
    assert watch.node == NodeConfig(NODE, 0.9, None, "systemd")
    assert watch.rejected == 0


def test_unchanged_file_is_not_reloaded(watch: ConfigWatch) -> None:
    assert watch.reload() is False
    assert watch.node.device_memory_scaling == 0.9


def test_valid_rewrite_is_taken(watch: ConfigWatch, tmp_path: Path) -> None:
    write(tmp_path / "config.json", 0.5, "cgroupfs")
    assert watch.reload() is True
    assert watch.node == NodeConfig(NODE, 0.5, None, "cgroupfs")
    assert watch.reload() is False  # same text again
    assert watch.rejected == 0


def test_invalid_rewrite_keeps_the_old_config(
    watch: ConfigWatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "config.json"
    write(path, 1.5)
    with caplog.at_level(logging.ERROR, logger="agent.control.configwatch"):
        assert watch.reload() is False
    assert watch.node == NodeConfig(NODE, 0.9, None, "systemd")
    assert watch.rejected == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "deviceMemoryScaling" in errors[0]
    assert NODE in errors[0]
    assert "keeping the current config" in errors[0]

    # The same invalid text is not rejected (and logged) again on every poll.
    caplog.clear()
    assert watch.reload() is False
    assert watch.rejected == 1
    assert not caplog.records

    # Fixing the file is picked up.
    write(path, 0.7)
    assert watch.reload() is True
    assert watch.node.device_memory_scaling == 0.7


def test_every_problem_of_a_rejected_config_is_logged(
    watch: ConfigWatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path / "config.json", 0, "docker")
    with caplog.at_level(logging.ERROR, logger="agent.control.configwatch"):
        assert watch.reload() is False
    text = caplog.text
    assert "deviceMemoryScaling" in text
    assert "cgroupDriver" in text
    assert watch.rejected == 1


def test_unparsable_json_is_rejected(watch: ConfigWatch, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    assert watch.reload() is False
    assert watch.rejected == 1
    assert watch.node.device_memory_scaling == 0.9


def test_reverting_to_the_original_after_a_bad_edit_is_taken(watch: ConfigWatch, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    original = path.read_text()
    write(path, 2)
    assert watch.reload() is False
    path.write_text(original)
    assert watch.reload() is True
    assert watch.node.device_memory_scaling == 0.9


def test_unreadable_file_keeps_the_config(
    watch: ConfigWatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "config.json").unlink()
    with caplog.at_level(logging.ERROR, logger="agent.control.configwatch"):
        assert watch.reload() is False
    assert "cannot read" in caplog.text
    assert watch.node.device_memory_scaling == 0.9
    assert watch.rejected == 0


def test_node_missing_from_new_config_gets_defaults(watch: ConfigWatch, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"nodeConfig": [{"name": "other"}]}))
    assert watch.reload() is True
    assert watch.node == NodeConfig(NODE)


def test_without_a_file_nothing_reloads() -> None:
    watch = ConfigWatch(None, NODE, ClusterConfig())
    assert watch.reload() is False
    assert watch.node == NodeConfig(NODE)


def test_run_polls_until_stopped(watch: ConfigWatch, tmp_path: Path) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=watch.run, args=(stop,), daemon=True)
    thread.start()
    try:
        write(tmp_path / "config.json", 0.25)
        for _ in range(200):
            if watch.node.device_memory_scaling == 0.25:
                break
            stop.wait(0.01)
        assert watch.node.device_memory_scaling == 0.25
    finally:
        stop.set()
        thread.join(timeout=5)
    assert not thread.is_alive()
