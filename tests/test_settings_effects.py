"""Every key the settings accept changes what a user can observe, or is refused with a message saying why.

``PROBES`` maps each leaf of the settings model (dotted: ``section.key``,
``plugins.NAME.key`` for a built-in component's table, ``kv_cache.tiers[].key``
for the keys every tier entry has, ``kv_cache.tiers[PLUGIN].key`` for a built-in
tier plugin's own) to a probe that sets it away from its default and checks an
output, status code, header, statistic, log line, file, error message or the
engine's reported facts. A key added to the model without a probe fails
``test_every_leaf_has_a_probe``, which lists the missing leaves; keys whose
probe the HTTP tests own are in the table as ``HttpProbe`` entries and report
themselves as skipped until that probe exists.
"""

from __future__ import annotations

import pytest

from tests.effects_cache import PROBES as CACHE_PROBES
from tests.effects_engine import PROBES as ENGINE_PROBES
from tests.effects_fleet import PROBES as FLEET_PROBES
from tests.effects_http import PROBES as HTTP_PROBES
from tests.effects_lab import HttpProbe, Lab, Probe
from tests.effects_redis import PROBES as REDIS_PROBES
from tests.effects_registry import PROBES as REGISTRY_PROBES
from tests.effects_server import PROBES as SERVER_PROBES
from tests.engine_helpers import build_checkpoint
from tierserve.settings.config import ModelSettings, Settings, TierSettings
from tierserve.core.sections import ModelEntry
from tierserve.core.plugins import TIER_KIND, load_plugins
from tierserve.core.tier_settings import FLAT_TIER_KEYS

pytestmark = pytest.mark.integration

PROBES: dict[str, Probe] = {
    **ENGINE_PROBES, **CACHE_PROBES, **REDIS_PROBES, **SERVER_PROBES, **HTTP_PROBES, **FLEET_PROBES,
    **REGISTRY_PROBES,
}


def model_leaves() -> set[str]:
    """Every key the settings model and the built-in components' settings models define."""
    sections = {name: field.annotation for name, field in Settings.model_fields.items() if name != "models"}
    leaves = {f"{section}.{key}" for section, model in sections.items() for key in model.model_fields}
    # a [[models]] entry's [model] keys are [model]'s (probed there); its own keys are probed here
    leaves |= {f"models[].{key}" for key in ModelEntry.model_fields if key not in ModelSettings.model_fields}
    leaves |= {f"kv_cache.tiers[].{key}" for key in TierSettings.model_fields if key != "options"}
    # flat [kv_cache] tier keys: shorthands written into the tier list, or refused with the entry to write
    leaves |= {f"kv_cache.{key}" for key in FLAT_TIER_KEYS}
    builtins = load_plugins(allowlist=[])
    for name, component in builtins.settings_components().items():
        leaves |= {f"plugins.{name}.{key}" for key in component.settings.model_fields}
    for component in builtins.registry(TIER_KIND):
        if component.settings is not None:
            leaves |= {f"kv_cache.tiers[{component.name}].{key}" for key in component.settings.model_fields}
    return leaves


def test_every_leaf_has_a_probe():
    leaves = model_leaves()
    missing = sorted(leaves - PROBES.keys())
    assert not missing, f"settings keys without a probe in PROBES (add one that shows their effect): {missing}"
    stale = sorted(PROBES.keys() - leaves)
    assert not stale, f"probes of keys the settings no longer define: {stale}"
    deferred = sorted(key for key, probe in PROBES.items() if isinstance(probe, HttpProbe))
    assert not deferred, f"keys whose probe is still missing: {deferred}"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(build_checkpoint(tmp_path_factory.mktemp("effects"), "llama", "llama"))
    yield lab
    lab.close()


@pytest.mark.parametrize("leaf", sorted(PROBES))
def test_key_has_an_effect(leaf, lab, tmp_path, request):
    lab.tmp, lab.request = tmp_path, request
    PROBES[leaf](lab)
