"""The usage dashboard in a real browser: two tenants' traffic shows in its charts, a tenant filter
narrows them, the live panel shows the real worker and gate, and only a signed-in browser sees it."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.integration.browser import chromium
from tests.integration.conftest import ADMIN_TOKEN, MODEL_NAME

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

TENANTS = ("dash-north", "dash-south")


def _labels(page, chart: str) -> list[str]:
    return page.evaluate(f"window.tokenmillCharts[{chart!r}].data.datasets.map(d => d.label)")


def _tenant_tokens(page) -> dict[str, int]:
    return page.evaluate("Object.fromEntries(window.tokenmillCharts['tokens-by-tenant'].data.datasets"
                         ".map(d => [d.label, d.data.reduce((a, b) => a + b, 0)]))")


def _await_ledger(stack, sent: dict[str, int], timeout=60) -> dict[str, int]:
    """Each tenant's billed tokens, once the ledger holds every request it sent (a tenant whose first rows
    are in is not yet whole: on a busy machine the chart then showed a request the ledger had not had)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = httpx.get(f"{stack.billing_url}/admin/usage/top-tenants", params={"since": "1h", "limit": 1000},
                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
        tokens = {r["tenant_id"]: r["tokens"] for r in rows if r["tenant_id"] in sent}
        requests = {r["tenant_id"]: r["requests"] for r in rows if r["tenant_id"] in sent}
        if requests == sent or time.monotonic() > deadline:
            return tokens
        time.sleep(0.3)


def _login_url(stack) -> str:
    env = {**os.environ, **stack.env}
    out = subprocess.run([sys.executable, "-m", "tokenmill.cli", "dashboard", "--url"], env=env, check=True,
                         capture_output=True, text=True).stdout.strip()
    assert out.startswith(f"{stack.billing_url}/dashboard/login?token="), out
    return out


def test_two_tenants_show_in_the_charts_and_a_filter_narrows_them(stack):
    for i, tenant in enumerate(TENANTS):
        client = openai.OpenAI(base_url=stack.base_url, api_key=stack.issue_tenant(tenant), max_retries=5)
        for n in range(2 + i):
            client.completions.create(model=MODEL_NAME, prompt=f"{tenant} {n}", max_tokens=5 + 3 * i,
                                      extra_body={"ignore_eos": True})
    billed = _await_ledger(stack, {tenant: 2 + i for i, tenant in enumerate(TENANTS)})
    assert set(billed) == set(TENANTS)

    with chromium() as browser:
        outsider = browser.new_page()
        assert outsider.goto(f"{stack.billing_url}/dashboard").status == 401
        assert outsider.request.get(f"{stack.billing_url}/dashboard/api/usage").status == 401

        url = _login_url(stack)
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("requestfailed", lambda req: errors.append(f"request failed: {req.url}"))
        assert page.goto(url).status == 200
        assert page.url == f"{stack.billing_url}/dashboard"  # the token is gone from the address bar
        page.wait_for_function("Number(document.body.dataset.usageLoads) > 0"
                               " && Number(document.body.dataset.liveLoads) > 0")

        shown = _tenant_tokens(page)
        assert {t: shown.get(t) for t in TENANTS} == billed  # the chart adds up to the ledger
        assert page.evaluate("window.tokenmillCharts['outcomes'].data.datasets"
                             ".find(d => d.label === 'finished').data.reduce((a, b) => a + b, 0)") >= 5
        assert MODEL_NAME in _labels(page, "tokens-by-model")
        assert "test-worker-0" in page.inner_text("#workers")
        assert all(t in page.inner_text("#gate") for t in TENANTS)  # the gate's own counters, live

        page.click("#tenant-filter summary")
        for tenant in TENANTS:
            page.check(f"#tenant-checkboxes input[value='{tenant}']")
        page.wait_for_function(f"JSON.stringify(window.tokenmillCharts['tokens-by-tenant'].data.datasets"
                               f".map(d => d.label)) === JSON.stringify({sorted(TENANTS)!r})")
        by_tokens = sorted(TENANTS, key=lambda t: -billed[t])  # the other tests' tenants are filtered out
        assert page.evaluate("window.tokenmillCharts['top-tenants'].data.labels") == by_tokens
        page.uncheck(f"#tenant-checkboxes input[value='{TENANTS[1]}']")
        page.wait_for_function(f"JSON.stringify(window.tokenmillCharts['tokens-by-tenant'].data.datasets"
                               f".map(d => d.label)) === JSON.stringify([{TENANTS[0]!r}])")
        assert _tenant_tokens(page) == {TENANTS[0]: billed[TENANTS[0]]}
        assert page.evaluate("window.tokenmillCharts['top-tenants'].data.labels") == [TENANTS[0]]
        assert f"tenant={TENANTS[0]}" in page.url  # the view is a link
        assert page.inner_text("#tenant-filter-label") == TENANTS[0]

        page.click("#tenants-all")
        page.wait_for_function("window.tokenmillCharts['tokens-by-tenant'].data.datasets.length > 1")
        screenshot = os.environ.get("TOKENMILL_DASHBOARD_SCREENSHOT")
        if screenshot:
            page.screenshot(path=screenshot, full_page=True)
        assert errors == []

        again = browser.new_page()  # a sign-in link works once
        assert again.goto(url).status == 401
