// tierserve fleet dashboard: polls the fleet's /v1/fleet/stats (at the ingress) and draws each replica, the routing
// decisions and the shared tiers (common.js: the key, the call, the formatting). Every figure is read from that document; the fleet-wide hit rate is the only sum
// made here. Each figure's element carries the raw value in data-value (tests and scripts read it).
"use strict";

let polls = 0;

function sum(values) {
  return values.reduce((total, value) => total + (value || 0), 0);
}

function decisionsText(decisions) {
  const entries = Object.entries(decisions || {}).sort((a, b) => b[1] - a[1]);
  return entries.length ? entries.map(([reason, count]) => `${reason} ${count}`).join(", ") : "–";
}

function held(replica) {
  const counts = replica.blocks_held || {};
  const l1 = counts["0"] || 0;
  const lower = sum(Object.entries(counts).filter(([position]) => position !== "0").map(([, count]) => count));
  return [l1, lower];
}

function renderFigures(fleet) {
  const replicas = Object.values(fleet.replicas);
  const live = replicas.filter((r) => !r.stale);
  setFigure("fig-routing", fleet.routing, fleet.routing);
  setFigure("fig-replicas", live.length, integer(live.length));
  $("fig-replicas-detail").textContent = replicas.length > live.length ? `${replicas.length - live.length} stale` : "";
  setFigure("fig-running", sum(live.map((r) => r.requests_running)), integer(sum(live.map((r) => r.requests_running))));
  setFigure("fig-waiting", sum(live.map((r) => r.requests_waiting)), integer(sum(live.map((r) => r.requests_waiting))));
  const cached = sum(replicas.map((r) => r.prompt_tokens_cached));
  const computed = sum(replicas.map((r) => r.prompt_tokens_computed));
  const rate = cached + computed ? cached / (cached + computed) : null;
  setFigure("fig-hit-rate", rate, percent(rate));
  $("fig-hit-detail").textContent = `${integer(cached)} of ${integer(cached + computed)} prompt tokens`;
  const routed = sum(Object.values(fleet.routing_decisions));
  setFigure("fig-routed", routed, integer(routed));
}

function renderReplicas(fleet) {
  const body = $("replicas").querySelector("tbody");
  const rows = Object.entries(fleet.replicas).map(([name, replica]) => {
    const row = document.createElement("tr");
    row.dataset.replica = name;
    if (replica.stale) row.className = "stale";
    const [l1, lower] = held(replica);
    cell(row, name, name);
    cell(row, replica.deployment || "–", replica.deployment || "");
    cell(row, (replica.node || "–").slice(0, 12), replica.node || "");
    cell(row, integer(replica.requests_running), replica.requests_running);
    cell(row, integer(replica.requests_waiting), replica.requests_waiting);
    cell(row, percent(replica.hit_rate), replica.hit_rate);
    cell(row, integer(l1), l1);
    cell(row, integer(lower), lower);
    cell(row, `${integer(replica.free_blocks)} / ${integer(replica.total_blocks)}`, replica.free_blocks);
    cell(row, millis(replica.ttft_p50), replica.ttft_p50);
    cell(row, decisionsText(replica.routing_decisions), JSON.stringify(replica.routing_decisions || {}));
    cell(row, replica.stale ? "stale" : `${replica.seconds_since_update.toFixed(1)} s ago`, replica.seconds_since_update);
    return row;
  });
  body.replaceChildren(...(rows.length ? rows : [emptyRow(12, "No replica has published yet.")]));
}

function renderDecisions(fleet) {
  const body = $("decisions").querySelector("tbody");
  const entries = Object.entries(fleet.routing_decisions).sort((a, b) => b[1] - a[1]);
  const why = fleet.routing === "power_of_two" ? "Ray's default router keeps no reasons." : "Nothing routed yet.";
  body.replaceChildren(
    ...(entries.length
      ? entries.map(([reason, count]) => {
          const row = document.createElement("tr");
          row.dataset.reason = reason;
          cell(row, reason, reason);
          cell(row, integer(count), count);
          return row;
        })
      : [emptyRow(2, why)]),
  );
}

function renderSharedTiers(fleet) {
  const body = $("shared-tiers").querySelector("tbody");
  const entries = Object.entries(fleet.shared_tiers);
  body.replaceChildren(
    ...(entries.length
      ? entries.map(([name, tier]) => {
          const row = document.createElement("tr");
          row.dataset.tier = name;
          const lookups = tier.hits + tier.misses;
          cell(row, name, name);
          cell(row, integer(tier.entries), tier.entries);
          cell(row, bytes(tier.bytes), tier.bytes);
          cell(row, percent(lookups ? tier.hits / lookups : null), lookups ? tier.hits / lookups : null);
          cell(row, integer(tier.hits), tier.hits);
          cell(row, integer(tier.replicas), tier.replicas);
          return row;
        })
      : [emptyRow(6, "No tier shared by the replicas (a redis tier is).")]),
  );
}

async function poll() {
  try {
    const fleet = await call("GET", "/v1/fleet/stats");
    renderFigures(fleet);
    renderReplicas(fleet);
    renderDecisions(fleet);
    renderSharedTiers(fleet);
    showNotice("");
    polls += 1;
    setStatus("updated " + new Date().toLocaleTimeString(), true);
    document.body.dataset.loaded = "true";
    document.body.dataset.polls = String(polls);
  } catch (error) {
    setStatus("not updated", false);
    if (error.status === 401 || error.status === 403) {
      showNotice(error.message + " — enter the fleet's admin API key above.", "bad");
    } else {
      showNotice(error.message, "bad");
    }
  }
}

function setUp() {
  $("api-key").value = apiKey();
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORE, $("api-key").value.trim());
    schedule();
  });
  $("key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORE);
    $("api-key").value = "";
    schedule();
  });
  schedule();
}

document.addEventListener("DOMContentLoaded", setUp);
