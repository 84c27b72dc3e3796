"""One warning per run of failures of a retried action, and one line when it works again.

A publisher retrying every few seconds through an API outage would otherwise log the same
warning on every pass; a new message (the failure changed) is logged again.
"""

from __future__ import annotations

import logging


class RetryLog:
    """``failing``: what fails, e.g. "node n1: cannot publish the GPU offer"; ``recovered``:
    the line said once it works again."""

    def __init__(self, logger: logging.Logger, failing: str, recovered: str) -> None:
        self._log = logger
        self._failing = failing
        self._recovered = recovered
        self._logged = ""  # the message last warned about; "" while it works

    def failed(self, message: str) -> None:
        if message != self._logged:
            self._logged = message
            self._log.warning("%s: %s; retrying", self._failing, message)

    def succeeded(self) -> None:
        if self._logged:
            self._logged = ""
            self._log.info("%s", self._recovered)
