"""The node's current MIG offer (``domain/migoffer.py``), recomputed from its sources: the MIG
state, GPU and instance health, the configured strategy and the GPUs a geometry drains.

``refresh()`` recomputes it; when it changed, its version grows and the MIG device plugins'
ListAndWatch streams wake (``wait_for_change``); when the GPUs withheld from shares changed,
the health board is touched so that the vcuda-core plugin and the node publisher look again.
``run()`` refreshes on every health change and every ``poll_s``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from agent.clock import Clock, SystemClock
from agent.control.migwatch import MigWatch
from agent.domain.health import HealthBoard
from agent.domain.migconfig import MigStrategy
from agent.domain.migoffer import MigOffer, mig_offer
from agent.platform.gpu.inventory import GpuInfo
from agent.settings import MIG_OFFER_POLL_S

log = logging.getLogger(__name__)


class MigOffers:
    def __init__(
        self,
        gpus: Sequence[GpuInfo],
        watch: MigWatch,
        board: HealthBoard,
        strategy: Callable[[], MigStrategy],
        draining: Callable[[], Iterable[int]] = set,
        *,
        poll_s: float = MIG_OFFER_POLL_S,
        clock: Clock | None = None,
    ) -> None:
        self._gpus = tuple(gpus)
        self._watch = watch
        self._board = board
        self._strategy = strategy
        self._draining = draining
        self._poll_s = poll_s
        self._clock = clock or SystemClock()
        self._changed = threading.Condition()
        self._offer = MigOffer()
        self._version = 0
        # The node agent sets it: GPUs whose MIG mode serves shares (mig.onDemand), whose
        # withholding here is not what they offer (control/migshares.py says that).
        self.serving_shares: Callable[[], Iterable[int]] = set

    def current(self) -> tuple[int, MigOffer]:
        with self._changed:
            return self._version, self._offer

    def withheld(self) -> dict[int, str]:
        """GPU index -> why it offers no vcuda-core or vcuda-memory of its own."""
        with self._changed:
            return dict(self._offer.withheld)

    def refresh(self) -> bool:
        """Recompute; True when the offer changed."""
        _, health = self._board.snapshot()
        _, infos = self._watch.snapshot()
        offer = mig_offer(
            self._strategy(),
            infos=infos,
            gpus=self._gpus,
            health=health,
            unhealthy_gis=self._board.unhealthy_instances(),
            draining=self._draining(),
        )
        with self._changed:
            before = self._offer
            if offer == before:
                return False
            self._offer = offer
            self._version += 1
            self._changed.notify_all()
        _log_change(before, offer, set(self.serving_shares()))
        if offer.withheld != before.withheld:
            self._board.touch()
        return True

    def wait_for_change(self, seen: int, timeout_s: float, abort: threading.Event | None = None) -> int:
        with self._changed:
            self._changed.wait_for(
                lambda: self._version != seen or (abort is not None and abort.is_set()), timeout=timeout_s
            )
            return self._version

    def wake_all(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def run(self, stop: threading.Event) -> None:
        seen = self._board.snapshot()[0]
        while not stop.is_set():
            self.refresh()
            seen = self._board.wait_for_change(seen, self._poll_s, abort=stop)


def _log_change(before: MigOffer, offer: MigOffer, quiet: set[int]) -> None:
    for index, why in sorted(offer.withheld.items()):
        if before.withheld.get(index) != why and index not in quiet:
            log.info("GPU %d offers no vcuda-core or vcuda-memory: %s", index, why)
    for index in sorted(set(before.withheld) - set(offer.withheld)):
        log.info("GPU %d offers vcuda-core and vcuda-memory again", index)
    if offer.problem and offer.problem != before.problem:
        log.warning("%s", offer.problem)
    counts = {name: len(devices) for name, devices in offer.resources.items()}
    if counts != {name: len(devices) for name, devices in before.resources.items()}:
        listed = ", ".join(f"{n}: {c}" for n, c in sorted(counts.items()))
        log.info("MIG devices offered: %s", listed or "none")
