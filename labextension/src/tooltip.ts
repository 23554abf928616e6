/**
 * A chart's tooltip: a line per series, at that series' own point nearest the pointer.
 */
import { formatValue } from './format';
import { colourVar } from './palette';

/** One tooltip line: a series, the x of its own nearest point, its value, and raw when smoothed. */
export interface ITooltipLine {
  label: string;
  colour: number;
  x: number;
  value: number;
  raw?: number;
}

/**
 * The tooltip's table: a line per series with the step of its own point nearest the pointer (an
 * eval series logged every 25 steps says its own step), its value, and raw beside smoothed.
 */
export function tooltipTable(
  xTitle: string,
  lines: ITooltipLine[]
): HTMLElement {
  const table = document.createElement('table');
  const smoothed = lines.some(l => l.raw !== undefined);
  const head = table.createTHead().insertRow();
  head.className = 'nbtrain-Chart-tooltipHead';
  for (const text of [
    '',
    xTitle,
    ...(smoothed ? ['smoothed', 'value'] : ['value'])
  ]) {
    const th = document.createElement('th');
    th.textContent = text;
    head.appendChild(th);
  }
  const body = table.createTBody();
  for (const line of lines) {
    const tr = body.insertRow();
    tr.className = 'nbtrain-Chart-tooltipLine';
    tr.dataset.series = line.label;
    const name = tr.insertCell();
    const key = document.createElement('span');
    key.className = 'nbtrain-Chart-key';
    key.style.color = colourVar(line.colour);
    key.textContent = line.label;
    name.appendChild(key);
    const x = tr.insertCell();
    x.className = 'nbtrain-Chart-tooltipX';
    x.textContent = Number.isInteger(line.x)
      ? String(line.x)
      : formatValue(line.x);
    const value = tr.insertCell();
    value.className = 'nbtrain-Chart-tooltipValue';
    value.textContent = formatValue(line.value);
    if (smoothed) {
      const raw = tr.insertCell();
      raw.className = 'nbtrain-Chart-tooltipRaw';
      raw.textContent = line.raw === undefined ? '' : formatValue(line.raw);
    }
  }
  return table;
}
