"""The fake node the kubelet-facing fuzz tests share: three GPUs, their device IDs, ID
strategies, and a pod cache and API sink that need no API server."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hypothesis import strategies as st

from agent.domain.placement import Placer
from agent.platform.gpu.inventory import Topology
from agent.platform.kube.pods import PodInfo
from tests.unit.kubefixtures import make_gpus

GPUS = tuple(make_gpus(3))
PLACER = Placer(GPUS, Topology())  # shared: built once, its cache is deterministic
TABLE = PLACER.table
IDS = TABLE.ids_by_gpu
ALL_IDS = [d for ids in IDS.values() for d in ids]
KNOWN = frozenset(ALL_IDS)

# Device IDs: real ones, near misses of the format, and anything at all.
near_ids = st.builds(
    "{}-vcore-{}".format,
    st.sampled_from([g.uuid for g in GPUS] + ["GPU-unknown", "", "-", "GPU-0-vcore-00"]),
    st.sampled_from(["00", "99", "100", "7", "007", "-1", "٣٣", "0x", ""]),
)
device_ids = st.sampled_from(ALL_IDS) | near_ids | st.text(max_size=70)


@st.composite
def gpu_ids(draw: st.DrawFn) -> list[str]:
    """IDs that look like a real request: part of a GPU (a share), or whole GPUs, then maybe
    perturbed by one dropped, duplicated or foreign ID."""
    gpus = draw(st.lists(st.sampled_from(sorted(IDS)), min_size=1, max_size=3))
    if len(gpus) == 1 and draw(st.booleans()):
        ids = draw(st.permutations(IDS[gpus[0]]))[: draw(st.integers(1, 100))]
    else:
        ids = [d for g in gpus for d in IDS[g]]
    change = draw(st.sampled_from(["none", "drop", "duplicate", "foreign"]))
    if change == "drop":
        ids.pop(draw(st.integers(0, len(ids) - 1)))
    elif change == "duplicate":
        ids.append(draw(st.sampled_from(ids)))
    elif change == "foreign":
        ids.insert(draw(st.integers(0, len(ids))), draw(device_ids))
    return ids


id_lists = gpu_ids() | st.lists(device_ids, max_size=6)


class PodCache:
    """A PodSource over a fixed list of pods."""

    def __init__(self, pods: list[PodInfo]) -> None:
        self._pods = pods

    def pods(self) -> list[PodInfo]:
        return list(self._pods)

    def snapshot(self) -> tuple[int, list[PodInfo]]:
        return 1, list(self._pods)

    def version(self) -> int:
        return 1  # a fixed list

    def get(self, uid: str) -> PodInfo | None:
        return next((p for p in self._pods if p.uid == uid), None)

    def find(self, namespace: str, name: str) -> PodInfo | None:
        return next((p for p in self._pods if (p.namespace, p.name) == (namespace, name)), None)

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        return predicate()


class Nowhere:
    """Event sink and annotation writer that drop everything (no API server here)."""

    def pod(self, pod: PodInfo, reason: str, message: str, warning: bool = True) -> None:
        pass

    def node(self, reason: str, message: str, warning: bool = True) -> None:
        pass

    def patch_annotations(
        self,
        namespace: str,
        name: str,
        annotations: Mapping[str, str | None],
        resource_version: str | None = None,
    ) -> PodInfo:
        raise AssertionError("the annotator's thread is not running in these tests")
