"""The presets, the serving spec's TOML and tier lists load to the same effective settings as before the
flat ``[kv_cache]`` tier keys became shorthands of ``[[kv_cache.tiers]]`` (``tests/data``'s fixture)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.effective_settings import CASES, effective, load_case

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).parent / "data" / "preset_effective_settings.json"


@pytest.mark.parametrize("case", sorted(CASES))
def test_loads_to_the_same_effective_settings_as_before(case, tmp_path):
    expected = json.loads(FIXTURE.read_text())[case]
    assert effective(load_case(case, tmp_path)) == expected
