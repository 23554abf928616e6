/**
 * Comparing runs from the Training sidebar: two real tiny `finetune` runs that differ only in
 * learning rate (tests/ui/run_writer.py, the same writer training.spec.ts drives) are ticked in the
 * run list and opened in one panel. Each samples three prompts every 6 steps (samples.jsonl: see
 * run_writer.py for where finetune cannot sample yet), for the Samples section of a run's panel and
 * the last samples side by side. The panel is looked at in the light and the dark theme, and its
 * geometry checked. Also writes docs/images/lab-compare.png and lab-samples.png.
 */
import { ChildProcess, spawn } from 'child_process';
import * as fs from 'fs';
import * as path from 'path';

import { expect, Locator, Page, test } from '@playwright/test';

import { formatValue } from '../src/format';
import { ema } from '../src/compare';
import { shortPath } from '../src/model';
import {
  expectInside,
  hoverChart,
  openLab,
  openRunPanel,
  openSidebar,
  setTheme,
  yTicks
} from './lab';

const uiDir = process.env.NBTRAIN_UI_DIR!;
const repo = path.resolve(__dirname, '..', '..');
const shots = path.join(uiDir, 'screenshots');
const root = path.join(uiDir, 'runs', 'compare');
const RATES = ['1e-2', '1e-3'];
const STEPS = 12;
const SAMPLE_STEPS = 6;

function writer(rate: string, model?: string): ChildProcess {
  const args = [
    path.join(repo, 'tests', 'ui', 'run_writer.py'),
    path.join(root, `lr-${rate}`),
    '--steps',
    String(STEPS),
    '--lr',
    rate,
    '--eval-steps',
    '4',
    '--sample-steps',
    String(SAMPLE_STEPS),
    '--name',
    `lr-${rate}`,
    ...(model ? ['--model', model] : [])
  ];
  return spawn(process.env.PYTHON!, args, {
    env: { ...process.env, NBTRAIN_HOME: path.join(uiDir, 'home') },
    stdio: ['ignore', 'pipe', 'inherit']
  });
}

function firstLine(proc: ChildProcess): Promise<string> {
  return new Promise((resolve, reject) => {
    proc.stdout!.once('data', (chunk: Buffer) =>
      resolve(chunk.toString().trim().split('\n')[0])
    );
    proc.once('exit', code => reject(new Error(`writer exited: ${code}`)));
  });
}

function exited(proc: ChildProcess): Promise<number | null> {
  return new Promise(resolve => {
    if (proc.exitCode !== null) {
      resolve(proc.exitCode);
    } else {
      proc.on('exit', code => resolve(code));
    }
  });
}

function metrics(rate: string): Array<Record<string, number>> {
  return fs
    .readFileSync(path.join(root, `lr-${rate}`, 'metrics.jsonl'), 'utf8')
    .trim()
    .split('\n')
    .map(line => JSON.parse(line));
}

interface ISampleRow {
  step: number;
  index: number;
  prompt: string;
  completion: string;
  reference: string | null;
}

function samples(rate: string): ISampleRow[] {
  return fs
    .readFileSync(path.join(root, `lr-${rate}`, 'samples.jsonl'), 'utf8')
    .trim()
    .split('\n')
    .map(line => JSON.parse(line));
}

function config(rate: string): Record<string, unknown> {
  return JSON.parse(
    fs.readFileSync(path.join(root, `lr-${rate}`, 'sft_config.json'), 'utf8')
  );
}

/** The tooltip's line of run `run` on the loss chart, the pointer at `fx` of the plot's width. */
async function tipLine(
  page: Page,
  panel: Locator,
  run: string,
  fx = 0.6
): Promise<{ step: number; value: string; raw: string | null }> {
  const figure = panel.locator('figure[data-chart="loss"]');
  await hoverChart(page, figure, fx);
  const line = figure.locator(
    `.nbtrain-Chart-tooltip tr[data-series="${run}"]`
  );
  await expect(line).toBeVisible();
  const raw = line.locator('.nbtrain-Chart-tooltipRaw');
  return {
    step: Number(await line.locator('.nbtrain-Chart-tooltipX').textContent()),
    value: (await line.locator('.nbtrain-Chart-tooltipValue').textContent())!,
    raw: (await raw.count()) ? await raw.textContent() : null
  };
}

async function openComparison(page: Page): Promise<Locator> {
  await openLab(page);
  await openSidebar(page);
  const button = page.locator('.nbtrain-CompareButton');
  for (const rate of RATES) {
    const row = page.locator('.nbtrain-Run', {
      has: page.locator('.nbtrain-Item-name', { hasText: `lr-${rate}` })
    });
    await expect(row).toHaveAttribute('data-state', 'done');
    const box = row.locator('input.nbtrain-Run-select');
    if (!(await box.isChecked())) {
      await box.check();
    }
  }
  await expect(button).toHaveText('Compare (2)');
  await expect(button).toBeEnabled();
  await button.click();
  const panel = page.locator('.nbtrain-ComparePanel').filter({ visible: true });
  await expect(panel).toBeVisible();
  await expect(
    panel.locator(
      'figure[data-chart="loss"] .nbtrain-Chart-legend .nbtrain-Chart-key'
    )
  ).toHaveCount(2);
  return panel;
}

test.describe.configure({ mode: 'serial' });

// eslint-disable-next-line no-empty-pattern
test.beforeAll(async ({}, testInfo) => {
  testInfo.setTimeout(300_000);
  fs.rmSync(root, { recursive: true, force: true });
  // the first writer builds the tiny model; the second starts on it once the first has trained a step
  const first = writer(RATES[0]);
  const procs = [first];
  try {
    await firstLine(first);
    const second = writer(RATES[1], path.join(root, 'tiny-model'));
    procs.push(second);
    expect(await Promise.all(procs.map(exited))).toEqual([0, 0]);
  } finally {
    for (const p of procs) {
      if (p.exitCode === null) {
        p.kill();
      }
    }
  }
});

test('two runs, ticked in the sidebar, are drawn over each other with a legend', async ({
  page
}) => {
  const panel = await openComparison(page);
  for (const chart of ['loss', 'eval_loss', 'tokens_per_s', 'learning_rate']) {
    const keys = panel.locator(
      `figure[data-chart="${chart}"] .nbtrain-Chart-legend .nbtrain-Chart-key`
    );
    await expect(keys).toHaveCount(2);
    const texts = await keys.allTextContents();
    expect(texts.map(t => t.split(' ')[0]).sort()).toEqual([
      'lr-1e-2',
      'lr-1e-3'
    ]);
  }
  // every logged step of both runs, and the eval every 4 steps
  await expect(panel.locator('figure[data-chart="loss"]')).toHaveAttribute(
    'data-points',
    String(2 * STEPS)
  );
  await expect(panel.locator('figure[data-chart="eval_loss"]')).toHaveAttribute(
    'data-points',
    String(2 * (STEPS / 4))
  );

  // the table: of the settings, only what differs between the runs, minus where each run wrote
  const a = config(RATES[0]);
  const b = config(RATES[1]);
  const differ = Object.keys(a)
    .filter(k => JSON.stringify(a[k]) !== JSON.stringify(b[k]))
    .sort();
  expect(differ).toEqual(['learning_rate', 'output_dir', 'run_name']);
  const table = panel.locator('.nbtrain-Compare-table');
  await expect(table.locator('th.nbtrain-Compare-field')).toHaveText([
    'learning_rate'
  ]);
  for (const rate of RATES) {
    const row = table.locator('tbody tr', { hasText: `lr-${rate}` });
    await expect(row.locator('td[data-field="learning_rate"]')).toHaveText(
      rate === '1e-2' ? '0.01' : '1e-3'
    );
    const last = metrics(rate)[STEPS - 1];
    await expect(row.locator('td[data-metric="loss"]')).toHaveText(
      formatValue(last.loss)
    );
    await expect(row.locator('td[data-metric="step"]')).toHaveText(
      String(STEPS)
    );
    // the adapter's path shortened, the whole of it on hover
    const adapter = path.join(fs.realpathSync(root), `lr-${rate}`, 'adapter');
    const cell = row.locator('.nbtrain-Compare-adapter');
    await expect(cell).toHaveText(shortPath(adapter, 2));
    await expect(cell).toHaveAttribute('title', adapter);
  }
  // the run, how it ended, then what differs; the adapter last
  await expect(table.locator('thead th')).toHaveText([
    'run',
    'loss',
    'eval loss',
    'tokens/s',
    'steps',
    'learning_rate',
    'adapter'
  ]);

  // hovering shows each run's own step, its smoothed value there, and its raw value
  const tip = panel.locator('figure[data-chart="loss"] .nbtrain-Chart-tooltip');
  await tipLine(page, panel, 'lr-1e-2');
  await expect(tip.locator('.nbtrain-Chart-tooltipHead th')).toHaveText([
    '',
    'step',
    'smoothed',
    'value'
  ]);
  const weight = Number(
    await panel.locator('.nbtrain-Compare-smoothing').inputValue()
  );
  for (const rate of RATES) {
    const losses = metrics(rate).map(r => r.loss);
    const line = await tipLine(page, panel, `lr-${rate}`);
    expect(line.step).toBeGreaterThan(1);
    expect(line.step).toBeLessThan(STEPS);
    expect(line.value).toBe(formatValue(ema(losses, weight)[line.step - 1]));
    expect(line.raw).toBe(formatValue(losses[line.step - 1]));
  }
  // the legend gives where each run ended (raw), and says the lines are smoothed
  const legend = panel.locator(
    'figure[data-chart="loss"] .nbtrain-Chart-legend'
  );
  for (const rate of RATES) {
    await expect(legend.locator(`[data-series="lr-${rate}"]`)).toHaveText(
      `lr-${rate} ${formatValue(metrics(rate)[STEPS - 1].loss)}`
    );
  }
  await expect(
    panel.locator('figure[data-chart="loss"] .nbtrain-Chart-note')
  ).toHaveText(`smoothed ${weight.toFixed(2)}`);
  await page.screenshot({ path: path.join(shots, 'compare-hover.png') });

  // the README screenshot: the sidebar with both runs ticked, and the comparison
  await page.mouse.move(0, 0);
  await panel.locator('.nbtrain-Compare-table').scrollIntoViewIfNeeded();
  const docs = path.join(repo, 'docs', 'images', 'lab-compare.png');
  await page.screenshot({ path: docs });
});

test('smoothing, log scale and time change the drawing; the CSV has both runs', async ({
  page
}) => {
  const panel = await openComparison(page);
  const slider = panel.locator('.nbtrain-Compare-smoothing');
  const losses = metrics(RATES[0]).map(r => r.loss);
  await slider.fill('0');
  await expect(panel.locator('.nbtrain-Compare-smoothingValue')).toHaveText(
    '0.00'
  );
  // no smoothing: the line is the raw curve, and the tooltip has no raw column
  let line = await tipLine(page, panel, 'lr-1e-2');
  expect(line.raw).toBeNull();
  expect(line.value).toBe(formatValue(losses[line.step - 1]));
  await slider.fill('0.9');
  await expect(panel.locator('.nbtrain-Compare-smoothingValue')).toHaveText(
    '0.90'
  );
  line = await tipLine(page, panel, 'lr-1e-2');
  expect(line.value).toBe(formatValue(ema(losses, 0.9)[line.step - 1]));
  expect(line.raw).toBe(formatValue(losses[line.step - 1]));
  // the learning rate is never smoothed, whatever the slider says
  await expect(
    panel.locator('figure[data-chart="learning_rate"] .nbtrain-Chart-note')
  ).toHaveText('never smoothed');
  await slider.fill('0.5');

  await panel.locator('.nbtrain-Compare-log').check();
  const loss = panel.locator('figure[data-chart="loss"]');
  await expect(loss).toHaveAttribute('data-log-y', 'true');
  await expect(loss).toHaveAttribute('data-y-title', 'nats/token (log)');

  // the CSV: both runs, each logged step, raw and smoothed as drawn
  const [download] = await Promise.all([
    page.waitForEvent('download'),
    panel.locator('.nbtrain-Compare-csv').click()
  ]);
  const file = path.join(uiDir, 'compare.csv');
  await download.saveAs(file);
  const lines = fs.readFileSync(file, 'utf8').trim().split('\n');
  // every numeric metric the runs logged, loss first; each with its smoothed value as drawn
  const header = lines[0].split(',');
  expect(header.slice(0, 6)).toEqual([
    'run',
    'step',
    'loss',
    'loss_smoothed',
    'eval_loss',
    'eval_loss_smoothed'
  ]);
  const logged = new Set<string>();
  for (const rate of RATES) {
    for (const row of metrics(rate)) {
      for (const [k, v] of Object.entries(row)) {
        if (k !== 'step' && k !== 'time' && typeof v === 'number') {
          logged.add(k);
        }
      }
    }
  }
  expect(new Set(header.slice(2))).toEqual(
    new Set([...logged].flatMap(k => [k, `${k}_smoothed`]))
  );
  // the learning rate is never smoothed: its smoothed column is its value
  const lrAt = header.indexOf('learning_rate');
  for (const line of lines.slice(1)) {
    const cells = line.split(',');
    expect(cells[lrAt + 1]).toBe(cells[lrAt]);
  }
  for (const rate of RATES) {
    const mine = lines.slice(1).filter(l => l.startsWith(`lr-${rate},`));
    expect(mine.length).toBe(STEPS);
    const rows = metrics(rate);
    const smooth = ema(
      rows.map(r => r.loss),
      0.5
    );
    mine.forEach((line, i) => {
      const cells = line.split(',');
      expect(Number(cells[1])).toBe(rows[i].step);
      expect(Number(cells[2])).toBe(rows[i].loss);
      expect(Number(cells[3])).toBeCloseTo(smooth[i], 12);
    });
  }

  // by time: seconds since each run's first row
  await panel.locator('.nbtrain-Compare-x').selectOption('time');
  await expect(loss).toHaveAttribute('data-x-title', 'seconds');
  await page.screenshot({ path: path.join(shots, 'compare-by-time.png') });
});

test('the comparison reads in both themes: axis titles, round ticks, the table whole under the charts', async ({
  page
}) => {
  const panel = await openComparison(page);
  await panel.locator('.nbtrain-Compare-log').check();
  for (const theme of ['JupyterLab Light', 'JupyterLab Dark'] as const) {
    await setTheme(page, theme);
    const charts = panel.locator('.nbtrain-Board-sections');
    const loss = panel.locator('figure[data-chart="loss"]');
    await expect(loss).toHaveAttribute('data-x-title', 'step');
    await expect(loss).toHaveAttribute('data-y-title', 'nats/token (log)');
    await expect(
      panel.locator('figure[data-chart="tokens_per_s"]')
    ).toHaveAttribute('data-y-title', 'tokens/s (log)');
    // round ticks on the log axis: each label is a value with at most two significant digits
    for (const chart of ['loss', 'tokens_per_s', 'learning_rate']) {
      const labels = await yTicks(
        panel.locator(`figure[data-chart="${chart}"]`)
      );
      expect(labels.length).toBeGreaterThanOrEqual(2);
      for (const label of labels) {
        const value = Number(label.replace(/k$/, 'e3'));
        expect(value, `${chart}: ${label}`).toBe(Number(value.toPrecision(2)));
      }
    }
    // the table is under the charts, and every column of it shows
    const table = panel.locator('.nbtrain-Compare-table');
    await table.scrollIntoViewIfNeeded();
    const chartsBox = (await charts.boundingBox())!;
    const tableBox = (await table.boundingBox())!;
    expect(tableBox.y).toBeGreaterThanOrEqual(chartsBox.y + chartsBox.height);
    await expectInside(table.locator('th, td'), panel);
    await page.screenshot({
      path: path.join(
        shots,
        `compare-${theme.endsWith('Dark') ? 'dark' : 'light'}.png`
      )
    });
  }
  await setTheme(page, 'JupyterLab Light');
});

test("a run's Samples section: each prompt's completion by step, newest first; the runs' last samples side by side", async ({
  page
}) => {
  await openLab(page);
  await openSidebar(page);
  const rows = samples(RATES[0]);
  const steps = [...new Set(rows.map(r => r.step))].sort((a, b) => b - a);
  // step 0, every SAMPLE_STEPS and the last
  expect(steps).toEqual([12, 6, 0]);
  const panel = await openRunPanel(page, `lr-${RATES[0]}`);
  const section = panel.locator('.nbtrain-Samples');
  await expect(section).toBeVisible();
  await expect(section.locator('h3')).toHaveText('Samples');
  const blocks = section.locator('details.nbtrain-Samples-step');
  await expect(blocks).toHaveCount(steps.length);
  for (const [i, step] of steps.entries()) {
    const block = blocks.nth(i);
    await expect(block).toHaveAttribute('data-step', String(step));
    // the newest step is open, older ones folded
    expect(await block.evaluate(d => (d as HTMLDetailsElement).open)).toBe(
      i === 0
    );
  }
  const newest = blocks.first();
  const mine = rows
    .filter(r => r.step === steps[0])
    .sort((a, b) => a.index - b.index);
  await expect(newest.locator('.nbtrain-Sample-completion')).toHaveText(
    mine.map(r => r.completion)
  );
  await expect(newest.locator('.nbtrain-Sample-prompt')).toHaveText(
    mine.map(r => r.prompt)
  );
  await expect(newest.locator('.nbtrain-Sample-reference')).toHaveText(
    mine.filter(r => r.reference !== null).map(r => r.reference!)
  );
  // an older step opens on a click
  await blocks.nth(2).locator('summary').click();
  await expect(
    blocks.nth(2).locator('.nbtrain-Sample-completion').first()
  ).toHaveText(
    rows.find(r => r.step === steps[2] && r.index === 0)!.completion
  );
  // long text wraps inside the panel: nothing runs off to the right
  const long = newest.locator('.nbtrain-Sample-completion').nth(2);
  expect(await long.evaluate(e => e.scrollWidth <= e.clientWidth + 1)).toBe(
    true
  );
  expect(
    await long.evaluate(e => e.getBoundingClientRect().height)
  ).toBeGreaterThan(20);
  await expectInside(section.locator('.nbtrain-Sample > div'), panel);
  await section.scrollIntoViewIfNeeded();
  await page.screenshot({ path: path.join(shots, 'samples-light.png') });
  await page.screenshot({
    path: path.join(repo, 'docs', 'images', 'lab-samples.png')
  });
  await setTheme(page, 'JupyterLab Dark');
  await section.scrollIntoViewIfNeeded();
  await page.screenshot({ path: path.join(shots, 'samples-dark.png') });
  await setTheme(page, 'JupyterLab Light');

  // the comparison: the runs' last samples side by side, a column per run
  const compare = await openComparison(page);
  const side = compare.locator('.nbtrain-Compare-samples');
  await expect(side.locator('h3')).toHaveText('Last samples');
  const table = side.locator('table');
  await expect(table.locator('th.nbtrain-Compare-runHead')).toHaveCount(2);
  const order = await table
    .locator('th.nbtrain-Compare-runHead .nbtrain-Chart-key')
    .allTextContents();
  expect(order.sort()).toEqual(RATES.map(r => `lr-${r}`).sort());
  for (const rate of RATES) {
    const last = samples(rate)
      .filter(r => r.step === STEPS)
      .sort((a, b) => a.index - b.index);
    const id = await compare
      .locator('.nbtrain-Compare-table tbody tr', { hasText: `lr-${rate}` })
      .getAttribute('data-run-id');
    await expect(
      table.locator(`td.nbtrain-Sample-completion[data-run-id="${id}"]`)
    ).toHaveText(last.map(r => r.completion));
  }
  await expectInside(table.locator('th, td'), compare);
  await side.scrollIntoViewIfNeeded();
  await page.screenshot({ path: path.join(shots, 'compare-samples.png') });
});
