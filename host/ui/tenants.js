/* Gateway admin console: tenants (their policy, previewed as a diff, then applied) and their
 * API keys. Uses the core in app.js (GW). */
(() => {
  'use strict';

  const GW = window.GW;
  const { h, fmt, DASH, api, act, enc, notice, showError, table, diff, confirmButton, field, tenantSelect } = GW;

  // The policy fields the form edits, as the policy file names them.
  const LISTS = ['models', 'plugins', 'collections'];
  const PLUGINS = ['prompt_template', 'output_parser', 'logits_processor', 'reranker', 'cache_key'];
  const FLAGS = ['parse_output', 'plugin_debug'];
  const LIMITS = ['requests_per_second', 'requests_per_minute', 'tokens_per_minute', 'max_concurrent', 'weight'];
  const OBJECTS = ['config', 'rag', 'cache'];
  const KNOWN = new Set([...LISTS, ...PLUGINS, ...FLAGS, ...LIMITS, ...OBJECTS, 'token_budget', 'name', 'keys']);

  const LABELS = {
    models: 'Models', plugins: 'Plugins', collections: 'Collections',
    prompt_template: 'Prompt template plugin', output_parser: 'Output parser plugin',
    logits_processor: 'Logits processor plugin', reranker: 'Reranker plugin', cache_key: 'Cache key plugin',
    parse_output: 'Always parse output', plugin_debug: 'Allow plugin debugging',
    requests_per_second: 'Requests / second', requests_per_minute: 'Requests / minute',
    tokens_per_minute: 'Tokens / minute', max_concurrent: 'Max concurrent', weight: 'Weight',
    config: 'Plugin config (JSON object)', rag: 'RAG (JSON object)', cache: 'Response cache (JSON object)',
  };

  const SHORT = { requests_per_second: 'rps', requests_per_minute: 'rpm', tokens_per_minute: 'tpm', max_concurrent: 'concurrent', weight: 'weight' };

  function limits(p) {
    const parts = LIMITS.filter((k) => p[k] !== undefined && p[k] !== null).map((k) => `${SHORT[k]} ${fmt.num(p[k])}`);
    return parts.length ? parts.join(' · ') : 'none';
  }

  function budget(b) {
    if (!b || typeof b !== 'object') return DASH;
    const used = typeof b.used === 'number' ? fmt.num(b.used) : DASH;
    return `${used} / ${fmt.num(b.tokens)} per ${b.period || DASH}`;
  }

  // ---------------------------------------------------------------- tenants

  GW.views.tenants = {
    title: 'Tenants',
    render(root, ctx) {
      const list = h('div', { id: 'tenants-list' });
      const formBox = h('div', { id: 'tenant-form-box' });
      const newBtn = h('button', { type: 'button', id: 'tenant-new', onclick: () => openForm(null) }, 'New tenant');
      root.append(h('div', { class: 'titlebar' }, h('h1', null, 'Tenants'), newBtn), list, formBox);

      async function load() {
        const data = await GW.tenants();
        if (!ctx.alive) return;
        list.replaceChildren(h('div', { class: 'card' }, table([
          { key: 'name', label: 'Name' },
          { key: 'models', label: 'Models', render: (t) => fmt.list((t.policy || {}).models === undefined ? ['*'] : t.policy.models) },
          { key: 'limits', label: 'Limits', render: (t) => limits(t.policy || {}) },
          { key: 'budget', label: 'Budget used / budget', render: (t) => budget(t.budget) },
          { key: 'keys', label: 'Keys', cls: 'num', render: (t) => fmt.num(t.keys) },
          {
            key: 'actions', label: '', render: (t) => h('span', { class: 'actions' },
              h('button', { type: 'button', class: 'edit small', data: { tenant: t.name }, onclick: () => openForm(t.name) }, 'Edit'),
              confirmButton('Delete', 'Really delete?', 'delete', { tenant: t.name }, async () => {
                await api('DELETE', `/admin/tenants/${enc(t.name)}`);
                notice(`Tenant ${t.name} deleted.`);
                formBox.replaceChildren();
                await load();
              })),
          },
        ], data, { id: 'tenants-table', empty: 'No tenants.', rowAttrs: (t) => ({ data: { tenant: t.name } }) })));
      }

      async function openForm(name) {
        showError('');
        formBox.replaceChildren(); // never a stale form while the tenant loads
        let current = { policy: {} };
        if (name) {
          try {
            current = await api('GET', `/admin/tenants/${enc(name)}`);
          } catch (e) {
            showError(e.message);
            return;
          }
          if (!ctx.alive) return;
        }
        formBox.replaceChildren(form(name, current || { policy: {} }, load));
        const first = formBox.querySelector(name ? '#tenant-models' : '#tenant-name');
        if (first) first.focus();
      }

      load().catch((e) => ctx.alive && showError(e.message));
    },
  };

  /** The edit form of tenant `name` (null: a new one); `current` is `GET /admin/tenants/{t}`. */
  function form(name, current, reload) {
    const p = current.policy || {};
    const inputs = {};
    const id = (f) => `tenant-${f}`;
    const nameInput = h('input', { id: 'tenant-name', type: 'text', value: name || '', required: true, readonly: !!name, autocomplete: 'off', placeholder: 'a-z, 0-9, - and _' });

    const grid = (items) => h('div', { class: 'form-grid' }, items);
    const text = (f, hint) => {
      inputs[f] = h('input', { id: id(f), type: 'text', value: Array.isArray(p[f]) ? p[f].join(', ') : (p[f] === undefined || p[f] === null ? '' : String(p[f])), autocomplete: 'off' });
      return field(LABELS[f], inputs[f], hint);
    };
    const number = (f) => {
      inputs[f] = h('input', { id: id(f), type: 'number', min: '0', step: '1', value: typeof p[f] === 'number' ? String(p[f]) : '' });
      return field(LABELS[f], inputs[f]);
    };
    const flag = (f) => {
      inputs[f] = h('input', { id: id(f), type: 'checkbox', checked: p[f] === true });
      return h('label', { class: 'check' }, inputs[f], LABELS[f]);
    };
    const json = (f) => {
      const v = p[f];
      const shown = v === undefined || v === null || (typeof v === 'object' && !Array.isArray(v) && !Object.keys(v).length) ? '' : JSON.stringify(v, null, 2);
      inputs[f] = h('textarea', { id: id(f), rows: '4', spellcheck: 'false' });
      inputs[f].value = shown;
      return field(LABELS[f], inputs[f]);
    };
    const b = p.token_budget && typeof p.token_budget === 'object' ? p.token_budget : {};
    const budgetTokens = h('input', { id: 'tenant-token_budget', type: 'number', min: '0', step: '1', value: typeof b.tokens === 'number' ? String(b.tokens) : '' });
    const budgetPeriod = h('select', { id: 'tenant-token_budget_period' },
      h('option', { value: 'day', selected: b.period !== 'month' }, 'per day'),
      h('option', { value: 'month', selected: b.period === 'month' }, 'per month'));
    // Fields this form has no input for are sent back as they are.
    const extra = {};
    for (const [k, v] of Object.entries(p)) if (!KNOWN.has(k)) extra[k] = v;

    const diffBox = h('div', { id: 'tenant-diff' });
    const status = h('p', { id: 'tenant-status', class: 'muted' });
    const preview = h('button', { type: 'button', id: 'tenant-preview', class: 'secondary' }, 'Preview');
    const apply = h('button', { type: 'button', id: 'tenant-apply' }, 'Apply');
    const cancel = h('button', { type: 'button', id: 'tenant-cancel', class: 'ghost' }, 'Close');

    function collect() {
      const tenant = nameInput.value.trim();
      if (!tenant) throw new Error('Name the tenant.');
      const body = { ...extra };
      for (const f of LISTS) {
        const items = inputs[f].value.split(',').map((s) => s.trim()).filter(Boolean);
        if (items.length) body[f] = items;
      }
      for (const f of PLUGINS) {
        const v = inputs[f].value.trim();
        if (v) body[f] = v;
      }
      for (const f of FLAGS) if (inputs[f].checked) body[f] = true;
      for (const f of LIMITS) {
        const v = inputs[f].value.trim();
        if (v === '') {
          if (inputs[f].validity && inputs[f].validity.badInput) throw new Error(`${LABELS[f]}: enter a whole number.`);
          continue;
        }
        const n = Number(v);
        if (!Number.isInteger(n)) throw new Error(`${LABELS[f]}: enter a whole number.`);
        body[f] = n;
      }
      if (budgetTokens.value.trim() !== '') {
        const n = Number(budgetTokens.value);
        if (!Number.isInteger(n)) throw new Error('Token budget: enter a whole number.');
        body.token_budget = { tokens: n, period: budgetPeriod.value };
      }
      for (const f of OBJECTS) {
        const v = inputs[f].value.trim();
        if (!v) continue;
        let parsed;
        try {
          parsed = JSON.parse(v);
        } catch (e) {
          throw new Error(`${LABELS[f]}: not valid JSON (${e.message}).`);
        }
        if (typeof parsed !== 'object' || parsed === null || Array.isArray(parsed)) throw new Error(`${LABELS[f]}: must be a JSON object.`);
        body[f] = parsed;
      }
      return { tenant, body };
    }

    preview.addEventListener('click', () => act(preview, async () => {
      diffBox.replaceChildren();
      status.textContent = '';
      const { tenant, body } = collect();
      const r = await api('PUT', `/admin/tenants/${enc(tenant)}?dry_run=true`, { json: body });
      status.textContent = 'Valid. Nothing is applied until you press Apply.';
      diff(diffBox, r && r.diff);
    }));

    apply.addEventListener('click', () => act(apply, async () => {
      diffBox.replaceChildren();
      status.textContent = '';
      const { tenant, body } = collect();
      const r = await api('PUT', `/admin/tenants/${enc(tenant)}`, { json: body });
      const version = r && r.version !== undefined && r.version !== null ? ` (policy version ${r.version})` : '';
      nameInput.readOnly = true;
      await reload().catch((e) => showError(e.message));
      status.textContent = `Applied${version}.`;
      diff(diffBox, r && r.diff);
      notice(`Tenant ${tenant} applied${version}.`);
    }));

    const box = h('form', { class: 'card', id: 'tenant-form', autocomplete: 'off' });
    box.addEventListener('submit', (ev) => ev.preventDefault());
    cancel.addEventListener('click', () => box.remove());
    // DOM `append` would write a null as the text "null": the optional parts are dropped first.
    box.append(...[
      h('h2', null, name ? `Edit tenant ${name}` : 'New tenant'),
      grid([
        field('Name', nameInput, name ? 'The name cannot change; make a new tenant instead.' : null),
        text('models', 'Comma-separated; * = all; empty = all'),
        text('plugins', 'Comma-separated; * = all of its own'),
        text('collections', 'Comma-separated; * = all of its own'),
      ]),
      h('h3', null, 'Limits'),
      grid([
        ...LIMITS.map(number),
        field('Token budget', h('span', { class: 'inline' }, budgetTokens, budgetPeriod), 'Prompt + completion tokens; empty = none'),
      ]),
      h('h3', null, 'Plugins bound'),
      grid([...PLUGINS.map((f) => text(f)), h('div', { class: 'checks' }, FLAGS.map(flag))]),
      h('h3', null, 'Advanced'),
      grid(OBJECTS.map(json)),
      Object.keys(extra).length ? h('p', { class: 'muted' }, `Kept as they are: ${Object.keys(extra).join(', ')}.`) : null,
      h('div', { class: 'buttons' }, preview, apply, cancel),
      status,
      diffBox,
      current.toml ? h('details', null, h('summary', null, 'As written in the policy file'), h('pre', { class: 'code' }, current.toml)) : null,
    ].filter(Boolean));
    return box;
  }

  // ---------------------------------------------------------------- keys

  /** A date input's value (YYYY-MM-DD, UTC midnight) as Unix seconds; null when empty. */
  function dateSeconds(v) {
    if (!v) return null;
    const ms = Date.parse(`${v}T00:00:00Z`);
    if (Number.isNaN(ms)) throw new Error(`Not a date: ${v}`);
    return Math.floor(ms / 1000);
  }

  GW.views.keys = {
    title: 'Keys',
    render(root, ctx) {
      const list = h('div', { id: 'keys-list' });
      const shown = h('div', { id: 'new-key-box', class: 'card highlight', hidden: true });
      const select = tenantSelect('keys-tenant', null, () => {
        shown.hidden = true;
        load().catch((e) => ctx.alive && showError(e.message));
      });
      const keyId = h('input', { id: 'key-id', type: 'text', maxlength: '64', placeholder: 'e.g. ci-2025', autocomplete: 'off' });
      const expires = h('input', { id: 'key-expires', type: 'date' });
      const create = h('button', { type: 'button', id: 'key-create' }, 'Create key');

      create.addEventListener('click', () => act(create, async () => {
        const tenant = select.value;
        if (!tenant) throw new Error('Pick a tenant first.');
        const r = await api('POST', `/admin/tenants/${enc(tenant)}/keys`, { json: { id: keyId.value.trim(), expires_at: dateSeconds(expires.value) } });
        showKey(tenant, r || {});
        keyId.value = '';
        expires.value = '';
        notice(`Key ${(r && r.id) || ''} created for ${tenant}.`);
        await load();
      }));

      function showKey(tenant, r) {
        const code = h('code', { id: 'new-key' }, r.key || DASH);
        const copy = h('button', { type: 'button', id: 'new-key-copy', class: 'small' }, 'Copy');
        copy.addEventListener('click', async () => {
          try {
            if (!navigator.clipboard || !window.isSecureContext) throw new Error('no clipboard');
            await navigator.clipboard.writeText(r.key || '');
            notice('Key copied.');
          } catch (e) {
            const range = document.createRange();
            range.selectNodeContents(code);
            const sel = window.getSelection();
            sel.removeAllRanges();
            sel.addRange(range);
            notice('Key selected: press Ctrl+C (⌘C) to copy it.');
          }
        });
        shown.replaceChildren(
          h('h2', null, `New key ${r.id || ''} for ${tenant}`),
          h('p', null, 'Copy it now: it is shown once and only its SHA-256 is kept.'),
          h('div', { class: 'inline' }, code, copy),
        );
        shown.hidden = false;
      }

      async function load() {
        const tenant = select.value;
        if (!tenant) {
          list.replaceChildren(h('p', { class: 'muted' }, 'No tenant to show.'));
          return;
        }
        const r = await api('GET', `/admin/tenants/${enc(tenant)}/keys`);
        if (!ctx.alive || select.value !== tenant) return;
        list.replaceChildren(h('div', { class: 'card' }, h('h2', null, `Keys of ${tenant}`), table([
          { key: 'id', label: 'Id' },
          { key: 'sha256', label: 'SHA-256', cls: 'mono', render: (k) => fmt.any(k.sha256) },
          { key: 'expires_at', label: 'Expires', render: (k) => (k.expires_at ? fmt.time(k.expires_at) : 'never') },
          { key: 'expiry', label: 'Change expiry', render: (k) => expiry(tenant, k) },
          {
            key: 'actions', label: '', render: (k) => confirmButton('Revoke', 'Really revoke?', 'revoke', { key: k.id }, async () => {
              await api('DELETE', `/admin/tenants/${enc(tenant)}/keys/${enc(k.id)}`);
              notice(`Key ${k.id} revoked.`);
              await load();
            }),
          },
        ], (r && r.data) || [], { id: 'keys-table', empty: 'No keys.', rowAttrs: (k) => ({ data: { key: k.id } }) })));
      }

      function expiry(tenant, k) {
        const input = h('input', { type: 'date', class: 'key-expiry', data: { key: k.id }, value: fmt.date(k.expires_at) });
        const set = h('button', { type: 'button', class: 'small key-expiry-set', data: { key: k.id } }, 'Set');
        const never = h('button', { type: 'button', class: 'small ghost key-expiry-clear', data: { key: k.id } }, 'Never');
        const put = (btn, at) => act(btn, async () => {
          await api('PUT', `/admin/tenants/${enc(tenant)}/keys/${enc(k.id)}`, { json: { expires_at: at } });
          notice(at ? `Key ${k.id} expires ${fmt.time(at)}.` : `Key ${k.id} never expires.`);
          await load();
        });
        set.addEventListener('click', () => put(set, dateSeconds(input.value)));
        never.addEventListener('click', () => put(never, null));
        return h('span', { class: 'inline' }, input, set, never);
      }

      root.append(
        h('h1', null, 'API keys'),
        h('div', { class: 'card' }, h('div', { class: 'toolbar' }, field('Tenant', select))),
        h('div', { class: 'card' }, h('h2', null, 'New key'), h('div', { class: 'toolbar' },
          field('Id', keyId), field('Expires (00:00 UTC that day; empty = never)', expires), create)),
        shown,
        list,
      );
      select.ready.then(() => ctx.alive && load()).catch((e) => ctx.alive && showError(e.message));
    },
  };
})();
