"""Probes of ``[fleet]``: each key changes what ``tierserve fleet`` asks Ray Serve for (the engine
deployment's options, as the Ray dashboard and ``serve status`` show them) or how the router decides.

``tests/test_fleet.py`` runs these options on a real cluster (replicas, autoscaling, routing).
"""

from __future__ import annotations

import pytest

from tests.effects_lab import Lab
from tierserve.core.errors import ConfigError
from tierserve.fleet.app import check_disaggregation, engine_options, prefill_options
from tierserve.fleet.prefix_affinity import choose


def options(lab: Lab, **fleet) -> dict:
    settings = lab.settings({f"fleet.{key}": value for key, value in fleet.items()}).settings
    return engine_options(settings.fleet, settings)


def autoscaling(lab: Lab, **fleet) -> dict:
    return options(lab, autoscaling=True, **fleet)["autoscaling_config"]


def fleet_replicas(lab: Lab) -> None:
    assert options(lab, replicas=3)["num_replicas"] == 3 != options(lab)["num_replicas"]


def fleet_autoscaling(lab: Lab) -> None:
    assert "autoscaling_config" in options(lab, autoscaling=True) and "num_replicas" not in options(lab, autoscaling=True)
    assert "autoscaling_config" not in options(lab)


def fleet_min_replicas(lab: Lab) -> None:
    assert autoscaling(lab, min_replicas=2)["min_replicas"] == 2
    with pytest.raises(ConfigError, match="min_replicas"):
        lab.settings({"fleet.min_replicas": 3, "fleet.max_replicas": 2})


def fleet_max_replicas(lab: Lab) -> None:
    assert autoscaling(lab, max_replicas=5)["max_replicas"] == 5


def fleet_target_ongoing_requests(lab: Lab) -> None:
    assert autoscaling(lab, target_ongoing_requests=1.5)["target_ongoing_requests"] == 1.5


def fleet_upscale_delay_seconds(lab: Lab) -> None:
    assert autoscaling(lab, upscale_delay_seconds=3)["upscale_delay_s"] == 3


def fleet_downscale_delay_seconds(lab: Lab) -> None:
    assert autoscaling(lab, downscale_delay_seconds=7)["downscale_delay_s"] == 7


def fleet_load_window_seconds(lab: Lab) -> None:
    scaled = autoscaling(lab, load_window_seconds=3)
    assert scaled["look_back_period_s"] == 3 and scaled["metrics_interval_s"] == 1


def fleet_num_cpus(lab: Lab) -> None:
    assert options(lab, num_cpus=0.25)["ray_actor_options"]["num_cpus"] == 0.25


def fleet_num_gpus(lab: Lab) -> None:
    assert options(lab, num_gpus=1)["ray_actor_options"]["num_gpus"] == 1


def fleet_max_replicas_per_node(lab: Lab) -> None:
    assert options(lab, max_replicas_per_node=1)["max_replicas_per_node"] == 1
    assert "max_replicas_per_node" not in options(lab)  # unset: Ray places by resources alone
    tier = {"name": "shared", "plugin": "redis", "url": "redis://127.0.0.1:1/0", "write_through": True}
    loaded = lab.settings({"fleet.prefill_replicas": 1, "fleet.max_replicas_per_node": 2, "kv_cache.tiers": [tier]})
    assert prefill_options(loaded.settings.fleet, loaded.settings)["max_replicas_per_node"] == 2


def fleet_routing(lab: Lab) -> None:
    router = options(lab)["request_router_config"]
    assert router.request_router_class.endswith("CacheAwareRouter")
    assert "request_router_config" not in options(lab, routing="power_of_two")  # Ray's default router
    events = options(lab, routing="kv_events")["request_router_config"]
    assert events.request_router_class.endswith("KVEventRouter") and events.request_router_kwargs["max_imbalance"] == 8


def fleet_max_imbalance(lab: Lab) -> None:
    kwargs = options(lab, max_imbalance=1)["request_router_config"].request_router_kwargs
    assert kwargs == {"max_imbalance": 1}
    ongoing = {"a": 3, "b": 1}
    assert choose("a", ongoing, kwargs["max_imbalance"], min) == ("b", False)
    assert choose("a", ongoing, options(lab)["request_router_config"].request_router_kwargs["max_imbalance"], min) == ("a", True)


def fleet_prefill_replicas(lab: Lab) -> None:
    tier = {"name": "shared", "plugin": "redis", "url": "redis://127.0.0.1:1/0", "write_through": True}
    loaded = lab.settings({"fleet.prefill_replicas": 2, "kv_cache.tiers": [tier]})
    check_disaggregation(loaded)
    assert prefill_options(loaded.settings.fleet, loaded.settings)["num_replicas"] == 2
    with pytest.raises(ConfigError, match="shared cache tier"):  # L2 only: nothing to hand prompts over with
        check_disaggregation(lab.settings({"fleet.prefill_replicas": 1}))


PROBES = {
    "fleet.prefill_replicas": fleet_prefill_replicas,
    "fleet.replicas": fleet_replicas,
    "fleet.autoscaling": fleet_autoscaling,
    "fleet.min_replicas": fleet_min_replicas,
    "fleet.max_replicas": fleet_max_replicas,
    "fleet.target_ongoing_requests": fleet_target_ongoing_requests,
    "fleet.upscale_delay_seconds": fleet_upscale_delay_seconds,
    "fleet.downscale_delay_seconds": fleet_downscale_delay_seconds,
    "fleet.load_window_seconds": fleet_load_window_seconds,
    "fleet.num_cpus": fleet_num_cpus,
    "fleet.num_gpus": fleet_num_gpus,
    "fleet.max_replicas_per_node": fleet_max_replicas_per_node,
    "fleet.routing": fleet_routing,
    "fleet.max_imbalance": fleet_max_imbalance,
}
