// What the tierserve pages share (the cache dashboard, dashboard.js; the fleet's, fleet.js): the API key kept in
// the tab, the JSON call that sends it, and the formatting of figures. Loaded before the page's own script.
"use strict";

const KEY_STORE = "tierserve.apiKey";
const $ = (id) => document.getElementById(id);

function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function call(method, path, body) {
  const headers = { Accept: "application/json" };
  const key = apiKey();
  if (key) headers.Authorization = "Bearer " + key;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch (_) {
    data = null;
  }
  if (!response.ok) {
    const message = data && data.error ? data.error.message : text || response.statusText;
    throw new ApiError(response.status, `${method} ${path}: HTTP ${response.status}: ${message}`);
  }
  return data;
}

function integer(n) {
  return n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US");
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return (unit === 0 ? value.toString() : value.toFixed(1)) + " " + units[unit];
}

function percent(fraction) {
  return fraction === null || fraction === undefined ? "–" : (100 * fraction).toFixed(1) + "%";
}

function millis(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  return seconds < 1 ? (1000 * seconds).toFixed(1) + " ms" : seconds.toFixed(2) + " s";
}

function setFigure(id, value, text) {
  const element = $(id);
  element.dataset.value = value === null || value === undefined ? "" : String(value);
  element.textContent = text;
}

function cell(row, text, value, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (value !== undefined) td.dataset.value = value === null ? "" : String(value);
  if (className) td.className = className;
  row.appendChild(td);
  return td;
}

function emptyRow(columns, text) {
  const row = document.createElement("tr");
  const td = cell(row, text, undefined, "empty");
  td.colSpan = columns;
  return row;
}

function showNotice(text, kind) {
  const notice = $("notice");
  notice.hidden = !text;
  notice.textContent = text || "";
  notice.className = "notice " + (kind || "");
}

const STATS_EVERY_MS = 2000;
let timer = null;

// the page's poll() now, then again STATS_EVERY_MS after each one ends (never two at once); calling it again
// (a new key) polls at once
function schedule() {
  clearTimeout(timer);
  poll().finally(() => {
    timer = setTimeout(schedule, STATS_EVERY_MS);
  });
}

function setStatus(text, ok) {
  const status = $("status");
  status.textContent = text;
  status.classList.toggle("bad", !ok);
}

