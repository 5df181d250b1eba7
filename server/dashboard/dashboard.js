// tierserve cache dashboard: polls the cache API with the key given on the page and draws what it answers.
// Every figure is read from /v1/cache/stats, /v1/cache/keys or /v1/cache/prefixes; nothing is computed here
// beyond formatting. Each figure's element carries the raw value in data-value (tests and scripts read it).
"use strict";

const LISTS_EVERY = 5; // the prefix and key lists walk the server's index: every 5th poll
const TIER_COLOURS = ["#2f6fdf", "#1a9e5c", "#e07b12", "#9b4dca", "#c23b57", "#5b6b7b"];
const SVG = "http://www.w3.org/2000/svg";

let polls = 0;
let firstRender = true;

// ---- formatting -----------------------------------------------------------------------------------

function bar(td, used, capacity, colour) {
  if (!capacity) return;
  const track = document.createElement("div");
  track.className = "bar";
  const fill = document.createElement("div");
  fill.style.width = Math.min(100, (100 * used) / capacity).toFixed(1) + "%";
  fill.style.background = colour;
  track.appendChild(fill);
  td.appendChild(track);
}

function colourOf(index) {
  return TIER_COLOURS[index % TIER_COLOURS.length];
}

// ---- rendering ------------------------------------------------------------------------------------

function renderFigures(stats) {
  const overall = stats.overall;
  const kv = stats.cache_manager.kv_cache;
  const spec = stats.cache_manager.speculation;
  const recent = stats.recent;
  const ttft = stats.latency.ttft_seconds;
  setFigure("fig-running", overall.requests_running, integer(overall.requests_running));
  setFigure("fig-waiting", overall.requests_waiting, integer(overall.requests_waiting));
  setFigure("fig-tokens-per-second", recent.generation_tokens_per_second, recent.generation_tokens_per_second.toFixed(1));
  $("fig-rate-span").textContent = `generated, last ${Math.round(recent.seconds)} s`;
  setFigure("fig-ttft-p50", ttft.p50, millis(ttft.p50));
  setFigure("fig-ttft-p99", ttft.p99, millis(ttft.p99));
  $("fig-ttft-count").textContent = `last ${integer(ttft.count)} requests`;
  if (spec.enabled || spec.proposed) {
    setFigure("fig-spec-acceptance", spec.acceptance_rate, percent(spec.acceptance_rate));
    $("fig-spec-detail").textContent = `${integer(spec.accepted)} of ${integer(spec.proposed)} drafts (${spec.method || "off"})`;
  } else {
    setFigure("fig-spec-acceptance", spec.acceptance_rate, "off");
    $("fig-spec-detail").textContent = "no speculation configured";
  }
  setFigure("fig-hit-rate", kv.hit_rate, kv.hit_rate.toFixed(1) + "%");
  $("fig-hit-detail").textContent = `${integer(kv.hits)} hits, ${integer(kv.misses)} misses`;
  setFigure("fig-alerts", stats.alerts.length, String(stats.alerts.length));
  $("fig-alerts").classList.toggle("bad", stats.alerts.length > 0);
}

function renderTiers(stats) {
  const tiers = stats.cache_manager.kv_cache.tiers;
  const body = $("tiers").querySelector("tbody");
  body.replaceChildren();
  Object.entries(tiers).forEach(([name, tier], index) => {
    const row = document.createElement("tr");
    row.id = `tier-${name}`;
    cell(row, name.toUpperCase(), name, "name");
    cell(row, tier.medium, tier.medium, "medium");
    const blocks = cell(row, capacityText(integer(tier.entries), tier.capacity_entries, integer), tier.entries, "entries");
    bar(blocks, tier.entries, tier.capacity_entries, colourOf(index));
    const held = cell(row, capacityText(bytes(tier.bytes), tier.capacity_bytes, bytes), tier.bytes, "bytes");
    bar(held, tier.bytes, tier.capacity_bytes, colourOf(index));
    cell(row, percent(tier.hit_rate), tier.hit_rate, "hit-rate");
    cell(row, integer(tier.hits), tier.hits, "hits");
    cell(row, integer(tier.evictions), tier.evictions, "evictions");
    body.appendChild(row);
  });
  const l1 = tiers.l1;
  $("l1-detail").textContent = l1
    ? `L1 blocks: ${integer(l1.blocks_in_use)} in use by running requests, ` +
      `${integer(l1.blocks_total - l1.blocks_in_use - l1.blocks_empty)} cached and idle, ` +
      `${integer(l1.blocks_empty)} empty, of ${integer(l1.blocks_total)}.`
    : "Prefix caching is off: no tiers.";
  const select = $("clear-tier");
  const wanted = ["all", ...Object.keys(tiers)];
  if (select.options.length !== wanted.length) {
    const chosen = select.value;
    select.replaceChildren(
      ...wanted.map((name) => new Option(name === "all" ? "all tiers" : name.toUpperCase(), name))
    );
    if (wanted.includes(chosen)) select.value = chosen;
  }
}

function capacityText(used, capacity, format) {
  return capacity === null || capacity === undefined ? used : `${used} / ${format(capacity)}`;
}

function renderEvictions(stats) {
  const tiers = stats.cache_manager.kv_cache.tiers;
  const recent = stats.recent;
  $("evictions-window").textContent = `Last ${Math.round(recent.seconds)} s`;
  const body = $("evictions").querySelector("tbody");
  body.replaceChildren();
  for (const [name, tier] of Object.entries(tiers)) {
    const row = document.createElement("tr");
    row.id = `evictions-${name}`;
    cell(row, name.toUpperCase(), name, "name");
    cell(row, integer(recent.evictions[name] || 0), recent.evictions[name] || 0, "recent");
    cell(row, integer(tier.evictions), tier.evictions, "total");
    cell(row, integer(tier.expirations), tier.expirations, "expired");
    body.appendChild(row);
  }
  const points = stats.trend_points.filter((p) => p.tiers);
  const series = Object.keys(tiers).map((name, index) => ({
    name,
    colour: colourOf(index),
    values: points.map((p, i) => {
      if (i === 0 || !p.tiers[name] || !points[i - 1].tiers[name]) return null;
      return Math.max(0, p.tiers[name].evictions - points[i - 1].tiers[name].evictions);
    }).slice(1),
  }));
  drawChart($("eviction-chart"), points.slice(1).map((p) => p.timestamp), series, null, "", 90);
}

function renderTrend(stats) {
  const tiers = Object.keys(stats.cache_manager.kv_cache.tiers);
  const points = stats.trend_points.filter((p) => p.tiers);
  const now = { timestamp: Date.now() / 1000, tiers: {} };
  for (const [name, tier] of Object.entries(stats.cache_manager.kv_cache.tiers)) now.tiers[name] = tier;
  const all = [...points, now]; // the samples, then the reading just taken
  const series = tiers.map((name, index) => ({
    name,
    colour: colourOf(index),
    values: all.map((p) => (p.tiers[name] ? 100 * p.tiers[name].hit_rate : null)),
  }));
  drawChart($("trend-chart"), all.map((p) => p.timestamp), series, 100, "%", 150);
  const interval = stats.trends.data_points ? `${stats.trends.data_points} samples` : "no samples yet";
  $("trend-note").textContent =
    `Each tier's hit rate (its hits / its lookups) at each monitor sample (${interval}; ` +
    `window ${Math.round(stats.trends.window_seconds)} s), and now.`;
}

function drawChart(container, times, series, fixedMax, unit, height) {
  const width = 460;
  const pad = { left: 36, right: 8, top: 8, bottom: 18 };
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("role", "img");
  const values = series.flatMap((s) => s.values.filter((v) => v !== null));
  const max = fixedMax || Math.max(1, ...values);
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  const x = (i) => pad.left + (times.length > 1 ? (i * plotW) / (times.length - 1) : plotW);
  const y = (v) => pad.top + plotH - (v * plotH) / max;
  for (const tick of fixedMax ? [0, 0.5, 1] : [0, 1]) {
    const line = document.createElementNS(SVG, "line");
    line.setAttribute("x1", pad.left);
    line.setAttribute("x2", width - pad.right);
    line.setAttribute("y1", y(tick * max));
    line.setAttribute("y2", y(tick * max));
    line.setAttribute("class", "grid");
    svg.appendChild(line);
    const label = document.createElementNS(SVG, "text");
    label.setAttribute("x", pad.left - 4);
    label.setAttribute("y", y(tick * max) + 4);
    label.setAttribute("class", "axis");
    label.textContent = Math.round(tick * max) + (unit === "%" ? "%" : "");
    svg.appendChild(label);
  }
  if (!values.length) {
    const empty = document.createElementNS(SVG, "text");
    empty.setAttribute("x", width / 2);
    empty.setAttribute("y", height / 2);
    empty.setAttribute("class", "empty");
    empty.textContent = "no data yet";
    svg.appendChild(empty);
  }
  for (const s of series) {
    const dots = s.values.map((v, i) => (v === null ? null : [x(i), y(v)])).filter(Boolean);
    if (!dots.length) continue;
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", dots.map((d) => d.join(",")).join(" "));
    line.setAttribute("stroke", s.colour);
    line.setAttribute("class", "series");
    line.dataset.tier = s.name;
    svg.appendChild(line);
    const [lx, ly] = dots[dots.length - 1];
    const dot = document.createElementNS(SVG, "circle");
    dot.setAttribute("cx", lx);
    dot.setAttribute("cy", ly);
    dot.setAttribute("r", 3);
    dot.setAttribute("fill", s.colour);
    svg.appendChild(dot);
  }
  const legend = document.createElement("div");
  legend.className = "legend";
  for (const s of series) {
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = s.colour;
    item.append(swatch, s.name.toUpperCase());
    legend.appendChild(item);
  }
  container.replaceChildren(svg, legend);
}

function renderAlerts(stats) {
  const list = $("alerts");
  list.replaceChildren();
  if (!stats.alerts.length) {
    const item = document.createElement("li");
    item.className = "ok";
    item.textContent = "No alert: every [monitoring] threshold holds.";
    list.appendChild(item);
    return;
  }
  for (const alert of stats.alerts) {
    const item = document.createElement("li");
    item.dataset.name = alert.name;
    const name = document.createElement("b");
    name.textContent = alert.name;
    item.append(name, " " + alert.message);
    list.appendChild(item);
  }
}

function renderPrefixes(prefixes) {
  const body = $("prefixes").querySelector("tbody");
  body.replaceChildren();
  if (!prefixes.data.length) body.appendChild(emptyRow(5, "No cached prefix has been reused."));
  for (const prefix of prefixes.data) {
    const row = document.createElement("tr");
    cell(row, prefix.key.slice(0, 12) + "…", prefix.key, "key mono");
    cell(row, integer(prefix.hits), prefix.hits, "hits");
    cell(row, integer(prefix.tokens), prefix.tokens, "tokens");
    cell(row, prefix.tiers.map((t) => t.toUpperCase()).join(" + "), prefix.tiers.join(","), "tiers");
    cell(row, prefix.cache_key || "", prefix.cache_key || "", "cache-key");
    body.appendChild(row);
  }
}

function renderKeys(keys) {
  const body = $("keys").querySelector("tbody");
  body.replaceChildren();
  const sorted = [...keys.data].sort((a, b) => b.hits - a.hits || b.requests - a.requests).slice(0, 10);
  if (!sorted.length) body.appendChild(emptyRow(6, "No named prefix (cache_key) is registered."));
  for (const key of sorted) {
    const row = document.createElement("tr");
    cell(row, key.id, key.id, "key");
    cell(row, key.tenant || "", key.tenant || "");
    cell(row, integer(key.hits), key.hits, "hits");
    cell(row, integer(key.requests), key.requests, "requests");
    cell(row, integer(key.prefix_tokens), key.prefix_tokens, "tokens");
    const where = key.tiers.complete.map((t) => t.toUpperCase()).join(" + ");
    cell(row, key.blocks === 0 ? "no full block" : where || "partly evicted", key.tiers.complete.join(","), "tiers");
    body.appendChild(row);
  }
}

function renderTenant(doc) {
  const body = $("tenant").querySelector("tbody");
  body.replaceChildren();
  const rows = [
    ["Tenant", doc.tenant || "(open)"],
    ["Requests", integer(doc.requests)],
    ["Prompt tokens", integer(doc.prompt_tokens)],
    ["Cached prompt tokens", integer(doc.cached_tokens)],
    ["Completion tokens", integer(doc.completion_tokens)],
    ["Block hit rate", doc.hit_rate.toFixed(1) + "%"],
    ["Token hit rate", doc.token_hit_rate.toFixed(1) + "%"],
  ];
  for (const [name, value] of rows) {
    const row = document.createElement("tr");
    const th = document.createElement("th");
    th.textContent = name;
    row.appendChild(th);
    cell(row, value);
    body.appendChild(row);
  }
}

// ---- polling ----------------------------------------------------------------------------------------

async function refreshLists() {
  const [keys, prefixes] = await Promise.allSettled([
    call("GET", "/v1/cache/keys"),
    call("GET", "/v1/cache/prefixes?limit=10"),
  ]);
  if (keys.status === "fulfilled") renderKeys(keys.value);
  else listRefused("keys", 6, keys.reason);
  if (prefixes.status === "fulfilled") renderPrefixes(prefixes.value);
  else listRefused("prefixes", 5, prefixes.reason);
}

// a list this key may not read (a user key where stats are public) says why instead of staying blank
function listRefused(id, columns, error) {
  const body = $(id).querySelector("tbody");
  const status = error instanceof ApiError ? error.status : 0;
  const why = status === 401 || status === 403 ? "This list needs the admin key." : String(error.message || error);
  body.replaceChildren(emptyRow(columns, why));
}

async function poll() {
  try {
    const stats = await call("GET", "/v1/cache/stats");
    const tenant = stats.scope === "tenant";
    $("figures").hidden = tenant;
    $("cache-view").hidden = tenant;
    $("tenant-view").hidden = !tenant;
    if (tenant) {
      renderTenant(stats);
      showNotice("This key is not an admin key: the page shows your tenant's usage. The cache figures and actions need the admin key.", "info");
    } else {
      renderFigures(stats);
      renderTiers(stats);
      renderTrend(stats);
      renderEvictions(stats);
      renderAlerts(stats);
      if (polls % LISTS_EVERY === 0) await refreshLists();
      showNotice("");
    }
    polls += 1;
    setStatus("updated " + new Date().toLocaleTimeString(), true);
    if (firstRender) {
      firstRender = false;
      performance.mark("tierserve-first-data");
      document.body.dataset.loaded = "true";
    }
    document.body.dataset.polls = String(polls);
  } catch (error) {
    setStatus("not updated", false);
    if (error.status === 401 || error.status === 403) {
      showNotice(error.message + " — enter an API key above.", "bad");
    } else if (error.status === 503) {
      showNotice("The server is not ready yet (loading the model); retrying.", "info");
    } else {
      showNotice(error.message, "bad");
    }
  }
}

// ---- actions -------------------------------------------------------------------------------------------

async function act(question, method, path, body) {
  if (!window.confirm(question)) return;
  const result = $("action-result");
  result.hidden = false;
  result.className = "result";
  result.textContent = "working…";
  try {
    const answer = await call(method, path, body);
    result.textContent = `${method} ${path}\n` + JSON.stringify(answer, null, 2);
    result.classList.add("ok");
  } catch (error) {
    result.textContent = error.message;
    result.classList.add("bad");
  }
  polls = 0; // the lists too
  schedule();
}

function setUp() {
  $("api-key").value = apiKey();
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORE, $("api-key").value.trim());
    polls = 0;
    schedule();
  });
  $("key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORE);
    $("api-key").value = "";
    polls = 0;
    schedule();
  });
  $("clear").addEventListener("click", () => {
    const tier = $("clear-tier").value;
    const what = tier === "all" ? "every tier" : tier.toUpperCase();
    act(`Drop the cached prefixes of ${what}? Requests running keep their blocks.`, "POST", "/v1/cache/clear", {
      tiers: tier === "all" ? "all" : [tier],
    });
  });
  $("offload").addEventListener("click", () => {
    act("Move L1's idle cached prefixes down a tier, freeing the live pool?", "POST", "/v1/cache/offload");
  });
  $("warm-prompts-button").addEventListener("click", () => {
    const prompts = $("warm-prompts").value.split("\n").map((p) => p.trim()).filter(Boolean);
    if (!prompts.length) {
      const result = $("action-result");
      result.hidden = false;
      result.className = "result bad";
      result.textContent = "Enter at least one prompt to warm (one per line).";
      return;
    }
    act(`Prefill ${prompts.length} prompt(s) and keep their KV?`, "POST", "/v1/cache/warm", { prompts });
  });
  $("warm-frequent").addEventListener("click", () => {
    act("Promote the most used cached prefixes into the faster tiers?", "POST", "/v1/cache/warm");
  });
  schedule();
}

document.addEventListener("DOMContentLoaded", setUp);
