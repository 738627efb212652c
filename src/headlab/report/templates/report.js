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

  // Categorical colours (Tableau 10, then greys) for a map whose values are categories (offsets).
  var CATEGORIES = [[78, 121, 167], [242, 142, 43], [225, 87, 89], [118, 183, 178], [89, 161, 79], [237, 201, 72],
    [176, 122, 161], [255, 157, 167], [156, 117, 95], [186, 176, 172]];
  function categoricalScale(values) {
    var seen = {};
    values.forEach(function (v) { if (v !== null) seen[v] = (seen[v] || 0) + 1; });
    var cats = Object.keys(seen).map(Number).sort(function (a, b) { return seen[b] - seen[a] || a - b; });
    var colour = {};
    cats.forEach(function (v, i) { colour[v] = i < CATEGORIES.length ? rgb(CATEGORIES[i]) : "#7f7f7f"; });
    return { categorical: true, cats: cats.sort(function (a, b) { return a - b; }),
      color: function (v) { return colour[v] || "#7f7f7f"; } };
  }

  function legend(scale) {
    var box = el("div", { class: "hm-legend" });
    if (scale.categorical) {
      scale.cats.forEach(function (v) {
        var sw = el("span", { class: "swatch" });
        sw.style.background = scale.color(v);
        box.appendChild(sw);
        box.appendChild(el("span", {}, (v > 0 ? "+" : "") + v));
      });
      box.appendChild(el("span", {}, "grey: not scored"));
      return box;
    }
    var canvas = el("canvas", { width: "100", height: "8" });
    var ctx = canvas.getContext("2d");
    for (var x = 0; x < 100; x++) { ctx.fillStyle = rgb(lerp(scale.stops, x / 99)); ctx.fillRect(x, 0, 1, 8); }
    box.appendChild(el("span", {}, fmt(scale.lo)));
    box.appendChild(canvas);
    box.appendChild(el("span", {}, fmt(scale.hi)));
    box.appendChild(el("span", {}, "grey: not scored"));
    return box;
  }

  // One listener per heatmap (not per cell): at 32 x 32 heads a page holds tens of thousands of cells.
  function cellOf(event) {
    var t = event.target;
    return t && t.classList && t.classList.contains("cell") ? t : null;
  }
  function onHeatmapClick(event) {
    var r = cellOf(event);
    if (r) viewer.open(r.getAttribute("data-kind"), +r.getAttribute("data-layer"), +r.getAttribute("data-head"), true);
  }
  function onHeatmapMove(event) {
    var r = cellOf(event);
    if (!r) { hideTip(); return; }
    var kind = r.getAttribute("data-kind"), layer = +r.getAttribute("data-layer"), head = +r.getAttribute("data-head");
    var v = r.getAttribute("data-value"), labels = labelsOf(kind, layer, head);
    showTip(event, headName(kind, layer, head) + ": " + (v === "" ? "not scored" : fmt(+v)) +
      (labels.length ? "\n" + labels.join(", ") : "") + "\nclick: open in the viewer");
  }

  function renderHeatmap(h) {
    var box = el("div", { class: "heatmap", "data-id": h.id });
    box.appendChild(el("h4", {}, h.title));
    if (h.caption) box.appendChild(el("p", { class: "hm-caption" }, h.caption + " (" + h.file + ")"));
    var all = [];
    Object.keys(h.scores).forEach(function (k) { h.scores[k].forEach(function (row) { all = all.concat(row); }); });
    var scale = h.categorical ? categoricalScale(all) : scaleFor(all);
    var kinds = el("div", { class: "hm-kinds" });
    DATA.kinds.forEach(function (kind) {
      var rows = h.scores[kind];
      if (!rows) return;
      var nHeads = rows.reduce(function (m, r) { return Math.max(m, r.length); }, 0);
      var cell = nHeads > 16 ? Math.max(8, Math.floor(352 / nHeads)) : (rows.length > 24 ? 14 : 22);
      // Labels at least 14 px apart (2-digit layers at 10 px font), so that "10111213" cannot happen.
      var headStep = Math.ceil(18 / cell), layerStep = Math.ceil(13 / cell);
      var left = 28, top = 14;
      var width = left + nHeads * cell + 2, height = top + rows.length * cell + 2;
      var wrap = el("div", {});
      wrap.appendChild(el("div", { class: "hm-kind-title" }, kind));
      var s = svg("svg", { class: "hm", width: width, height: height, viewBox: "0 0 " + width + " " + height,
        "data-kind": kind, role: "img", "aria-label": h.title + ", " + kind });
      for (var hd = 0; hd < nHeads; hd++) {
        if (hd % headStep === 0) s.appendChild(svg("text", { x: left + hd * cell + cell / 2, y: 10, "text-anchor": "middle" }, hd));
      }
      rows.forEach(function (row, layer) {
        if (layer % layerStep === 0) {
          s.appendChild(svg("text", { x: left - 4, y: top + layer * cell + cell / 2 + 3, "text-anchor": "end" }, "L" + layer));
        }
        row.forEach(function (v, head) {
          s.appendChild(svg("rect", { class: "cell", x: left + head * cell, y: top + layer * cell, width: cell, height: cell,
            fill: v === null ? "#ddd" : scale.color(v), "data-kind": kind, "data-layer": layer, "data-head": head,
            "data-value": v === null ? "" : v }));
          var labels = labelsOf(kind, layer, head);
          if (labels.length && cell >= 18) {
            s.appendChild(svg("text", { class: "cell-label", x: left + head * cell + cell / 2,
              y: top + layer * cell + cell / 2 + 3, "text-anchor": "middle" }, abbreviation(labels)));
          }
        });
      });
      s.addEventListener("click", onHeatmapClick);
      s.addEventListener("mousemove", onHeatmapMove);
      s.addEventListener("mouseleave", hideTip);
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

  var selectedCells = [];
  function markSelected() {
    var st = viewer.state;
    selectedCells.forEach(function (r) { r.classList.remove("selected"); });
    if (!st.kind) { selectedCells = []; return; }
    selectedCells = Array.prototype.slice.call(document.querySelectorAll('svg.hm rect.cell[data-kind="' + st.kind +
      '"][data-layer="' + st.layer + '"][data-head="' + st.head + '"]'));
    selectedCells.forEach(function (r) { r.classList.add("selected"); });
  }

  /* ---- tokens, shown decoded --------------------------------------------------------------- */
  // Byte-level BPE (GPT-2, RoBERTa, Llama 3...) writes each byte as a printable character
  // ("Ġ" = space): invert bytes_to_unicode and decode UTF-8. SentencePiece marks a word start
  // with "▁", WordPiece a continuation with "##", old BPE a word end with "</w>".
  var BYTE_OF = null;
  function byteOf() {
    if (BYTE_OF) return BYTE_OF;
    var bs = [], cs, i, n = 0;
    for (i = 33; i <= 126; i++) bs.push(i);
    for (i = 161; i <= 172; i++) bs.push(i);
    for (i = 174; i <= 255; i++) bs.push(i);
    cs = bs.slice();
    for (i = 0; i < 256; i++) if (bs.indexOf(i) < 0) { bs.push(i); cs.push(256 + n); n++; }
    BYTE_OF = {};
    bs.forEach(function (b, k) { BYTE_OF[String.fromCharCode(cs[k])] = b; });
    return BYTE_OF;
  }
  function tokenStyle(tokens) {
    if (tokens.some(function (t) { return /[\u0120\u010a]/.test(t); })) return "bytes";
    if (tokens.some(function (t) { return t.charAt(0) === "\u2581"; })) return "sentencepiece";
    if (tokens.some(function (t) { return t.length > 2 && t.slice(0, 2) === "##"; })) return "wordpiece";
    if (tokens.some(function (t) { return /.<\/w>$/.test(t); })) return "bpe";
    return "";
  }
  function decodeToken(token, style) {
    var out = token;
    if (style === "bytes") {
      var map = byteOf(), bytes = [];
      for (var i = 0; i < token.length; i++) {
        if (!(token.charAt(i) in map)) return token;
        bytes.push(map[token.charAt(i)]);
      }
      try { out = new TextDecoder("utf-8", { fatal: true }).decode(new Uint8Array(bytes)); } catch (e) { return token; }
    } else if (style === "sentencepiece") {
      out = token.replace(/\u2581/g, " ");
    } else if (style === "wordpiece") {
      out = token.length > 2 && token.slice(0, 2) === "##" ? token.slice(2) : token;
    } else if (style === "bpe") {
      out = token.replace(/<\/w>$/, "");
    }
    out = out.trim();
    return out === "" ? (token === "" ? "" : "\u2423") : out;  // a token that is only a space: "␣"
  }
  function shownTokens(payload, side) {
    payload.shown = payload.shown || {};
    if (!payload.shown[side]) {
      var raw = payload.tokens[side] || [], style = tokenStyle(raw);
      payload.shown[side] = raw.map(function (t) { return decodeToken(String(t), style); });
    }
    return payload.shown[side];
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
    var entry = ATT.sentences[slot];
    if (!entry.script) {  // inlined (mode "inline", or the first sentences of mode "mixed")
      var node = document.getElementById("headlab-attention-" + slot);
      if (!node) return cb(null, "attention data of sentence " + slot + " is missing");
      cache[slot] = JSON.parse(node.textContent);
      return cb(cache[slot], null);
    }
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
    state: { slot: 0, kind: null, layer: 0, head: 0, view: "lines", threshold: 0.02, payload: null, gold: "dep" },
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
      if (removedHead(block, h)) return "H" + h + " (removed)";
      return "H" + h + (l.length ? " (" + l.join(", ") + ")" : "");
    }), st.head);
  }

  // A pruned model's blocks name heads by their original index; a removed head's rows are 0.
  function removedHead(block, head) { return !!block && (block.removed || []).indexOf(head) >= 0; }

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
    renderExemplars();
    var block = currentBlock();
    if (!ATT.sentences.length) { status(ATT.not_shown || "No example attention in this analysis directory (attention/index.json)."); clearViews(); return; }
    if (!block || st.head >= block.shape[0]) {
      if (st.payload) status("No example sentence has attention for " + (st.kind ? headName(st.kind, st.layer, st.head) : "this head") + ".");
      clearViews();
      return;
    }
    if (removedHead(block, st.head)) {
      status(headName(st.kind, st.layer, st.head) + " was removed by pruning: it has no attention.");
      clearViews();
      return;
    }
    status("");
    goldNote(block);
    root.setAttribute("data-view", st.view);
    $("v-lines").hidden = st.view !== "lines" && st.view !== "heads";
    $("v-matrix").hidden = st.view !== "matrix";
    $("v-model").hidden = st.view !== "model";
    $("v-heads").hidden = st.view !== "heads";
    if (st.view === "matrix") drawMatrix(block);
    else if (st.view === "model") drawModel();
    else if (st.view === "heads") drawHeads(block, null);
    else drawLines(block, null);
    document.body.setAttribute("data-rendered", "1");
  }
  function clearViews() {
    goldNote(null);
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

  function tokenColumns(block, st) {
    var tokens = st.payload.tokens, rawQ = tokens[block.q] || [], rawK = tokens[block.k] || [];
    var q = shownTokens(st.payload, block.q), k = shownTokens(st.payload, block.k);
    var nq = block.shape[1], nk = block.shape[2];
    var left = $("v-left"), right = $("v-right");
    if (left.childElementCount !== nq || left.getAttribute("data-side") !== block.q + st.slot) {
      left.replaceChildren(); right.replaceChildren();
      for (var i = 0; i < nq; i++) {
        var span = el("span", { "data-i": String(i), title: rawQ[i] }, q[i]);
        span.addEventListener("mouseenter", onTokenEnter);
        left.appendChild(span);
      }
      for (var j = 0; j < nk; j++) right.appendChild(el("span", { "data-j": String(j), title: rawK[j] }, k[j]));
      left.setAttribute("data-side", block.q + st.slot);
      left.onmouseleave = function () { viewer.hover = null; render(); };
    }
    return { left: left, right: right, q: q, k: k };
  }

  function drawLines(block, onlyRow) {
    var st = viewer.state, cols = tokenColumns(block, st), k = cols.k;
    var rawK = st.payload.tokens[block.k] || [];
    var nq = block.shape[1], nk = block.shape[2], bytes = decode(block), base = st.head * nq * nk;
    var left = cols.left, right = cols.right;
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
    drawGoldLines(ctx, block, width, onlyRow, right);
    Array.prototype.forEach.call(left.children, function (s, idx) { s.classList.toggle("active", idx === onlyRow); });
    Array.prototype.forEach.call(right.children, function (s, idx) {
      var w = onlyRow === null ? 0 : bytes[base + onlyRow * nk + idx] / 255;
      s.style.background = w > 0 ? "rgba(" + color.join(",") + "," + w.toFixed(3) + ")" : "";
      s.style.color = w > 0.6 ? "#fff" : "";
      s.title = rawK[idx] + (onlyRow === null ? "" : ": " + w.toFixed(3));
    });
  }
  function onTokenEnter(event) {
    var block = currentBlock(), view = viewer.state.view;
    if (!block || (view !== "lines" && view !== "heads")) return;
    var row = +event.currentTarget.getAttribute("data-i");
    if (view === "lines") drawLines(block, row); else drawHeads(block, row);
  }

  /* ---- gold arcs of a treebank sentence (payload.gold, written by write_treebank_examples) ---- */
  function goldOf(block) {
    var gold = viewer.state.payload && viewer.state.payload.gold;
    return gold && block && block.q === gold.side && block.k === gold.side ? gold : null;
  }
  // [query token, key token, deprel] per arc in the chosen direction, or null (no gold, or off)
  function goldPairs(block) {
    var gold = goldOf(block), dir = viewer.state.gold;
    if (!gold || dir === "off") return null;
    return (gold.arcs || []).map(function (a) { return dir === "gov" ? [a[1], a[0], a[2]] : [a[0], a[1], a[2]]; });
  }
  function drawGoldLines(ctx, block, width, onlyRow, right) {
    var pairs = goldPairs(block), drawn = 0, keys = {};
    if (pairs) {
      ctx.save();
      ctx.strokeStyle = "#111"; ctx.lineWidth = 1.6; ctx.setLineDash([5, 3]); ctx.globalAlpha = 0.9;
      ctx.beginPath();
      pairs.forEach(function (a) {
        if (onlyRow !== null && a[0] !== onlyRow) return;
        ctx.moveTo(0, a[0] * ROW + ROW / 2);
        ctx.lineTo(width, a[1] * ROW + ROW / 2);
        keys[a[1]] = true; drawn++;
      });
      ctx.stroke();
      ctx.restore();
    }
    Array.prototype.forEach.call(right.children, function (s, idx) { s.classList.toggle("gold-key", onlyRow !== null && !!keys[idx]); });
    $("v-canvas").setAttribute("data-gold", String(drawn));
  }
  // The note under the controls: where the parse is from, and how often the head's strongest
  // key from a query token is that token's gold partner (first tokens; the functions stage pools words).
  function goldNote(block) {
    var st = viewer.state, note = $("v-gold-note"), gold = st.payload && st.payload.gold;
    $("v-gold-control").hidden = !gold;
    note.hidden = !gold;
    $("viewer").setAttribute("data-gold", gold ? st.gold : "");
    if (!gold) { note.textContent = ""; return; }
    var text = "Gold parse of " + gold.where + ": " + (gold.arcs || []).length + " arcs";
    if ((gold.arcs || []).length < gold.n_arcs) text += " (" + (gold.n_arcs - gold.arcs.length) + " more with a word cut off by the model's maximum length)";
    var pairs = block ? goldPairs(block) : null;
    if (block && !goldOf(block)) text += "; not drawn: this block attends " + block.q + " \u2192 " + block.k + ", the parse is of the " + gold.side;
    else if (pairs && st.head < block.shape[0]) {
      var bytes = decode(block), nq = block.shape[1], nk = block.shape[2], base = st.head * nq * nk, hits = 0;
      var partners = {};  // query token -> its gold keys (a governor has several dependents)
      pairs.forEach(function (a) { (partners[a[0]] || (partners[a[0]] = {}))[a[1]] = true; });
      var queries = Object.keys(partners).map(Number);
      queries.forEach(function (q) {
        var best = 0;
        for (var j = 1; j < nk; j++) if (bytes[base + q * nk + j] > bytes[base + q * nk + best]) best = j;
        if (partners[q][best]) hits++;
      });
      text += ". " + headName(st.kind, st.layer, st.head) + " attends most to a gold " + (st.gold === "gov" ? "dependent" : "governor") +
        " from " + hits + " of " + queries.length + " " + (st.gold === "gov" ? "governors" : "dependents") + " (first tokens)";
      note.setAttribute("data-hits", String(hits));
    }
    note.textContent = text + ".";
  }

  /* ---- head view: every head of one layer overlaid (bertviz's head view) --------------------- */
  function headColour(h, n) {
    // Hues spread around the wheel, alternating lightness so that neighbours differ at 32 heads.
    var hue = Math.round(h * 360 / Math.max(n, 1)), light = h % 2 ? 38 : 52;
    return "hsl(" + hue + ",70%," + light + "%)";
  }
  function drawHeadToggles(n) {
    var box = $("v-heads"), st = viewer.state;
    if (!st.shownHeads || st.shownHeads.length !== n) { st.shownHeads = []; for (var h = 0; h < n; h++) st.shownHeads.push(true); }
    if (box.childElementCount !== n) {
      box.replaceChildren();
      for (var i = 0; i < n; i++) {
        var b = el("button", { type: "button", class: "head-toggle", "data-head": String(i), title: "head " + i + ": show or hide" }, String(i));
        b.style.borderColor = headColour(i, n);
        b.addEventListener("click", function (event) {
          var hh = +event.currentTarget.getAttribute("data-head");
          viewer.state.shownHeads[hh] = !viewer.state.shownHeads[hh];
          render();
        });
        b.addEventListener("dblclick", function (event) {  // double click: this head only
          var hh = +event.currentTarget.getAttribute("data-head");
          viewer.state.shownHeads = viewer.state.shownHeads.map(function (_, x) { return x === hh; });
          render();
        });
        box.appendChild(b);
      }
    }
    Array.prototype.forEach.call(box.children, function (b, i) {
      b.style.background = st.shownHeads[i] ? headColour(i, n) : "#fff";
      b.style.color = st.shownHeads[i] ? "#fff" : "#1d2330";
      b.setAttribute("aria-pressed", st.shownHeads[i] ? "true" : "false");
    });
  }
  function drawHeads(block, onlyRow) {
    var st = viewer.state, cols = tokenColumns(block, st);
    var nHeads = block.shape[0], nq = block.shape[1], nk = block.shape[2], bytes = decode(block);
    drawHeadToggles(nHeads);
    var width = 260, height = Math.max(nq, nk) * ROW;
    var ctx = sizeCanvas($("v-canvas"), width, height);
    var threshold = Math.max(1, onlyRow === null ? Math.round(st.threshold * 255) : 1);
    ctx.lineWidth = 1.5;
    var drawn = 0;
    for (var h = 0; h < nHeads; h++) {
      if (!st.shownHeads[h]) continue;
      var base = h * nq * nk, levels = {};
      for (var a = onlyRow === null ? 0 : onlyRow; a < (onlyRow === null ? nq : onlyRow + 1); a++) {
        for (var b = 0; b < nk; b++) {
          var v = bytes[base + a * nk + b];
          if (v >= threshold) (levels[v >> 4] || (levels[v >> 4] = [])).push(a, b);  // 16 opacity levels per head
        }
      }
      ctx.strokeStyle = headColour(h, nHeads);
      Object.keys(levels).forEach(function (lv) {
        var pairs = levels[lv];
        ctx.globalAlpha = Math.min(1, ((+lv << 4) + 8) / 255 * 0.85);  // weight, a little translucent: heads overlap
        ctx.beginPath();
        for (var p = 0; p < pairs.length; p += 2) {
          ctx.moveTo(0, pairs[p] * ROW + ROW / 2);
          ctx.lineTo(width, pairs[p + 1] * ROW + ROW / 2);
        }
        ctx.stroke();
        drawn += pairs.length / 2;
      });
    }
    ctx.globalAlpha = 1;
    $("v-canvas").setAttribute("data-lines", String(drawn));
    drawGoldLines(ctx, block, width, onlyRow, cols.right);
    Array.prototype.forEach.call(cols.left.children, function (s, idx) { s.classList.toggle("active", idx === onlyRow); });
    Array.prototype.forEach.call(cols.right.children, function (s) { s.style.background = ""; s.style.color = ""; });
  }

  /* ---- model view: a thumbnail per head, layers down, heads across (bertviz's model view) ---- */
  function drawModel() {
    var st = viewer.state, payload = st.payload;
    var layers = blocksOf(payload).filter(function (b) { return b.split(":")[0] === st.kind; })
      .map(function (b) { return payload.blocks[b]; }).sort(function (x, y) { return x.layer - y.layer; });
    var canvas = $("v-model-canvas");
    if (!layers.length) { canvas.width = 0; canvas.height = 0; return; }
    var nHeads = layers.reduce(function (m, b) { return Math.max(m, b.shape[0]); }, 0);
    var gap = 2, left = 30, top = 16;
    var thumb = Math.max(12, Math.min(64, Math.floor((Math.min(1180, window.innerWidth - 60) - left) / nHeads) - gap));
    var W = left + nHeads * (thumb + gap), H = top + layers.length * (thumb + gap);
    canvas.width = W; canvas.height = H; canvas.style.width = W + "px"; canvas.style.height = H + "px";
    var ctx = canvas.getContext("2d");
    var image = ctx.createImageData(W, H), px = image.data, color = KIND_RGB[st.kind] || [60, 60, 60];
    for (var p = 0; p < px.length; p += 4) { px[p] = px[p + 1] = px[p + 2] = 255; px[p + 3] = 255; }
    var shade = [];  // byte -> rgb, once
    for (var v = 0; v < 256; v++) shade.push([0, 1, 2].map(function (c) { return Math.round(255 - v / 255 * (255 - color[c])); }));
    layers.forEach(function (block, row) {
      var bytes = decode(block), nq = block.shape[1], nk = block.shape[2];
      for (var h = 0; h < block.shape[0]; h++) {
        var x0 = left + h * (thumb + gap), y0 = top + row * (thumb + gap), base = h * nq * nk;
        for (var y = 0; y < thumb; y++) {
          var i = Math.floor(y * nq / thumb), line = ((y0 + y) * W + x0) * 4;
          for (var x = 0; x < thumb; x++) {
            var c = shade[bytes[base + i * nk + Math.floor(x * nk / thumb)]], o = line + x * 4;
            px[o] = c[0]; px[o + 1] = c[1]; px[o + 2] = c[2];
          }
        }
      }
    });
    ctx.putImageData(image, 0, 0);
    ctx.fillStyle = "#5b6475"; ctx.font = "10px sans-serif"; ctx.textBaseline = "middle";
    var step = Math.ceil(16 / (thumb + gap));
    ctx.textAlign = "right";
    layers.forEach(function (block, row) {
      if (row % step === 0) ctx.fillText("L" + block.layer, left - 4, top + row * (thumb + gap) + thumb / 2);
    });
    ctx.textAlign = "center";
    for (var h = 0; h < nHeads; h += step) ctx.fillText(String(h), left + h * (thumb + gap) + thumb / 2, 8);
    var sel = layers.map(function (b) { return b.layer; }).indexOf(st.layer);
    if (sel >= 0 && st.head < nHeads) {
      ctx.strokeStyle = "#000"; ctx.lineWidth = 2;
      ctx.strokeRect(left + st.head * (thumb + gap) - 1, top + sel * (thumb + gap) - 1, thumb + 2, thumb + 2);
    }
    canvas.setAttribute("data-layers", String(layers.length));
    canvas.setAttribute("data-heads", String(nHeads));
    var at = function (event) {
      var rect = canvas.getBoundingClientRect();
      var hh = Math.floor((event.clientX - rect.left - left) / (thumb + gap));
      var rr = Math.floor((event.clientY - rect.top - top) / (thumb + gap));
      return rr >= 0 && rr < layers.length && hh >= 0 && hh < layers[rr].shape[0] ? { layer: layers[rr].layer, head: hh } : null;
    };
    canvas.onmousemove = function (event) {
      var cell = at(event);
      if (!cell) { hideTip(); return; }
      var l = labelsOf(st.kind, cell.layer, cell.head);
      showTip(event, headName(st.kind, cell.layer, cell.head) + (l.length ? "\n" + l.join(", ") : "") + "\nclick: lines view of this head");
    };
    canvas.onmouseleave = hideTip;
    canvas.onclick = function (event) {
      var cell = at(event);
      if (!cell) return;
      hideTip();
      st.layer = cell.layer; st.head = cell.head; st.view = "lines";
      document.querySelector('input[name="v-view"][value="lines"]').checked = true;
      refreshControls(); render();
    };
  }

  /* ---- exemplars of the selected head (aggregate/exemplars.json) ---------------------------- */
  function renderExemplars() {
    var box = $("exemplars"), ex = DATA.exemplars, st = viewer.state;
    if (!box || !ex) return;
    var rows = (ex.heads[st.kind + ":" + st.layer] || [])[st.head] || [];
    box.replaceChildren();
    box.setAttribute("data-head", st.kind ? st.kind + ":" + st.layer + ":" + st.head : "");
    box.appendChild(el("p", { class: "v-head-label" }, st.kind ? headName(st.kind, st.layer, st.head) : "no head selected"));
    if (!rows.length) { box.appendChild(el("p", { class: "note" }, "No exemplar for this head.")); return; }
    var list = el("ol", { class: "exemplar-list" });
    rows.forEach(function (e) {
      var words = ex.sentences[e[1]] || [], item = el("li", { class: "exemplar" });
      item.appendChild(el("span", { class: "ex-weight num" }, (e[0] === null ? "n/a" : e[0].toFixed(3)) + " "));
      item.appendChild(el("span", { class: "ex-arc" }, (words[e[2]] || "?") + " \u2192 " + (words[e[3]] || "?") + ": "));
      words.forEach(function (w, i) {
        var cls = i === e[2] && i === e[3] ? "ex-q ex-k" : i === e[2] ? "ex-q" : i === e[3] ? "ex-k" : "";
        item.appendChild(el("span", cls ? { class: cls } : {}, w));
        item.appendChild(document.createTextNode(" "));
      });
      list.appendChild(item);
    });
    box.appendChild(list);
  }

  function drawMatrix(block) {
    var st = viewer.state;
    var q = shownTokens(st.payload, block.q), k = shownTokens(st.payload, block.k);
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
    var gold = goldPairs(block);
    if (gold) {
      ctx.strokeStyle = "#111"; ctx.lineWidth = Math.max(1, Math.min(2, cell / 6)); ctx.setLineDash([Math.max(2, cell / 4), 2]);
      gold.forEach(function (a) { if (a[0] < nq && a[1] < nk) ctx.strokeRect(margin + a[1] * cell + 0.5, margin + a[0] * cell + 0.5, cell - 1, cell - 1); });
      ctx.setLineDash([]);
    }
    canvas.setAttribute("data-gold", String(gold ? gold.length : 0));
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
    $("v-gold").addEventListener("change", function () { viewer.state.gold = $("v-gold").value; render(); });
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
      if (viewer.state.view === "lines" || viewer.state.view === "heads") render();
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
      var first = Object.keys((DATA.exemplars || {}).heads || {})[0];  // exemplars without attention data
      if (first) { viewer.state.kind = first.split(":")[0]; viewer.state.layer = +first.split(":")[1]; }
      render();
    }
  }

  window.headlabReport = { viewer: viewer, open: function (k, l, h) { viewer.open(k, l, h, false); },
    tokens: { style: tokenStyle, decode: decodeToken } };
  renderGroups();
  initViewer();
  if (window.performance && performance.mark) performance.mark("headlab-rendered");
})();
