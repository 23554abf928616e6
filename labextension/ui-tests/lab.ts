/**
 * What every UI spec does first: open JupyterLab and its Training sidebar.
 */
import { expect, Page } from '@playwright/test';

export const token = process.env.NBTRAIN_UI_TOKEN!;

export async function openLab(page: Page): Promise<void> {
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
  await item.locator('.nbtrain-Item-name').click();
  const panel = page.locator(`.nbtrain-RunPanel[data-run-id="${id}"]`);
  await expect(panel).toBeVisible();
  return panel;
}
