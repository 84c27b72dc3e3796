"""Re-reading the node config file; an invalid new config is reported and the old one kept."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from agent.domain.nodeconfig import ClusterConfig, NodeConfig, parse_config
from agent.errors import ConfigError, PlatformError
from agent.platform.atomicfile import read_text

log = logging.getLogger(__name__)


class ConfigWatch:
    def __init__(
        self, path: Path | None, node_name: str, initial: ClusterConfig, period_s: float = 10.0
    ) -> None:
        self._path = path
        self._node_name = node_name
        self._config = initial
        self._text = _read(path) if path else None
        self._period = period_s
        self._lock = threading.Lock()
        self.rejected = 0  # reloads refused because the new config was invalid

    @property
    def node(self) -> NodeConfig:
        with self._lock:
            return self._config.for_node(self._node_name)

    def reload(self) -> bool:
        """Re-read the file; True if a new valid config was taken."""
        if self._path is None:
            return False
        try:
            text = _read(self._path)
        except PlatformError as err:  # not UTF-8: as unreadable as a missing file
            log.error("config reload: %s; keeping the current config", err)
            return False
        if text == self._text:
            return False
        self._text = text
        try:
            config = parse_config(text, str(self._path))
        except ConfigError as err:
            self.rejected += 1
            for problem in err.problems:
                log.error("config reload rejected, keeping the current config: %s", problem)
            return False
        with self._lock:
            self._config = config
        log.info("config reloaded from %s: node %s -> %s", self._path, self._node_name, self.node)
        return True

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self._period):
            self.reload()


def _read(path: Path) -> str:
    """The config file's text; PlatformError when it is missing or cannot be read."""
    text = read_text(path)
    if text is None:
        raise PlatformError(f"cannot read {path}: no such file")
    return text
