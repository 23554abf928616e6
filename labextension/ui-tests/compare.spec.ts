/**
 * Comparing runs from the Training sidebar: two real tiny `finetune` runs that differ only in
 * learning rate (tests/ui/run_writer.py, the same writer training.spec.ts drives) are ticked in the
 * run list and opened in one panel. Also writes docs/images/lab-compare.png for the README.
 */
import { ChildProcess, spawn } from 'child_process';
import * as fs from 'fs';
import * as path from 'path';

import { expect, Locator, Page, test } from '@playwright/test';

import { formatTick } from '../src/charts';
import { ema } from '../src/compare';
import { openLab, openSidebar } from './lab';

const uiDir = process.env.NBTRAIN_UI_DIR!;
const repo = path.resolve(__dirname, '..', '..');
const shots = path.join(uiDir, 'screenshots');
const root = path.join(uiDir, 'runs', 'compare');
const RATES = ['1e-2', '1e-3'];
const STEPS = 12;

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

function config(rate: string): Record<string, unknown> {
  return JSON.parse(
    fs.readFileSync(path.join(root, `lr-${rate}`, 'sft_config.json'), 'utf8')
  );
}

async function lossPath(panel: Locator, run: string): Promise<string> {
  return (await panel
    .locator(
      `figure[data-chart="loss"] path.nbtrain-Chart-line:not(.nbtrain-Chart-faint)[data-series="${run}"]`
    )
    .getAttribute('d'))!;
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
  const panel = page.locator('.nbtrain-ComparePanel');
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
    await expect(row.locator('td').nth(2)).toHaveText(last.loss.toFixed(2));
    await expect(row.locator('.nbtrain-Compare-adapter')).toHaveText(
      path.join(fs.realpathSync(root), `lr-${rate}`, 'adapter')
    );
  }

  // hovering shows each run's smoothed value at the nearest step
  const svg = panel.locator('figure[data-chart="loss"] svg');
  const box = (await svg.boundingBox())!;
  await page.mouse.move(box.x + box.width * 0.6, box.y + box.height / 2);
  const tip = panel.locator('figure[data-chart="loss"] .nbtrain-Chart-tooltip');
  await expect(tip).toBeVisible();
  const head = (await tip.locator('.nbtrain-Chart-tooltipHead').textContent())!;
  const step = Number(head.replace('step ', ''));
  expect(step).toBeGreaterThan(1);
  expect(step).toBeLessThan(STEPS);
  const weight = Number(
    await panel.locator('.nbtrain-Compare-smoothing').inputValue()
  );
  for (const rate of RATES) {
    const losses = metrics(rate).map(r => r.loss);
    const expected = ema(losses, weight)[step - 1];
    await expect(tip.locator(`[data-series="lr-${rate}"]`)).toHaveText(
      `lr-${rate}: ${formatTick(expected, 2)}`
    );
  }
  await page.screenshot({ path: path.join(shots, 'compare-hover.png') });

  // the README screenshot: the sidebar with both runs ticked, and the comparison
  await page.mouse.move(0, 0);
  const docs = path.join(repo, 'docs', 'images', 'lab-compare.png');
  await page.screenshot({ path: docs });
});

test('smoothing, log scale and time change the drawing; the CSV has both runs', async ({
  page
}) => {
  const panel = await openComparison(page);
  const slider = panel.locator('.nbtrain-Compare-smoothing');
  const at = async (): Promise<string> => lossPath(panel, 'lr-1e-2');
  await slider.fill('0');
  await expect(panel.locator('.nbtrain-Compare-smoothingValue')).toHaveText(
    '0.00'
  );
  const raw = await at();
  // no smoothing: no faint underlay, the line is the raw curve
  await expect(
    panel.locator('figure[data-chart="loss"] path.nbtrain-Chart-faint')
  ).toHaveCount(0);
  await slider.fill('0.9');
  await expect(panel.locator('.nbtrain-Compare-smoothingValue')).toHaveText(
    '0.90'
  );
  const smoothed = await at();
  expect(smoothed).not.toBe(raw);
  // the raw curve stays, faint, under the smoothed one
  await expect(
    panel.locator(
      `figure[data-chart="loss"] path.nbtrain-Chart-faint[data-series="lr-1e-2"]`
    )
  ).toHaveAttribute('d', raw);
  await slider.fill('0.5');
  expect(await at()).not.toBe(smoothed);

  await panel.locator('.nbtrain-Compare-log').check();
  await expect(panel.locator('figure[data-chart="loss"]')).toHaveAttribute(
    'data-log-y',
    'true'
  );
  const logged = await at();
  expect(logged).not.toBe(smoothed);

  // the CSV: both runs, each logged step, raw and smoothed as drawn
  const [download] = await Promise.all([
    page.waitForEvent('download'),
    panel.locator('.nbtrain-Compare-csv').click()
  ]);
  const file = path.join(uiDir, 'compare.csv');
  await download.saveAs(file);
  const lines = fs.readFileSync(file, 'utf8').trim().split('\n');
  expect(lines[0]).toBe(
    'run,step,loss,loss_smoothed,eval_loss,eval_loss_smoothed,tokens_per_s,tokens_per_s_smoothed,learning_rate,learning_rate_smoothed'
  );
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
  expect(await at()).not.toBe(logged);
  await page.screenshot({ path: path.join(shots, 'compare-by-time.png') });
});
