/**
 * The comparison panel: the chosen runs' loss, eval loss, tokens/s and learning-rate curves over
 * each other (a colour per run), against step or time, smoothed as TensorBoard smooths, on a
 * linear or log y axis, with a tooltip of each run's smoothed and raw value at the hovered step;
 * under them, full width, a table of each run with the settings that differ, its last metrics and
 * its adapter folder, then the runs' last samples side by side; a CSV download of what is drawn.
 */
import { Widget } from '@lumino/widgets';

import { formatValue, ISeries, LineChart } from './charts';
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
import { lossTitle, shortPath } from './model';
import { blankClass, COLOURS } from './panel';
import { sideBySide } from './samples';
import { IComparePage } from './tokens';

/** Each compared metric's y axis title, with its unit. */
const Y_TITLES: Record<string, string> = {
  loss: 'nats/token',
  eval_loss: 'nats/token',
  tokens_per_s: 'tokens/s',
  learning_rate: 'learning rate'
};

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
      m =>
        new LineChart(m.title, m.key, {
          hover: true,
          yTitle: Y_TITLES[m.key] ?? m.key
        })
    );
    const grid = document.createElement('div');
    grid.className = 'nbtrain-RunPanel-charts';
    grid.append(...this._charts.map(c => c.node));
    this._table = document.createElement('table');
    this._table.className = 'nbtrain-Compare-table';
    this._status = document.createElement('div');
    this._status.className = 'nbtrain-Compare-status';
    // the table and the samples under the charts, full width: a column beside them clipped it
    const side = document.createElement('section');
    side.className = 'nbtrain-Compare-side';
    side.append(this._table);
    this._samples = document.createElement('section');
    this._samples.className = 'nbtrain-Compare-samples';
    this._samples.hidden = true;
    this.node.append(controls, this._status, grid, side, this._samples);

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
    for (const chart of this._charts) {
      chart.dispose();
    }
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
      const loss = metric.key === 'loss' || metric.key === 'eval_loss';
      chart.setOptions({
        // DPO's and GRPO's losses are not nats/token: each run's kind says its unit
        ...(loss ? { yTitle: lossTitle(page.runs.map(r => r.kind)) } : {}),
        logY: this._log.checked,
        xTitle: x === 'step' ? 'step' : 'seconds',
        note: weight > 0 ? `smoothed ${weight.toFixed(2)}` : ''
      });
      const series: ISeries[] = page.runs.map((run, r) => {
        const className = COLOURS[r % COLOURS.length];
        const points = runPoints(run, metric.key, x);
        return weight > 0
          ? {
              label: run.label,
              className,
              points: smooth(points, weight),
              raw: points
            }
          : { label: run.label, className, points };
      });
      chart.update(series);
    }
    this._renderTable(page);
    this._renderSamples(page);
  }

  /** The runs' last samples side by side: a row per prompt, a column per run. */
  private _renderSamples(page: IComparePage): void {
    const matched = sideBySide(page.runs);
    this._samples.hidden = !matched.length;
    if (!matched.length) {
      this._samples.replaceChildren();
      return;
    }
    const head = document.createElement('h3');
    head.textContent = 'Last samples';
    const table = document.createElement('table');
    table.className = 'nbtrain-Compare-samplesTable';
    const withReference = matched.some(m => m.reference !== null);
    const top = table.createTHead().insertRow();
    const th = (text: string, className = '') => {
      const cell = document.createElement('th');
      cell.textContent = text;
      cell.className = className;
      top.appendChild(cell);
      return cell;
    };
    th('prompt', 'nbtrain-Compare-promptHead');
    if (withReference) {
      th('reference', 'nbtrain-Compare-referenceHead');
    }
    page.runs.forEach((run, r) => {
      const steps = matched
        .map(m => m.completions[r]?.step)
        .filter((s): s is number => s !== undefined);
      const cell = th('', 'nbtrain-Compare-runHead');
      const key = document.createElement('span');
      key.className = `nbtrain-Chart-key ${COLOURS[r % COLOURS.length]}`;
      key.textContent = run.label;
      const step = document.createElement('span');
      step.className = 'nbtrain-Compare-sampleStep';
      step.textContent = steps.length
        ? ` step ${Math.max(...steps)}`
        : ' no samples';
      cell.append(key, step);
      cell.dataset.runId = run.id;
    });
    const body = table.createTBody();
    for (const m of matched) {
      const tr = body.insertRow();
      const prompt = tr.insertCell();
      prompt.className = 'nbtrain-Sample-prompt';
      prompt.textContent = m.prompt;
      if (withReference) {
        const ref = tr.insertCell();
        ref.className = 'nbtrain-Sample-reference';
        ref.textContent = m.reference ?? '–';
      }
      m.completions.forEach((sample, r) => {
        const td = tr.insertCell();
        td.className = sample
          ? blankClass('nbtrain-Sample-completion', sample.completion)
          : 'nbtrain-Sample-completion';
        td.dataset.runId = page.runs[r].id;
        td.textContent = sample ? sample.completion : '–';
      });
    }
    this._samples.replaceChildren(head, table);
  }

  private _renderTable(page: IComparePage): void {
    const fields = Object.keys(page.diff);
    const metrics: Array<[string, string]> = [
      ['loss', 'loss'],
      ['eval_loss', 'eval loss'],
      ['tokens_per_s', 'tokens/s'],
      ['step', 'steps']
    ];
    const head = document.createElement('thead');
    const top = head.insertRow();
    // the run, what differs, how it ended; then where its adapter is
    for (const title of [
      'run',
      ...fields,
      ...metrics.map(m => m[1]),
      'adapter'
    ]) {
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
      name.className = 'nbtrain-Compare-run';
      name.append(key);
      name.title = `${run.name}\n${run.output_dir}`;
      for (const field of fields) {
        const td = tr.insertCell();
        td.dataset.field = field;
        td.textContent = formatSetting(page.diff[field][r]);
      }
      for (const [metric] of metrics) {
        const td = tr.insertCell();
        td.dataset.metric = metric;
        td.className = 'nbtrain-Compare-number';
        const value = finalValue(run, metric);
        td.textContent =
          metric === 'step' ? String(value ?? '–') : formatValue(value);
      }
      const adapter = tr.insertCell();
      adapter.className = 'nbtrain-Compare-adapter';
      adapter.textContent = run.adapter
        ? shortPath(run.adapter, 2)
        : 'none exported';
      adapter.title = run.adapter ?? 'no adapter exported';
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
  private _samples: HTMLElement;
  private _status: HTMLElement;
}

function label(text: string, ...children: Array<Node | string>): HTMLElement {
  const node = document.createElement('label');
  node.append(text, ...children);
  return node;
}
