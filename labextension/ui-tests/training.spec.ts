import { ChildProcess, spawn } from 'child_process';
import * as fs from 'fs';
import * as path from 'path';

import { expect, test } from '@playwright/test';

import {
  expectInside,
  openLab,
  openRunPanel,
  openSidebar,
  setTheme
} from './lab';

const uiDir = process.env.NBTRAIN_UI_DIR!;
const repo = path.resolve(__dirname, '..', '..');
const shots = path.join(uiDir, 'screenshots');

/** The contrast ratio (WCAG) of an element's text colour against its background colour. */
function contrast(e: Element): number {
  const rgb = (c: string) => (c.match(/[\d.]+/g) ?? []).slice(0, 3).map(Number);
  const lum = ([r, g, b]: number[]) => {
    const f = (v: number) => {
      const s = v / 255;
      return s <= 0.03928 ? s / 12.92 : Math.pow((s + 0.055) / 1.055, 2.4);
    };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const style = getComputedStyle(e);
  // the text colour is drawn over the background: blend its alpha in
  const fg = rgb(style.color);
  const alpha = Number((style.color.match(/[\d.]+/g) ?? [])[3] ?? 1);
  const bg = rgb(style.backgroundColor);
  const seen = fg.map((v, i) => v * alpha + bg[i] * (1 - alpha));
  const [a, b] = [lum(seen), lum(bg)].sort((x, y) => y - x);
  return (a + 0.05) / (b + 0.05);
}

function stepOf(text: string | null): number {
  return Number((text ?? '').split('/')[0]);
}

test.describe.configure({ mode: 'serial' });

test('Lab opens and the sidebar lists the finished fixture run and the cluster', async ({
  page
}) => {
  await openLab(page);
  await openSidebar(page);
  const run = page.locator('.nbtrain-Run', { hasText: 'finished-sft' });
  await expect(run).toHaveAttribute('data-state', 'done');
  await expect(run.locator('.nbtrain-Run-progress')).toContainText(
    'step 200/200 · loss 0.958'
  );
  // the one-engine ipyparallel cluster serve_lab.py started, with its side file
  const cluster = page.locator('.nbtrain-Cluster[data-cluster-id="ui-test"]');
  await expect(cluster).toContainText('1 node · 1 rank · 0 GPUs · gloo');
  await expect(cluster).toContainText('from ui-test.ipynb');
  // a finished run has nothing running: no status bar item
  await expect(page.locator('.nbtrain-Status')).toBeHidden();
});

test("a finished run's panel draws its charts", async ({ page }) => {
  await openLab(page);
  await openSidebar(page);
  // by its run id: panels an earlier spec left open are restored with the layout
  const panel = await openRunPanel(page, 'finished-sft');
  await expect(panel).toHaveAttribute('data-state', 'done');
  // 200 loss points and 8 eval-loss points (every 25 steps) from the fixture's metrics.jsonl
  const loss = panel.locator('figure[data-chart="loss"]');
  await expect(loss).toHaveAttribute('data-points', '208');
  await expect(loss).toHaveAttribute('data-series', 'loss|eval loss');
  await expect(loss).toContainText('eval loss 1.04');
  await expect(
    panel.locator('figure[data-chart="tokens_per_s"]')
  ).toHaveAttribute('data-points', '200');
  await expect(
    panel.locator('figure[data-chart="learning_rate"]')
  ).toHaveAttribute('data-points', '200');
  // every numeric metric it logged has a chart: grad norm, step time and epoch too
  for (const key of ['grad_norm', 'step_time', 'epoch']) {
    await expect(panel.locator(`figure[data-chart="${key}"]`)).toBeVisible();
  }
  await panel.screenshot({ path: path.join(shots, 'finished-run-panel.png') });
});

test('a run being written advances its step, and stop ends it', async ({
  page
}) => {
  // a real run on a shared 2-core machine: its steps set the pace, not the browser
  test.setTimeout(180_000);
  const out = path.join(uiDir, 'runs', 'live-sft');
  fs.rmSync(out, { recursive: true, force: true });
  const writer: ChildProcess = spawn(
    process.env.PYTHON!,
    [path.join(repo, 'tests', 'ui', 'run_writer.py'), out, '--steps', '100000'],
    {
      env: { ...process.env, NBTRAIN_HOME: path.join(uiDir, 'home') },
      stdio: ['ignore', 'pipe', 'inherit']
    }
  );
  const exited = new Promise<number | null>(resolve =>
    writer.on('exit', code => resolve(code))
  );
  // the writer prints the run id it registered on its first line
  const runId = await new Promise<string>((resolve, reject) => {
    writer.stdout!.once('data', (chunk: Buffer) =>
      resolve(chunk.toString().trim().split('\n')[0])
    );
    writer.once('exit', code => reject(new Error(`writer exited: ${code}`)));
  });
  try {
    await openLab(page);
    await openSidebar(page);
    const row = page.locator('.nbtrain-Run', { hasText: 'live-sft' });
    await expect(row).toHaveAttribute('data-state', 'running');

    // the status bar follows the newest running run
    const status = page.locator('.nbtrain-Status');
    await expect(status).toHaveText(
      /^live-sft · step \d+\/100000 · loss [\d.]+ · [\d.]+[kM]? tok\/s$/
    );

    await row.locator('.nbtrain-Item-name').click();
    const panel = page.locator(`.nbtrain-RunPanel[data-run-id="${runId}"]`);
    await expect(panel).toHaveAttribute('data-state', 'running');
    await expect(panel).toBeVisible();
    const step = panel.locator('.nbtrain-RunPanel-step');
    await expect(step).toHaveText(/^\d+\/100000$/);
    const first = stepOf(await step.textContent());
    // the panel polls every second: the step moves on as the run trains (a step took 17 s once,
    // on the 2-core machine at load 12, so the wait is for the run, not the panel)
    await expect
      .poll(async () => stepOf(await step.textContent()), { timeout: 60_000 })
      .toBeGreaterThan(first + 2);
    const points = Number(
      await panel
        .locator('figure[data-chart="tokens_per_s"]')
        .getAttribute('data-points')
    );
    expect(points).toBeGreaterThan(first);

    // the README screenshot: sidebar with both runs, the live panel, the status bar
    await openRunPanel(page, 'finished-sft');
    await page.locator('.lm-TabBar-tab', { hasText: 'Run: live-sft' }).click();
    await expect(panel).toBeVisible();
    await page.waitForTimeout(1500);
    const docs = path.join(repo, 'docs', 'images', 'lab-sidebar.png');
    fs.mkdirSync(path.dirname(docs), { recursive: true });
    await page.screenshot({ path: docs });
    await page.screenshot({ path: path.join(shots, 'live-run.png') });

    // the look of a running run, in both themes
    for (const theme of ['JupyterLab Light', 'JupyterLab Dark'] as const) {
      await setTheme(page, theme);
      const dark = theme.endsWith('Dark');
      // (the sidebar redraws its rows at each poll: each check reads the row drawn last, again
      // until it holds)
      // the "running" pill reads: its text stands out from its background (WCAG AA, 4.5:1)
      for (const pill of [
        row.locator('.nbtrain-State'),
        panel.locator('.nbtrain-RunPanel-titleLine .nbtrain-State')
      ]) {
        await expect(pill).toHaveText('running');
        await expect
          .poll(() => pill.evaluate(contrast))
          .toBeGreaterThanOrEqual(4.5);
      }
      // Stop looks like a button: filled, not faded as a disabled one is
      const stopItem = row.locator('.nbtrain-StopButton');
      await expect(stopItem).toBeEnabled();
      await expect(stopItem).toHaveCSS('opacity', '1');
      await expect(stopItem).toHaveCSS('cursor', 'pointer');
      await expect(stopItem).not.toHaveCSS(
        'background-color',
        'rgba(0, 0, 0, 0)'
      );
      // the row's lines never wrap, and the name is not cut by the pill and Stop
      await expect
        .poll(() =>
          row
            .locator('.nbtrain-Item-name, .nbtrain-Run-text')
            .evaluateAll(parts => parts.map(e => e.getClientRects().length))
        )
        .toEqual([1, 1]);
      await expect
        .poll(() =>
          row
            .locator('.nbtrain-Item-name')
            .evaluate(e => e.scrollWidth <= e.clientWidth)
        )
        .toBe(true);
      // the status bar item's text sits level with Lab's own items' text, and names its run
      const bar = page.locator('#jp-main-statusbar');
      const textMiddle = (e: Element) => {
        const range = document.createRange();
        range.selectNodeContents(e);
        const r = range.getBoundingClientRect();
        return r.top + r.height / 2;
      };
      const mine = await status.evaluate(textMiddle);
      const theirs = await bar
        .locator('.jp-StatusBar-TextItem')
        .first()
        .evaluate(textMiddle);
      expect(Math.abs(mine - theirs)).toBeLessThanOrEqual(1);
      await expectInside(status, bar);
      // the panel's header: the run's name, when it started, how long, and its folder
      await expect(panel.locator('.nbtrain-RunPanel-name')).toHaveText(
        'live-sft'
      );
      await expect(panel.locator('.nbtrain-RunPanel-started')).toHaveText(
        /^started \d\d:\d\d$/
      );
      await expect(panel.locator('.nbtrain-RunPanel-duration')).toHaveText(
        /^running for \d+(s|m \d\ds)$/
      );
      await expect(panel.locator('.nbtrain-RunPanel-folder')).toHaveAttribute(
        'title',
        fs.realpathSync(out)
      );
      await page.screenshot({
        path: path.join(shots, `live-run-${dark ? 'dark' : 'light'}.png`)
      });
    }
    await setTheme(page, 'JupyterLab Light');
    // a cut name reads whole on hover
    await expect(row.locator('.nbtrain-Item-name')).toHaveAttribute(
      'title',
      'live-sft'
    );

    // Stop asks first: cancelled, the run goes on; confirmed, it stops
    const dialog = page.locator('.jp-Dialog');
    await panel.getByRole('button', { name: 'Stop run' }).click();
    await expect(dialog).toContainText('Stop run live-sft?');
    // the hint SFTConfig takes (resume=True is refused)
    await expect(dialog).toContainText("resume it with resume='latest'");
    await dialog.getByRole('button', { name: 'Cancel' }).click();
    await expect(dialog).toHaveCount(0);
    await page.waitForTimeout(1500);
    await expect(panel).toHaveAttribute('data-state', 'running');
    await expect(panel.getByRole('button', { name: 'Stop run' })).toBeEnabled();
    await panel.getByRole('button', { name: 'Stop run' }).click();
    await dialog.getByRole('button', { name: 'Stop run' }).click();
    await expect(panel).toHaveAttribute('data-state', 'stopped', {
      timeout: 15_000
    });
    await expect(row).toHaveAttribute('data-state', 'stopped');
    await expect(status).toBeHidden();
    expect(await exited).toBe(0);
    // finetune checkpointed at the step boundary where it saw the stop flag, and exported the adapter
    expect(fs.readdirSync(out).some(f => f.startsWith('checkpoint-'))).toBe(
      true
    );
    expect(
      fs.existsSync(path.join(out, 'adapter', 'adapter_config.json'))
    ).toBe(true);
    const final = stepOf(await step.textContent());
    await page.waitForTimeout(2500);
    expect(stepOf(await step.textContent())).toBe(final);
    await page.screenshot({ path: path.join(shots, 'stopped-run.png') });
  } finally {
    if (writer.exitCode === null) {
      writer.kill();
    }
  }
});

test('the palette has the open, stop and refresh commands', async ({
  page
}) => {
  await openLab(page);
  const search = page.locator('.lm-CommandPalette-input:visible');
  const items = page.locator('.lm-CommandPalette-item:visible');
  // the palette is modal and closes when focus moves (Lab may still be restoring its layout on a
  // loaded machine): open it again until it stays open long enough to use
  const openPalette = async (): Promise<void> => {
    if (await search.isVisible()) {
      return;
    }
    await page.locator('.lm-MenuBar-itemLabel', { hasText: 'View' }).click();
    await page
      .locator('.lm-Menu-itemLabel', { hasText: 'Activate Command Palette' })
      .click();
    await expect(search).toBeVisible({ timeout: 5_000 });
  };
  await expect(async () => {
    await openPalette();
    await search.fill('Training');
    await expect(items.filter({ hasText: 'Open Training Run…' })).toHaveCount(
      1,
      { timeout: 5_000 }
    );
    await expect(items.filter({ hasText: 'Stop Training Run…' })).toHaveCount(
      1,
      { timeout: 5_000 }
    );
    await expect(
      items.filter({ hasText: 'Refresh Training Runs and Clusters' })
    ).toHaveCount(1, { timeout: 5_000 });
  }).toPass({ timeout: 60_000 });
  // open a run through the palette's dialog
  const dialog = page.locator('.jp-Dialog');
  await expect(async () => {
    await openPalette();
    await search.fill('Open Training Run');
    await items
      .filter({ hasText: 'Open Training Run…' })
      .click({ timeout: 5_000 });
    await expect(dialog).toBeVisible({ timeout: 5_000 });
  }).toPass({ timeout: 60_000 });
  const select = dialog.locator('select');
  const label = (await select.locator('option').nth(1).textContent())!;
  await select.selectOption({ index: 1 });
  const id = /\[(\w+)\]$/.exec(label)![1];
  await dialog.getByRole('button', { name: /ok|select/i }).click();
  await expect(
    page.locator(`.nbtrain-RunPanel[data-run-id="${id}"]`)
  ).toBeVisible();
});
