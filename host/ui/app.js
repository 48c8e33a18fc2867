/* Gateway admin console: the core (DOM helpers, the API client, the session, the router)
 * and the overview screen. The other screens are in tenants.js and views.js; each registers
 * itself in GW.views. No framework, no build step; every piece of data reaches the page
 * through textContent, never as HTML. */
(() => {
  'use strict';

  const GW = (window.GW = window.GW || {});
  const views = (GW.views = GW.views || {});
  const state = (GW.state = { session: null, ctx: null, tenant: '' });

  // ---------------------------------------------------------------- DOM helpers

  /** An element: `h('td', {class: 'num', data: {col: 'requests'}}, '12')`. Attributes are
   * set with setAttribute (never `style`: the CSP forbids inline styles), `on*` functions
   * become listeners, children may be nodes, strings, numbers, arrays or null. */
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === 'class') el.className = v;
      else if (k === 'text') el.textContent = String(v);
      else if (k === 'data') Object.assign(el.dataset, v);
      else if (k.startsWith('on') && typeof v === 'function') el.addEventListener(k.slice(2), v);
      else if (k === 'style') throw new Error('inline styles are not allowed by the CSP');
      else el.setAttribute(k, v === true ? '' : String(v));
    }
    add(el, children);
    return el;
  }

  function add(el, children) {
    for (const c of children) {
      if (c === null || c === undefined || c === false) continue;
      if (Array.isArray(c)) add(el, c);
      else if (c instanceof Node) el.append(c);
      else el.append(document.createTextNode(String(c)));
    }
    return el;
  }

  const $ = (sel, root) => (root || document).querySelector(sel);

  // ---------------------------------------------------------------- formatting

  const DASH = '–';
  const missing = (v) => v === undefined || v === null || v === '' || (typeof v === 'number' && !Number.isFinite(v));
  const nf = new Intl.NumberFormat('en-US', { maximumFractionDigits: 2 });

  const fmt = {
    any(v) {
      if (missing(v)) return DASH;
      if (typeof v === 'number') return nf.format(v);
      if (typeof v === 'object') return JSON.stringify(v);
      return String(v);
    },
    num(v, digits) {
      if (missing(v) || typeof v !== 'number') return missing(v) ? DASH : String(v);
      return digits === undefined ? nf.format(v) : v.toFixed(digits);
    },
    pct(v) {
      return typeof v === 'number' && Number.isFinite(v) ? `${(v * 100).toFixed(1)} %` : DASH;
    },
    /** Unix seconds as `YYYY-MM-DD HH:MM:SS UTC`. */
    time(s) {
      if (typeof s !== 'number' || !Number.isFinite(s) || s <= 0) return DASH;
      const d = new Date(s * 1000);
      return Number.isNaN(d.getTime()) ? DASH : `${d.toISOString().slice(0, 19).replace('T', ' ')} UTC`;
    },
    date(s) {
      return typeof s === 'number' && s > 0 ? new Date(s * 1000).toISOString().slice(0, 10) : '';
    },
    bytes(n) {
      if (typeof n !== 'number' || !Number.isFinite(n)) return DASH;
      const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
      let i = 0;
      while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
      return `${i ? n.toFixed(1) : n} ${units[i]}`;
    },
    duration(s) {
      if (typeof s !== 'number' || !Number.isFinite(s) || s < 0) return DASH;
      s = Math.floor(s);
      const d = Math.floor(s / 86400), hr = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
      if (d) return `${d}d ${hr}h ${m}m`;
      if (hr) return `${hr}h ${m}m`;
      return m ? `${m}m ${s % 60}s` : `${s}s`;
    },
    list(v) {
      if (!Array.isArray(v)) return fmt.any(v);
      if (v.length === 1 && v[0] === '*') return 'all (*)';
      return v.length ? v.join(', ') : 'none';
    },
  };

  /** Today (UTC) plus `days`, as YYYY-MM-DD. */
  function utcDay(days) {
    return new Date(Date.now() + (days || 0) * 86400000).toISOString().slice(0, 10);
  }

  // ---------------------------------------------------------------- widgets

  /** A table. `columns`: [{key, label, cls, render(row) -> node | string}]; each cell has
   * `data-col=<key>`; `rowAttrs(row)` gives each row's attributes. */
  function table(columns, rows, opts) {
    const o = opts || {};
    const head = h('tr', null, columns.map((c) => h('th', { class: c.cls, data: { col: c.key } }, c.label !== undefined ? c.label : c.key)));
    const body = h('tbody');
    for (const row of rows || []) {
      const tr = h('tr', o.rowAttrs ? o.rowAttrs(row) : null);
      for (const c of columns) {
        const v = c.render ? c.render(row) : fmt.any(row[c.key]);
        tr.append(h('td', { class: c.cls, data: { col: c.key } }, missing(v) ? DASH : v));
      }
      body.append(tr);
    }
    if (!body.childElementCount) {
      body.append(h('tr', { class: 'empty' }, h('td', { colspan: columns.length }, o.empty || 'Nothing here yet.')));
    }
    return h('table', { id: o.id, class: 'grid' }, h('thead', null, head), body);
  }

  /** `key=value` pairs of an object, in a span each. */
  function pairs(obj, skip) {
    const out = [];
    for (const [k, v] of Object.entries(obj || {})) {
      if (skip && skip.includes(k)) continue;
      out.push(h('span', { class: 'kv' }, h('span', { class: 'k' }, k), '=', typeof v === 'object' && v !== null ? JSON.stringify(v) : fmt.any(v)));
    }
    return out.length ? out : DASH;
  }

  /** The lines a change removed (red) and added (green), as `/admin/...` answers them. */
  function diff(target, d) {
    target.replaceChildren();
    const removed = (d && Array.isArray(d.removed)) ? d.removed : [];
    const added = (d && Array.isArray(d.added)) ? d.added : [];
    if (!removed.length && !added.length) {
      target.append(h('p', { class: 'muted' }, 'No changes.'));
      return target;
    }
    const box = h('div', { class: 'diff' });
    for (const l of removed) box.append(h('div', { class: 'del' }, `- ${l}`));
    for (const l of added) box.append(h('div', { class: 'add' }, `+ ${l}`));
    target.append(box);
    return target;
  }

  /** A button that asks "Really …?" in the page before doing `fn` (no window.confirm). The
   * confirming button has class `<cls>-confirm` and the same data attributes. */
  function confirmButton(label, question, cls, data, fn) {
    const wrap = h('span', { class: 'confirm' });
    const first = h('button', { type: 'button', class: `${cls} small danger`, data }, label);
    const reset = () => wrap.replaceChildren(first);
    first.addEventListener('click', () => {
      const yes = h('button', { type: 'button', class: `${cls}-confirm small danger`, data }, question);
      const no = h('button', { type: 'button', class: 'small ghost', onclick: reset }, 'Cancel');
      yes.addEventListener('click', () => act(yes, fn));
      wrap.replaceChildren(yes, no);
    });
    wrap.append(first);
    return wrap;
  }

  /** A labelled form field. */
  function field(label, input, hint) {
    return h('label', { class: 'field' }, h('span', { class: 'label' }, label), input, hint ? h('span', { class: 'hint' }, hint) : null);
  }

  // ---------------------------------------------------------------- messages

  function showError(msg) {
    const e = $('#error');
    e.textContent = msg || '';
    e.hidden = !msg;
  }

  let noticeTimer = 0;
  function notice(msg) {
    const n = $('#notice');
    n.textContent = msg;
    n.hidden = false;
    clearTimeout(noticeTimer);
    noticeTimer = setTimeout(() => { n.hidden = true; }, 4000);
  }

  /** Runs an action from `button`: clears the error, disables the button meanwhile, shows
   * what went wrong in #error. */
  async function act(button, fn) {
    showError('');
    if (button) button.disabled = true;
    try {
      return await fn();
    } catch (e) {
      showError(e && e.message ? e.message : String(e));
      return undefined;
    } finally {
      if (button) button.disabled = false;
    }
  }

  // ---------------------------------------------------------------- the API

  class ApiError extends Error {
    constructor(status, message, body) {
      super(message);
      this.status = status;
      this.body = body;
    }
  }

  /** A call to the admin API, with the session cookie and, for writes, the CSRF token.
   * `json`: a body to send as JSON; `body` + `type`: a raw body. Answers the parsed JSON (or
   * text); throws ApiError with the server's `error.message`. A 401 signs out. */
  async function api(method, path, opts) {
    const o = opts || {};
    const headers = { Accept: 'application/json' };
    let body = o.body;
    if (o.json !== undefined) {
      body = JSON.stringify(o.json);
      headers['Content-Type'] = 'application/json';
    } else if (o.type) {
      headers['Content-Type'] = o.type;
    }
    if (method !== 'GET' && method !== 'HEAD' && state.session && state.session.csrf_token) {
      headers['X-CSRF-Token'] = state.session.csrf_token;
    }
    let res;
    try {
      res = await fetch(path, { method, headers, body, credentials: 'same-origin', cache: 'no-store' });
    } catch (e) {
      throw new ApiError(0, `Could not reach the gateway (${method} ${path}): ${e.message}`);
    }
    const type = res.headers.get('content-type') || '';
    let data = null;
    if (type.includes('json')) data = await res.json().catch(() => null);
    else data = await res.text().catch(() => '');
    if (!res.ok) {
      let msg = data && data.error && typeof data.error.message === 'string' ? data.error.message : '';
      if (!msg) msg = `${method} ${path}: HTTP ${res.status}${typeof data === 'string' && data ? `: ${data.slice(0, 300)}` : ''}`;
      if (res.status === 401 && !o.noSignout) signedOut();
      throw new ApiError(res.status, msg, data);
    }
    return data;
  }

  const enc = encodeURIComponent;

  /** `?a=1&b=2` of the pairs whose value is set. */
  function query(params) {
    const q = Object.entries(params).filter(([, v]) => !missing(v)).map(([k, v]) => `${enc(k)}=${enc(v)}`);
    return q.length ? `?${q.join('&')}` : '';
  }

  /** The tenants' list (`GET /admin/tenants`). */
  async function tenants() {
    const r = await api('GET', '/admin/tenants');
    return r && Array.isArray(r.data) ? r.data : [];
  }

  /** A tenant <select> filled from the server; `all`: the label of an "every tenant" option.
   * Keeps GW.state.tenant, the tenant last picked on any screen. */
  function tenantSelect(id, all, onchange) {
    const sel = h('select', { id });
    if (all) sel.append(h('option', { value: '' }, all));
    sel.addEventListener('change', () => {
      if (sel.value) state.tenant = sel.value;
      if (onchange) onchange(sel.value);
    });
    sel.ready = tenants().then((list) => {
      for (const t of list) sel.append(h('option', { value: t.name }, t.name));
      const want = list.some((t) => t.name === state.tenant) ? state.tenant : (all ? '' : (list[0] && list[0].name) || '');
      sel.value = want;
      return list;
    }).catch((e) => { showError(e.message); return []; });
    return sel;
  }

  // ---------------------------------------------------------------- session

  function showSignin() {
    leave();
    state.session = null;
    $('#topbar').hidden = true;
    $('#nav').hidden = true;
    $('#view').hidden = true;
    $('#view').replaceChildren();
    $('#signin-view').hidden = false;
    const input = $('#signin-token');
    input.value = '';
    input.focus();
    if (performance.mark && !performance.getEntriesByName('signin-visible').length) performance.mark('signin-visible');
  }

  function signedOut() {
    if (state.session) {
      showSignin();
      showError('Your session ended; sign in again.');
    }
  }

  function signedIn(s) {
    state.session = s;
    const who = $('#whoami');
    who.replaceChildren(h('strong', null, s.name || DASH), ' ', h('span', { class: `badge role-${s.role}` }, s.role || DASH));
    who.title = s.expires_at ? `Session until ${fmt.time(s.expires_at)}` : '';
    $('#readonly').hidden = s.role !== 'viewer';
    $('#signin-view').hidden = true;
    $('#topbar').hidden = false;
    $('#nav').hidden = false;
    $('#view').hidden = false;
    route();
  }

  async function signIn(ev) {
    ev.preventDefault();
    const token = $('#signin-token').value.trim();
    if (!token) { showError('Enter a token.'); return; }
    await act($('#signin-submit'), async () => {
      const s = await api('POST', '/admin/session', { json: { token }, noSignout: true });
      $('#signin-token').value = '';
      signedIn(s);
    });
  }

  async function signOut() {
    await act($('#signout'), async () => {
      try { await api('DELETE', '/admin/session', { noSignout: true }); } catch (e) { /* gone either way */ }
      showSignin();
      notice('Signed out.');
    });
  }

  // ---------------------------------------------------------------- router

  /** Leaves the screen shown: its timers stop, its late answers are dropped. */
  function leave() {
    const ctx = state.ctx;
    state.ctx = null;
    if (!ctx) return;
    ctx.alive = false;
    for (const f of ctx.cleanups) { try { f(); } catch (e) { /* leaving anyway */ } }
  }

  function route() {
    if (!state.session) return;
    const name = location.hash.replace(/^#/, '').split('?')[0];
    const view = Object.prototype.hasOwnProperty.call(views, name) ? name : 'overview';
    leave();
    showError('');
    for (const a of document.querySelectorAll('#nav a')) a.classList.toggle('active', a.id === `nav-${view}`);
    const root = h('section', { class: 'screen', id: `screen-${view}` });
    $('#view').replaceChildren(root);
    const ctx = { alive: true, cleanups: [], onLeave(f) { this.cleanups.push(f); } };
    state.ctx = ctx;
    document.title = `${views[view].title || view} · Gateway admin`;
    Promise.resolve()
      .then(() => views[view].render(root, ctx))
      .catch((e) => { if (ctx.alive) showError(e.message); });
  }

  // ---------------------------------------------------------------- charts

  const COLORS = ['#2563eb', '#dc2626', '#059669', '#d97706', '#7c3aed', '#0891b2'];

  /** A uPlot chart in `target`: `series` [{label, scale}], `scales` {name: {side, label}};
   * null when uPlot did not load. Resizes with the window until the screen is left. */
  function chart(target, ctx, series, scales, opts) {
    if (typeof window.uPlot !== 'function') {
      target.append(h('p', { class: 'muted' }, 'Charts are unavailable (uPlot did not load).'));
      return null;
    }
    const o = opts || {};
    const width = () => Math.max(320, target.clientWidth || 640);
    const axes = [{}];
    for (const [name, s] of Object.entries(scales)) {
      axes.push({ scale: name, side: s.side || 3, label: s.label, grid: { show: !s.side }, size: 64 });
    }
    const u = new window.uPlot({
      width: width(),
      height: o.height || 220,
      scales: { x: { time: o.time !== false } },
      series: [{}].concat(series.map((s, i) => ({
        label: s.label,
        scale: s.scale,
        stroke: s.color || COLORS[i % COLORS.length],
        width: 2,
        points: { show: o.points || false },
        value: (self, v) => (v === null || v === undefined ? DASH : nf.format(v)),
      }))),
      axes,
    }, [[]].concat(series.map(() => [])), target);
    const resize = () => u.setSize({ width: width(), height: o.height || 220 });
    window.addEventListener('resize', resize);
    ctx.onLeave(() => { window.removeEventListener('resize', resize); u.destroy(); });
    return u;
  }

  /** Numbers of `arr` (or nulls), as long as `n`. */
  function column(arr, n, scale) {
    const out = new Array(n).fill(null);
    if (!Array.isArray(arr)) return out;
    for (let i = 0; i < n && i < arr.length; i += 1) {
      const v = arr[i];
      out[i] = typeof v === 'number' && Number.isFinite(v) ? v * (scale || 1) : null;
    }
    return out;
  }

  // ---------------------------------------------------------------- overview

  views.overview = {
    title: 'Overview',
    render(root, ctx) {
      const cards = h('div', { class: 'cards', id: 'overview-cards' });
      const traffic = h('div', { class: 'chart', id: 'chart-traffic' });
      const engine = h('div', { class: 'chart', id: 'chart-engine' });
      const models = h('div', { id: 'overview-models' });
      root.append(
        h('h1', null, 'Overview'), cards,
        h('div', { class: 'card' }, h('h2', null, 'Traffic'), traffic),
        h('div', { class: 'card' }, h('h2', null, 'Engine'), engine),
        h('div', { class: 'card' }, h('h2', null, 'Models'), models),
      );
      const c1 = chart(traffic, ctx, [
        { label: 'requests/s', scale: 'rate' },
        { label: 'errors/s (5xx)', scale: 'rate' },
        { label: 'refused/s (4xx)', scale: 'rate' },
        { label: 'tokens/s', scale: 'tokens' },
      ], { rate: { label: 'per second' }, tokens: { side: 1, label: 'tokens/s' } });
      const c2 = chart(engine, ctx, [
        { label: 'running', scale: 'n' },
        { label: 'waiting', scale: 'n' },
        { label: 'KV cache %', scale: 'pct' },
      ], { n: { label: 'sequences' }, pct: { side: 1, label: 'KV %' } });

      let timer = 0;
      const tick = async () => {
        try {
          const o = await api('GET', '/admin/overview');
          if (!ctx.alive) return;
          draw(o || {});
        } catch (e) {
          if (ctx.alive) showError(e.message);
        }
        if (ctx.alive) timer = setTimeout(tick, 2000);
      };
      ctx.onLeave(() => clearTimeout(timer));

      function draw(o) {
        const rates = o.rates || {};
        cards.replaceChildren(
          card('Uptime', fmt.duration(o.uptime_s)),
          card('Requests/s', fmt.num(rates.requests_per_s)),
          card('Errors/s', fmt.num(rates.errors_per_s)),
          card('Refused/s', fmt.num(rates.refused_per_s)),
          card('Tokens/s', fmt.num(rates.tokens_per_s)),
          card('Models', Array.isArray(o.models) ? String(o.models.length) : DASH),
          card('Updated', typeof o.now === 'number' ? fmt.time(o.now).slice(11) : DASH),
        );
        const s = o.series || {};
        const t = Array.isArray(s.t) ? s.t.filter((x) => typeof x === 'number') : [];
        const n = t.length;
        if (c1) c1.setData([t, column(s.requests_per_s, n), column(s.errors_per_s, n), column(s.refused_per_s, n), column(s.tokens_per_s, n)]);
        if (c2) c2.setData([t, column(s.running, n), column(s.waiting, n), column(s.kv_usage, n, 100)]);
        models.replaceChildren(table([
          { key: 'id', label: 'Model' },
          { key: 'kind', label: 'Kind' },
          { key: 'state', label: 'State', render: modelState },
          { key: 'replicas', label: 'Replicas', render: replicas },
        ], Array.isArray(o.models) ? o.models : [], { id: 'models-table', empty: 'No models.' }));
      }
      tick();
    },
  };

  function card(label, value) {
    return h('div', { class: 'card stat' }, h('div', { class: 'label' }, label), h('div', { class: 'value' }, value));
  }

  function modelState(m) {
    const rest = {};
    for (const [k, v] of Object.entries(m || {})) {
      if (k === 'id' || k === 'kind' || k === 'replicas') continue;
      rest[k] = k === 'kv_usage' ? fmt.pct(v) : v;
    }
    return h('span', null, pairs(rest));
  }

  function replicas(m) {
    if (!Array.isArray(m.replicas)) return DASH;
    if (!m.replicas.length) return 'none';
    return h('ul', { class: 'replicas' }, m.replicas.map((r) => {
      const healthy = r && r.healthy;
      const badge = h('span', { class: `badge ${healthy === true ? 'ok' : healthy === false ? 'bad' : ''}` },
        healthy === true ? 'healthy' : healthy === false ? 'unhealthy' : 'health ?');
      return h('li', null, h('code', null, fmt.any(r && r.url)), ' ', badge, ' ', pairs(r, ['url', 'healthy']));
    }));
  }

  // ---------------------------------------------------------------- start

  Object.assign(GW, { h, add, $, fmt, DASH, missing, utcDay, table, pairs, diff, confirmButton, field, showError, notice, act, api, ApiError, enc, query, tenants, tenantSelect, chart, column, route });

  function boot() {
    $('#signin-form').addEventListener('submit', signIn);
    $('#signout').addEventListener('click', signOut);
    $('#error').addEventListener('click', () => showError(''));
    window.addEventListener('hashchange', route);
    api('GET', '/admin/session', { noSignout: true })
      .then(signedIn)
      .catch((e) => {
        showSignin();
        if (e.status !== 401) showError(e.message);
      });
  }

  // Deferred scripts run in order before DOMContentLoaded: every screen is registered by then.
  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', boot);
  else boot();
})();
