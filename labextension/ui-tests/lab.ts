/**
 * What every UI spec does first: open JupyterLab and its Training sidebar.
 */
import { expect, Locator, Page } from '@playwright/test';

export const token = process.env.NBTRAIN_UI_TOKEN!;

export async function openLab(page: Page): Promise<void> {
  // an error thrown in the page shows in the test's output
  page.on('pageerror', error => console.log(`page error: ${error.stack}`));
  await page.goto(`/lab?token=${token}`);
  await expect(page.locator('#jupyterlab-splash')).toHaveCount(0, {
    timeout: 60_000
  });
  await expect(page.locator('.jp-LabShell')).toBeVisible();
}

export async function openSidebar(page: Page): Promise<void> {
  const sidebar = page.locator('#nbtrain-training-sidebar');
  const tab = page.locator('li[data-id="nbtrain-training-sidebar"]');
  await expect(tab).toBeVisible();
  // Lab restores the last layout (the sidebar open) a moment after the shell shows: a click decided
  // before that lands as the restored sidebar opens, and closes it. Click only a tab that is not
  // the current one, and look again.
  for (let i = 0; i < 3 && !(await sidebar.isVisible()); i++) {
    if ((await tab.getAttribute('aria-selected')) !== 'true') {
      await tab.click();
    }
    await sidebar
      .waitFor({ state: 'visible', timeout: 5_000 })
      .catch(() => undefined);
  }
  await expect(sidebar).toBeVisible();
}

/** Open a run's panel from the sidebar by the run's name; returns the panel. */
export async function openRunPanel(page: Page, name: string) {
  const item = page.locator('.nbtrain-Run', {
    has: page.locator('.nbtrain-Item-name', { hasText: name })
  });
  const id = await item.getAttribute('data-run-id');
  const panel = page.locator(`.nbtrain-RunPanel[data-run-id="${id}"]`);
  // a click while Lab still restores its layout can be lost: click again until the panel shows
  await expect(async () => {
    await item.locator('.nbtrain-Item-name').click();
    await expect(panel).toBeVisible({ timeout: 5_000 });
  }).toPass({ timeout: 40_000 });
  return panel;
}

/** Switch Lab's theme through its Settings menu ('JupyterLab Light' or 'JupyterLab Dark'). */
export async function setTheme(
  page: Page,
  theme: 'JupyterLab Light' | 'JupyterLab Dark'
): Promise<void> {
  const light = theme === 'JupyterLab Light';
  const body = page.locator('body');
  if ((await body.getAttribute('data-jp-theme-light')) === String(light)) {
    return;
  }
  await page.locator('.lm-MenuBar-itemLabel', { hasText: 'Settings' }).click();
  await page
    .locator('.lm-Menu-itemLabel', { hasText: /^Theme$/ })
    .first()
    .hover();
  await page
    .locator('.lm-Menu-itemLabel', { hasText: new RegExp(`^${theme}$`) })
    .click();
  await expect(body).toHaveAttribute('data-jp-theme-light', String(light));
  // the theme's CSS loads after the attribute flips
  await page.waitForTimeout(500);
}

/** Every element of `items` lies inside `box` (nothing clipped, nothing off-screen to the right). */
export async function expectInside(
  items: Locator,
  box: Locator
): Promise<void> {
  const outer = (await box.boundingBox())!;
  const n = await items.count();
  expect(n).toBeGreaterThan(0);
  for (let i = 0; i < n; i++) {
    const r = (await items.nth(i).boundingBox())!;
    const what = `${await items.nth(i).evaluate(e => e.outerHTML.slice(0, 80))}`;
    expect(r.x, what).toBeGreaterThanOrEqual(outer.x - 0.5);
    expect(r.x + r.width, what).toBeLessThanOrEqual(
      outer.x + outer.width + 0.5
    );
  }
}

/** No two of `items` overlap (tick labels, legend keys). */
export async function expectNoOverlap(items: Locator): Promise<void> {
  const boxes = await items.evaluateAll(els =>
    els.map(e => {
      const r = e.getBoundingClientRect();
      return {
        l: r.left,
        r: r.right,
        t: r.top,
        b: r.bottom,
        text: e.textContent
      };
    })
  );
  for (let i = 0; i < boxes.length; i++) {
    for (let j = i + 1; j < boxes.length; j++) {
      const a = boxes[i];
      const b = boxes[j];
      const overlap =
        a.l < b.r - 0.5 &&
        b.l < a.r - 0.5 &&
        a.t < b.b - 0.5 &&
        b.t < a.b - 0.5;
      expect(overlap, `"${a.text}" overlaps "${b.text}"`).toBe(false);
    }
  }
}

/** The rendered font size, in px, of each of `items`. */
export async function fontSizes(items: Locator): Promise<number[]> {
  return items.evaluateAll(els =>
    els.map(e => {
      // an SVG text's size on screen: its box height against its font size, through the scaling
      const svg = (e as SVGGraphicsElement).ownerSVGElement;
      const size = parseFloat(getComputedStyle(e).fontSize);
      if (!svg) {
        return size;
      }
      const scale =
        svg.getBoundingClientRect().width / svg.viewBox.baseVal.width;
      return size * scale;
    })
  );
}

/** Move the pointer over a chart's plot at `fx` of its width (and half its height). */
export async function hoverChart(
  page: Page,
  figure: Locator,
  fx: number
): Promise<void> {
  const over = figure.locator('.u-over');
  const box = (await over.boundingBox())!;
  await page.mouse.move(box.x + box.width * fx, box.y + box.height / 2);
}

/** Drag across a chart's plot from `f0` to `f1` of its width: uPlot's zoom. */
export async function dragChart(
  page: Page,
  figure: Locator,
  f0: number,
  f1: number
): Promise<void> {
  const over = figure.locator('.u-over');
  const box = (await over.boundingBox())!;
  const y = box.y + box.height / 2;
  await page.mouse.move(box.x + box.width * f0, y);
  await page.mouse.down();
  await page.mouse.move(box.x + box.width * ((f0 + f1) / 2), y, { steps: 4 });
  await page.mouse.move(box.x + box.width * f1, y, { steps: 4 });
  await page.mouse.up();
}

/** The y tick labels uPlot drew on a chart's canvas (the chart lists them in data-y-ticks). */
export async function yTicks(figure: Locator): Promise<string[]> {
  const text = (await figure.getAttribute('data-y-ticks')) ?? '';
  return text.split(' ').filter(t => t);
}

/** Close every main-area tab (File > Close All Tabs), so the next spec's layout starts empty. */
export async function closeAllTabs(page: Page): Promise<void> {
  await page.locator('.lm-MenuBar-itemLabel', { hasText: 'File' }).click();
  await page
    .locator('.lm-Menu-itemLabel', { hasText: /^Close All Tabs$/ })
    .click();
  await expect(
    page.locator('.nbtrain-RunPanel, .nbtrain-ComparePanel')
  ).toHaveCount(0);
  // Lab saves the layout a moment after it changes
  await page.waitForTimeout(1000);
}
