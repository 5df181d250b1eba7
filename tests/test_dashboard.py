"""``/dashboard`` in a real headless Chromium: the page shows what ``/v1/cache/stats`` says, and its buttons work.

Against both presets: development (an open server) and production (API keys,
an admin key, the L3 disk tier). Each test saves a screenshot of the page (see
``tests.browser.artifact_dir``: ``$TIERSERVE_TEST_ARTIFACTS``, else the test's
temporary folder) and prints where.
"""

from __future__ import annotations

import httpx
import pytest

from tests.browser import artifact_dir, headless_chromium, save_page_screenshot
from tests.conftest import require_service
from tests.engine_helpers import PROMPTS, build_checkpoint
from tests.server_helpers import running_server
from tierserve.settings.config import load_settings

pytestmark = pytest.mark.browser

try:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:
    require_service("selenium", "pip install -e '.[test]' installs it")

USER_KEY, ADMIN_KEY = "dash-user-key", "dash-admin-key"
SHARED = PROMPTS[4] + " " + PROMPTS[2]  # long enough for several full blocks

# every [data-value] on the page, keyed by its id, or by its row's id and its cell's first class
PAGE_VALUES = """
const out = {};
for (const e of document.querySelectorAll("[data-value]")) {
  const row = e.closest("tr");
  const key = e.id || (row && row.id ? row.id + "." + e.className.split(" ")[0] : null);
  if (key) out[key] = e.dataset.value;
}
return out;
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")


def preset(name: str, checkpoint, **extra):
    overrides = {
        ("model", "path"): str(checkpoint),
        ("model", "device"): "cpu",
        ("server", "engine_process"): False,
        ("logging", "level"): "warning",
        **{tuple(key.split("__")): value for key, value in extra.items()},
    }
    return load_settings(name, environ={}, overrides=overrides)


def traffic(base: str, headers: dict[str, str]) -> None:
    """A shared prefix three times (L1 hits), and a named prefix (a cache key)."""
    for _ in range(3):
        reply = httpx.post(f"{base}/v1/completions", json={"prompt": SHARED, "max_tokens": 4}, headers=headers, timeout=120)
        assert reply.status_code == 200, reply.text
    named = {"prompt": " ".join([PROMPTS[3], PROMPTS[6], PROMPTS[1]]), "max_tokens": 4, "cache_key": "docs"}
    for _ in range(2):
        reply = httpx.post(f"{base}/v1/cached/completions", json=named, headers=headers, timeout=120)
        assert reply.status_code == 200, reply.text


def expected_values(stats: dict) -> dict[str, float]:
    """What the page must show for a stats document: its figures, and every tier's row."""
    overall, latency = stats["overall"], stats["latency"]
    kv, spec = stats["cache_manager"]["kv_cache"], stats["cache_manager"]["speculation"]
    values = {
        "fig-running": overall["requests_running"],
        "fig-waiting": overall["requests_waiting"],
        "fig-hit-rate": kv["hit_rate"],
        "fig-spec-acceptance": spec["acceptance_rate"],
        "fig-ttft-p50": latency["ttft_seconds"]["p50"],
        "fig-ttft-p99": latency["ttft_seconds"]["p99"],
        "fig-alerts": len(stats["alerts"]),
    }
    for name, tier in kv["tiers"].items():
        for field in ("entries", "bytes", "hits", "evictions"):
            values[f"tier-{name}.{field}"] = tier[field]
        values[f"tier-{name}.hit-rate"] = tier["hit_rate"]
        values[f"evictions-{name}.total"] = tier["evictions"]
        values[f"evictions-{name}.expired"] = tier["expirations"]
    return values


def read(chrome, selector: str, what: str = "value") -> str | None:
    """One element's ``data-value`` (``what="value"``) or text, read in one script: the page redraws its
    tables on every poll, so an element found earlier may be gone."""
    return chrome.execute_script(
        "const e = document.querySelector(arguments[0]);"
        "return e === null ? null : arguments[1] === 'value' ? e.dataset.value : e.textContent;",
        selector,
        what,
    )


def mismatches(chrome, stats: dict) -> dict[str, tuple[object, object]]:
    shown = chrome.execute_script(PAGE_VALUES)
    wrong = {}
    for key, value in expected_values(stats).items():
        got = shown.get(key)
        same = got == "" if value is None else got not in (None, "") and float(got) == float(value)
        if not same:
            wrong[key] = (got, value)
    return wrong


def wait_until_page_matches_stats(chrome, base: str, headers: dict[str, str]) -> dict:
    """Poll until the page shows the figures of ``/v1/cache/stats`` (the page polls every 2 s); returns them."""
    found: dict = {}

    def matches(_) -> bool:
        found["stats"] = httpx.get(f"{base}/v1/cache/stats", headers=headers).json()
        found["wrong"] = mismatches(chrome, found["stats"])
        return not found["wrong"]

    try:
        WebDriverWait(chrome, 20, poll_frequency=0.3).until(matches)
    except TimeoutException:
        pytest.fail(f"the page never showed /v1/cache/stats' figures; (shown, stats): {found.get('wrong')}")
    return found["stats"]


def open_page(chrome, base: str) -> None:
    chrome.get(f"{base}/dashboard")
    WebDriverWait(chrome, 20).until(lambda c: c.find_element(By.ID, "status").text != "connecting…")


def click_and_confirm(chrome, button_id: str) -> str:
    """Click an action, accept its confirmation, and return the result the page shows."""
    result = chrome.find_element(By.ID, "action-result")
    chrome.execute_script("arguments[0].textContent = ''", result)  # not the previous action's result

    def shown(_) -> str:
        text = result.get_attribute("textContent")  # also while a poll hides the panel
        return text if text and text != "working…" else ""

    chrome.find_element(By.ID, button_id).click()
    WebDriverWait(chrome, 10).until(lambda c: c.switch_to.alert).accept()
    return WebDriverWait(chrome, 60).until(shown)


def load_timing(chrome) -> dict:
    return chrome.execute_script(
        "const n = performance.getEntriesByType('navigation')[0];"
        "const m = performance.getEntriesByName('tierserve-first-data')[0];"
        "return {dom_content_loaded_ms: n.domContentLoadedEventEnd, load_ms: n.loadEventEnd,"
        " first_data_ms: m ? m.startTime : null};"
    )


def test_development_page_matches_stats_and_clear_empties_l1(checkpoint, tmp_path):
    loaded = preset("development", checkpoint, monitoring__collection_interval_seconds=0.5)
    with headless_chromium() as chrome, running_server(loaded.settings, plugins=loaded.plugins) as base:
        traffic(base, {})
        open_page(chrome, base)
        WebDriverWait(chrome, 20).until(lambda c: c.find_element(By.TAG_NAME, "body").get_attribute("data-loaded"))
        print("dashboard load timing (development):", load_timing(chrome))
        stats = wait_until_page_matches_stats(chrome, base, {})
        assert set(stats["cache_manager"]["kv_cache"]["tiers"]) == {"l1", "l2"}  # the preset's tiers: no L3
        l1 = stats["cache_manager"]["kv_cache"]["tiers"]["l1"]
        assert l1["entries"] > 0 and l1["hits"] > 0  # the traffic was cached and reused: the figures are not zeros
        entries_text = read(chrome, "#tier-l1 td.entries", "text")
        assert entries_text.startswith(f"{l1['entries']:,} / {l1['capacity_entries']:,}")

        # the lists: the most used prefix and the named one, as the API ranks them
        WebDriverWait(chrome, 20).until(lambda c: read(c, "#prefixes tbody td.key"))
        top = httpx.get(f"{base}/v1/cache/prefixes?limit=10").json()["data"]
        assert read(chrome, "#prefixes tbody tr:first-child td.key") == top[0]["key"]
        assert read(chrome, "#prefixes tbody tr:first-child td.hits") == str(top[0]["hits"]) and top[0]["hits"] >= 2
        [key] = httpx.get(f"{base}/v1/cache/keys").json()["data"]
        assert key["blocks"] > 0 and key["hits"] == 1  # its second request reused its blocks
        assert read(chrome, "#keys tbody tr:first-child td.key") == "docs" == key["id"]
        assert read(chrome, "#keys tbody tr:first-child td.hits") == str(key["hits"])

        # the hit-rate chart draws one line per tier
        tiers = chrome.execute_script(
            "return [...document.querySelectorAll('#trend-chart polyline')].map((line) => line.dataset.tier)"
        )
        assert set(tiers) == set(stats["cache_manager"]["kv_cache"]["tiers"])
        save_page_screenshot(chrome, artifact_dir(tmp_path) / "dashboard-development.png")

        # a dismissed confirmation does nothing
        Select(chrome.find_element(By.ID, "clear-tier")).select_by_value("l1")
        chrome.find_element(By.ID, "clear").click()
        WebDriverWait(chrome, 10).until(lambda c: c.switch_to.alert).dismiss()
        assert not chrome.find_element(By.ID, "action-result").is_displayed()
        assert httpx.get(f"{base}/v1/cache/stats").json()["cache_manager"]["kv_cache"]["tiers"]["l1"]["entries"] > 0

        result = click_and_confirm(chrome, "clear")
        assert '"cleared"' in result and '"l1"' in result
        WebDriverWait(chrome, 10).until(lambda c: read(c, "#tier-l1 td.entries") == "0")
        assert read(chrome, "#tier-l1 td.bytes") == "0"
        after = wait_until_page_matches_stats(chrome, base, {})
        assert after["cache_manager"]["kv_cache"]["tiers"]["l1"]["entries"] == 0
        shot = save_page_screenshot(chrome, artifact_dir(tmp_path) / "dashboard-development-cleared.png")
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        print("dashboard screenshots in", shot.parent)
        errors = [entry for entry in chrome.get_log("browser") if entry["level"] == "SEVERE"]
        assert not errors, errors  # no script error, no blocked resource (the CSP allows only the page's own files)


def test_production_page_needs_keys_and_admin_actions_work(checkpoint, tmp_path):
    loaded = preset(
        "production", checkpoint, kv_cache__disk_path=str(tmp_path / "l3"),
        auth__api_keys=[USER_KEY], auth__admin_api_keys=[ADMIN_KEY],
    )  # fmt: skip
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with headless_chromium() as chrome, running_server(loaded.settings, plugins=loaded.plugins) as base:
        page = httpx.get(f"{base}/dashboard")  # the page itself holds no figures: served without a key
        assert page.status_code == 200 and "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert httpx.get(f"{base}/v1/cache/stats").status_code == 401
        traffic(base, admin)

        open_page(chrome, base)
        notice = chrome.find_element(By.ID, "notice")
        WebDriverWait(chrome, 10).until(lambda _: "401" in notice.text)
        assert "enter an API key" in notice.text

        def use_key(key: str) -> None:
            field = chrome.find_element(By.ID, "api-key")
            field.clear()
            field.send_keys(key)
            chrome.find_element(By.ID, "key-use").click()

        use_key(USER_KEY)  # a tenant's key: its own usage, no cache figures
        WebDriverWait(chrome, 10).until(lambda c: c.find_element(By.ID, "tenant-view").is_displayed())
        assert "not an admin key" in notice.text and not chrome.find_element(By.ID, "cache-view").is_displayed()

        use_key(ADMIN_KEY)
        WebDriverWait(chrome, 10).until(lambda c: c.find_element(By.ID, "cache-view").is_displayed())
        stats = wait_until_page_matches_stats(chrome, base, admin)
        assert set(stats["cache_manager"]["kv_cache"]["tiers"]) == {"l1", "l2", "l3"}
        assert read(chrome, "#tier-l3 td.medium", "text") == "disk"
        l1_before = stats["cache_manager"]["kv_cache"]["tiers"]["l1"]["entries"]
        assert l1_before > 0

        [key] = httpx.get(f"{base}/v1/cache/keys", headers=admin).json()["data"]
        pinned = key["blocks"]  # the named prefix's blocks stay in L1; nothing runs, so every other one is idle
        result = click_and_confirm(chrome, "offload")
        assert f'"offloaded_blocks": {l1_before - pinned}' in result
        after = wait_until_page_matches_stats(chrome, base, admin)
        assert after["cache_manager"]["kv_cache"]["tiers"]["l1"]["entries"] == pinned
        assert after["cache_manager"]["kv_cache"]["tiers"]["l2"]["entries"] >= l1_before - pinned

        chrome.find_element(By.ID, "warm-prompts").send_keys(" ".join(PROMPTS[3].split()))  # one line: one prompt
        result = click_and_confirm(chrome, "warm-prompts-button")
        assert '"source": "prompts"' in result and '"warmed": 1' in result
        result = click_and_confirm(chrome, "warm-frequent")
        assert '"source": "frequent"' in result
        wait_until_page_matches_stats(chrome, base, admin)
        save_page_screenshot(chrome, artifact_dir(tmp_path) / "dashboard-production.png")

        use_key(USER_KEY)  # a tenant's key cannot clear: the page shows the server's refusal
        WebDriverWait(chrome, 10).until(lambda c: c.find_element(By.ID, "tenant-view").is_displayed())
        chrome.execute_script("document.getElementById('cache-view').hidden = false")
        result = click_and_confirm(chrome, "clear")
        assert "HTTP 403" in result and "admin API key" in result


def test_public_stats_show_a_user_key_why_the_prefix_list_is_empty(checkpoint):
    """With [auth] public_stats every key reads the figures, but the prefix list stays the admin's: the page
    says so instead of leaving it blank."""
    loaded = preset("development", checkpoint, auth__api_keys=[USER_KEY], auth__admin_api_keys=[ADMIN_KEY],
                    auth__public_stats=True)  # fmt: skip
    with headless_chromium() as chrome, running_server(loaded.settings, plugins=loaded.plugins) as base:
        traffic(base, {"Authorization": f"Bearer {ADMIN_KEY}"})
        open_page(chrome, base)
        field = chrome.find_element(By.ID, "api-key")
        field.send_keys(USER_KEY)
        chrome.find_element(By.ID, "key-use").click()
        WebDriverWait(chrome, 10).until(lambda c: c.find_element(By.ID, "cache-view").is_displayed())
        WebDriverWait(chrome, 20).until(lambda c: "needs the admin key" in (read(c, "#prefixes tbody", "text") or ""))
        # the key list is the caller's tenant's own: the admin's "docs" is not in it
        assert "No named prefix" in read(chrome, "#keys tbody", "text")
