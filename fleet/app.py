"""The fleet as a Ray Serve application, from ``[fleet]`` and the same settings ``tierserve serve`` reads.

    python: build_fleet(sources, settings) ─► serve.run(app, route_prefix="/")
    shell:  tierserve fleet --preset production --set fleet.replicas=4
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from tierserve.settings.config import LoadedSettings
from tierserve.core.errors import ConfigError
from tierserve.core.sections import FleetSettings, Settings
from tierserve.fleet.settings_sources import SettingsSources

APP_NAME = "tierserve"
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's resource of the head node


def replica_options(fleet: FleetSettings, settings: Settings) -> dict[str, Any]:
    """What every engine-running deployment (engine, prefill) asks of Ray Serve."""
    return {
        "ray_actor_options": {"num_cpus": fleet.num_cpus, "num_gpus": fleet.num_gpus},
        # a replica batches up to max_num_seqs and queues the rest itself; the router holds what is beyond
        "max_ongoing_requests": settings.scheduler.max_num_seqs + settings.scheduler.max_waiting_requests,
        "health_check_period_s": 5,
        "health_check_timeout_s": 30,
        **({"max_replicas_per_node": fleet.max_replicas_per_node} if fleet.max_replicas_per_node else {}),
    }


def engine_options(fleet: FleetSettings, settings: Settings, sources: SettingsSources | None = None) -> dict[str, Any]:
    """The engine deployment's Ray Serve options (what ``[fleet]`` controls)."""
    options = replica_options(fleet, settings)
    if fleet.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": fleet.min_replicas,
            "max_replicas": fleet.max_replicas,
            "target_ongoing_requests": fleet.target_ongoing_requests,
            "upscale_delay_s": fleet.upscale_delay_seconds,
            "downscale_delay_s": fleet.downscale_delay_seconds,
            "look_back_period_s": fleet.load_window_seconds,
            "metrics_interval_s": min(10.0, max(0.5, fleet.load_window_seconds / 3)),  # a few reports per window
        }
    else:
        options["num_replicas"] = fleet.replicas
    if fleet.routing == "cache_aware":
        from ray.serve.config import RequestRouterConfig

        from tierserve.fleet.router import CacheAwareRouter

        options["request_router_config"] = RequestRouterConfig(
            request_router_class=CacheAwareRouter,
            request_router_kwargs={"max_imbalance": fleet.max_imbalance},
        )
    elif fleet.routing == "kv_events":
        from ray.serve.config import RequestRouterConfig

        from tierserve.fleet.router import KVEventRouter

        options["request_router_config"] = RequestRouterConfig(
            request_router_class=KVEventRouter,
            request_router_kwargs={
                "max_imbalance": fleet.max_imbalance, "sources": sources.as_json() if sources else None, "app_name": APP_NAME,
            },  # fmt: skip
        )
    return options


def prefill_options(fleet: FleetSettings, settings: Settings) -> dict[str, Any]:
    """The prefill deployment's options: ``prefill_replicas`` replicas, Ray's default router."""
    return {**replica_options(fleet, settings), "num_replicas": fleet.prefill_replicas}


def check_disaggregation(loaded: LoadedSettings) -> None:
    """Prefill replicas hand prompts to decode replicas through a shared tier written through: refuse
    a fleet with prefill replicas and no such tier (ConfigError naming what is missing)."""
    if not loaded.settings.fleet.prefill_replicas:
        return
    registry = loaded.plugins.registry("cache_tiers")
    for tier in loaded.settings.kv_cache.tiers:
        # a shared tier is written through unless its entry says write_through = false (engine.builder)
        if getattr(registry.get(tier.plugin).factory, "shared", False) and tier.write_through is not False:
            return
    raise ConfigError(
        "fleet.prefill_replicas: prefill replicas hand their prompts to the decode replicas through a shared "
        "cache tier written through; add a [[kv_cache.tiers]] entry with plugin = \"redis\" (write_through is "
        "its default)"
    )


def build_fleet(sources: SettingsSources) -> Any:
    """The Ray Serve application: the engine deployment (and the prefill one) behind the ingress
    (bind, then ``serve.run``)."""
    from ray import serve

    from tierserve.fleet.deployments import EngineReplica, Ingress
    from tierserve.fleet.kv_hub import HUB_DEPLOYMENT, KVHub

    loaded = sources.load()
    check_disaggregation(loaded)
    settings = loaded.settings
    # the replicas publish their cache events and figures to the hub; kv_events routers, the dashboard and
    # /v1/fleet/stats read it. The hub and the ingress live on the head node: they go when the cluster goes, and
    # losing any other node leaves them standing.
    on_head = {"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}}
    hub_options = {"num_replicas": 1, "ray_actor_options": on_head, "max_ongoing_requests": 10_000,
                   "logging_config": {"enable_access_log": False}}  # a publication every 0.1-1 s per replica, a call as often per router
    hub = serve.deployment(KVHub, name=HUB_DEPLOYMENT).options(**hub_options).bind()
    engine = serve.deployment(EngineReplica, name="engine").options(**engine_options(settings.fleet, settings, sources))
    ingress = serve.deployment(Ingress, name="ingress").options(ray_actor_options=on_head, max_ongoing_requests=10_000)
    prefill = None
    if settings.fleet.prefill_replicas:
        deployment = serve.deployment(EngineReplica, name="prefill").options(**prefill_options(settings.fleet, settings))
        prefill = deployment.bind(sources, hub)
    return ingress.bind(engine.bind(sources, hub), sources, prefill, hub)


def run_fleet(sources: SettingsSources, address: str | None = None, blocking: bool = True) -> None:
    """Start (or join, with ``address``) a Ray cluster and serve the fleet on ``[server] host:port``."""
    import ray
    from ray import serve

    settings = sources.load().settings
    ray.init(address=address, ignore_reinit_error=True, include_dashboard=False)
    if threading.current_thread() is threading.main_thread():
        # after ray.init, whose own handler aborts the process: SIGTERM stops the fleet as Ctrl-C does, so the
        # caller's cleanup runs (tierserve fleet: every process it started ends)
        signal.signal(signal.SIGTERM, _interrupt)
    serve.start(http_options={"host": settings.server.host, "port": settings.server.port})
    serve.run(build_fleet(sources), name=APP_NAME, route_prefix="/", blocking=blocking)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def app_builder(args: dict[str, Any]) -> Any:
    """The fleet for ``serve run`` and KubeRay's RayService (``import_path: tierserve.fleet.app:app_builder``).

    ``args``: ``preset`` (default ``production``), ``config_file`` (a TOML path on every node) and ``set``
    (``{"fleet.replicas": 4, ...}``, as ``--set`` takes them).
    """
    overrides: dict[tuple[str, str], Any] = {}
    for dotted, value in (args.get("set") or {}).items():
        section, _, key = str(dotted).partition(".")
        overrides[(section, key)] = value
    return build_fleet(SettingsSources.of(args.get("preset", "production"), args.get("config_file"), overrides))
