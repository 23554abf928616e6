/**
 * Issue 38: every metric charted, uPlot's zoom and the shared crosshair, the compare view of many
 * settings, the sidebar's filter, delete and rows that never wrap; in the light and dark theme.
 * Runs: the fixtures serve_lab.py registers (tests/ui/fixtures.py dpo_run, grpo_run, sweep_runs).
 */
import * as fs from 'fs';
import * as path from 'path';

import { expect, Locator, Page, test } from '@playwright/test';

import {
  closeAllTabs,
  dragChart,
  expectInside,
  expectNoOverlap,
  hoverChart,
  openLab,
  openRunPanel,
  openSidebar,
  setTheme
} from './lab';

const uiDir = process.env.NBTRAIN_UI_DIR!;
const shots = path.join(uiDir, 'screenshots');
const THEMES = ['JupyterLab Light', 'JupyterLab Dark'] as const;

/** WCAG contrast between two CSS colours (rgb()/rgba() as computed). */
function contrastOf(fg: string, bg: string): number {
  const rgb = (c: string) => (c.match(/[\d.]+/g) ?? []).slice(0, 3).map(Number);
  const lum = ([r, g, b]: number[]) => {
    const f = (v: number) => {
      const s = v / 255;
      return s <= 0.03928 ? s / 12.92 : Math.pow((s + 0.055) / 1.055, 2.4);
    };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const [a, b] = [lum(rgb(fg)), lum(rgb(bg))].sort((x, y) => y - x);
  return (a + 0.05) / (b + 0.05);
}

/** The charts of a panel: none clipped by the panel, none overlapping another. */
async function expectChartsLaidOut(panel: Locator): Promise<void> {
  const figures = panel.locator('figure.nbtrain-Chart:visible');
  await expectInside(figures, panel);
  await expectNoOverlap(figures);
  // legends keep one line: every caption is as tall as the first
  const heights = await panel
    .locator('figure.nbtrain-Chart:visible figcaption')
    .evaluateAll(els =>
      els.map(e => Math.round(e.getBoundingClientRect().height))
    );
  expect(new Set(heights).size).toBe(1);
}

async function themeName(page: Page): Promise<string> {
  const light = await page.locator('body').getAttribute('data-jp-theme-light');
  return light === 'false' ? 'dark' : 'light';
}

/**
 * How many pixels of a chart's canvas are `colour` (a computed rgb(), within 6 per channel), and
 * how many are the colour of every other palette entry (the same test), as `{ colour: n }`.
 */
async function canvasColours(
  figure: Locator,
  colours: string[]
): Promise<number[]> {
  return figure.locator('canvas').evaluate((c, wanted) => {
    const canvas = c as HTMLCanvasElement;
    const rgb = (s: string) =>
      (s.match(/[\d.]+/g) ?? []).slice(0, 3).map(Number);
    const targets = wanted.map(rgb);
    const data = canvas
      .getContext('2d')!
      .getImageData(0, 0, canvas.width, canvas.height).data;
    const counts = targets.map(() => 0);
    for (let i = 0; i < data.length; i += 4) {
      if (data[i + 3] < 250) {
        continue;
      }
      targets.forEach(([r, g, b], t) => {
        if (
          Math.abs(data[i] - r) <= 6 &&
          Math.abs(data[i + 1] - g) <= 6 &&
          Math.abs(data[i + 2] - b) <= 6
        ) {
          counts[t] += 1;
        }
      });
    }
    return counts;
  }, colours);
}

test.describe.configure({ mode: 'serial' });

test('a DPO and a GRPO run chart their rewards first, every metric grouped by prefix, in both themes', async ({
  page
}) => {
  await openLab(page);
  await openSidebar(page);
  for (const theme of THEMES) {
    await setTheme(page, theme);
    const dpo = await openRunPanel(page, 'dpo-prefs');
    // the kind's most watched first: loss (eval loss over it), reward margin, reward accuracy
    const overview = dpo.locator(
      'details[data-group="overview"] figure.nbtrain-Chart'
    );
    await expect(overview).toHaveCount(3);
    expect(
      await overview.evaluateAll(els =>
        els.map(e => (e as HTMLElement).dataset.chart)
      )
    ).toEqual(['loss', 'rewards/margins', 'rewards/accuracies']);
    await expect(overview.first()).toHaveAttribute(
      'data-series',
      'loss|eval loss'
    );
    // the run's loss line is drawn in its sidebar dot's colour (its colour in compare too), the
    // eval loss over it in another; the canvas is read back, in this theme's palette
    const dpoRow = page.locator('.nbtrain-Run', {
      has: page.locator('.nbtrain-Item-name', { hasText: /^dpo-prefs$/ })
    });
    const dot = await dpoRow
      .locator('.nbtrain-Dot')
      .evaluate(e => getComputedStyle(e).backgroundColor);
    const lossKey = overview
      .first()
      .locator('.nbtrain-Chart-key[data-series="loss"]');
    const evalKey = overview
      .first()
      .locator('.nbtrain-Chart-key[data-series="eval loss"]');
    await expect(lossKey).toHaveCSS('color', dot);
    const evalColour = await evalKey.evaluate(e => getComputedStyle(e).color);
    expect(evalColour).not.toBe(dot);
    await expect(async () => {
      const [ofDot, ofEval] = await canvasColours(overview.first(), [
        dot,
        evalColour
      ]);
      // a line 1.75 px wide across the plot: hundreds of pixels of its colour
      expect(ofDot, `pixels of the dot's colour ${dot}`).toBeGreaterThan(150);
      expect(ofEval, `pixels of eval loss's ${evalColour}`).toBeGreaterThan(0);
    }).toPass({ timeout: 10_000 });
    // no nats/token on a DPO loss
    await expect(overview.first()).toHaveAttribute('data-y-title', 'loss');
    await expect(
      dpo.locator('figure[data-chart="rewards/margins"]')
    ).toHaveAttribute('data-points', '80');
    // every metric it logged: rewards/*, logps/*, eval_*, grad norm, timings
    for (const key of [
      'rewards/chosen',
      'rewards/rejected',
      'logps/chosen',
      'eval_rewards/margins',
      'grad_norm',
      'step_time'
    ]) {
      await expect(dpo.locator(`figure[data-chart="${key}"]`)).toBeVisible();
    }
    await expect(
      dpo.locator('figure[data-chart="logps/chosen"]')
    ).toHaveAttribute('data-y-title', 'nats');
    await expectChartsLaidOut(dpo);
    await dpo.screenshot({
      path: path.join(shots, `dpo-panel-${await themeName(page)}.png`)
    });

    const grpo = await openRunPanel(page, 'grpo-math');
    const first = grpo.locator(
      'details[data-group="overview"] figure.nbtrain-Chart'
    );
    await expect(first).toHaveCount(6);
    expect(
      await first.evaluateAll(els =>
        els.map(e => (e as HTMLElement).dataset.chart)
      )
    ).toEqual([
      // in the order the run logs its reward functions
      'rewards/format/mean',
      'rewards/exact/mean',
      'reward',
      'completions/mean_length',
      'kl',
      'loss'
    ]);
    await expect(
      grpo.locator('figure[data-chart="completions/mean_length"]')
    ).toHaveAttribute('data-y-title', 'tokens');
    await expect(
      grpo.locator('details[data-group="clip_ratio"]')
    ).toBeVisible();
    // the legend's colour reads on the theme's background (>= 4.5:1)
    const key = grpo
      .locator('figure[data-chart="kl"] .nbtrain-Chart-key')
      .first();
    const [fg, bg] = await key.evaluate(e => [
      getComputedStyle(e).color,
      getComputedStyle(document.querySelector('.nbtrain-RunPanel')!)
        .backgroundColor
    ]);
    expect(contrastOf(fg, bg)).toBeGreaterThanOrEqual(4.5);
    await expectChartsLaidOut(grpo);
    await grpo.screenshot({
      path: path.join(shots, `grpo-panel-${await themeName(page)}.png`)
    });
  }
  await setTheme(page, 'JupyterLab Light');
});

test('drag zooms every chart of a view to one x range, double-click resets; one crosshair, one tooltip', async ({
  page
}) => {
  await openLab(page);
  await openSidebar(page);
  const panel = await openRunPanel(page, 'finished-sft');
  const loss = panel.locator('figure[data-chart="loss"]');
  const lr = panel.locator('figure[data-chart="learning_rate"]');
  await expect(loss).toHaveAttribute('data-zoomed', 'false');
  const whole = await loss.getAttribute('data-x-range');
  expect(whole).toBe('1.00..200');
  await dragChart(page, loss, 0.25, 0.5);
  await expect(loss).toHaveAttribute('data-zoomed', 'true');
  const zoomed = (await loss.getAttribute('data-x-range'))!;
  expect(zoomed).not.toBe(whole);
  const [a, b] = zoomed.split('..').map(Number);
  expect(a).toBeGreaterThan(30);
  expect(b).toBeLessThan(120);
  // every chart of the panel follows
  for (const figure of await panel
    .locator('.nbtrain-Board figure.nbtrain-Chart')
    .all()) {
    await expect(figure).toHaveAttribute('data-x-range', zoomed);
  }

  // the tooltip: on the chart under the pointer only; the crosshair on every chart
  await hoverChart(page, loss, 0.5);
  await expect(loss.locator('.nbtrain-Chart-tooltip')).toBeVisible();
  await expect(lr.locator('.nbtrain-Chart-tooltip')).toBeHidden();
  const cursors = await panel
    .locator('.nbtrain-Board figure.nbtrain-Chart .u-cursor-x')
    .evaluateAll(els =>
      els.map(e => ({
        off: e.classList.contains('u-off'),
        x: Math.round(e.getBoundingClientRect().left)
      }))
    );
  expect(cursors.length).toBeGreaterThan(3);
  expect(cursors.every(c => !c.off)).toBe(true);
  // charts in one grid column share a crosshair x
  const lossX = await loss
    .locator('.u-cursor-x')
    .evaluate(e => Math.round(e.getBoundingClientRect().left));
  expect(
    cursors.filter(c => Math.abs(c.x - lossX) <= 2).length
  ).toBeGreaterThan(1);
  // the tooltip names each series' own step: eval loss is logged every 25 steps
  const evalStep = Number(
    await loss
      .locator('tr[data-series="eval loss"] .nbtrain-Chart-tooltipX')
      .textContent()
  );
  expect(evalStep % 25).toBe(0);
  await page.screenshot({ path: path.join(shots, 'zoom-crosshair.png') });
  await loss.locator('.u-over').dblclick();
  await expect(loss).toHaveAttribute('data-zoomed', 'false');
  await expect(lr).toHaveAttribute('data-x-range', whole!);

  // the panel's own log y and smoothing, as compare's
  await panel.locator('.nbtrain-Compare-log').check();
  await expect(loss).toHaveAttribute('data-log-y', 'true');
  await panel.locator('.nbtrain-Compare-log').uncheck();
  await expect(lr.locator('.nbtrain-Chart-note')).toHaveText('never smoothed');

  // PNG export of one chart
  const [download] = await Promise.all([
    page.waitForEvent('download'),
    loss.locator('.nbtrain-Chart-png').click()
  ]);
  const file = path.join(uiDir, 'loss.png');
  await download.saveAs(file);
  const bytes = fs.readFileSync(file);
  expect(bytes.subarray(1, 4).toString()).toBe('PNG');
  expect(bytes.length).toBeGreaterThan(2000);
});

test('a view of 3 runs keeps the run column while the table scrolls sideways; one colour per run everywhere', async ({
  page
}) => {
  await openLab(page);
  await openSidebar(page);
  const names = ['sweep-lr-0.0001', 'sweep-lr-0.0003', 'sweep-lr-0.001'];
  for (const name of names) {
    const row = page.locator('.nbtrain-Run', {
      has: page.locator('.nbtrain-Item-name', {
        hasText: new RegExp(`^${name}$`)
      })
    });
    await row.locator('input.nbtrain-Run-select').check();
  }
  await page.locator('.nbtrain-CompareButton').click();
  const panel = page.locator('.nbtrain-ComparePanel').filter({ visible: true });
  await expect(panel.locator('figure[data-chart="loss"]')).toHaveAttribute(
    'data-series',
    /sweep/
  );
  for (const theme of THEMES) {
    await setTheme(page, theme);
    const scroller = panel.locator('.nbtrain-Compare-scroll');
    await scroller.scrollIntoViewIfNeeded();
    const wide = await scroller.evaluate(e => e.scrollWidth - e.clientWidth);
    expect(wide, 'the table is wider than the panel').toBeGreaterThan(50);
    await scroller.evaluate(e => (e.scrollLeft = e.scrollWidth));
    const box = (await scroller.boundingBox())!;
    for (const cell of await panel.locator('td.nbtrain-Compare-run').all()) {
      const r = (await cell.boundingBox())!;
      expect(Math.abs(r.x - box.x)).toBeLessThanOrEqual(1);
      expect(await cell.textContent()).toMatch(/^sweep-lr-/);
    }
    // long lists folded; long paths shortened, the whole on hover
    await expect(
      panel.locator('td[data-field="layers_to_transform"] details.nbtrain-Fold')
    ).toHaveCount(3);
    const pathCell = panel
      .locator('td[data-field="data_path"] .nbtrain-Path')
      .first();
    await expect(pathCell).toHaveText(/^…\//);
    await expect(pathCell).toHaveAttribute(
      'title',
      /^\/home\/someone\/datasets\//
    );
    // final metrics come before the settings
    const heads = await panel
      .locator('.nbtrain-Compare-table thead th')
      .allTextContents();
    expect(heads.indexOf('loss')).toBeLessThan(heads.indexOf('learning_rate'));
    await page.screenshot({
      path: path.join(shots, `compare-3-runs-${await themeName(page)}.png`)
    });
    await scroller.evaluate(e => (e.scrollLeft = 0));
  }
  // a run's colour: its sidebar dot, its legend key and its table key are one colour
  for (const name of names) {
    const row = page.locator('.nbtrain-Run', {
      has: page.locator('.nbtrain-Item-name', {
        hasText: new RegExp(`^${name}$`)
      })
    });
    const dot = await row
      .locator('.nbtrain-Dot')
      .evaluate(e => getComputedStyle(e).backgroundColor);
    const key = await panel
      .locator(
        `figure[data-chart="loss"] .nbtrain-Chart-key[data-series="${name}"]`
      )
      .evaluate(e => getComputedStyle(e).color);
    expect(key).toBe(dot);
  }
  await setTheme(page, 'JupyterLab Light');
  await expectChartsLaidOut(panel);
  await closeAllTabs(page);
});

test('sidebar: rows never wrap, the filter box, the config section, delete asks first and keeps the folder', async ({
  page
}) => {
  await openLab(page);
  await openSidebar(page);
  const sidebar = page.locator('.nbtrain-Sidebar');
  for (const theme of THEMES) {
    await setTheme(page, theme);
    const rows = sidebar.locator('.nbtrain-Run');
    expect(await rows.count()).toBeGreaterThanOrEqual(8);
    // every line of every row is one line, inside the sidebar
    const lines = await rows
      .locator('.nbtrain-Item-name, .nbtrain-Run-text, .nbtrain-State')
      .evaluateAll(els => els.map(e => e.getClientRects().length));
    expect(lines.every(n => n === 1)).toBe(true);
    // every visible part of every row inside the sidebar (read at once: the rows redraw at polls)
    const outside = await sidebar.evaluate(bar => {
      const box = bar.getBoundingClientRect();
      return [
        ...bar.querySelectorAll(
          '.nbtrain-Run .nbtrain-Item-head > *, .nbtrain-Run .nbtrain-Run-progress > *'
        )
      ]
        .filter(e => getComputedStyle(e).visibility === 'visible')
        .filter(e => {
          const r = e.getBoundingClientRect();
          return r.left < box.left - 0.5 || r.right > box.right + 0.5;
        })
        .map(e => e.outerHTML.slice(0, 80));
    });
    expect(outside).toEqual([]);
    // runs and the scaling report: their names start at one x
    const xs = await rows
      .locator('.nbtrain-Item-name')
      .evaluateAll(els =>
        els.map(e => Math.round(e.getBoundingClientRect().left))
      );
    expect(new Set(xs).size).toBe(1);
    // finished runs have no progress bar
    await expect(
      sidebar.locator('.nbtrain-Run[data-state="done"] .nbtrain-Run-bar')
    ).toHaveCount(0);
    // the cluster row names the notebook, not its path
    await expect(sidebar.locator('.nbtrain-Cluster')).toContainText(
      'from ui-test.ipynb'
    );
    // the disabled Compare button reads as disabled on either background
    const button = sidebar.locator('.nbtrain-CompareButton');
    await expect(button).toBeDisabled();
    const [fg, bg] = await button.evaluate(e => [
      getComputedStyle(e).color,
      getComputedStyle(e).backgroundColor
    ]);
    expect(contrastOf(fg, bg)).toBeGreaterThanOrEqual(2);
    await sidebar.screenshot({
      path: path.join(shots, `sidebar-${await themeName(page)}.png`)
    });
  }
  await setTheme(page, 'JupyterLab Light');

  const filter = sidebar.locator('.nbtrain-RunFilter');
  await filter.fill('grpo');
  await expect(sidebar.locator('.nbtrain-Run')).toHaveCount(1);
  await expect(sidebar.locator('.nbtrain-Run .nbtrain-Item-name')).toHaveText(
    'grpo-math'
  );

  // the run panel's config section: kind, cluster, settings
  const grpo = await openRunPanel(page, 'grpo-math');
  const config = grpo.locator('.nbtrain-Config');
  await expect(config.locator('tr[data-setting="kind"] td')).toHaveText('grpo');
  await expect(
    config.locator('tr[data-setting="num_generations"] td')
  ).toHaveText('4');

  // delete: asks first; cancelled, the run stays; confirmed, its record goes and its folder stays
  const row = sidebar.locator('.nbtrain-Run', { hasText: 'grpo-math' });
  const dialog = page.locator('.jp-Dialog');
  await row.hover();
  await row.locator('.nbtrain-DeleteButton').click();
  await expect(dialog).toContainText('Delete run grpo-math from the list?');
  await dialog.getByRole('button', { name: 'Cancel' }).click();
  await expect(row).toHaveCount(1);
  await row.hover();
  await row.locator('.nbtrain-DeleteButton').click();
  await dialog.getByRole('button', { name: 'Delete record' }).click();
  await expect(row).toHaveCount(0);
  expect(
    fs.existsSync(path.join(uiDir, 'runs', 'grpo-math', 'metrics.jsonl'))
  ).toBe(true);
  await filter.fill('');
  // the next specs start from an empty layout (their screenshots go to the README)
  await closeAllTabs(page);
});
