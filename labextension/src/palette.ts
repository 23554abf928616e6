/**
 * The palette in the current JupyterLab theme: concrete colours for uPlot's canvas, CSS variables
 * (--nbtrain-c0 ... --nbtrain-c7, switched with the theme) for DOM elements.
 */
import { PALETTE_DARK, PALETTE_LIGHT } from './metrics';

/** Whether JupyterLab shows a dark theme now. */
export function isDark(): boolean {
  return document.body.dataset.jpThemeLight === 'false';
}

/** The colour of palette index `i` in the current theme. */
export function colourOf(i: number): string {
  const palette = isDark() ? PALETTE_DARK : PALETTE_LIGHT;
  return palette[((i % palette.length) + palette.length) % palette.length];
}

/**
 * The palette as CSS variables (--nbtrain-c0 ... --nbtrain-c7), switched with the theme: the DOM's
 * colour keys (the sidebar's dots, legends, tables) follow a theme change by themselves.
 */
export function installPalette(): void {
  if (document.getElementById('nbtrain-palette')) {
    return;
  }
  const vars = (palette: string[]) =>
    palette.map((c, i) => `--nbtrain-c${i}: ${c};`).join(' ');
  const style = document.createElement('style');
  style.id = 'nbtrain-palette';
  style.textContent =
    `:root { ${vars(PALETTE_LIGHT)} }\n` +
    `body[data-jp-theme-light='false'] { ${vars(PALETTE_DARK)} }`;
  document.head.appendChild(style);
}

/** Palette index `i` as a CSS colour that follows the theme (for DOM elements). */
export function colourVar(i: number): string {
  installPalette();
  const n = PALETTE_LIGHT.length;
  return `var(--nbtrain-c${((i % n) + n) % n})`;
}

export function cssVar(name: string, fallback: string): string {
  const v = getComputedStyle(document.body).getPropertyValue(name).trim();
  return v || fallback;
}
