/* Gateway admin console: plugins, usage, collections, the audit log and the policy history.
 * Uses the core in app.js (GW). */
(() => {
  'use strict';

  const GW = window.GW;
  const { h, fmt, DASH, api, act, enc, query, notice, showError, table, pairs, diff, confirmButton, field, tenantSelect, utcDay } = GW;

  const fail = (ctx) => (e) => { if (ctx.alive) showError(e.message); };

  // ---------------------------------------------------------------- plugins

  const KINDS = ['prompt-template', 'reranker', 'output-parser', 'logits-processor', 'cache-key'];

  GW.views.plugins = {
    title: 'Plugins',
    render(root, ctx) {
      let last = null;
      const filter = tenantSelect('plugins-filter', 'All tenants', () => draw());
      const tenant = tenantSelect('plugin-tenant', null);
      const name = h('input', { id: 'plugin-name', type: 'text', maxlength: '64', placeholder: 'a-z, 0-9, - and _', autocomplete: 'off' });
      const kind = h('select', { id: 'plugin-kind' },
        h('option', { value: '' }, 'detect from the component'),
        KINDS.map((k) => h('option', { value: k }, k)));
      const file = h('input', { id: 'plugin-file', type: 'file', accept: '.wasm,application/wasm' });
      const upload = h('button', { type: 'button', id: 'plugin-upload' }, 'Upload');
      const loaded = h('div', { id: 'plugins-loaded' });
      const refused = h('div', { id: 'plugins-refused-box' });

      file.addEventListener('change', () => {
        const f = file.files && file.files[0];
        if (f && !name.value.trim()) name.value = f.name.replace(/\.wasm$/i, '').toLowerCase().replace(/[^a-z0-9_-]/g, '-').slice(0, 64);
      });

      upload.addEventListener('click', () => act(upload, async () => {
        const t = tenant.value;
        const n = name.value.trim();
        const f = file.files && file.files[0];
        if (!t) throw new Error('Pick a tenant.');
        if (!n) throw new Error('Name the plugin.');
        if (!f) throw new Error('Choose a .wasm file.');
        const bytes = await f.arrayBuffer();
        const r = await api('PUT', `/admin/plugins/${enc(t)}/${enc(n)}${query({ kind: kind.value })}`, { body: bytes, type: 'application/wasm' });
        notice(`Plugin ${t}/${n} installed (${(r && r.kind) || 'plugin'}, sha256 ${(r && r.sha256) || DASH}).`);
        file.value = '';
        if (filter.value && filter.value !== t) filter.value = t;
        await load();
      }));

      async function load() {
        const r = await api('GET', '/admin/plugins');
        if (!ctx.alive) return;
        last = r || {};
        draw();
      }

      function draw() {
        if (!last) return;
        const only = filter.value;
        const keep = (p) => !only || p.tenant === only;
        const data = (Array.isArray(last.data) ? last.data : []).filter(keep);
        loaded.replaceChildren(table([
          { key: 'tenant', label: 'Tenant' },
          { key: 'name', label: 'Name' },
          { key: 'kind', label: 'Kind' },
          { key: 'wit_version', label: 'WIT' },
          { key: 'sha256', label: 'SHA-256', cls: 'sha256 mono', render: (p) => fmt.any(p.sha256) },
          { key: 'bytes', label: 'Size', cls: 'num', render: (p) => fmt.bytes(p.bytes) },
          { key: 'loaded_at', label: 'Loaded', cls: 'time', render: (p) => fmt.time(p.loaded_at) },
          { key: 'load_ms', label: 'Load ms', cls: 'num', render: (p) => fmt.num(p.load_ms, 1) },
          { key: 'calls', label: 'Calls', cls: 'num', render: (p) => fmt.num(p.calls) },
          { key: 'failures', label: 'Failures', render: (p) => failures(p.failures) },
          { key: 'p50_ms', label: 'p50 ms', cls: 'num', render: (p) => fmt.num(p.p50_ms, 2) },
          { key: 'p99_ms', label: 'p99 ms', cls: 'num', render: (p) => fmt.num(p.p99_ms, 2) },
          { key: 'previous', label: 'Previous version', cls: 'mono', render: (p) => (p.previous ? `${String(p.previous.sha256 || '').slice(0, 12)}… (${fmt.bytes(p.previous.bytes)})` : DASH) },
          { key: 'actions', label: '', render: actions },
        ], data, { id: 'plugins-table', empty: 'No plugins.', rowAttrs: (p) => ({ data: { tenant: p.tenant, plugin: p.name } }) }));
        const rejected = (Array.isArray(last.rejected) ? last.rejected : []).filter(keep);
        refused.replaceChildren(table([
          { key: 'tenant', label: 'Tenant' },
          { key: 'name', label: 'Name' },
          { key: 'sha256', label: 'SHA-256', cls: 'refused-sha256 mono', render: (p) => fmt.any(p.sha256) },
          { key: 'reason', label: 'Reason', cls: 'reason', render: (p) => fmt.any(p.reason) },
          { key: 'rejected_at', label: 'When', cls: 'time', render: (p) => fmt.time(p.rejected_at) },
        ], rejected, { id: 'plugins-refused', empty: 'No file was refused.' }));
      }

      function actions(p) {
        const path = `/admin/plugins/${enc(p.tenant)}/${enc(p.name)}`;
        const data = { tenant: p.tenant, plugin: p.name };
        return h('span', { class: 'actions' },
          p.previous ? confirmButton('Roll back', 'Really roll back?', 'plugin-rollback', data, async () => {
            await api('POST', `${path}/rollback`);
            notice(`Plugin ${p.tenant}/${p.name} rolled back.`);
            await load();
          }) : null,
          confirmButton('Delete', 'Really delete?', 'plugin-delete', data, async () => {
            await api('DELETE', path);
            notice(`Plugin ${p.tenant}/${p.name} deleted.`);
            await load();
          }));
      }

      root.append(
        h('h1', null, 'Plugins'),
        h('div', { class: 'card' }, h('h2', null, 'Upload a plugin'), h('div', { class: 'toolbar' },
          field('Tenant', tenant), field('Name', name), field('Kind', kind), field('Component (.wasm)', file), upload),
        h('p', { class: 'hint' }, 'A plugin with the same name is replaced; the version it replaces is kept for a rollback.')),
        h('div', { class: 'card' }, h('div', { class: 'titlebar' }, h('h2', null, 'Serving'), field('Tenant', filter)), loaded),
        h('div', { class: 'card' }, h('h2', null, 'Refused'), refused),
      );
      load().catch(fail(ctx));
    },
  };

  function failures(f) {
    if (!f || typeof f !== 'object') return fmt.any(f);
    const nonzero = Object.fromEntries(Object.entries(f).filter(([, v]) => v));
    return Object.keys(nonzero).length ? h('span', null, pairs(nonzero)) : 'none';
  }

  // ---------------------------------------------------------------- usage

  const USAGE_COLUMNS = [
    ['requests', 'Requests'], ['prompt_tokens', 'Prompt tokens'], ['completion_tokens', 'Completion tokens'],
    ['total_tokens', 'Total tokens'], ['failed_requests', 'Failed'], ['cached_requests', 'Cached'],
    ['mean_latency_ms', 'Mean latency ms'], ['plugin_ms', 'Plugin ms'],
  ];

  function usageTable(id, group, rows) {
    return table([
      { key: 'tenant', label: 'Tenant' },
      { key: group, label: group === 'day' ? 'Day' : 'Model' },
      ...USAGE_COLUMNS.map(([key, label]) => ({
        key, label, cls: 'num',
        render: (r) => (key.endsWith('_ms') ? fmt.num(r[key], 1) : fmt.num(r[key])),
      })),
    ], rows, { id, empty: 'No requests in this period.' });
  }

  GW.views.usage = {
    title: 'Usage',
    render(root, ctx) {
      const tenant = tenantSelect('usage-tenant', 'All tenants', () => load().catch(fail(ctx)));
      const from = h('input', { id: 'usage-from', type: 'date', value: utcDay(-29) });
      const to = h('input', { id: 'usage-to', type: 'date', value: utcDay(0) });
      const refresh = h('button', { type: 'button', id: 'usage-refresh' }, 'Refresh');
      const csvDay = h('a', { id: 'usage-csv', class: 'button secondary', download: 'usage-by-day.csv' }, 'CSV by day');
      const csvModel = h('a', { id: 'usage-csv-model', class: 'button secondary', download: 'usage-by-model.csv' }, 'CSV by model');
      const budgets = h('div', { id: 'usage-budgets' });
      const chartBox = h('div', { class: 'chart', id: 'usage-chart' });
      const days = h('div');
      const models = h('div');
      root.append(
        h('h1', null, 'Usage'),
        h('div', { class: 'card' }, h('div', { class: 'toolbar' },
          field('Tenant', tenant), field('From (UTC)', from), field('To (UTC, inclusive)', to), refresh, csvDay, csvModel)),
        h('div', { class: 'card' }, h('h2', null, 'Budgets'), budgets),
        h('div', { class: 'card' }, h('h2', null, 'Tokens and requests per day'), chartBox),
        h('div', { class: 'card' }, h('h2', null, 'By day'), days),
        h('div', { class: 'card' }, h('h2', null, 'By model'), models),
      );
      const chart = GW.chart(chartBox, ctx, [
        { label: 'total tokens', scale: 'tokens' },
        { label: 'requests', scale: 'requests' },
      ], { tokens: { label: 'tokens' }, requests: { side: 1, label: 'requests' } }, { points: true });

      refresh.addEventListener('click', () => act(refresh, load));

      async function load() {
        const exclusive = to.value ? new Date(Date.parse(`${to.value}T00:00:00Z`) + 86400000).toISOString().slice(0, 10) : '';
        const params = { tenant: tenant.value, from: from.value, to: exclusive };
        csvDay.href = `/admin/usage${query({ ...params, group_by: 'day', format: 'csv' })}`;
        csvModel.href = `/admin/usage${query({ ...params, group_by: 'model', format: 'csv' })}`;
        const [byDay, byModel, list] = await Promise.all([
          api('GET', `/admin/usage${query({ ...params, group_by: 'day' })}`),
          api('GET', `/admin/usage${query({ ...params, group_by: 'model' })}`),
          GW.tenants(),
        ]);
        if (!ctx.alive) return;
        const dayRows = (byDay && byDay.data) || [];
        days.replaceChildren(usageTable('usage-days', 'day', dayRows));
        models.replaceChildren(usageTable('usage-table', 'model', (byModel && byModel.data) || []));
        drawBudgets(list.filter((t) => !tenant.value || t.name === tenant.value));
        if (chart) {
          const per = new Map();
          for (const r of dayRows) {
            const at = Date.parse(`${r.day}T00:00:00Z`) / 1000;
            if (!Number.isFinite(at)) continue;
            const s = per.get(at) || { tokens: 0, requests: 0 };
            s.tokens += Number(r.total_tokens) || 0;
            s.requests += Number(r.requests) || 0;
            per.set(at, s);
          }
          const xs = [...per.keys()].sort((a, b) => a - b);
          chart.setData([xs, xs.map((x) => per.get(x).tokens), xs.map((x) => per.get(x).requests)]);
        }
      }

      function drawBudgets(list) {
        const withBudget = list.filter((t) => t.budget && typeof t.budget === 'object');
        if (!withBudget.length) {
          budgets.replaceChildren(h('p', { class: 'muted' }, 'No token budget is set.'));
          return;
        }
        budgets.replaceChildren(h('div', { id: 'budgets-table' }, withBudget.map((t) => {
          const b = t.budget;
          const share = typeof b.used === 'number' && typeof b.tokens === 'number' && b.tokens > 0 ? b.used / b.tokens : null;
          const fill = h('div', { class: `fill ${share !== null && share >= 1 ? 'over' : share !== null && share >= 0.8 ? 'near' : ''}` });
          fill.style.width = `${Math.min(100, (share || 0) * 100).toFixed(1)}%`; // CSSOM: allowed by the CSP
          return h('div', { class: 'budget', data: { tenant: t.name } },
            h('span', { class: 'name' }, t.name),
            h('div', { class: 'bar' }, fill),
            h('span', { class: 'figures' }, `${fmt.num(b.used)} / ${fmt.num(b.tokens)} tokens per ${b.period || DASH}${share !== null ? ` (${(share * 100).toFixed(1)} %)` : ''}`));
        })));
      }

      tenant.ready.then(() => ctx.alive && load()).catch(fail(ctx));
    },
  };

  // ---------------------------------------------------------------- collections

  GW.views.collections = {
    title: 'Collections',
    render(root, ctx) {
      const tenant = tenantSelect('collections-tenant', 'All tenants', () => load().catch(fail(ctx)));
      const list = h('div');
      root.append(h('h1', null, 'Collections'), h('div', { class: 'card' }, h('div', { class: 'toolbar' }, field('Tenant', tenant)), list));
      async function load() {
        const r = await api('GET', `/admin/collections${query({ tenant: tenant.value })}`);
        if (!ctx.alive) return;
        list.replaceChildren(table([
          { key: 'tenant', label: 'Tenant' },
          { key: 'name', label: 'Collection' },
          { key: 'documents', label: 'Documents', cls: 'num', render: (c) => fmt.num(c.documents) },
          { key: 'chunks', label: 'Chunks', cls: 'num', render: (c) => fmt.num(c.chunks) },
          { key: 'bytes', label: 'On disk', cls: 'num', render: (c) => fmt.bytes(c.bytes) },
        ], (r && r.data) || [], { id: 'collections-table', empty: 'No collections.' }));
      }
      tenant.ready.then(() => ctx.alive && load()).catch(fail(ctx));
    },
  };

  // ---------------------------------------------------------------- audit log

  function detail(d) {
    if (d && typeof d === 'object' && !Array.isArray(d) && (Array.isArray(d.removed) || Array.isArray(d.added))) {
      const rest = { ...d };
      delete rest.removed;
      delete rest.added;
      return h('div', null,
        diff(h('div'), d),
        Object.keys(rest).length ? h('div', { class: 'rest' }, pairs(rest)) : null);
    }
    if (d === null || d === undefined) return DASH;
    return h('div', null, h('pre', { class: 'code' }, JSON.stringify(d, null, 2)));
  }

  GW.views.audit = {
    title: 'Audit log',
    render(root, ctx) {
      const actor = h('input', { id: 'audit-actor', type: 'text', placeholder: 'any', autocomplete: 'off' });
      const action = h('input', { id: 'audit-action', type: 'text', placeholder: 'e.g. tenant.update', autocomplete: 'off' });
      const refresh = h('button', { type: 'button', id: 'audit-refresh' }, 'Refresh');
      const older = h('button', { type: 'button', id: 'audit-older', class: 'secondary', hidden: true }, 'Older entries');
      const list = h('div');
      const PAGE = 100;
      let rows = [];
      root.append(
        h('h1', null, 'Audit log'),
        h('div', { class: 'card' }, h('div', { class: 'toolbar' }, field('Actor', actor), field('Action', action), refresh), list, older),
      );
      const columns = [
        { key: 'ts', label: 'Time', cls: 'time', render: (e) => fmt.time(e.ts) },
        { key: 'actor', label: 'Actor' },
        { key: 'action', label: 'Action' },
        { key: 'target', label: 'Target' },
        { key: 'detail', label: 'Detail', cls: 'detail', render: (e) => detail(e.detail) },
      ];
      async function load(before) {
        const r = await api('GET', `/admin/audit${query({ limit: PAGE, before, actor: actor.value.trim(), action: action.value.trim() })}`);
        if (!ctx.alive) return;
        const page = (r && r.data) || [];
        rows = before ? rows.concat(page) : page;
        list.replaceChildren(table(columns, rows, { id: 'audit-table', empty: 'No changes recorded.' }));
        older.hidden = page.length < PAGE;
      }
      refresh.addEventListener('click', () => act(refresh, () => load()));
      older.addEventListener('click', () => act(older, () => {
        const ids = rows.map((e) => e.id).filter((id) => typeof id === 'number');
        return load(ids.length ? Math.min(...ids) : undefined);
      }));
      for (const input of [actor, action]) input.addEventListener('keydown', (ev) => { if (ev.key === 'Enter') refresh.click(); });
      load().catch(fail(ctx));
    },
  };

  // ---------------------------------------------------------------- policy history

  const blank = () => h('span');

  GW.views.history = {
    title: 'Policy history',
    render(root, ctx) {
      const list = h('div');
      const out = h('div', { id: 'history-out' });
      const compare = h('button', { type: 'button', id: 'history-compare' }, 'Compare A → B');
      const current = h('button', { type: 'button', id: 'history-current', class: 'secondary' }, 'Show the policy in force');
      root.append(
        h('h1', null, 'Policy history'),
        h('div', { class: 'card' },
          h('p', { class: 'hint' }, 'Every policy applied through the admin API is kept. Pick A and B, then compare; B may be the policy in force.'),
          list, h('div', { class: 'buttons' }, compare, current)),
        h('div', { class: 'card' }, out),
      );
      const picked = (name) => {
        const r = list.querySelector(`input[name="${name}"]:checked`);
        return r ? r.value : '';
      };

      compare.addEventListener('click', () => act(compare, async () => {
        const a = picked('history-a');
        const b = picked('history-b');
        if (!a || !b) throw new Error('Pick a version as A and one (or the policy in force) as B.');
        const d = await api('GET', `/admin/policies/versions/${enc(a)}/diff${query({ against: b })}`);
        out.replaceChildren(h('h2', null, `From version ${a} to ${b === 'current' ? 'the policy in force' : `version ${b}`}`), diff(h('div', { id: 'history-diff' }), d));
      }));
      current.addEventListener('click', () => act(current, async () => {
        const text = await api('GET', '/admin/policies');
        out.replaceChildren(h('h2', null, 'The policy in force'), h('pre', { class: 'code' }, String(text || '')));
      }));

      async function load() {
        const r = await api('GET', '/admin/policies/versions');
        if (!ctx.alive) return;
        const versions = (r && r.data) || [];
        const radio = (name, value, checked) => h('input', { type: 'radio', name, value: String(value), checked, 'aria-label': `${name === 'history-a' ? 'A' : 'B'}: ${value}` });
        const rows = [{ id: 'current', current: true }].concat(versions);
        list.replaceChildren(table([
          { key: 'a', label: 'A', render: (v) => (v.current ? blank() : radio('history-a', v.id, v === versions[Math.min(1, versions.length - 1)])) },
          { key: 'b', label: 'B', render: (v) => radio('history-b', v.id, !!v.current) },
          { key: 'id', label: 'Version', render: (v) => (v.current ? 'in force' : String(v.id)) },
          { key: 'ts', label: 'Applied', cls: 'time', render: (v) => (v.current ? blank() : fmt.time(v.ts)) },
          { key: 'actor', label: 'By', render: (v) => (v.current ? blank() : fmt.any(v.actor)) },
          { key: 'bytes', label: 'Size', cls: 'num', render: (v) => (v.current ? blank() : fmt.bytes(v.bytes)) },
          {
            key: 'actions', label: '', render: (v) => (v.current ? blank() : h('span', { class: 'actions' },
              h('button', { type: 'button', class: 'small secondary version-view', data: { version: v.id }, onclick: (ev) => act(ev.currentTarget, async () => {
                const text = await api('GET', `/admin/policies/versions/${enc(v.id)}`);
                out.replaceChildren(h('h2', null, `Version ${v.id}`), h('pre', { class: 'code' }, String(text || '')));
              }) }, 'View'),
              confirmButton('Re-apply', 'Really re-apply?', 'version-apply', { version: v.id }, async () => {
                const r2 = await api('POST', `/admin/policies/versions/${enc(v.id)}/apply`);
                notice(`Version ${v.id} applied again${r2 && r2.version ? ` as version ${r2.version}` : ''}.`);
                await load();
              }))),
          },
        ], rows, { id: 'history-table', rowAttrs: (v) => ({ data: { version: v.id } }) }));
        if (!versions.length) list.append(h('p', { class: 'muted' }, 'No version kept yet.'));
      }
      load().catch(fail(ctx));
    },
  };
})();
