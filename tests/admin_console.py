"""Drives the admin console (/admin/ui) in headless Chromium with Playwright, as an admin and
then as a viewer: sign-in, a tenant made and edited (previewed as a diff, applied), a key made,
used and revoked, usage, a plugin upload, an edit the validator refuses, and a viewer's write
refused by the server. Prints how long the console takes to load and how long an edit takes
to be in force.

Usage: python3 tests/admin_console.py <base_url> <admin_token> <viewer_token> <model>
       <plugin.wasm> <plugin kind>
(kind may be `auto` or `` to let the gateway detect it from the component)."""
import faulthandler
import hashlib
import json
import os
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request

from playwright.sync_api import expect, sync_playwright

if len(sys.argv) != 7:
    raise SystemExit(__doc__)
base, admin_token, viewer_token, model, wasm_path, kind = sys.argv[1:]
base = base.rstrip("/")
kind = "" if kind in ("", "auto", "detect") else kind
TENANT, PLUGIN = "console-t", "console-plugin"
WAIT_MS = 10_000


def http(method, path, token=None, body=None):
    """One call of the test's own (not the browser's): status and parsed JSON (or bytes)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw, status, ctype = r.read(), r.status, r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        raw, status, ctype = e.read(), e.code, e.headers.get("Content-Type", "")
    if "json" in ctype and raw:
        return status, json.loads(raw)
    return status, raw


def policy():
    status, body = http("GET", f"/admin/tenants/{TENANT}", admin_token)
    assert status == 200, f"GET /admin/tenants/{TENANT} answered {status}: {body}"
    return body["policy"]


def chat(key):
    return http("POST", "/v1/chat/completions", key, {
        "model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0,
    })


def key_ids():
    status, body = http("GET", f"/admin/tenants/{TENANT}/keys", admin_token)
    assert status == 200, f"GET /admin/tenants/{TENANT}/keys answered {status}: {body}"
    return [k["id"] for k in body["data"]]


def sign_in(page, token, role):
    expect(page.locator("#signin-token")).to_be_visible()
    page.fill("#signin-token", token)
    page.click("#signin-submit")
    expect(page.locator("#whoami")).to_contain_text(role)


def open_tenant(page, name):
    """The tenants screen with `name`'s edit form loaded."""
    page.click("#nav-tenants")
    page.click(f'#tenants-table button.edit[data-tenant="{name}"]')
    expect(page.locator("#tenant-name")).to_have_value(name)


def scenario(page, problems):
    # 1. The page, its CSP, the sign-in form, an admin signed in.
    response = page.goto(base + "/admin/ui")
    assert response is not None and response.status == 200, f"GET /admin/ui: {response and response.status}"
    csp = response.headers.get("content-security-policy", "")
    assert "script-src 'self'" in csp, f"the console's Content-Security-Policy lacks script-src 'self': {csp!r}"
    expect(page.locator("#signin-token")).to_be_visible()
    page.wait_for_function("() => { const n = performance.getEntriesByType('navigation')[0]; return n && n.loadEventEnd > 0; }")
    load_ms = page.evaluate("""() => {
        const n = performance.getEntriesByType('navigation')[0];
        const m = performance.getEntriesByName('signin-visible')[0];
        return Math.max(n.loadEventEnd - n.startTime, m ? m.startTime : 0);
    }""")
    print(f"console load ms: {load_ms:.0f}")
    assert page.get_attribute("#signin-token", "type") == "password", "the token input must be a password field"
    page.fill("#signin-token", "not-a-token")
    page.click("#signin-submit")
    expect(page.locator("#error")).to_be_visible()
    sign_in(page, admin_token, "admin")
    expect(page.locator("#readonly")).to_be_hidden()

    # 2. A new tenant: previewed (the diff adds its name), then applied.
    page.click("#nav-tenants")
    page.click("#tenant-new")
    page.fill("#tenant-name", TENANT)
    page.fill("#tenant-models", model)
    page.fill("#tenant-requests_per_minute", "1000")
    page.click("#tenant-preview")
    expect(page.locator("#tenant-diff .add").filter(has_text=f'name = "{TENANT}"')).to_have_count(1)
    expect(page.locator("#error")).to_be_hidden()
    status, _ = http("GET", f"/admin/tenants/{TENANT}", admin_token)
    assert status == 404, f"a preview must apply nothing, yet GET /admin/tenants/{TENANT} answered {status}"
    page.click("#tenant-apply")
    expect(page.locator(f'#tenants-table tr[data-tenant="{TENANT}"]')).to_be_visible()
    expect(page.locator("#error")).to_be_hidden()
    assert policy().get("requests_per_minute") == 1000, policy()

    # 3. A key, shown once.
    page.click("#nav-keys")
    page.select_option("#keys-tenant", TENANT)
    page.fill("#key-id", "k1")
    page.click("#key-create")
    expect(page.locator("#new-key")).to_have_text(re.compile(r"^\s*\S{16,}\s*$"))
    key = page.inner_text("#new-key").strip()
    expect(page.locator('#keys-table tr[data-key="k1"]')).to_be_visible()

    # 4. The key works; an edit made in the console is in force within ... ms.
    deadline = time.monotonic() + 2
    while True:
        status, body = chat(key)
        if status != 401 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert status == 200, f"chat with the console's new key answered {status}: {body}"
    open_tenant(page, TENANT)
    expect(page.locator("#tenant-requests_per_minute")).to_have_value("1000")
    page.fill("#tenant-requests_per_minute", "2000")
    started = time.monotonic()
    page.click("#tenant-apply")
    while True:
        p = policy()
        if p.get("requests_per_minute") == 2000:
            break
        assert time.monotonic() - started < 10, f"the edit is not in force after 10 s: {p}"
        time.sleep(0.01)
    print(f"policy edit in force ms: {(time.monotonic() - started) * 1000:.0f}")
    expect(page.locator("#tenant-status")).to_contain_text("Applied")

    # 5. Usage shows the request.
    page.click("#nav-usage")
    page.select_option("#usage-tenant", TENANT)
    deadline = time.monotonic() + 10
    rows = []
    while True:
        page.click("#usage-refresh")
        expect(page.locator("#usage-refresh")).to_be_enabled()
        rows = page.evaluate("""() => [...document.querySelectorAll('#usage-table tbody tr')].map((tr) => {
            const cell = (k) => { const td = tr.querySelector(`td[data-col="${k}"]`); return td ? td.textContent.trim() : ''; };
            return { tenant: cell('tenant'), requests: cell('requests') };
        })""")
        if any(r["tenant"] == TENANT and r["requests"].replace(",", "").isdigit() and int(r["requests"].replace(",", "")) >= 1 for r in rows):
            break
        assert time.monotonic() < deadline, f"#usage-table shows no request of {TENANT} after 10 s: {rows}; #error: {page.inner_text('#error')!r}"
        time.sleep(0.5)
    expect(page.locator("#usage-csv")).to_have_attribute("href", re.compile(r"format=csv"))

    # 6. A plugin upload; the table shows the file's sha256.
    with open(wasm_path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    page.click("#nav-plugins")
    page.select_option("#plugin-tenant", TENANT)
    page.set_input_files("#plugin-file", wasm_path)
    page.fill("#plugin-name", PLUGIN)
    page.select_option("#plugin-kind", kind)
    page.click("#plugin-upload")
    expect(page.locator("#plugins-table td.sha256").filter(has_text=sha)).to_have_count(1)
    row = page.locator(f'#plugins-table tr[data-tenant="{TENANT}"][data-plugin="{PLUGIN}"]')
    expect(row).to_be_visible()
    if kind:
        expect(row.locator('td[data-col="kind"]')).to_have_text(kind)
    expect(page.locator("#error")).to_be_hidden()

    # 7. An edit the validator refuses: its problem shown, nothing applied.
    before = policy()
    open_tenant(page, TENANT)
    page.fill("#tenant-weight", "0")
    page.click("#tenant-preview")
    expect(page.locator("#error")).to_contain_text("weight")
    expect(page.locator("#error")).to_contain_text("at least 1")
    page.click("#tenant-apply")
    expect(page.locator("#error")).to_contain_text("weight")
    expect(page.locator("#tenant-diff .add")).to_have_count(0)
    after = policy()
    assert after == before, f"a refused edit changed the policy: {before} -> {after}"

    # 8. The key revoked (confirmed in the page): refused within a second.
    page.click("#nav-keys")
    page.select_option("#keys-tenant", TENANT)
    page.click('#keys-table button.revoke[data-key="k1"]')
    page.click('#keys-table button.revoke-confirm[data-key="k1"]')
    expect(page.locator('#keys-table tr[data-key="k1"]')).to_have_count(0)
    revoked = time.monotonic()
    while True:
        status, body = chat(key)
        if status == 401:
            break
        assert time.monotonic() - revoked < 1, f"a revoked key still answers {status} after 1 s: {body}"
        time.sleep(0.02)
    assert "k1" not in key_ids()

    # 9. A viewer: signed in, told it is read-only, its write refused by the server.
    page.click("#signout")
    sign_in(page, viewer_token, "viewer")
    expect(page.locator("#readonly")).to_be_visible()
    page.click("#nav-keys")
    page.select_option("#keys-tenant", TENANT)
    page.fill("#key-id", "viewer-key")
    page.click("#key-create")
    expect(page.locator("#error")).to_contain_text("viewer")
    expect(page.locator("#new-key")).to_have_count(0)
    assert "viewer-key" not in key_ids(), "a viewer's key was created"

    assert not problems, "the console logged errors:\n" + "\n".join(problems)


def main():
    # A hang anywhere (Playwright's driver, Chromium, the gateway) ends the run with every
    # thread's stack on stderr, so the caller can say where instead of waiting for CI's limit.
    faulthandler.dump_traceback_later(float(os.environ.get("SCENARIO_DEADLINE_S", "150")), exit=True)
    # Left over from an earlier run against the same gateway: gone, so the diff adds the name.
    http("DELETE", f"/admin/plugins/{TENANT}/{PLUGIN}", admin_token)
    http("DELETE", f"/admin/tenants/{TENANT}", admin_token)
    problems = []
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path="/usr/bin/chromium", args=["--no-sandbox"], headless=True, timeout=60_000
        )
        page = browser.new_page()
        page.set_default_timeout(WAIT_MS)
        expect.set_options(timeout=WAIT_MS)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))

        def console(msg):
            text = msg.text
            if msg.type == "error" and ("Content Security Policy" in text or "Refused to" in text or "Uncaught" in text):
                problems.append(f"console: {text}")

        page.on("console", console)
        try:
            scenario(page, problems)
        except BaseException:
            shot = os.path.join(tempfile.gettempdir(), "admin_console_failure.png")
            try:
                page.screenshot(path=shot, full_page=True)
                print(f"screenshot: {shot}; #error: {page.inner_text('#error')!r}", file=sys.stderr)
            except Exception:  # the page may be gone
                pass
            if problems:
                print("console problems:\n" + "\n".join(problems), file=sys.stderr)
            raise
        finally:
            browser.close()
    print("admin console scenario: ok")


if __name__ == "__main__":
    main()
