"""The node agent: builds every component from the settings, starts and stops them."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from agent.control.configwatch import ConfigWatch
from agent.control.guardtargets import GuardTargets
from agent.control.health import HealthMonitor
from agent.control.metricsauth import MetricsAuthorizer
from agent.control.miggeometry import MigGeometry
from agent.control.migholdings import MigHoldings, merged_grants
from agent.control.migoffers import MigOffers
from agent.control.migshares import MigShares
from agent.control.migwatch import MigWatch
from agent.control.mpssharing import MpsSharing
from agent.control.supervisor import Supervisor
from agent.control.visibledevices import VisibleDevicesCheck
from agent.domain.health import GpuHealth, HealthBoard, HealthPolicy
from agent.domain.nodeconfig import ClusterConfig
from agent.domain.placement import Placer
from agent.domain.specs import SpecBounds
from agent.errors import ConfigError, VcudaError
from agent.platform.driverfiles import discover_driver_files
from agent.platform.gpu.factory import open_backend
from agent.platform.gpu.guarded import GuardedBackend
from agent.platform.gpu.inventory import GpuBackend, GpuInfo
from agent.platform.kube.reviews import ReviewClient
from agent.platform.toolkitconfig import default_paths
from agent.settings import MIG_SHARES_CHECKPOINT, DevicePluginSettings, MetricsAuth, Settings
from agent.surfaces.deviceplugin.endpoint import EndpointStatus, PluginEndpoint
from agent.surfaces.deviceplugin.isolated import IsolatedAllocator
from agent.surfaces.deviceplugin.migplugins import MigPlugins
from agent.surfaces.deviceplugin.responses import ResponseBuilder
from agent.surfaces.deviceplugin.service import DevicePluginService
from agent.surfaces.dranode import DraIntegration, split_gpus
from agent.surfaces.enforcementnode import EnforcementIntegration
from agent.surfaces.extender.transport import is_loopback
from agent.surfaces.hostnode import HostIntegration
from agent.surfaces.kubenode import KubeIntegration
from agent.surfaces.metrics.collector import AgentCollector
from agent.surfaces.metrics.dra_collector import DraCollector
from agent.surfaces.metrics.enforcement_collector import EnforcementCollector
from agent.surfaces.metrics.host_collector import HostCollector
from agent.surfaces.metrics.http import MetricsServer, tls_context
from agent.surfaces.metrics.kube_collector import AllocationCollector
from agent.surfaces.metrics.legacy_collector import LegacyCollector
from agent.surfaces.metrics.mig_collector import MigCollector
from agent.surfaces.metrics.migshare_collector import MigShareCollector
from agent.surfaces.metrics.sharing_collector import SharingCollector
from agent.surfaces.metrics.tracer_collector import TracerCollector
from agent.surfaces.metrics.xid_collector import XidCollector
from agent.surfaces.migstatus import (
    MigGeometryStatus,
    MigStatus,
    add_isolated_shares,
    add_mig_config,
    mig_statuses,
)
from agent.surfaces.sharingnode import build_sharing

log = logging.getLogger(__name__)


class NodeAgent:
    def __init__(self, settings: Settings, config: ClusterConfig, backend: GpuBackend | None = None) -> None:
        self.settings = settings
        self.node_name = settings.node_name
        sim = settings.simulation
        plugin = settings.plugin
        driver_root = plugin.driver_root_in_agent or plugin.driver_root
        # Every per-GPU call under a deadline: a stuck driver call degrades its GPU and
        # stalls no loop, server or other GPU (platform/gpu/guarded.py).
        self.backend = GuardedBackend(
            backend or open_backend(sim.spec, settings.node_name, sim.state_dir, driver_root)
        )
        try:
            self._build(settings, config)
        except BaseException:
            self.backend.close()  # NVML shut down, simulator state released
            raise

    def _build(self, settings: Settings, config: ClusterConfig) -> None:
        self.backend_name = self.backend.name
        self.gpus = tuple(self.backend.gpus())
        self.board = HealthBoard(g.index for g in self.gpus)
        self.config = ConfigWatch(settings.config_file, settings.node_name, config, settings.config_reload_s)
        plugin = settings.plugin
        driver = discover_driver_files(plugin.driver_root, plugin.driver_root_in_agent)
        responses = ResponseBuilder(plugin.device_list_strategy, driver, plugin.driver_root)
        toolkit_configs = plugin.toolkit_configs or default_paths(settings.cgroups.host_root)
        self.visible_devices = VisibleDevicesCheck(toolkit_configs, plugin.device_list_strategy.value)
        topology = self.backend.topology()
        plugin_gpus, dra_gpus = split_gpus(self.gpus, settings.dra)
        placer = Placer(plugin_gpus, topology)
        self.service = DevicePluginService(plugin_gpus, topology, self.board, responses, placer)
        self.endpoint = PluginEndpoint(plugin, self.service)
        self._build_mig(plugin, responses)
        self.supervisor = Supervisor()
        self.kube: KubeIntegration | None = None
        if settings.use_kube:
            self.kube = KubeIntegration(
                settings=settings.kube,
                node_name=settings.node_name,
                gpus=self.gpus,
                topology=topology,
                board=self.board,
                placer=placer,
                scaling=lambda: self.config.node.device_memory_scaling,
                bounds=lambda: SpecBounds.of(self.config.node),
                plugin_gpus=plugin_gpus,
                mig=self.mig.snapshot,
                withheld=lambda: frozenset(self.service.withheld()),
                mig_strategy=lambda: str(self.config.node.mig.strategy),
            )
            self.service.allocations = self.kube.allocations
            self.service.recovery = self.kube.recovery
            self._build_mig_kube(self.kube)
        self.sharing = build_sharing(
            settings.sharing,
            backend=self.backend,
            gpus=self.gpus,
            node_mode=lambda: self.config.node.sharing_mode,
            node_advisory=lambda: self.config.node.mps_advisory_limits,
            kube=self.kube,
        )
        self.service.mps = self.sharing
        self.dra: DraIntegration | None = None
        if settings.dra.enabled and self.kube is not None:
            self.dra = DraIntegration(
                settings.dra,
                node_name=settings.node_name,
                gpus=dra_gpus,
                board=self.board,
                scaling=lambda: self.config.node.device_memory_scaling,
                kube=self.kube,
                responses=responses,
                sharing=self.sharing,
                backend=self.backend,
                mig_watch=self.mig,
                mig_dynamic=lambda: self.config.node.mig.dynamic,
            )
        elif settings.dra.enabled:
            log.error("--dra needs the Kubernetes API (claims are read from it): not serving DRA")
        self.host: HostIntegration | None = None
        try:
            self.host = HostIntegration(settings.cgroups, settings.bpf, self.config.node)
        except VcudaError as err:  # the device plugin still serves; attribution and guard do not
            log.error("host integration unavailable (cgroups, eBPF, device guard): %s", err)
        if self.host is not None and self.kube is not None:
            self.host.enable_guard(self._guard_targets(self.kube, settings))
        self.enforcement: EnforcementIntegration | None = None
        if self.host is not None and self.kube is not None:
            self.enforcement = EnforcementIntegration(
                settings.enforcement,
                node_name=settings.node_name,
                backend=self.backend,
                gpus=self.gpus,
                board=self.board,
                host=self.host,
                kube=self.kube,
                sharing=self.sharing,
            )
        elif settings.use_kube:
            log.error("no enforcement: it needs the host integration (cgroups) and the Kubernetes API")
        if self.enforcement is not None and self.dra is not None:
            self.enforcement.dra_state = self.dra.describe
        if self.enforcement is not None:
            self.enforcement.visible_devices_hole = self.visible_devices_hole
            self.enforcement.mig_state = self.mig_status
            self.enforcement.hardware_held = self.mig_shares.on_demand
        self.registry = self._collectors(settings)
        self.metrics: MetricsServer | None = None
        self.metrics_auth: MetricsAuthorizer | None = None

    def _build_mig(self, plugin: DevicePluginSettings, responses: ResponseBuilder) -> None:
        """MIG: the config's geometry applied, the MIG devices offered by strategy, one device
        plugin per MIG resource, and the GPUs in MIG mode withheld from vcuda-core and
        vcuda-memory (docs/mig.md)."""
        self.mig = MigWatch(self.backend, self.gpus, self.board)
        self.mig.refresh()  # MIG modes and devices as the node starts
        self.geometry = MigGeometry(self.backend, self.gpus, self.mig, lambda: self.config.node.mig)
        self.mig_offers = MigOffers(
            self.gpus, self.mig, self.board, lambda: self.config.node.mig.strategy, self.geometry.draining
        )
        # Isolated shares on demand (mig.onDemand): such a GPU in MIG mode offers its shares.
        checkpoint = self.settings.enforcement.state_dir / MIG_SHARES_CHECKPOINT
        self.mig_shares = MigShares(
            self.backend, self.gpus, self.mig, lambda: self.config.node.mig, checkpoint
        )
        self.service.withheld = lambda: self.mig_shares.withheld(self.mig_offers.withheld())
        self.mig_offers.serving_shares = self.mig_shares.on_demand
        self.service.isolated = IsolatedAllocator(self.mig_shares, responses)
        self.mig_holdings: MigHoldings | None = None
        self.mig_plugins = MigPlugins(plugin, self.mig_offers, responses, on_allocate=self._mig_allocated)
        # Instances made on demand (isolated shares, DRA claims) are their owners', not offers.
        self.mig_plugins.exclude = lambda: self.mig_shares.on_demand() | self.config.node.mig.dynamic

    def _build_mig_kube(self, kube: KubeIntegration) -> None:
        """Events for the geometry; who holds which MIG device, from kubelet, for the guard."""
        self.geometry.events = kube.events
        self.mig_holdings = MigHoldings(kube.truth, kube.pods, self.mig_offers, self.mig_plugins.resources)
        self.mig_shares.pods = kube.pods
        kube.allocations.isolated_gpus = self.mig_shares.ready

    def _guard_targets(self, kube: KubeIntegration, settings: Settings) -> GuardTargets:
        targets = guard_targets(kube, self.gpus, settings)
        if self.mig_holdings is not None:
            grants = merged_grants(self.mig_holdings.grants, self.mig_shares.grants)
            targets.add_mig(grants, self.mig_plugins.resources)
        if self.dra is not None:
            targets.add_mig_source(self.dra.mig_grants)  # dynamic MIG instances of DRA claims
        return targets

    def _collectors(self, settings: Settings) -> CollectorRegistry:
        registry = CollectorRegistry(auto_describe=True)
        registry.register(AgentCollector(self))
        if self.kube is not None:
            registry.register(AllocationCollector(self.kube, self.gpus))
        if self.host is not None:
            registry.register(HostCollector(self.host, settings.node_name))
        if self.enforcement is not None:
            registry.register(EnforcementCollector(self.enforcement, self.gpus, settings.node_name))
        registry.register(XidCollector(self.board.xids, self.gpus, settings.node_name))
        registry.register(MigCollector(self.mig.snapshot, self.board, self.gpus, settings.node_name))
        registry.register(MigShareCollector(self.mig_shares.shares, settings.node_name))
        if self.dra is not None:
            registry.register(DraCollector(self.dra, settings.node_name))
        registry.register(SharingCollector(self.sharing, self.enforcement, self.gpus, settings.node_name))
        if self.host is not None and self.kube is not None:
            host, specs, node = self.host, self.kube.specs, settings.node_name
            tracer = TracerCollector(lambda: host.tracer, host.resolver.index_cgroup_ids, specs, node)
            registry.register(tracer)
        if self.enforcement is not None and self.kube is not None and settings.metrics.legacy:
            legacy = LegacyCollector(self.enforcement, self.kube.specs, self.gpus, settings.node_name)
            registry.register(legacy)
        return registry

    # AgentView ---------------------------------------------------------------
    def gpu_list(self) -> Sequence[GpuInfo]:
        return self.gpus

    def gpu_health(self) -> dict[int, GpuHealth]:
        return dict(self.board.snapshot()[1])

    def gpu_degraded(self) -> dict[int, str]:
        return {g.index: why for g in self.gpus if (why := self.backend.degraded(g.index)) is not None}

    def call_timeouts(self) -> dict[tuple[int, str], int]:
        return self.backend.call_timeouts()

    def endpoint_status(self) -> EndpointStatus:
        return self.endpoint.status()

    def visible_devices_hole(self) -> tuple[str, str]:
        verdict = self.visible_devices.verdict()
        return verdict.state.value, verdict.detail

    def mig_status(self) -> dict[int, MigStatus]:
        """Each MIG-capable GPU's MIG side for the status document."""
        _, infos = self.mig.snapshot()
        geometry = {
            i: MigGeometryStatus(wanted=list(s.wanted), state=str(s.state), reason=s.reason)
            for i, s in self.geometry.statuses().items()
        }
        statuses = mig_statuses(infos, self.board.unhealthy_instances())
        strategy = str(self.config.node.mig.strategy)
        add_mig_config(statuses, strategy, self.service.withheld(), geometry)
        return add_isolated_shares(statuses, self.mig_shares.on_demand(), self.mig_shares.shares())

    def _mig_allocated(self) -> None:
        if self.mig_holdings is not None:
            self.mig_holdings.invalidate()

    def readiness(self) -> tuple[bool, str]:
        status = self.endpoint.status()
        if not self.gpus:
            return False, "no GPUs in the inventory"
        if not status.registered:
            return False, f"not registered with kubelet {status.last_error}".strip()
        return True, f"ready: {len(self.gpus)} GPUs, registered with kubelet"

    # Lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        """Start everything; on failure the caller still calls ``stop()`` to undo what started."""
        metrics = self.settings.metrics
        if metrics.enabled:
            self.metrics = self._metrics_server()
        node = self.config.node
        log.info(
            "node %s: %d GPUs from %s backend; deviceMemoryScaling=%s",
            self.node_name,
            len(self.gpus),
            self.backend_name,
            node.device_memory_scaling,
        )
        for gpu in self.gpus:
            log.info(
                "GPU %d: %s %s, %d MiB, NUMA %s",
                gpu.index,
                gpu.uuid,
                gpu.model,
                gpu.memory_mib,
                gpu.numa_node,
            )
        self.visible_devices.verdict()  # logged now, not at the first status request
        policy = HealthPolicy(self.settings.health.ignored_xids)
        self.supervisor.spawn("health", HealthMonitor(self.backend, policy, self.board).run)
        self.supervisor.spawn("mig-inventory", self.mig.run)
        self.geometry.apply_once()  # a geometry the GPUs can take now, before the plugins serve
        self.mig_shares.adopt()  # the isolated shares of the last run, before kubelet can Allocate
        self.mig_shares.reconcile_once()  # on-demand GPUs into MIG mode
        self.mig_offers.refresh()
        self.supervisor.spawn("mig-geometry", self.geometry.run)
        self.supervisor.spawn("mig-offers", self.mig_offers.run)
        self.supervisor.spawn("mig-shares", self.mig_shares.run)
        if self.settings.config_file is not None:
            self.supervisor.spawn("config-watch", self.config.run)
        if self.host is not None:
            self.host.start(self.supervisor)
        if self.kube is not None:
            self.kube.start(self.supervisor)  # the ledger is rebuilt before kubelet can Allocate
        log.info("sharing mode %s%s", self.sharing.mode(), _mps_note(self.sharing))
        if self.dra is not None:
            self.dra.start(self.supervisor)  # after the rebuild: prepared claims join the ledger
        self.supervisor.spawn("mps", self.sharing.run)  # after the rebuild: it knows the shares
        if self.enforcement is not None:
            self.enforcement.start(self.supervisor)  # thaws what a previous run left frozen first
        self.endpoint.start()
        self.mig_plugins.sync()
        self.supervisor.spawn("mig-plugins", self.mig_plugins.run)
        if self.metrics is not None:
            self.metrics.start()

    def _metrics_server(self) -> MetricsServer:
        metrics = self.settings.metrics
        tls = None
        if metrics.tls_cert is not None and metrics.tls_key is not None:
            tls = tls_context(metrics.tls_cert, metrics.tls_key)
        authorize = None
        if metrics.auth is MetricsAuth.KUBERNETES:
            if self.kube is None:  # settings refuse it with --no-kube; never serve open by mistake
                raise ConfigError(["--metrics-auth kubernetes needs the Kubernetes API"])
            reviews = ReviewClient(self.kube.api, timeout_s=metrics.review_timeout_s)
            self.metrics_auth = MetricsAuthorizer(reviews, cache_s=metrics.auth_cache_s)
            authorize = self.metrics_auth.decide
        elif tls is None and not is_loopback(metrics.host):
            log.warning(
                "metrics on %s:%d are open to anyone who reaches the port (they name this node's "
                "pods); --metrics-auth kubernetes asks for a bearer token (docs/metrics.md)",
                metrics.host,
                metrics.port,
            )
        return MetricsServer(
            metrics.host, metrics.port, self.registry, self.readiness, authorize=authorize, tls=tls
        )

    def stop(self) -> None:
        log.info("stopping")
        if self.kube is not None:
            self.kube.stop()  # flush queued annotations and events while their loops still run
        self.supervisor.stop_event.set()  # background loops wind down while the rest stops
        self.endpoint.stop()
        self.mig_plugins.stop()
        if self.dra is not None:
            self.dra.stop()
        if self.metrics is not None:
            self.metrics.stop()
        self.supervisor.stop()
        if self.enforcement is not None:
            self.enforcement.stop()  # after its loops ended: thaw, then let the watchdog go
        if self.host is not None:
            self.host.stop()
        self.backend.close()
        log.info("stopped")


def _mps_note(sharing: MpsSharing) -> str:
    if sharing.mode() == "freezer":
        return ""
    if sharing.unavailable is not None:
        return f": MPS cannot run here ({sharing.unavailable}), shares are held by the freezer"
    return f": MPS control daemons ({' '.join(sharing.command)}) under {sharing.settings.mps_root}"


def guard_targets(kube: KubeIntegration, gpus: Sequence[GpuInfo], settings: Settings) -> GuardTargets:
    """The device guard's targets: the admin's exemptions, Events for refused ones."""
    cgroups = settings.cgroups
    return GuardTargets(
        kube.pods,
        kube.ledger,
        gpus,
        cgroups.own_pod_uid,
        exempt_namespaces=cgroups.guard_exempt_namespaces,
        events=kube.events,
        node_resources=kube.node_resources,
    )
