/**
 * The run panel's GPU charts and scaling report, on the fixtures serve_lab.py registers
 * (tests/ui/fixtures.py): a two-rank run whose metrics rows carry GPU memory and MFU (written by
 * hand: no GPU here), and a scaling report built by nbtrain's scaling model from a 4-node test-bed
 * measurement, linked to the finished fixture run.
 */
import * as path from 'path';

import { expect, test } from '@playwright/test';

import { openLab, openRunPanel, openSidebar } from './lab';

const shots = path.join(process.env.NBTRAIN_UI_DIR!, 'screenshots');

test.describe.configure({ mode: 'serial' });

test('a GPU run shows peak memory per rank and MFU; a CPU run does not', async ({
  page
}) => {
  await openLab(page);
  await openSidebar(page);
  const panel = await openRunPanel(page, 'gpu-sft');
  const memory = panel.locator('figure[data-chart="peak_memory_gb"]');
  await expect(memory).toBeVisible();
  // 60 rows, one line per rank, each at its last value
  await expect(memory).toHaveAttribute('data-points', '120');
  await expect(memory).toHaveAttribute('data-series', 'rank 0|rank 1');
  await expect(memory.locator('.nbtrain-Chart-key')).toHaveText([
    'rank 0 14.0',
    'rank 1 13.4'
  ]);
  const mfu = panel.locator('figure[data-chart="mfu"]');
  await expect(mfu).toBeVisible();
  await expect(mfu).toHaveAttribute('data-points', '60');
  await expect(mfu.locator('.nbtrain-Chart-key')).toHaveText('MFU 40.0');
  await panel.screenshot({ path: path.join(shots, 'gpu-run-panel.png') });

  const cpu = await openRunPanel(page, 'finished-sft');
  await expect(cpu.locator('figure[data-chart="loss"]')).toHaveAttribute(
    'data-points',
    '208'
  );
  // a chart per metric logged: a CPU run logs no memory or MFU, so it has none of them
  await expect(cpu.locator('figure[data-chart="peak_memory_gb"]')).toHaveCount(
    0
  );
  await expect(cpu.locator('figure[data-chart="mfu"]')).toHaveCount(0);
});

test("the scaling report shows in its own panel and in the measured run's", async ({
  page
}) => {
  await openLab(page);
  await openSidebar(page);
  const item = page.locator('.nbtrain-Run[data-kind="scaling"]');
  await expect(item).toContainText('scaling 1-4 nodes');
  await expect(item).toContainText('scaling report');
  const own = await openRunPanel(page, 'scaling 1-4 nodes');
  await expect(own).toHaveAttribute('data-kind', 'scaling');
  // a report has no training charts
  await expect(own.locator(':scope > .nbtrain-Board')).toBeHidden();
  // its tab says "scaling" once (the record's name already says it)
  await expect(
    page.locator('.lm-TabBar-tab', { hasText: 'scaling 1-4 nodes' })
  ).not.toContainText(/scaling:\s*scaling/i);
  await expect(own.locator('.nbtrain-RunPanel-about')).toContainText(
    'scaling report in'
  );
  for (const name of ['scaling 1-4 nodes', 'finished-sft']) {
    const panel = await openRunPanel(page, name);
    const section = panel.locator('.nbtrain-Scaling');
    await expect(section).toBeVisible();
    await expect(section.locator('.nbtrain-Scaling-verdict')).toHaveText(
      /^not near-linear: efficiency 0\.30 at 4 nodes \(< 0\.9\); .*compute-bound$/
    );
    const rows = section.locator('tbody tr');
    await expect(rows).toHaveCount(5);
    await expect(rows.nth(0).locator('td')).toHaveText([
      '1',
      '904',
      '1.00',
      'measured'
    ]);
    await expect(rows.nth(2).locator('td')).toHaveText([
      '4',
      '1.10k',
      '0.304',
      'measured'
    ]);
    await expect(section.locator('tr[data-predicted="true"]')).toHaveCount(2);
    await expect(
      section.locator('tr[data-predicted="true"] td:first-child')
    ).toHaveText(['8', '16']);
    // the figure is drawn with the panel's own charts (so it follows the theme): the 3 measured
    // sizes, and the prediction from the largest measured size on
    for (const chart of ['scaling_tokens_per_s', 'scaling_efficiency']) {
      const figure = section.locator(`figure[data-chart="${chart}"]`);
      await expect(figure).toHaveAttribute('data-points', '6');
      await expect(figure).toHaveAttribute('data-x-title', 'nodes');
      await expect(figure).toHaveAttribute('data-series', 'measured|predicted');
    }
  }
  const run = await openRunPanel(page, 'finished-sft');
  await run.screenshot({ path: path.join(shots, 'scaling-in-run-panel.png') });
});
