/* headlab report: heatmaps and attention viewer. Vanilla JS, no network, no innerHTML:
   every string from the data reaches the page through textContent or setAttribute. */
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("headlab-data").textContent);
  var SVGNS = "http://www.w3.org/2000/svg";
  var KIND_RGB = { enc_self: [43, 108, 176], dec_self: [47, 133, 90], dec_cross: [192, 86, 33] };
  var ROW = 18;

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    for (var k in attrs || {}) node.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function svg(tag, attrs, text) {
    var node = document.createElementNS(SVGNS, tag);
    for (var k in attrs || {}) node.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function headName(kind, layer, head) { return kind + " L" + layer + " H" + head; }
  function labelsOf(kind, layer, head) { return (DATA.labels || {})[kind + ":" + layer + ":" + head] || []; }
  function fmt(v) {
    if (v === null || v === undefined) return "n/a";
    var a = Math.abs(v);
    return a !== 0 && (a < 0.001 || a >= 10000) ? v.toExponential(2) : v.toFixed(3);
  }

  /* ---- colour scales ------------------------------------------------------------------ */
  var VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  function lerp(stops, t) {
    t = Math.max(0, Math.min(1, t));
    var x = t * (stops.length - 1), i = Math.min(Math.floor(x), stops.length - 2), f = x - i;
    var a = stops[i], b = stops[i + 1];
    return [0, 1, 2].map(function (c) { return Math.round(a[c] + (b[c] - a[c]) * f); });
  }
  var DIVERGING = [[33, 102, 172], [146, 197, 222], [247, 247, 247], [244, 165, 130], [178, 24, 43]];
  function rgb(c) { return "rgb(" + c[0] + "," + c[1] + "," + c[2] + ")"; }
  function scaleFor(values) {
    var lo = Infinity, hi = -Infinity;
    values.forEach(function (v) { if (v !== null) { lo = Math.min(lo, v); hi = Math.max(hi, v); } });
    if (lo === Infinity) return { lo: 0, hi: 0, color: function () { return "#ddd"; }, stops: VIRIDIS };
    if (lo < 0 && hi > 0) {
      var m = Math.max(-lo, hi);
      return { lo: -m, hi: m, stops: DIVERGING, color: function (v) { return rgb(lerp(DIVERGING, (v + m) / (2 * m))); } };
    }
    return { lo: lo, hi: hi, stops: VIRIDIS,
      color: function (v) { return rgb(lerp(VIRIDIS, hi > lo ? (v - lo) / (hi - lo) : 0.5)); } };
  }

  /* ---- tooltip ----------------------------------------------------------------------------- */
  var tooltip = document.getElementById("tooltip");
  function showTip(event, text) {
    tooltip.textContent = text;
    tooltip.hidden = false;
    tooltip.style.left = Math.min(event.clientX + 14, window.innerWidth - 300) + "px";
    tooltip.style.top = event.clientY + 14 + "px";
  }
  function hideTip() { tooltip.hidden = true; }

  /* ---- heatmaps ---------------------------------------------------------------------------- */
  function abbreviation(labels) {
    return labels.map(function (l) {
      var m = /^positional\s*([+-]?\d+)/.exec(l);
      if (m) return "P" + (m[1].charAt(0) === "-" || m[1].charAt(0) === "+" ? m[1] : "+" + m[1]);
      if (/^rare/.test(l)) return "R";
      return "S";
    }).filter(function (v, i, a) { return a.indexOf(v) === i; }).join(" ");
  }

  function legend(scale) {
    var box = el("div", { class: "hm-legend" });
    var canvas = el("canvas", { width: "100", height: "8" });
    var ctx = canvas.getContext("2d");
    for (var x = 0; x < 100; x++) { ctx.fillStyle = rgb(lerp(scale.stops, x / 99)); ctx.fillRect(x, 0, 1, 8); }
    box.appendChild(el("span", {}, fmt(scale.lo)));
    box.appendChild(canvas);
    box.appendChild(el("span", {}, fmt(scale.hi)));
    box.appendChild(el("span", {}, "grey: not scored"));
    return box;
  }

  function renderHeatmap(h) {
    var box = el("div", { class: "heatmap", "data-id": h.id });
    box.appendChild(el("h4", {}, h.title));
    if (h.caption) box.appendChild(el("p", { class: "hm-caption" }, h.caption + " (" + h.file + ")"));
    var all = [];
    Object.keys(h.scores).forEach(function (k) { h.scores[k].forEach(function (row) { all = all.concat(row); }); });
    var scale = scaleFor(all);
    var kinds = el("div", { class: "hm-kinds" });
    DATA.kinds.forEach(function (kind) {
      var rows = h.scores[kind];
      if (!rows) return;
      var nHeads = rows.reduce(function (m, r) { return Math.max(m, r.length); }, 0);
      var cell = nHeads > 16 ? Math.max(8, Math.floor(352 / nHeads)) : 22;
      var left = 26, top = 14;
      var width = left + nHeads * cell + 2, height = top + rows.length * cell + 2;
      var wrap = el("div", {});
      wrap.appendChild(el("div", { class: "hm-kind-title" }, kind));
      var s = svg("svg", { class: "hm", width: width, height: height, viewBox: "0 0 " + width + " " + height,
        "data-kind": kind, role: "img", "aria-label": h.title + ", " + kind });
      for (var hd = 0; hd < nHeads; hd++) {
        if (cell >= 14 || hd % 4 === 0) s.appendChild(svg("text", { x: left + hd * cell + cell / 2, y: 10, "text-anchor": "middle" }, hd));
      }
      rows.forEach(function (row, layer) {
        s.appendChild(svg("text", { x: left - 4, y: top + layer * cell + cell / 2 + 3, "text-anchor": "end" }, "L" + layer));
        row.forEach(function (v, head) {
          var labels = labelsOf(kind, layer, head);
          var r = svg("rect", { class: "cell", x: left + head * cell, y: top + layer * cell, width: cell, height: cell,
            fill: v === null ? "#ddd" : scale.color(v), "data-kind": kind, "data-layer": layer, "data-head": head,
            "data-value": v === null ? "" : v });
          var tip = headName(kind, layer, head) + ": " + (v === null ? "not scored" : fmt(v)) +
            (labels.length ? "\n" + labels.join(", ") : "") + "\nclick: open in the viewer";
          r.appendChild(svg("title", {}, tip));
          r.addEventListener("click", function () { viewer.open(kind, layer, head, true); });
          s.appendChild(r);
          if (labels.length && cell >= 18) {
            s.appendChild(svg("text", { class: "cell-label", x: left + head * cell + cell / 2,
              y: top + layer * cell + cell / 2 + 3, "text-anchor": "middle" }, abbreviation(labels)));
          }
        });
      });
      wrap.appendChild(s);
      kinds.appendChild(wrap);
    });
    box.appendChild(kinds);
    box.appendChild(legend(scale));
    return box;
  }

  function renderGroups() {
    var containers = document.querySelectorAll(".heatmaps");
    Array.prototype.forEach.call(containers, function (container) {
      var group = container.getAttribute("data-group");
      var maps = DATA.heatmaps.filter(function (h) { return h.group === group; });
      if (!maps.length) return;
      if (container.getAttribute("data-select") === "1") {
        var wrap = el("div", { class: "heatmap-select" });
        var label = el("label", { class: "hm-select" }, "Attention by part of speech of the attended word: ");
        var select = el("select", { "data-group": group });
        maps.forEach(function (h, i) { select.appendChild(el("option", { value: String(i) }, h.name)); });
        label.appendChild(select);
        wrap.appendChild(label);
        var slot = el("div", {});
        wrap.appendChild(slot);
        var show = function () { slot.replaceChildren(renderHeatmap(maps[+select.value])); markSelected(); };
        select.addEventListener("change", show);
        container.appendChild(wrap);
        show();
      } else {
        maps.forEach(function (h) { container.appendChild(renderHeatmap(h)); });
      }
    });
  }

  function markSelected() {
    var st = viewer.state;
    Array.prototype.forEach.call(document.querySelectorAll("svg.hm rect.cell"), function (r) {
      var on = r.getAttribute("data-kind") === st.kind && +r.getAttribute("data-layer") === st.layer &&
        +r.getAttribute("data-head") === st.head;
      r.classList.toggle("selected", on);
    });
  }

  /* ---- attention data ---------------------------------------------------------------------- */
  var ATT = DATA.attention || { sentences: [], mode: "none" };
  var cache = {}, pending = {};
  window.headlabAttention = function (slot, data) {
    cache[slot] = data;
    (pending[slot] || []).forEach(function (cb) { cb(data, null); });
    delete pending[slot];
  };
  function loadSentence(slot, cb) {
    if (cache[slot]) return cb(cache[slot], null);
    if (ATT.mode === "inline") {
      var node = document.getElementById("headlab-attention-" + slot);
      if (!node) return cb(null, "attention data of sentence " + slot + " is missing");
      cache[slot] = JSON.parse(node.textContent);
      return cb(cache[slot], null);
    }
    var entry = ATT.sentences[slot];
    if (pending[slot]) { pending[slot].push(cb); return; }
    pending[slot] = [cb];
    var tag = el("script", { src: entry.script });
    tag.addEventListener("error", function () {
      (pending[slot] || []).forEach(function (f) { f(null, "could not load " + entry.script); });
      delete pending[slot];
    });
    document.body.appendChild(tag);
  }
  function decode(block) {
    if (!block.bytes) {
      var raw = atob(block.data), bytes = new Uint8Array(raw.length);
      for (var i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
      block.bytes = bytes;
    }
    return block.bytes;
  }

  /* ---- viewer ------------------------------------------------------------------------------ */
  var $ = function (id) { return document.getElementById(id); };
  var viewer = {
    state: { slot: 0, kind: null, layer: 0, head: 0, view: "lines", threshold: 0.02, payload: null },
    hover: null
  };

  function setOptions(select, values, labels, current) {
    select.replaceChildren();
    values.forEach(function (v, i) { select.appendChild(el("option", { value: String(v) }, labels ? labels[i] : v)); });
    if (current !== undefined && values.map(String).indexOf(String(current)) >= 0) select.value = String(current);
  }
  function blocksOf(payload) { return payload ? Object.keys(payload.blocks) : []; }
  function kindsOf(keys) {
    return DATA.kinds.filter(function (k) { return keys.some(function (b) { return b.split(":")[0] === k; }); });
  }
  function status(text) { var s = $("v-status"); s.textContent = text || ""; s.hidden = !text; }

  viewer.open = function (kind, layer, head, scroll) {
    var st = viewer.state;
    var want = kind + ":" + layer;
    var slot = st.slot;
    var entry = ATT.sentences[slot];
    if (!entry || (entry.blocks || []).indexOf(want) < 0) {
      for (var i = 0; i < ATT.sentences.length; i++) {
        if ((ATT.sentences[i].blocks || []).indexOf(want) >= 0) { slot = i; break; }
      }
    }
    st.kind = kind; st.layer = layer; st.head = head;
    if (scroll) $("viewer").scrollIntoView({ block: "start" });
    selectSentence(slot, true);
  };

  function selectSentence(slot, keepHead) {
    var st = viewer.state;
    st.slot = slot;
    if (!ATT.sentences.length) { render(); return; }
    $("v-sentence").value = String(slot);
    var entry = ATT.sentences[slot];
    $("v-source").textContent = entry.source || "";
    $("v-target").textContent = entry.target ? entry.target + (entry.target_from === "translation" ? "  (the model's translation)" : "") : "";
    $("v-target-row").hidden = !entry.target;
    loadSentence(slot, function (payload, error) {
      if (st.slot !== slot) return;
      st.payload = payload;
      if (error) { status(error); render(); return; }
      var keys = blocksOf(payload);
      var kinds = kindsOf(keys);
      if (!keepHead || kinds.indexOf(st.kind) < 0) {
        if (kinds.indexOf(st.kind) < 0) st.kind = kinds[0] || null;
      }
      refreshControls();
      render();
    });
  }

  function refreshControls() {
    var st = viewer.state, keys = blocksOf(st.payload);
    var kinds = kindsOf(keys);
    setOptions($("v-kind"), kinds, null, st.kind);
    var layers = keys.filter(function (b) { return b.split(":")[0] === st.kind; }).map(function (b) { return +b.split(":")[1]; });
    setOptions($("v-layer"), layers, layers.map(function (l) { return "L" + l; }), st.layer);
    var block = st.payload && st.payload.blocks[st.kind + ":" + st.layer];
    var nHeads = block ? block.shape[0] : 0, heads = [];
    for (var h = 0; h < nHeads; h++) heads.push(h);
    setOptions($("v-head"), heads, heads.map(function (h) {
      var l = labelsOf(st.kind, st.layer, h);
      return "H" + h + (l.length ? " (" + l.join(", ") + ")" : "");
    }), st.head);
  }

  function currentBlock() {
    var st = viewer.state;
    return st.payload ? st.payload.blocks[st.kind + ":" + st.layer] : null;
  }

  function render() {
    var st = viewer.state, root = $("viewer");
    root.setAttribute("data-kind", st.kind || "");
    root.setAttribute("data-layer", String(st.layer));
    root.setAttribute("data-head", String(st.head));
    root.setAttribute("data-sentence", String(st.slot));
    var labels = st.kind ? labelsOf(st.kind, st.layer, st.head) : [];
    $("v-head-label").textContent = st.kind ? headName(st.kind, st.layer, st.head) + (labels.length ? " — " + labels.join(", ") : "") : "";
    markSelected();
    var block = currentBlock();
    if (!ATT.sentences.length) { status("No example attention in this analysis directory (attention/index.json)."); clearViews(); return; }
    if (!block || st.head >= block.shape[0]) {
      if (st.payload) status("No example sentence has attention for " + (st.kind ? headName(st.kind, st.layer, st.head) : "this head") + ".");
      clearViews();
      return;
    }
    status("");
    if (st.view === "matrix") { $("v-lines").hidden = true; $("v-matrix").hidden = false; drawMatrix(block); }
    else { $("v-matrix").hidden = true; $("v-lines").hidden = false; drawLines(block, null); }
    document.body.setAttribute("data-rendered", "1");
  }
  function clearViews() {
    $("v-left").replaceChildren(); $("v-right").replaceChildren();
    var c = $("v-canvas"); c.width = 0; c.height = 0;
    var m = $("v-matrix-canvas"); m.width = 0; m.height = 0;
    document.body.setAttribute("data-rendered", "1");
  }

  function sizeCanvas(canvas, w, h) {
    var dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
    canvas.style.width = w + "px"; canvas.style.height = h + "px";
    var ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return ctx;
  }

  function drawLines(block, onlyRow) {
    var st = viewer.state, tokens = st.payload.tokens;
    var q = tokens[block.q] || [], k = tokens[block.k] || [];
    var nq = block.shape[1], nk = block.shape[2], bytes = decode(block), base = st.head * nq * nk;
    var left = $("v-left"), right = $("v-right");
    if (left.childElementCount !== nq || left.getAttribute("data-side") !== block.q + st.slot) {
      left.replaceChildren(); right.replaceChildren();
      for (var i = 0; i < nq; i++) {
        var span = el("span", { "data-i": String(i), title: q[i] }, q[i]);
        span.addEventListener("mouseenter", onTokenEnter);
        left.appendChild(span);
      }
      for (var j = 0; j < nk; j++) right.appendChild(el("span", { "data-j": String(j), title: k[j] }, k[j]));
      left.setAttribute("data-side", block.q + st.slot);
      left.onmouseleave = function () { viewer.hover = null; drawLines(currentBlock(), null); };
    }
    var width = 260, height = Math.max(nq, nk) * ROW;
    var ctx = sizeCanvas($("v-canvas"), width, height);
    var color = KIND_RGB[st.kind] || [60, 60, 60];
    var threshold = onlyRow === null ? Math.round(st.threshold * 255) : 1;
    // Bucket lines by their byte value: one path per opacity level, at most 255 strokes.
    var buckets = {};
    for (var a = onlyRow === null ? 0 : onlyRow; a < (onlyRow === null ? nq : onlyRow + 1); a++) {
      for (var b = 0; b < nk; b++) {
        var v = bytes[base + a * nk + b];
        if (v >= Math.max(threshold, 1)) (buckets[v] || (buckets[v] = [])).push(a, b);
      }
    }
    ctx.lineWidth = 1.5;
    ctx.strokeStyle = rgb(color);
    Object.keys(buckets).forEach(function (v) {
      var pairs = buckets[v];
      ctx.globalAlpha = Math.min(1, +v / 255 * (onlyRow === null ? 1 : 1.5) + 0.03);
      ctx.beginPath();
      for (var p = 0; p < pairs.length; p += 2) {
        ctx.moveTo(0, pairs[p] * ROW + ROW / 2);
        ctx.lineTo(width, pairs[p + 1] * ROW + ROW / 2);
      }
      ctx.stroke();
    });
    ctx.globalAlpha = 1;
    Array.prototype.forEach.call(left.children, function (s, idx) { s.classList.toggle("active", idx === onlyRow); });
    Array.prototype.forEach.call(right.children, function (s, idx) {
      var w = onlyRow === null ? 0 : bytes[base + onlyRow * nk + idx] / 255;
      s.style.background = w > 0 ? "rgba(" + color.join(",") + "," + w.toFixed(3) + ")" : "";
      s.style.color = w > 0.6 ? "#fff" : "";
      s.title = k[idx] + (onlyRow === null ? "" : ": " + w.toFixed(3));
    });
  }
  function onTokenEnter(event) {
    var block = currentBlock();
    if (!block || viewer.state.view !== "lines") return;
    drawLines(block, +event.currentTarget.getAttribute("data-i"));
  }

  function drawMatrix(block) {
    var st = viewer.state, tokens = st.payload.tokens;
    var q = tokens[block.q] || [], k = tokens[block.k] || [];
    var nq = block.shape[1], nk = block.shape[2], bytes = decode(block), base = st.head * nq * nk;
    var n = Math.max(nq, nk), cell = Math.max(2, Math.min(22, Math.floor(640 / n)));
    var labelled = cell >= 10, margin = labelled ? 96 : 4;
    var canvas = $("v-matrix-canvas");
    var ctx = sizeCanvas(canvas, margin + nk * cell + 4, margin + nq * cell + 4);
    var color = KIND_RGB[st.kind] || [60, 60, 60];
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, margin + nk * cell + 4, margin + nq * cell + 4);
    for (var i = 0; i < nq; i++) {
      for (var j = 0; j < nk; j++) {
        var w = bytes[base + i * nk + j] / 255;
        ctx.fillStyle = "rgb(" + [0, 1, 2].map(function (c) { return Math.round(255 - w * (255 - color[c])); }).join(",") + ")";
        ctx.fillRect(margin + j * cell, margin + i * cell, cell, cell);
      }
    }
    if (labelled) {
      ctx.fillStyle = "#1d2330"; ctx.font = Math.min(12, cell - 1) + "px monospace"; ctx.textBaseline = "middle";
      var cut = function (t) { t = String(t); return t.length > 12 ? t.slice(0, 11) + "…" : t; };
      ctx.textAlign = "right";
      for (i = 0; i < nq; i++) ctx.fillText(cut(q[i]), margin - 4, margin + i * cell + cell / 2);
      for (j = 0; j < nk; j++) {
        ctx.save(); ctx.translate(margin + j * cell + cell / 2, margin - 4); ctx.rotate(-Math.PI / 2);
        ctx.textAlign = "left"; ctx.fillText(cut(k[j]), 0, 0); ctx.restore();
      }
    }
    canvas.onmousemove = function (event) {
      var rect = canvas.getBoundingClientRect();
      var x = event.clientX - rect.left - margin, y = event.clientY - rect.top - margin;
      var jj = Math.floor(x / cell), ii = Math.floor(y / cell);
      if (ii < 0 || jj < 0 || ii >= nq || jj >= nk) { hideTip(); return; }
      showTip(event, q[ii] + " (" + ii + ") → " + k[jj] + " (" + jj + "): " + (bytes[base + ii * nk + jj] / 255).toFixed(3));
    };
    canvas.onmouseleave = hideTip;
  }

  function initViewer() {
    var sel = $("v-sentence");
    ATT.sentences.forEach(function (s, i) {
      var text = (s.source || "").length > 90 ? s.source.slice(0, 89) + "…" : (s.source || "");
      sel.appendChild(el("option", { value: String(i) }, (s.id !== undefined ? s.id : i) + ": " + text));
    });
    sel.addEventListener("change", function () { selectSentence(+sel.value, true); });
    $("v-kind").addEventListener("change", function () {
      var st = viewer.state; st.kind = $("v-kind").value;
      refreshControls(); st.layer = +$("v-layer").value; st.head = Math.min(st.head, $("v-head").options.length - 1);
      refreshControls(); render();
    });
    $("v-layer").addEventListener("change", function () {
      var st = viewer.state; st.layer = +$("v-layer").value; refreshControls(); st.head = +$("v-head").value; render();
    });
    $("v-head").addEventListener("change", function () { viewer.state.head = +$("v-head").value; render(); });
    Array.prototype.forEach.call(document.querySelectorAll('input[name="v-view"]'), function (r) {
      r.addEventListener("change", function () { if (r.checked) { viewer.state.view = r.value; render(); } });
    });
    $("v-threshold").addEventListener("input", function () {
      viewer.state.threshold = +$("v-threshold").value;
      $("v-threshold-value").textContent = viewer.state.threshold.toFixed(2);
      if (viewer.state.view === "lines") render();
    });
    Array.prototype.forEach.call(document.querySelectorAll(".head-link[data-kind]"), function (row) {
      var go = function (event) {
        event.preventDefault();
        viewer.open(row.getAttribute("data-kind"), +row.getAttribute("data-layer"), +row.getAttribute("data-head"), true);
      };
      row.addEventListener("click", go);
      row.addEventListener("keydown", function (event) { if (event.key === "Enter") go(event); });
    });
    if (ATT.sentences.length) {
      var first = ATT.sentences[0].blocks || [];
      if (first.length) { viewer.state.kind = first[0].split(":")[0]; viewer.state.layer = +first[0].split(":")[1]; }
      selectSentence(0, true);
    } else {
      render();
    }
  }

  window.headlabReport = { viewer: viewer, open: function (k, l, h) { viewer.open(k, l, h, false); } };
  renderGroups();
  initViewer();
  if (window.performance && performance.mark) performance.mark("headlab-rendered");
})();
