// The offline memory viewer: draws the data of #data (written by burn-caching-alloc) as a
// summary table, an active-memory timeline and a segment map. No network, no library.
(function () {
  'use strict';
  const errors = document.getElementById('errors');
  window.addEventListener('error', (e) => {
    errors.textContent += 'script error: ' + e.message + '\n';
    document.body.dataset.rendered = 'error';
  });
  const NS = 'http://www.w3.org/2000/svg';
  const data = JSON.parse(document.getElementById('data').textContent);
  const details = document.getElementById('details');

  function human(bytes) {
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let value = bytes;
    let unit = 0;
    while (Math.abs(value) >= 1024 && unit < units.length - 1) {
      value /= 1024;
      unit += 1;
    }
    return unit === 0 ? bytes + ' B' : value.toFixed(2) + ' ' + units[unit];
  }
  function hex(n) {
    return '0x' + n.toString(16);
  }
  function node(tag, attrs, parent, svg) {
    const e = svg ? document.createElementNS(NS, tag) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === 'text') e.textContent = v;
      else e.setAttribute(k, v);
    }
    if (parent) parent.appendChild(e);
    return e;
  }

  // Summary.
  const table = document.getElementById('summary');
  for (const [key, label, bytes] of data.summary) {
    const tr = node('tr', { 'data-key': key, 'data-bytes': bytes }, table);
    node('th', { text: label }, tr);
    node('td', { text: human(bytes) }, tr);
    node('td', { class: 'exact', text: bytes + ' bytes' }, tr);
  }
  for (const [name, bytes] of data.layers) {
    const tr = node('tr', { 'data-key': 'layer', 'data-bytes': bytes, class: 'layer' }, table);
    node('th', { text: name }, tr);
    node('td', { text: human(bytes) }, tr);
    node('td', { class: 'exact', text: bytes + ' bytes' }, tr);
  }
  // 1 - largest free block / free bytes, per pool.
  for (const [key, label, ppm, free, largest] of data.fragmentation) {
    const tr = node('tr', { 'data-key': 'fragmentation.' + key, 'data-ppm': ppm }, table);
    node('th', { text: label }, tr);
    node('td', { text: (ppm / 1e4).toFixed(1) + ' %' }, tr);
    node('td', { class: 'exact', text: human(free) + ' free, largest block ' + human(largest) }, tr);
  }
  for (const [key, label, count] of data.counts) {
    const tr = node('tr', { 'data-key': key, 'data-count': count }, table);
    node('th', { text: label }, tr);
    node('td', { text: String(count) }, tr);
    node('td', {}, tr);
  }
  const hist = node('tr', { 'data-key': 'history', 'data-count': data.entries }, table);
  node('th', { text: 'History entries (dropped by the ring)' }, hist);
  node('td', { text: data.entries + ' (' + data.dropped + ' dropped)' }, hist);
  node('td', { text: data.entries_with_stacks + ' with stacks' }, hist);

  // Scopes: bytes of live allocations per memory scope, now and at the peak.
  const scopes = document.getElementById('scopes');
  if (data.scopes.length === 0) {
    node('tr', {}, scopes).appendChild(node('td', { text: 'no memory scope allocated (backend::memory_scope)' }));
  }
  for (const [name, current, peak] of data.scopes) {
    const tr = node('tr', { 'data-scope': name, 'data-bytes': current, 'data-peak': peak }, scopes);
    node('th', { text: name }, tr);
    node('td', { text: human(current) + ' now' }, tr);
    node('td', { class: 'exact', text: 'peak ' + human(peak) }, tr);
  }

  // Timeline: allocated and reserved after every history entry.
  const points = data.timeline;
  const W = 960, H = 260, L = 80, B = 24;
  const tl = node('svg', { id: 'timeline-svg', width: W, height: H + B, viewBox: `0 0 ${W} ${H + B}` },
    document.getElementById('timeline'), true);
  const layerMax = data.layers.reduce((m, l) => Math.max(m, l[1]), 0);
  const maxY = Math.max(1, layerMax, ...points.map((p) => Math.max(p[1], p[2])));
  const x = (i) => L + (points.length > 1 ? (i * (W - L - 10)) / (points.length - 1) : 0);
  const y = (v) => H - (v * (H - 10)) / maxY;
  node('line', { x1: L, y1: H, x2: W - 10, y2: H, class: 'axis' }, tl, true);
  node('line', { x1: L, y1: 10, x2: L, y2: H, class: 'axis' }, tl, true);
  for (const f of [0, 0.5, 1]) {
    node('text', { x: L - 6, y: y(maxY * f) + 4, class: 'tick', 'text-anchor': 'end', text: human(Math.round(maxY * f)) }, tl, true);
  }
  node('text', { x: L, y: H + 18, class: 'tick', text: 'history entry 0' }, tl, true);
  node('text', { x: W - 10, y: H + 18, class: 'tick', 'text-anchor': 'end', text: 'now' }, tl, true);
  for (const [series, idx] of [['reserved', 2], ['allocated', 1]]) {
    const path = points.map((p, i) => `${x(i).toFixed(1)},${y(p[idx]).toFixed(1)}`).join(' ');
    node('polyline', { points: path, class: 'series ' + series, 'data-series': series, 'data-last': points[points.length - 1][idx] }, tl, true);
  }
  data.layers.forEach(([name, bytes], i) => {
    node('line', { x1: W - 60, x2: W - 10, y1: y(bytes), y2: y(bytes), class: 'layer layer' + i, 'data-bytes': bytes }, tl, true);
    node('text', { x: W - 64, y: y(bytes) - 3 - 12 * i, class: 'tick', 'text-anchor': 'end', text: name + ' (now): ' + human(bytes) }, tl, true);
  });
  // Phases (annotations): a band from the first point at or after the start to the first at or
  // after the end; bands of one name share a colour, overlapping ones stack their labels.
  const at = (t) => {
    const i = points.findIndex((p) => p[0] >= t);
    return i < 0 ? points.length - 1 : i;
  };
  const phaseNames = [...new Set(data.phases.map((p) => p[0]))];
  data.phases.forEach(([name, start, end], k) => {
    const colour = phaseNames.indexOf(name) % 6;
    const x1 = x(at(start)), x2 = Math.max(x(at(end)), x1 + 1);
    node('rect', { x: x1, y: 10, width: x2 - x1, height: H - 10, class: 'phase phase' + colour, 'data-phase': name }, tl, true);
    node('text', { x: x1 + 2, y: 20 + 11 * (k % 3), class: 'tick phase-label', text: name }, tl, true);
  });
  const cursor = node('line', { x1: 0, x2: 0, y1: 10, y2: H, class: 'cursor' }, tl, true);
  const readout = node('text', { x: L + 6, y: 22, class: 'readout', text: '' }, tl, true);
  tl.addEventListener('mousemove', (ev) => {
    const box = tl.getBoundingClientRect();
    const px = ((ev.clientX - box.left) * W) / box.width;
    const i = Math.max(0, Math.min(points.length - 1, Math.round(((px - L) * (points.length - 1)) / (W - L - 10))));
    cursor.setAttribute('x1', x(i));
    cursor.setAttribute('x2', x(i));
    const p = points[i];
    readout.textContent = `point ${i}: allocated ${human(p[1])}, reserved ${human(p[2])}` +
      (p[0] ? `, ${new Date(p[0] / 1000).toISOString()}` : '');
  });
  const key = node('p', { class: 'legend' }, document.getElementById('timeline'));
  key.innerHTML = '<span class="swatch allocated"></span>allocated <span class="swatch reserved"></span>reserved ' +
    '(engine cache = reserved &minus; allocated)' + (data.layers.length ? '; right-hand marks: layers above the engine now' : '');

  // Segment map: one row per segment, its blocks to scale within it.
  document.getElementById('legend').innerHTML =
    '<span class="swatch active_allocated"></span>allocated <span class="swatch active_pending_free"></span>freed, waiting on another stream ' +
    '<span class="swatch inactive"></span>free (cached) <span class="swatch rounding"></span>rounding (block size &minus; requested)';
  const ROW = 22, SW = 960, SL = 300;
  const segs = data.segments;
  const map = node('svg', { id: 'segments-svg', width: SW, height: Math.max(ROW, segs.length * ROW), viewBox: `0 0 ${SW} ${Math.max(ROW, segs.length * ROW)}` },
    document.getElementById('segments'), true);
  function stackText(id) {
    if (id === null || id === undefined) return '(no stack recorded: stacks off, or allocated before recording started)';
    return data.stacks[id].join('\n');
  }
  function show(seg, block) {
    details.textContent =
      `block ${hex(block.address)} in segment ${hex(seg.address)} (${seg.pool} pool${seg.mem_pool ? `, private pool ${seg.mem_pool}` : ''}, stream ${seg.stream})\n` +
      `state ${block.state}, size ${human(block.size)} (${block.size} bytes), requested ${human(block.requested)}\n` +
      (block.scope ? `scope ${block.scope}\n` : '') + '\n' +
      (block.state === 'inactive' ? 'free block' : 'allocated at:\n' + stackText(block.stack)) +
      '\n\nsegment allocated at:\n' + stackText(seg.stack);
  }
  segs.forEach((seg, row) => {
    const top = row * ROW;
    node('text', { x: 0, y: top + 15, class: 'seglabel', text: `${hex(seg.address)} ${human(seg.size)} ${seg.pool}${seg.mem_pool ? ` p${seg.mem_pool}` : ''} s${seg.stream}` }, map, true);
    node('rect', { x: SL, y: top + 2, width: SW - SL - 4, height: ROW - 6, class: 'segment', 'data-address': seg.address }, map, true);
    const scale = (SW - SL - 4) / seg.size;
    for (const b of seg.blocks) {
      const bx = SL + (b.address - seg.address) * scale;
      const w = Math.max(0.5, b.size * scale);
      const r = node('rect', { x: bx, y: top + 2, width: w, height: ROW - 6, class: 'block ' + b.state, 'data-state': b.state, 'data-size': b.size, 'data-requested': b.requested, 'data-scope': b.scope || '' }, map, true);
      if (b.state !== 'inactive' && b.requested < b.size) {
        const rw = (b.size - b.requested) * scale;
        node('rect', { x: bx + w - rw, y: top + 2, width: rw, height: ROW - 6, class: 'rounding' }, map, true);
      }
      r.addEventListener('mouseover', () => show(seg, b));
      r.addEventListener('click', () => show(seg, b));
    }
  });
  // `#select=S:B` opens block B of segment S (links and screenshots).
  const selected = /^#select=(\d+):(\d+)$/.exec(window.location.hash);
  if (selected && segs[+selected[1]] && segs[+selected[1]].blocks[+selected[2]]) {
    show(segs[+selected[1]], segs[+selected[1]].blocks[+selected[2]]);
  }
  if (segs.length === 0) {
    node('text', { x: 0, y: 15, class: 'seglabel', text: 'no segments: the allocator holds no device memory' }, map, true);
  }
  if (document.body.dataset.rendered !== 'error') document.body.dataset.rendered = 'ok';
})();
