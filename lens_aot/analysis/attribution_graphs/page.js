(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";
  var DX = 16, MIN_COL = 56, PAD = 8, DY = 54, LEFT = 84, TOP = 116, BOTTOM = 40, R = 5.5;
  var data = JSON.parse(document.getElementById("graph-data").textContent);
  var meta = (data.metadata && typeof data.metadata === "object") ? data.metadata : {};
  var tokens = Array.isArray(meta.prompt_tokens) ? meta.prompt_tokens.map(String) : [];
  var svg = document.getElementById("graph");

  function num(v) { return (typeof v === "number" && isFinite(v)) ? v : null; }
  function fmt(v) {
    v = num(v);
    if (v === null) return "\u2014";
    var a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(3);
    return String(parseFloat(v.toPrecision(4)));
  }
  function signed(v) { return (v > 0 ? "+" : "") + fmt(v); }
  function el(tag, attrs, parent) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs) if (Object.prototype.hasOwnProperty.call(attrs, k)) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function clip(s, n) { return s.length > n ? s.slice(0, n - 1) + "\u2026" : s; }

  // ---- nodes ----
  var HEAD_RE = /(^|[^\w])a\d+\.h\d+/, NEURON_RE = /(^|[^\w])m\d+\.(e\d+\.)?n\d+/;
  function kindOf(n) {
    var ft = String(n.feature_type || "").toLowerCase(), layer = String(n.layer);
    var names = [n.node_id, n.clerp, n.name, n.label].filter(function (x) { return typeof x === "string"; }).join(" ");
    if (ft === "embedding" || layer === "E" || /^emb@/.test(String(n.node_id))) return "embedding";
    if (ft === "logit" || /^logit:/.test(String(n.node_id))) return "logit";
    if (ft.indexOf("error") >= 0) return "error";
    if (/attention|attn|head|lorsa/.test(ft) || HEAD_RE.test(names)) return "head";
    if (/neuron|mlp/.test(ft) || NEURON_RE.test(names)) return "neuron";
    return "feature";
  }
  var KIND_NAMES = { embedding: "token embedding", head: "attention head", neuron: "neuron", feature: "feature",
    error: "error node", logit: "logit" };
  var nodes = [], byId = Object.create(null);
  (Array.isArray(data.nodes) ? data.nodes : []).forEach(function (raw) {
    if (!raw || typeof raw !== "object") return;
    var id = String(raw.node_id);
    if (id in byId) return;
    var n = { raw: raw, id: id, kind: kindOf(raw), influence: num(raw.influence), activation: num(raw.activation),
      ctx: (typeof raw.ctx_idx === "number" && isFinite(raw.ctx_idx)) ? Math.max(0, Math.round(raw.ctx_idx)) : 0,
      inLinks: [], outLinks: [], index: nodes.length };
    n.label = (typeof raw.clerp === "string" && raw.clerp) ? raw.clerp
      : (typeof raw.label === "string" && raw.label) ? raw.label
      : (typeof raw.name === "string" && raw.name) ? raw.name : id;
    var layerNum = parseFloat(String(raw.layer));
    if (!isFinite(layerNum)) {
      var m = /(?:^|[^\w])[am](\d+)\./.exec(n.label + " " + id);
      layerNum = m ? parseInt(m[1], 10) : null;
    }
    n.layerNum = layerNum;
    n.alwaysKept = n.kind === "embedding" || n.kind === "logit";
    byId[id] = n;
    nodes.push(n);
  });

  // ---- links ----
  var links = [], skipped = 0, maxAbs = 0;
  (Array.isArray(data.links) ? data.links : []).forEach(function (raw) {
    if (!raw || typeof raw !== "object") return;
    var s = byId[String(raw.source)], t = byId[String(raw.target)], w = num(raw.weight);
    if (!s || !t || w === null) { skipped++; return; }
    var l = { s: s, t: t, w: w, abs: Math.abs(w), index: links.length };
    s.outLinks.push(l); t.inLinks.push(l);
    maxAbs = Math.max(maxAbs, l.abs);
    links.push(l);
  });
  nodes.forEach(function (n) { n.hasInputs = n.inLinks.length > 0; });

  // ---- layout: rows by layer (heads below neurons), columns by position ----
  var layersWithHeads = Object.create(null);
  nodes.forEach(function (n) { if (n.kind === "head" && n.layerNum !== null) layersWithHeads[n.layerNum] = true; });
  function rowKey(n) {
    if (n.kind === "embedding") return -1e18;
    if (n.kind === "logit") return 1e18;
    if (n.layerNum === null) return 1e17;
    return n.layerNum * 2 + (n.kind === "head" ? 0 : 1);
  }
  var keys = [];
  nodes.forEach(function (n) { n.rowKey = rowKey(n); if (keys.indexOf(n.rowKey) < 0) keys.push(n.rowKey); });
  keys.sort(function (a, b) { return a - b; });
  var rowOf = Object.create(null), rowLabels = [];
  keys.forEach(function (k, i) { rowOf[k] = i; });
  nodes.forEach(function (n) {
    n.row = rowOf[n.rowKey];
    if (rowLabels[n.row] !== undefined) return;
    if (n.kind === "embedding") rowLabels[n.row] = "Embed";
    else if (n.kind === "logit") rowLabels[n.row] = "Logits";
    else if (n.layerNum === null) rowLabels[n.row] = "other";
    else {
      var part = layersWithHeads[n.layerNum] ? (n.kind === "head" ? " attn" : " mlp") : "";
      rowLabels[n.row] = "L" + n.layerNum + part;
    }
  });
  var nRows = keys.length;
  var nCols = tokens.length;
  nodes.forEach(function (n) { nCols = Math.max(nCols, n.ctx + 1); });
  var cells = Object.create(null);
  nodes.forEach(function (n) { var k = n.row + ":" + n.ctx; (cells[k] = cells[k] || []).push(n); });
  // columns fill the width the page has (at least MIN_COL each); a busy cell widens its column
  var wrapWidth = document.getElementById("graph-wrap").clientWidth || 900;
  var minCol = Math.max(MIN_COL, Math.floor((wrapWidth - LEFT - 56) / Math.max(1, nCols)));
  var colWidth = [];
  for (var c = 0; c < nCols; c++) colWidth.push(minCol);
  Object.keys(cells).forEach(function (k) {
    var list = cells[k], col = list[0].ctx;
    list.sort(function (a, b) {
      if (a.kind === "logit" && b.kind === "logit") return (num(b.raw.token_prob) || 0) - (num(a.raw.token_prob) || 0);
      var ia = a.influence === null ? Infinity : a.influence, ib = b.influence === null ? Infinity : b.influence;
      return ia !== ib ? ia - ib : (a.label < b.label ? -1 : a.label > b.label ? 1 : 0);
    });
    colWidth[col] = Math.max(colWidth[col], list.length * DX + 2 * PAD);
  });
  var colX = [], x = LEFT;
  for (c = 0; c < nCols; c++) { colX.push(x); x += colWidth[c]; }
  var width = x + 56, height = TOP + Math.max(0, nRows - 1) * DY + BOTTOM;
  function rowY(r) { return TOP + (nRows - 1 - r) * DY; }
  Object.keys(cells).forEach(function (k) {
    var list = cells[k], col = list[0].ctx, off = (colWidth[col] - list.length * DX) / 2;
    list.forEach(function (n, i) { n.x = colX[col] + off + (i + 0.5) * DX; n.y = rowY(n.row); });
  });

  // ---- drawing ----
  svg.setAttribute("width", width); svg.setAttribute("height", height);
  svg.setAttribute("viewBox", "0 0 " + width + " " + height);
  el("rect", { x: 0, y: 0, width: width, height: height, fill: "#fff", id: "background" }, svg);
  var grid = el("g", { id: "grid" }, svg);
  for (var r = 0; r < nRows; r++) {
    el("line", { x1: LEFT - 4, x2: width - 8, y1: rowY(r), y2: rowY(r), "class": "grid" }, grid);
    var rl = el("text", { x: 6, y: rowY(r) + 4, "class": "row-label" }, grid);
    rl.textContent = rowLabels[r];
  }
  for (c = 0; c < nCols; c++) {
    if (c > 0) el("line", { x1: colX[c], x2: colX[c], y1: TOP - 30, y2: height - 8, "class": "grid" }, grid);
    var tl = el("text", { x: colX[c] + colWidth[c] / 2, y: height - 14, "text-anchor": "middle",
      "class": "token-label", "data-ctx": c }, grid);
    var tok = c < tokens.length ? tokens[c] : "";
    tl.textContent = clip(JSON.stringify(tok).slice(1, -1), Math.max(4, Math.floor(colWidth[c] / 7)));
    el("title", {}, tl).textContent = "position " + c + ": " + JSON.stringify(tok);
  }
  // links, then the focused node's links drawn again on top (the links group itself is dimmed as a whole: one
  // opacity change instead of a style change of every link), then the nodes
  var linkLayer = el("g", { id: "links" }, svg), overlay = el("g", { id: "focus-links" }, svg);
  var nodeLayer = el("g", { id: "nodes" }, svg);
  links.slice().sort(function (a, b) { return a.abs - b.abs; }).forEach(function (l) {
    var sx = l.s.x, sy = l.s.y, tx = l.t.x, ty = l.t.y, d;
    if (Math.abs(sy - ty) < 1) {
      var lift = 22 + Math.min(40, Math.abs(tx - sx) / 6);
      d = "M" + sx + " " + sy + " C" + sx + " " + (sy - lift) + " " + tx + " " + (ty - lift) + " " + tx + " " + ty;
    } else {
      var my = (sy + ty) / 2;
      d = "M" + sx + " " + sy + " C" + sx + " " + my + " " + tx + " " + my + " " + tx + " " + ty;
    }
    l.el = el("path", { d: d, "class": "link " + (l.w >= 0 ? "pos" : "neg"),
      "stroke-width": (0.5 + 3.5 * (maxAbs > 0 ? l.abs / maxAbs : 0)).toFixed(2),
      "data-link-source": l.s.id, "data-link-target": l.t.id, "data-weight": String(l.w) }, linkLayer);
  });
  nodes.forEach(function (n) {
    var cls = "node k-" + n.kind + (n.raw.is_target_logit ? " target" : "");
    var attrs = { "class": cls, "data-node-id": n.id, "data-kind": n.kind, tabindex: 0 };
    if (n.kind === "embedding" || n.kind === "logit") {
      attrs.x = n.x - R; attrs.y = n.y - R; attrs.width = 2 * R; attrs.height = 2 * R;
      attrs.rx = n.kind === "logit" ? 2 : 0;
      n.el = el("rect", attrs, nodeLayer);
    } else if (n.kind === "error") {
      attrs.points = [n.x, n.y - R - 1, n.x + R + 1, n.y, n.x, n.y + R + 1, n.x - R - 1, n.y].join(" ");
      n.el = el("polygon", attrs, nodeLayer);
    } else {
      attrs.cx = n.x; attrs.cy = n.y; attrs.r = R;
      n.el = el("circle", attrs, nodeLayer);
    }
    el("title", {}, n.el).textContent = n.label + (n.label !== n.id ? "\n" + n.id : "") +
      "\nactivation " + fmt(n.activation) + ", influence " + fmt(n.influence);
    if (n.kind === "logit") {
      var t = el("text", { x: n.x + 2, y: n.y - R - 4, "class": "logit-label",
        transform: "rotate(-65 " + (n.x + 2) + " " + (n.y - R - 4) + ")" }, svg);
      // the token and its probability ('Output "x" (p=0.5)' from circuit-tracer, logit:{token}@{p} from lens_aot)
      var m = /^Output "(.*)" \(p=([^)]*)\)$/.exec(n.label) || /^logit:(.*)@\d+$/.exec(n.id);
      var prob = num(n.raw.token_prob), shown = prob !== null && prob > 0 ? " " + fmt(prob) : "";
      t.textContent = m ? clip(JSON.stringify(m[1]), 14) + shown : clip(n.label, 18);
      n.labelEl = t;
    }
    n.el.addEventListener("mouseenter", function () { state.hover = n; refreshFocus(); });
    n.el.addEventListener("mouseleave", function () { if (state.hover === n) { state.hover = null; refreshFocus(); } });
    n.el.addEventListener("click", function (ev) { ev.stopPropagation(); select(state.selected === n ? null : n); });
    n.el.addEventListener("keydown", function (ev) { if (ev.key === "Enter" || ev.key === " ") select(n); });
  });

  // ---- header: prompt, legend of the kinds present ----
  var prompt = typeof meta.prompt === "string" ? meta.prompt : tokens.join("");
  var promptEl = document.getElementById("prompt");
  promptEl.textContent = (prompt ? "Prompt: " + prompt : "") +
    (num(meta.node_threshold) !== null ? "   (exported with node threshold " + fmt(meta.node_threshold) + ")" : "") +
    (skipped ? "   [" + skipped + " links to unknown nodes ignored]" : "");
  var kindsLegend = document.getElementById("legend-kinds");
  ["embedding", "head", "neuron", "feature", "error", "logit"].forEach(function (k) {
    if (!nodes.some(function (n) { return n.kind === k; })) return;
    var item = document.createElement("span");
    item.className = "legend-item"; item.setAttribute("data-kind", k);
    var s = el("svg", { width: 12, height: 12 }, item);
    el("circle", { cx: 6, cy: 6, r: 5, "class": "node k-" + k }, s);
    item.appendChild(document.createTextNode(KIND_NAMES[k]));
    kindsLegend.appendChild(item);
  });

  // ---- state: thresholds, visibility, focus ----
  var state = { nodeT: 1, edgeT: 0, hideOrphans: false, selected: null, hover: null, focusEls: [] };
  var nodeIn = document.getElementById("node-threshold-input"), nodeRange = document.getElementById("node-threshold");
  var edgeIn = document.getElementById("edge-threshold-input"), edgeRange = document.getElementById("edge-threshold");
  var orphans = document.getElementById("hide-orphans"), fit = document.getElementById("fit-width");
  edgeRange.max = String(maxAbs > 0 ? maxAbs : 1);
  edgeRange.step = String(maxAbs > 0 ? maxAbs / 500 : 0.01);

  function applyThresholds() {
    nodes.forEach(function (n) {
      // at 1 everything shows (a cumulative share summed in float32 may end just above 1)
      n.visible = n.alwaysKept || n.influence === null || state.nodeT >= 1 || n.influence <= state.nodeT;
    });
    function linkOk(l) { return l.s.visible && l.t.visible && l.abs >= state.edgeT; }
    if (state.hideOrphans) {
      var changed = true;
      while (changed) {
        changed = false;
        nodes.forEach(function (n) {
          if (!n.visible || n.alwaysKept) return;
          var out = n.outLinks.some(linkOk), inp = !n.hasInputs || n.inLinks.some(linkOk);
          if (!out || !inp) { n.visible = false; changed = true; }
        });
      }
    }
    var shownNodes = 0, shownLinks = 0;
    nodes.forEach(function (n) {
      if (n.shown !== n.visible) {
        n.el.classList.toggle("hidden", !n.visible);
        if (n.labelEl) n.labelEl.classList.toggle("hidden", !n.visible);
        n.shown = n.visible;
      }
      if (n.visible) shownNodes++;
    });
    links.forEach(function (l) {
      l.visible = linkOk(l);
      if (l.shown !== l.visible) { l.el.classList.toggle("hidden", !l.visible); l.shown = l.visible; }
      if (l.visible) shownLinks++;
    });
    var stats = document.getElementById("stats");
    stats.textContent = shownNodes + " / " + nodes.length + " nodes, " + shownLinks + " / " + links.length + " links";
    stats.setAttribute("data-nodes-shown", shownNodes); stats.setAttribute("data-links-shown", shownLinks);
    state.thresholdsAt = (state.thresholdsAt || 0) + 1;
    if (state.selected && !state.selected.visible) state.selected = null;
    if (state.hover && !state.hover.visible) state.hover = null;
    select(state.selected);
  }

  function refreshFocus() {
    var n = state.hover || state.selected;
    if (n === state.focused && state.focusedAt === state.thresholdsAt) return;
    state.focused = n; state.focusedAt = state.thresholdsAt;
    state.focusEls.forEach(function (e) { e.classList.remove("highlighted", "neighbor"); });
    state.focusEls = [];
    overlay.textContent = "";
    svg.classList.toggle("focus", !!n);
    if (!n) return;
    n.el.classList.add("highlighted"); state.focusEls.push(n.el);
    n.inLinks.concat(n.outLinks).sort(function (a, b) { return a.abs - b.abs; }).forEach(function (l) {
      if (!l.visible) return;
      l.el.classList.add("highlighted"); state.focusEls.push(l.el);
      var copy = l.el.cloneNode(false);
      copy.setAttribute("class", "focus-link " + (l.w >= 0 ? "pos" : "neg"));
      ["data-link-source", "data-link-target", "data-weight"].forEach(function (a) { copy.removeAttribute(a); });
      overlay.appendChild(copy);
      var other = l.s === n ? l.t : l.s;
      if (other !== n) { other.el.classList.add("neighbor"); state.focusEls.push(other.el); }
    });
  }

  function edgeList(listEl, items, otherEnd) {
    listEl.textContent = "";
    var shown = items.filter(function (l) { return l.visible; }).sort(function (a, b) { return b.abs - a.abs; });
    if (!shown.length) {
      var none = document.createElement("li"); none.className = "none"; none.textContent = "none shown";
      listEl.appendChild(none); return;
    }
    shown.slice(0, 12).forEach(function (l) {
      var other = otherEnd(l), li = document.createElement("li");
      li.setAttribute("data-edge-source", l.s.id); li.setAttribute("data-edge-target", l.t.id);
      li.setAttribute("data-weight", String(l.w));
      var w = document.createElement("span");
      w.className = "w " + (l.w >= 0 ? "pos" : "neg"); w.textContent = signed(l.w);
      var name = document.createElement("span"); name.textContent = other.label; name.title = other.id;
      li.appendChild(w); li.appendChild(name);
      li.addEventListener("click", function () {
        select(other);
        other.el.scrollIntoView({ block: "nearest", inline: "nearest" });
      });
      listEl.appendChild(li);
    });
    if (shown.length > 12) {
      var more = document.createElement("li"); more.className = "none";
      more.textContent = "\u2026 and " + (shown.length - 12) + " more"; listEl.appendChild(more);
    }
  }

  function select(n) {
    if (state.selected && state.selected !== n) state.selected.el.classList.remove("selected");
    state.selected = n;
    var panel = document.getElementById("panel");
    panel.setAttribute("data-selected", n ? n.id : "");
    document.getElementById("panel-empty").hidden = !!n;
    document.getElementById("panel-body").hidden = !n;
    if (n) {
      n.el.classList.add("selected");
      document.getElementById("panel-label").textContent = n.label;
      var fields = document.getElementById("panel-fields");
      fields.textContent = "";
      var tok = n.ctx < tokens.length ? " " + JSON.stringify(tokens[n.ctx]) : "";
      var ft = n.raw.feature_type ? String(n.raw.feature_type) : "";
      var kind = KIND_NAMES[n.kind] + (ft && ft !== KIND_NAMES[n.kind] ? " (" + ft + ")" : "");
      var rows = [["node", n.id], ["kind", kind],
        ["layer", String(n.raw.layer)], ["position", n.ctx + tok],
        ["activation", fmt(n.activation)], ["influence", fmt(n.influence)]];
      if (n.kind === "logit") rows.push(["probability", fmt(n.raw.token_prob)]);
      if (n.raw.is_target_logit) rows.push(["target", "yes"]);
      rows.push(["links", n.inLinks.length + " in, " + n.outLinks.length + " out (before thresholds)"]);
      rows.forEach(function (kv) {
        var dt = document.createElement("dt"), dd = document.createElement("dd");
        dt.textContent = kv[0]; dd.textContent = kv[1];
        dd.setAttribute("data-field", kv[0]);
        fields.appendChild(dt); fields.appendChild(dd);
      });
      edgeList(document.getElementById("panel-incoming"), n.inLinks, function (l) { return l.s; });
      edgeList(document.getElementById("panel-outgoing"), n.outLinks, function (l) { return l.t; });
    }
    refreshFocus();
  }

  function readNumber(input, lo, hi, fallback) {
    var v = parseFloat(input.value);
    if (!isFinite(v)) return fallback;
    return Math.min(hi, Math.max(lo, v));
  }
  function onNode(fromRange) {
    state.nodeT = readNumber(fromRange ? nodeRange : nodeIn, 0, 1, state.nodeT);
    if (fromRange) nodeIn.value = String(state.nodeT); else nodeRange.value = String(state.nodeT);
    applyThresholds();
  }
  function onEdge(fromRange) {
    state.edgeT = readNumber(fromRange ? edgeRange : edgeIn, 0, Infinity, state.edgeT);
    if (fromRange) edgeIn.value = String(state.edgeT); else edgeRange.value = String(state.edgeT);
    applyThresholds();
  }
  nodeRange.addEventListener("input", function () { onNode(true); });
  nodeIn.addEventListener("input", function () { onNode(false); });
  nodeIn.addEventListener("change", function () { onNode(false); });
  edgeRange.addEventListener("input", function () { onEdge(true); });
  edgeIn.addEventListener("input", function () { onEdge(false); });
  edgeIn.addEventListener("change", function () { onEdge(false); });
  orphans.addEventListener("change", function () { state.hideOrphans = orphans.checked; applyThresholds(); });
  fit.addEventListener("change", function () { svg.classList.toggle("fit", fit.checked); });
  // a drawing up to twice the page's width starts fitted to it (every node in view); wider ones scroll
  if (width > wrapWidth && width <= 2 * wrapWidth) { fit.checked = true; svg.classList.add("fit"); }
  document.getElementById("reset").addEventListener("click", function () {
    nodeIn.value = nodeRange.value = "1"; edgeIn.value = edgeRange.value = "0"; orphans.checked = false;
    state.nodeT = 1; state.edgeT = 0; state.hideOrphans = false; state.hover = null;
    state.selected && state.selected.el.classList.remove("selected"); state.selected = null;
    applyThresholds();
  });
  svg.addEventListener("click", function (ev) {
    if (ev.target === svg || ev.target.id === "background") select(null);
  });
  document.addEventListener("keydown", function (ev) {
    if (ev.key === "Escape") { state.hover = null; select(null); }
  });

  applyThresholds();
  document.body.setAttribute("data-ready", "true");
  window.lensAotGraph = { nodes: nodes.length, links: links.length, skipped: skipped };
})();
