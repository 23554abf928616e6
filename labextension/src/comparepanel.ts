/**
 * The comparison panel: the chosen runs' loss, eval loss, tokens/s and learning-rate curves over
 * each other (a colour per run), against step or time, smoothed as TensorBoard smooths, on a
 * linear or log y axis, with a tooltip of each run's value at the hovered step; beside them a
 * table of the settings that differ, each run's last metrics and its adapter folder; a CSV download of
 * what is drawn.
 */
import { Widget } from '@lumino/widgets';

import { ISeries, LineChart } from './charts';
import {
  COMPARE_METRICS,
  CompareModel,
  compareCSV,
  finalValue,
  formatSetting,
  runPoints,
  smooth,
  XAxis
} from './compare';
import { formatLoss, formatRate } from './model';
import { COLOURS } from './panel';
import { IComparePage } from './tokens';

/** TensorBoard's default smoothing. */
const DEFAULT_SMOOTHING = 0.6;

export class ComparePanel extends Widget {
  constructor(model: CompareModel) {
    super();
    this.model = model;
    this.addClass('nbtrain-ComparePanel');
    this.node.dataset.runIds = model.runIds.join(',');
    this.title.label = `Compare ${model.runIds.length} runs`;

    const controls = document.createElement('div');
    controls.className = 'nbtrain-Compare-controls';
    this._x = document.createElement('select');
    this._x.className = 'nbtrain-Compare-x';
    this._x.setAttribute('aria-label', 'x axis');
    for (const [value, text] of [
      ['step', 'by step'],
      ['time', 'by time (s)']
    ]) {
      const option = document.createElement('option');
      option.value = value;
      option.textContent = text;
      this._x.appendChild(option);
    }
    this._smoothing = document.createElement('input');
    this._smoothing.type = 'range';
    this._smoothing.className = 'nbtrain-Compare-smoothing';
    this._smoothing.min = '0';
    this._smoothing.max = '0.99';
    this._smoothing.step = '0.01';
    this._smoothing.value = String(DEFAULT_SMOOTHING);
    this._smoothing.setAttribute('aria-label', 'smoothing');
    this._smoothingValue = document.createElement('span');
    this._smoothingValue.className = 'nbtrain-Compare-smoothingValue';
    this._log = document.createElement('input');
    this._log.type = 'checkbox';
    this._log.className = 'nbtrain-Compare-log';
    const download = document.createElement('button');
    download.className = 'jp-Button jp-mod-styled nbtrain-Compare-csv';
    download.textContent = 'Download CSV';
    download.title =
      'The curves as drawn (smoothed) and raw, one line per run and step';
    download.addEventListener('click', () => this.downloadCSV());
    controls.append(
      label('x axis ', this._x),
      label('smoothing ', this._smoothing, this._smoothingValue),
      label('', this._log, ' log y'),
      download
    );

    this._charts = COMPARE_METRICS.map(
      m => new LineChart(m.title, m.key, { hover: true })
    );
    const grid = document.createElement('div');
    grid.className = 'nbtrain-RunPanel-charts';
    grid.append(...this._charts.map(c => c.node));
    this._table = document.createElement('table');
    this._table.className = 'nbtrain-Compare-table';
    this._status = document.createElement('div');
    this._status.className = 'nbtrain-Compare-status';
    const body = document.createElement('div');
    body.className = 'nbtrain-Compare-body';
    const side = document.createElement('div');
    side.className = 'nbtrain-Compare-side';
    side.append(this._table);
    body.append(grid, side);
    this.node.append(controls, this._status, body);

    for (const input of [this._x, this._smoothing, this._log]) {
      input.addEventListener('input', () => this._render());
      input.addEventListener('change', () => this._render());
    }
    model.changed.connect(this._render, this);
    this._render();
  }

  readonly model: CompareModel;

  get xAxis(): XAxis {
    return this._x.value as XAxis;
  }

  get smoothing(): number {
    return Number(this._smoothing.value);
  }

  /** The shown curves as a CSV file download. */
  downloadCSV(): void {
    const page = this.model.page;
    if (!page) {
      return;
    }
    const csv = compareCSV(page.runs, this.xAxis, this.smoothing);
    const url = URL.createObjectURL(new Blob([csv], { type: 'text/csv' }));
    const a = document.createElement('a');
    a.href = url;
    a.download =
      `nbtrain-compare-${page.runs.map(r => r.label).join('-vs-')}.csv`
        .replace(/[^\w.-]+/g, '_')
        .slice(0, 120);
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10_000);
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this.model.dispose();
    super.dispose();
  }

  private _render(): void {
    const weight = this.smoothing;
    this._smoothingValue.textContent = weight.toFixed(2);
    const page = this.model.page;
    this._status.textContent = this.model.error
      ? `Server: ${this.model.error}`
      : page
        ? ''
        : 'loading…';
    if (!page) {
      return;
    }
    this.title.label = `Compare: ${page.runs.map(r => r.label).join(' vs ')}`;
    const x = this.xAxis;
    for (const [i, metric] of COMPARE_METRICS.entries()) {
      const chart = this._charts[i];
      chart.setOptions({
        logY: this._log.checked,
        xName: x === 'step' ? 'step' : 's'
      });
      const series: ISeries[] = [];
      page.runs.forEach((run, r) => {
        const className = COLOURS[r % COLOURS.length];
        const points = runPoints(run, metric.key, x);
        if (weight > 0) {
          series.push({ label: run.label, className, points, faint: true });
        }
        series.push({
          label: run.label,
          className,
          points: smooth(points, weight)
        });
      });
      chart.update(series);
    }
    this._renderTable(page);
  }

  private _renderTable(page: IComparePage): void {
    const fields = Object.keys(page.diff);
    const head = document.createElement('thead');
    const top = head.insertRow();
    for (const title of ['run', ...fields, 'loss', 'eval loss', 'tokens/s']) {
      const th = document.createElement('th');
      th.textContent = title;
      if (fields.includes(title)) {
        th.dataset.field = title;
        th.className = 'nbtrain-Compare-field';
      }
      top.appendChild(th);
    }
    const body = document.createElement('tbody');
    page.runs.forEach((run, r) => {
      const tr = body.insertRow();
      tr.dataset.runId = run.id;
      const name = tr.insertCell();
      const key = document.createElement('span');
      key.className = `nbtrain-Chart-key ${COLOURS[r % COLOURS.length]}`;
      key.textContent = run.label;
      // the adapter under the name: a long path would squeeze the numbers beside it
      const adapter = document.createElement('div');
      adapter.className = 'nbtrain-Compare-adapter';
      adapter.textContent = run.adapter ?? 'no adapter exported';
      adapter.title = 'adapter folder';
      name.className = 'nbtrain-Compare-run';
      name.append(key, adapter);
      name.title = run.output_dir;
      for (const field of fields) {
        const td = tr.insertCell();
        td.dataset.field = field;
        td.textContent = formatSetting(page.diff[field][r]);
      }
      tr.insertCell().textContent = formatLoss(finalValue(run, 'loss'));
      tr.insertCell().textContent = formatLoss(finalValue(run, 'eval_loss'));
      tr.insertCell().textContent = formatRate(finalValue(run, 'tokens_per_s'));
    });
    this._table.replaceChildren(head, body);
    this._table.dataset.fields = fields.join(',');
    if (!fields.length) {
      const caption = this._table.createCaption();
      caption.textContent = 'no settings differ';
    }
  }

  private _x: HTMLSelectElement;
  private _smoothing: HTMLInputElement;
  private _smoothingValue: HTMLElement;
  private _log: HTMLInputElement;
  private _charts: LineChart[];
  private _table: HTMLTableElement;
  private _status: HTMLElement;
}

function label(text: string, ...children: Array<Node | string>): HTMLElement {
  const node = document.createElement('label');
  node.append(text, ...children);
  return node;
}
