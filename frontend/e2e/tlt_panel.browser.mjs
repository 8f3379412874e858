// Browser test of the job page's "TLT over training" panel, against the real backend: started by
// tests/ui/test_ui_tlt_panel.py, which records a tiny TLT job's metrics, loads them into a fresh database through the
// worker's DbReporter, starts uvicorn and passes (environment):
//   UI_BASE_URL  http://127.0.0.1:PORT     UI_TOKEN  an API token     UI_JOB  the job's id
//   UI_EXPECT    JSON: {steps, saved, entropy, accept, drafter_points}: what the panel must show
//   UI_SCREENSHOTS  directory for the screenshot     CHROMIUM  browser binary (default /usr/bin/chromium)
// Not named *.test.mjs: the dashboard's own run (node --test e2e/) does not pick it up; run it alone with
// node --test e2e/tlt_panel.browser.mjs (those variables set).
import assert from "node:assert/strict";
import { mkdirSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { chromium } from "playwright-core";

const BASE = process.env.UI_BASE_URL;
const EXPECT = JSON.parse(process.env.UI_EXPECT ?? "{}");
const SHOTS = process.env.UI_SCREENSHOTS ?? "test-artifacts";
const chart = (id) => `[data-chart="${id}"]`;
let browser, page;
const pageErrors = [];

before(async () => {
  assert.ok(BASE && process.env.UI_TOKEN && process.env.UI_JOB, "run through tests/ui/test_ui_tlt_panel.py");
  browser = await chromium.launch({ executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"] });
  const context = await browser.newContext({ viewport: { width: 1400, height: 900 } });
  context.setDefaultTimeout(20_000);
  page = await context.newPage();
  page.on("pageerror", (e) => pageErrors.push(e.message));
  await page.goto(`${BASE}/`);
  await page.evaluate((t) => localStorage.setItem("tlt.token", t), process.env.UI_TOKEN);
});

after(async () => { await browser?.close(); });

test("the TLT panel draws entropy, drafter accuracy, accept length and the time SD saved", async () => {
  await page.goto(`${BASE}/#/jobs/${process.env.UI_JOB}`);
  await page.waitForSelector('[data-panel="tlt"]');
  // right after the speculative-decoding panel
  const next = await page.$eval('[data-panel="sd"]', (el) => el.nextElementSibling?.getAttribute("data-panel"));
  assert.equal(next, "tlt");
  await page.waitForSelector(`${chart("tlt-entropy")}[data-points="${EXPECT.steps}"] canvas`);
  await page.waitForSelector(`${chart("tlt-drafter-acc")}[data-points="${EXPECT.drafter_points}"] canvas`);
  await page.waitForSelector(`${chart("tlt-accept-len")}[data-points] canvas`);
  await page.waitForSelector(`${chart("tlt-saved")}[data-points] canvas`);
  assert.equal(await page.getAttribute(chart("tlt-drafter-acc"), "data-y-range"), "0-1");
  await page.waitForSelector(`[data-testid=tlt-saved-total]:has-text("${EXPECT.saved}")`);
  assert.equal(await page.textContent("[data-testid=tlt-entropy-trend]"), EXPECT.entropy);
  assert.equal(await page.textContent("[data-testid=tlt-accept-trend]"), EXPECT.accept);
  // the saved-time chart has both series in its legend: SD steps' seconds and the plain estimate
  const legend = await page.$$eval(`${chart("tlt-saved")} .u-legend .u-series`, (rows) => rows.map((r) => r.textContent));
  assert.ok(legend.some((t) => t.includes("with SD")) && legend.some((t) => t.includes("plain estimate")), legend.join("|"));
  mkdirSync(SHOTS, { recursive: true });
  await page.locator('[data-panel="tlt"]').screenshot({ path: join(SHOTS, "ui-tlt-panel.png") });
  assert.deepEqual(pageErrors, []);
});
