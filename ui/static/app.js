// lcap ui: charts, live refresh, raw bodies on demand, keyboard navigation. Everything the store holds is
// untrusted: this script only moves server-rendered (escaped) HTML and sets text with textContent.
"use strict";

const COLORS = ["#0b5cad", "#d1495b", "#2a9d8f", "#e9a23b", "#6a4c93", "#8a8d91", "#1f7a1f", "#c05299"];

function drawCharts(root) {
  if (typeof Chart === "undefined") return;
  root.querySelectorAll("canvas[data-chart]").forEach((canvas) => {
    const spec = JSON.parse(document.getElementById(canvas.dataset.chart).textContent);
    const old = Chart.getChart(canvas);
    if (old) old.destroy();
    new Chart(canvas, {
      type: spec.type,
      data: {
        labels: spec.labels.map((r) => "round " + r),
        datasets: spec.series.map((s, i) => ({
          label: s.label, data: s.data, borderColor: COLORS[i % COLORS.length],
          backgroundColor: COLORS[i % COLORS.length] + (spec.type === "bar" ? "cc" : "33"),
          spanGaps: true, tension: 0.2, pointRadius: 3,
        })),
      },
      options: {
        responsive: true, maintainAspectRatio: false, animation: false,
        interaction: { mode: "index", intersect: false },
        scales: {
          x: { stacked: !!spec.stacked },
          y: { stacked: !!spec.stacked, beginAtZero: spec.type === "bar", ...(spec.y || {}) },
        },
      },
    });
  });
}

// Live: the server sends `change` when the store's counts move; each region marked data-live is re-read
// from the same address and swapped in place, keeping which <details> were open.
function startLive() {
  const status = document.getElementById("live");
  if (!window.EventSource) { status.textContent = "live: not supported"; return; }
  let first = true, pending = false;
  const source = new EventSource("/events");
  source.onopen = () => {  // the stream is open: live, whether or not the store has moved yet
    if (status.className !== "live on") { status.className = "live on"; status.textContent = "live: connected"; }
  };
  source.addEventListener("change", () => {
    status.className = "live on";
    status.textContent = "live · " + new Date().toLocaleTimeString();
    if (first) { first = false; return; }
    if (!document.querySelector("[data-live]") || pending) return;
    pending = true;
    refresh().finally(() => { pending = false; });
  });
  source.addEventListener("busy", (e) => {
    status.className = "live busy";
    status.textContent = "live: store busy (" + JSON.parse(e.data) + ")";
  });
  let ending = false;  // the server said `end`: the stream closes as planned and reopens by itself
  source.addEventListener("end", () => { ending = true; });
  source.onerror = () => {
    if (ending) { ending = false; return; }
    status.className = "live"; status.textContent = "live: reconnecting";
  };
  window.addEventListener("pagehide", () => source.close());
}

async function refresh() {
  const answer = await fetch(location.href, { headers: { "X-Lcap-Refresh": "1" }, credentials: "same-origin" });
  if (!answer.ok) return;
  const fresh = new DOMParser().parseFromString(await answer.text(), "text/html");
  document.querySelectorAll("[data-live][id]").forEach((region) => {
    const next = fresh.getElementById(region.id);
    if (!next) return;
    const open = new Set([...region.querySelectorAll("details[open][id], section[id] details[open]")].map(pathOf));
    region.replaceWith(document.adoptNode(next));
    next.querySelectorAll("details").forEach((d) => { if (open.has(pathOf(d))) d.open = true; });
    drawCharts(next);
    bindRaw(next);
  });
  document.dispatchEvent(new CustomEvent("lcap:refreshed"));
}

function pathOf(details) {
  const section = details.closest("[id]");
  const all = section ? [...section.querySelectorAll("details")] : [];
  return (section ? section.id : "") + ":" + all.indexOf(details);
}

// Raw request/response bodies: fetched when asked for, shown as text.
function bindRaw(root) {
  root.querySelectorAll("button[data-raw]").forEach((button) => {
    button.addEventListener("click", async () => {
      const pre = button.parentElement.querySelector(".raw-body");
      if (!pre.hidden && pre.dataset.shown === button.dataset.raw) { pre.hidden = true; return; }
      pre.hidden = false;
      pre.textContent = "loading…";
      const answer = await fetch("/raw?" + button.dataset.raw, { credentials: "same-origin" });
      const text = await answer.text();
      try { pre.textContent = JSON.stringify(JSON.parse(text), null, 2); } catch { pre.textContent = text; }
      pre.dataset.shown = button.dataset.raw;
    });
  });
}

// Keyboard: j/k move through a table's rows, Enter opens the row's first link, / focuses the search,
// n/p follow the pager's next/previous links.
function bindKeys() {
  let index = -1;
  document.addEventListener("keydown", (e) => {
    if (e.altKey || e.ctrlKey || e.metaKey) return;
    const tag = (e.target.tagName || "").toLowerCase();
    if (tag === "input" || tag === "select" || tag === "textarea") return;
    const rows = [...document.querySelectorAll("table[data-nav] tbody tr")];
    const move = (to) => {
      if (!rows.length) return;
      rows.forEach((r) => r.classList.remove("selected"));
      index = Math.max(0, Math.min(rows.length - 1, to));
      rows[index].classList.add("selected");
      const link = rows[index].querySelector("a");
      if (link) link.focus();
    };
    if (e.key === "j") { move(index + 1); e.preventDefault(); }
    else if (e.key === "k") { move(index - 1); e.preventDefault(); }
    else if (e.key === "/") {
      const search = document.querySelector("input[name=q]");
      if (search) { search.focus(); e.preventDefault(); }
    } else if (e.key === "n" || e.key === "p") {
      const link = document.querySelector(e.key === "n" ? ".pager a[rel=next]" : ".pager a[rel=prev]");
      if (link) link.click();
    }
  });
  document.addEventListener("lcap:refreshed", () => { index = -1; });
}

document.addEventListener("DOMContentLoaded", () => {
  drawCharts(document);
  bindRaw(document);
  bindKeys();
  startLive();
});
