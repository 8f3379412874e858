// Browser tests of the dashboard: playwright-core driving Debian's chromium (headless) against the REAL backend.
// Started by tests/ui/test_ui_dashboard.py, which migrates a fresh database, seeds jobs through the worker's
// DbReporter, starts uvicorn and passes (environment):
//   UI_BASE_URL   http://127.0.0.1:PORT          UI_SEED     the seed's JSON (token, job ids, artifact sha256)
//   UI_LIVE_CMD   JSON argv that writes one more step of a job (appended: --job ID --step N)
//   UI_SCREENSHOTS  directory for screenshots     CHROMIUM    browser binary (default /usr/bin/chromium)
// Run alone: node --test e2e/   (with those variables set).
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import { mkdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import { chromium } from "playwright-core";

const BASE = process.env.UI_BASE_URL;
const SEED = JSON.parse(process.env.UI_SEED ?? "{}");
const LIVE_CMD = JSON.parse(process.env.UI_LIVE_CMD ?? "[]");
const SHOTS = process.env.UI_SCREENSHOTS ?? "test-artifacts";
const ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
  "--disable-background-networking", "--disable-component-update", "--disable-sync"];

let browser, context, page;
const pageErrors = [];

function writeStep(jobId, step) {
  execFileSync(LIVE_CMD[0], [...LIVE_CMD.slice(1), "--job", String(jobId), "--step", String(step)], { stdio: "inherit" });
}

async function signIn(p) {
  await p.goto(`${BASE}/`);
  await p.evaluate((t) => localStorage.setItem("tlt.token", t), SEED.token);
}

const chart = (id) => `[data-chart="${id}"]`;

describe("dashboard against the real backend", { concurrency: false }, () => {
  before(async () => {
    assert.ok(BASE && SEED.token, "UI_BASE_URL and UI_SEED must be set (run through tests/ui/test_ui_dashboard.py)");
    mkdirSync(SHOTS, { recursive: true });
    browser = await chromium.launch({ executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium", args: ARGS });
    context = await browser.newContext({ viewport: { width: 1400, height: 900 }, acceptDownloads: true });
    context.setDefaultTimeout(20_000);
    page = await context.newPage();
    page.on("pageerror", (e) => pageErrors.push(e.message));
  });

  after(async () => { await browser?.close(); });

  test("sign-in refuses a bad token, accepts a good one, and the job list shows steps and step time", async () => {
    await page.goto(`${BASE}/`);
    await page.waitForURL(/#\/signin$/);
    await page.fill("input[name=token]", "tlt_not-a-real-token");
    await page.click("button[type=submit]");
    await page.waitForSelector("[data-testid=signin-error]:has-text('invalid')");
    // the hint gives the command whose token sees every user's jobs (the demo's belong to the admin)
    assert.match(await page.innerText("[data-testid=signin-hint]"), /tlt token create --admin/);
    await page.fill("input[name=token]", SEED.token);
    await page.click("button[type=submit]");
    await page.waitForURL(/#\/jobs$/);
    assert.equal(await page.evaluate(() => localStorage.getItem("tlt.token")), SEED.token);
    const row = page.locator(`tr[data-job-id="${SEED.job_id}"]`);
    await row.locator("[data-testid=job-step]:has-text('12')").waitFor();
    assert.match(await row.locator("[data-testid=job-step-time]").innerText(), /^\d+(\.\d+)? s$/);
    assert.equal(await row.locator("[data-testid=status]").innerText(), "running");
    await page.waitForSelector("[data-testid=jobs-scope]:has-text(\"Every user's jobs (admin token)\")");
    await page.screenshot({ path: join(SHOTS, "ui-jobs.png") });
  });

  test("job page renders every panel from the seeded run", async () => {
    await page.goto(`${BASE}/#/jobs/${SEED.job_id}`);
    await page.waitForSelector("[data-testid=stream-state]:has-text('open')");
    await page.waitForSelector(`${chart("reward")}[data-last-x="${SEED.steps}"]`);
    for (const id of ["length-lines", "sd-accept-len", "sd-pos-lines", "sd-on-fraction-line", "sd-arms", "sd-tail",
      "validation", "step-time", "tokens-per-s", "harvest-lines"]) {
      await page.waitForSelector(`${chart(id)}[data-last-x] canvas`);
    }
    await page.waitForSelector(`${chart("length-histogram")}[data-step="${SEED.steps}"]`);
    await page.waitForSelector(`${chart("length-heatmap")}[data-steps="${SEED.steps}"]`);
    // the p50 / p90 / max labels stay inside the histogram's canvas
    const [right, width] = await page.$eval(chart("length-histogram"), (b) => [Number(b.dataset.labelsRight), Number(b.dataset.width)]);
    assert.ok(right > 0 && right <= width, `histogram labels end at ${right} of ${width} px`);
    // a CPU job (the recorded run has no GPUs): the time panel and its units name the CPU, not a GPU
    assert.match(await page.innerText("[data-panel=gpu] > h2"), /^CPU time and idle-time harvesting/);
    assert.match(await page.innerText(`${chart("harvest-lines")} .chart-title`), /CPU-s/);
    assert.doesNotMatch(await page.innerText("[data-panel=gpu]"), /GPU/);
    // the "All other metrics" expander shows its marker, and opens
    const marker = await page.$eval("[data-testid=other-metrics]", (el) => getComputedStyle(el, "::before").content);
    assert.equal(marker, '"▸"');
    await page.click("[data-testid=other-metrics]");
    assert.equal(await page.$eval("[data-testid=other-metrics]", (el) => getComputedStyle(el, "::before").content), '"▾"');
    // the heat-map and the GPU timeline drew something: more than one colour on each canvas
    for (const id of ["length-heatmap", "gpu-timeline"]) {
      const colours = await page.$eval(`${chart(id)} canvas`, (c) => {
        const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
        const seen = new Set();
        for (let i = 0; i < d.length; i += 4 * 97) seen.add(`${d[i]},${d[i + 1]},${d[i + 2]},${d[i + 3]}`);
        return seen.size;
      });
      assert.ok(colours > 3, `${id} looks blank (${colours} colours)`);
    }
    await page.waitForSelector(`[data-testid=samples] td:has-text(${JSON.stringify(SEED.sample_prompt)})`);
    await page.waitForSelector("[data-testid=artifacts] tr[data-artifact-kind=drafter]");
    await page.waitForSelector("[data-testid=events] td:has-text('starting → running')");
    assert.match(await page.innerText("[data-testid=log-tail]"), /step 12 reward/);
    await page.screenshot({ path: join(SHOTS, "ui-job-page.png"), fullPage: true });
    await page.screenshot({ path: join(SHOTS, "ui-job-page-top.png") });
  });

  test("the headline figures are the recorded run's own, and fractions and shares sit on a 0-1 axis", async () => {
    // the seed computed them from the recording: harvest = used / idle GPU-seconds over the job, SD ran = decode
    // steps that drafted and verified at the latest step, tail speed-up = with / without SD at the newest step with both
    const num = async (id) => Number((await page.innerText(`[data-testid=${id}]`)).match(/^[\d.e+-]+/)[0]);
    const want = SEED.figures;
    assert.ok(Math.abs(await num("harvest-ratio") - 100 * want.harvest_ratio) <= 0.01 * 100 * want.harvest_ratio + 1e-9);
    assert.ok(100 * want.harvest_ratio <= 100, "harvested more idle time than there was");
    assert.ok(Math.abs(await num("sd-on-fraction") - 100 * want.sd_ran) <= 0.01 * 100 * want.sd_ran + 1e-9);
    // "SD ran" says what it covers: the mean over the run's steps, with the latest step's share beside it
    assert.match(await page.innerText(".stat:has([data-testid=sd-on-fraction])"), new RegExp(`^SD ran \\(mean of steps 1-${SEED.steps}\\)`));
    const latest = Number((await page.innerText("[data-testid=sd-on-fraction]")).match(/latest step ([\d.e+-]+) %/)[1]);
    assert.ok(Math.abs(latest - 100 * want.sd_ran_last) <= 0.01 * 100 * want.sd_ran_last + 1e-9);
    const tail = await page.innerText("[data-testid=tail-speedup]");
    assert.match(tail, new RegExp(`× \\(step ${want.tail_step}\\)$`));
    assert.ok(Math.abs(await num("tail-speedup") - want.tail_speedup) <= 0.01 * want.tail_speedup);
    // a chart drawn before the catalogue arrived is redrawn with its axis: wait for that
    for (const id of ["sd-arms", "harvest-ratio-line", "sd-on-fraction-line", "drafter-acc"]) {
      await page.waitForSelector(`${chart(id)}[data-y-range="0-1"]`, { timeout: 5000 });
    }
    assert.equal(await page.getAttribute(chart("reward"), "data-y-range"), "auto");
    // one legend row per arm the recorded run played ("none", n-gram and EAGLE arms), plus the step column
    const legend = await page.$$eval(`${chart("sd-arms")} .u-legend .u-series`, (rows) => rows.length);
    assert.ok(legend >= 3, `arm legend has ${legend} rows`);
    // "update" has one colour: the stacked step-time chart's marker and the GPU timeline's legend agree
    const colours = await page.evaluate(() => {
      const marker = [...document.querySelectorAll('[data-chart="step-time"] .u-legend .u-series')]
        .find((r) => r.textContent.trim().startsWith("update"))?.querySelector(".u-marker");
      const chip = [...document.querySelectorAll('[data-chart="gpu-timeline"] .legend span')]
        .find((s) => s.textContent.trim() === "update")?.querySelector("i");
      return [marker && getComputedStyle(marker).borderColor, chip && getComputedStyle(chip).backgroundColor];
    });
    assert.ok(colours[0] && colours[0] === colours[1], `update colours differ: ${colours}`);
  });

  test("a one-step job draws its point, and a job page stops fetching once left", async () => {
    const seen = [];
    const onRequest = (r) => seen.push({ url: r.url(), t: Date.now() });
    const bad = [];
    const onResponse = (r) => { if (r.status() === 422) bad.push(r.url()); };
    page.on("request", onRequest);
    page.on("response", onResponse);
    try {
      await page.goto(`${BASE}/#/jobs/${SEED.one_step_job_id}`);
      await page.waitForSelector(`${chart("reward")}[data-last-x="1"] canvas`);
      const blue = await page.$eval(`${chart("reward")} canvas`, (c) => {
        const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
        let n = 0; // pixels of the series colour (#4e79a7): the lone point's ring
        for (let i = 0; i < d.length; i += 4) {
          if (Math.abs(d[i] - 78) + Math.abs(d[i + 1] - 121) + Math.abs(d[i + 2] - 167) < 60 && d[i + 3] > 200) n++;
        }
        return n;
      });
      assert.ok(blue > 3, `the one-point series drew ${blue} pixels`);
      // a job without steps asks for no samples before its first step (after_step=-2 was a 422)
      await page.goto(`${BASE}/#/jobs/${SEED.failed_job_id}`);
      await page.waitForSelector("[data-testid=reason]");
      await page.waitForTimeout(2500);
      await page.goto(`${BASE}/#/jobs`);
      await page.waitForSelector("[data-testid=jobs-table]");
      const left = Date.now();
      await page.waitForTimeout(4000);
      const late = seen.filter((r) => r.t > left && /\/jobs\/\d+\//.test(new URL(r.url).pathname));
      assert.deepEqual(late.map((r) => r.url), [], "requests of a job page after leaving it");
      assert.deepEqual(bad, [], "422 responses");
      assert.ok(!seen.some((r) => r.url.includes("after_step=-2")));
    } finally {
      page.off("request", onRequest);
      page.off("response", onResponse);
    }
  });

  test("a metric written while the page is open arrives over SSE and is drawn", async () => {
    await page.goto(`${BASE}/#/jobs/${SEED.job_id}`);
    await page.waitForSelector("[data-testid=stream-state]:has-text('open')");
    await page.waitForSelector(`${chart("reward")}[data-last-x="${SEED.steps}"]`);
    const step = SEED.steps + 1;
    writeStep(SEED.job_id, step);
    await page.waitForSelector(`${chart("reward")}[data-last-x="${step}"]`);
    await page.waitForSelector("[data-testid=live-step]:has-text('" + step + "')");
    await page.waitForSelector(`${chart("length-heatmap")}[data-last-step="${step}"]`);
    await page.waitForSelector(`${chart("length-histogram")}[data-step="${step}"]`);
    // the log line comes as its own event, possibly after the metric: wait for it (same text as before)
    await page.waitForSelector(`[data-testid=log-tail]:has-text("step ${step} reward 0.9877")`);
    assert.match(await page.innerText("[data-testid=log-tail]"), new RegExp(`step ${step} reward 0\\.9877`));
  });

  test("after a dropped connection the stream resumes from Last-Event-ID without duplicates", async () => {
    const events = await page.locator("[data-testid=events] tbody tr").count();
    const resumed = page.waitForRequest((r) => r.url().endsWith(`/jobs/${SEED.job_id}/stream`) &&
      (r.headers()["last-event-id"] ?? "").length > 0, { timeout: 30_000 });
    const step = SEED.steps + 2;
    try {
      await context.setOffline(true); // the next connection attempts fail until we are back online
      await page.click("[data-testid=reconnect]"); // drop the open stream
      await page.waitForSelector("[data-testid=stream-state]:has-text('reconnecting')");
      writeStep(SEED.job_id, step); // written while the page has no connection
    } finally {
      await context.setOffline(false);
    }
    await resumed;
    await page.waitForSelector(`${chart("reward")}[data-last-x="${step}"]`);
    assert.equal(await page.locator("[data-testid=events] tbody tr").count(), events);
    const log = await page.innerText("[data-testid=log-tail]");
    for (const s of [1, SEED.steps, step]) {
      assert.equal(log.split("\n").filter((l) => l.startsWith(`step ${s} reward`)).length, 1, `log line of step ${s}`);
    }
    await page.screenshot({ path: join(SHOTS, "ui-job-page-live.png") });
  });

  test("an artifact downloads with the token and matches the server's sha256", async () => {
    const [download] = await Promise.all([
      page.waitForEvent("download"),
      page.click("[data-testid=artifacts] tr[data-artifact-kind=drafter] button"),
    ]);
    assert.equal(download.suggestedFilename(), `${SEED.artifact.name}.tar`);
    const bytes = readFileSync(await download.path());
    assert.equal(bytes.length, SEED.artifact.size);
    assert.equal(createHash("sha256").update(bytes).digest("hex"), SEED.artifact.sha256);
    await page.waitForSelector("[data-testid=download-status]:has-text('sha256 verified')");
  });

  test("cancel moves a running job to cancelling; retry requeues a failed one", async () => {
    page.once("dialog", (d) => void d.accept());
    await page.click("[data-testid=cancel]");
    await page.waitForSelector(".jobhead [data-testid=status]:has-text('cancelling')");
    await page.goto(`${BASE}/#/jobs/${SEED.failed_job_id}`);
    await page.waitForSelector("[data-testid=reason]:has-text('oom in step 3')");
    await page.click("[data-testid=retry]");
    await page.waitForSelector(".jobhead [data-testid=status]:has-text('queued')");
  });

  test("the new-job form shows the API's 422 next to the field, then the submitted job appears in the list", async () => {
    await page.goto(`${BASE}/#/jobs/new`);
    const lr = page.locator('input[name="algorithm.learning_rate"]');
    await lr.waitFor();
    await page.fill('input[name="name"]', "ui-form-job");
    await lr.fill("5");
    await page.fill('input[name="algorithm.num_generations"]', "1");
    await page.click("button[type=submit]");
    const lrErr = page.locator('[data-error-for="algorithm.learning_rate"]');
    await page.waitForSelector('[data-error-for="algorithm.learning_rate"]:not(:empty)');
    assert.match(await lrErr.innerText(), /less than or equal to 1/);
    assert.match(await page.innerText('[data-error-for="algorithm.num_generations"]'), /greater than or equal to 2/);
    await page.screenshot({ path: join(SHOTS, "ui-new-job-422.png"), fullPage: true });
    await lr.fill("0.00001");
    await page.fill('input[name="algorithm.num_generations"]', "4");
    await page.click("button[type=submit]");
    await page.waitForURL(/#\/jobs\?new=\d+$/);
    const id = page.url().match(/new=(\d+)/)[1];
    const row = page.locator(`tr[data-job-id="${id}"]`);
    await row.waitFor();
    assert.equal(await row.locator("[data-testid=job-name]").innerText(), "ui-form-job");
    assert.equal(await row.locator("[data-testid=status]").innerText(), "queued");
  });

  test("a CPU job switched by step costs says why SD is off; validation off says how to turn it on; samples wrap", async () => {
    await page.goto(`${BASE}/#/jobs/${SEED.cost_switch_job_id}`);
    const why = page.locator("[data-testid=sd-decision]");
    await page.waitForSelector("[data-testid=sd-decision]:has-text('measured step costs')");
    const text = await why.innerText();
    assert.match(text, /off, SD would slow the rollout/);
    assert.match(text, /5-8 active: off \(SD 0\.62× plain tokens\/s per sequence, an SD step 2\.2× a plain step's time\)/);
    assert.match(await page.innerText(chart("validation")), /Validation is off for this job: set eval_steps .* dataset\.validation_size/);
    // the long unbroken response wraps inside its column: it ends before the reward column starts
    const row = page.locator("[data-testid=samples] tbody tr").first();
    await row.waitFor();
    const [resp, reward] = await Promise.all([row.locator("td").nth(1).boundingBox(), row.locator("td").nth(2).boundingBox()]);
    const pre = await row.locator("td").nth(1).locator("pre").boundingBox();
    assert.ok(pre.x + pre.width <= reward.x + 0.5 && resp.x + resp.width <= reward.x + 0.5,
      `response column (${pre.x}+${pre.width}) runs into the next (${reward.x})`);
    await page.screenshot({ path: join(SHOTS, "ui-job-cost-switch.png"), fullPage: true });
  });

  test("a 10,000-step job loads downsampled history fast and still draws live points", async () => {
    if (!SEED.big_job_id) return assert.fail("the seed has no 10,000-step job");
    const t0 = Date.now();
    await page.goto(`${BASE}/#/jobs/${SEED.big_job_id}`);
    await page.waitForSelector(`${chart("step-time-total")}[data-last-x="10000"]`, { timeout: 30_000 });
    const loadMs = Date.now() - t0;
    const drawn = Number(await page.getAttribute(chart("step-time-total"), "data-points"));
    assert.ok(drawn <= 1100, `history not downsampled: ${drawn} points`);
    // the page answers while the stream works through its backlog
    let worst = 0;
    for (let i = 0; i < 10; i++) {
      const a = Date.now();
      await page.evaluate(() => new Promise((r) => requestAnimationFrame(() => r(1))));
      worst = Math.max(worst, Date.now() - a);
    }
    writeStep(SEED.big_job_id, 10_001);
    const t1 = Date.now();
    await page.waitForSelector(`${chart("reward")}[data-last-x="10001"]`, { timeout: 30_000 });
    console.log(`10k-step job: first draw ${loadMs} ms (${drawn} points per series), worst frame wait ${worst} ms, ` +
      `live point drawn ${Date.now() - t1} ms after the write`);
    assert.ok(loadMs < 15_000, `10k-step job took ${loadMs} ms to draw`);
    assert.ok(worst < 1000, `page blocked for ${worst} ms`);
    await page.screenshot({ path: join(SHOTS, "ui-job-10k-steps.png") });
    assert.deepEqual(pageErrors, []);
  });
});
