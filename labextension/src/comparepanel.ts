/**
 * The comparison panel: every metric the chosen runs logged, a chart each with a line per run (each
 * run in its own colour, the same as in the sidebar and every view), grouped by prefix with the most
 * watched first, against step or time, smoothed as TensorBoard smooths where that does not lie, on
 * a linear or log y axis, zoomed together; under them a table: the run (fixed while the table
 * scrolls sideways), its final metrics, then the settings that differ and its adapter; then the
 * runs' last samples side by side; a CSV download of what is drawn.
 */
import { Widget } from '@lumino/widgets';

import { ChartBoard, IRawSeries, label } from './board';
import { colourVar, formatValue } from './charts';
import {
  CompareModel,
  compareCSV,
  finalValue,
  runPoints,
  XAxis
} from './compare';
import {
  chartGroups,
  denseEnough,
  IChartSpec,
  numericKeys,
  overviewKeys,
  runColour,
  runStyles
} from './metrics';
import { shortPath } from './model';
import { blankClass, settingNode } from './panel';
import { shownCompletion, sideBySide } from './samples';
import { ICompareRun, IComparePage } from './tokens';

/** The metrics of a comparison table: loss and the kinds' most watched, tokens/s, steps. */
export function finalMetrics(runs: ICompareRun[]): string[] {
  const keys = new Set<string>();
  for (const run of runs) {
    for (const k of overviewKeys(run.kind, Object.keys(run.final))) {
      keys.add(k);
    }
  }
  for (const k of ['tokens_per_s', 'step']) {
    if (runs.some(run => run.final[k] !== undefined)) {
      keys.add(k);
    }
  }
  return [...keys];
}

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
    const download = document.createElement('button');
    download.className = 'jp-Button jp-mod-styled nbtrain-Compare-csv';
    download.textContent = 'Download CSV';
    download.title =
      'The curves as drawn (smoothed) and raw, one line per run and step';
    download.addEventListener('click', () => this.downloadCSV());
    this._board = new ChartBoard('compare');
    this._board.changed = () => this._render();
    controls.append(label('x axis ', this._x), download);
    // one row of controls: x axis, then the board's smoothing and log y, then the CSV
    this._board.controls.prepend(...Array.from(controls.childNodes));

    this._table = document.createElement('table');
    this._table.className = 'nbtrain-Compare-table';
    this._status = document.createElement('div');
    this._status.className = 'nbtrain-Compare-status';
    // the table and the samples under the charts, full width: a column beside them clipped it
    const side = document.createElement('section');
    side.className = 'nbtrain-Compare-side';
    // the table scrolls sideways inside its own box; the run column stays (position: sticky)
    const scroller = document.createElement('div');
    scroller.className = 'nbtrain-Compare-scroll';
    scroller.append(this._table);
    side.append(scroller);
    this._samples = document.createElement('section');
    this._samples.className = 'nbtrain-Compare-samples';
    this._samples.hidden = true;
    this.node.append(this._status, this._board.node, side, this._samples);
    this._x.addEventListener('change', () => this._render());
    model.changed.connect(this._render, this);
    this._render();
  }

  readonly model: CompareModel;

  get xAxis(): XAxis {
    return this._x.value as XAxis;
  }

  get smoothing(): number {
    return this._board.smoothing;
  }

  /** The shown curves as a CSV file download. */
  downloadCSV(): void {
    const page = this.model.page;
    if (!page) {
      return;
    }
    const specs = new Map(
      this._groups(page)
        .flatMap(g => g.charts)
        .map(c => [c.key, c] as [string, IChartSpec])
    );
    const csv = compareCSV(
      page.runs,
      this.xAxis,
      this.smoothing,
      [...specs.keys()],
      (m, points, rows) =>
        Boolean(specs.get(m)?.smoothable) && denseEnough(points, rows)
    );
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
    this._board.dispose();
    super.dispose();
  }

  private _groups(page: IComparePage) {
    const keys = [...new Set(page.runs.flatMap(run => numericKeys(run.rows)))];
    const kinds = new Set(page.runs.map(r => r.kind ?? 'sft'));
    // the kinds' most watched first when they agree; mixed kinds: SFT's (loss) first
    return chartGroups(keys, kinds.size === 1 ? [...kinds][0] : 'sft', false);
  }

  private _render(): void {
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
    const styles = runStyles(page.runs);
    this._board.render(
      this._groups(page),
      (spec: IChartSpec) =>
        page.runs.map((run, r): IRawSeries => ({
          label: run.label,
          ...styles[r],
          points: runPoints(run, spec.key, x).map(
            ([px, py]) => [px, py * spec.scale] as [number, number]
          ),
          rows: run.rows.length
        })),
      x === 'step' ? 'step' : 'seconds'
    );
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
      key.className = 'nbtrain-Chart-key';
      key.style.color = colourVar(runColour(run.id));
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
        td.textContent = sample ? shownCompletion(sample.completion).text : '–';
      });
    }
    this._samples.replaceChildren(head, table);
  }

  private _renderTable(page: IComparePage): void {
    const fields = Object.keys(page.diff);
    const metrics = finalMetrics(page.runs);
    const head = document.createElement('thead');
    const top = head.insertRow();
    // the run, how it ended, what differs; then where its adapter is
    const th = (title: string, className: string, data?: string) => {
      const cell = document.createElement('th');
      cell.textContent = title;
      cell.className = className;
      if (data) {
        cell.dataset.field = data;
      }
      top.appendChild(cell);
    };
    th('run', 'nbtrain-Compare-run');
    for (const m of metrics) {
      th(
        m === 'step'
          ? 'steps'
          : m === 'tokens_per_s'
            ? 'tokens/s'
            : m.replace(/_/g, ' '),
        'nbtrain-Compare-metric'
      );
    }
    for (const f of fields) {
      th(f, 'nbtrain-Compare-field', f);
    }
    th('adapter', 'nbtrain-Compare-adapterHead');
    const body = document.createElement('tbody');
    page.runs.forEach((run, r) => {
      const tr = body.insertRow();
      tr.dataset.runId = run.id;
      const name = tr.insertCell();
      const dot = document.createElement('span');
      dot.className = 'nbtrain-Dot';
      dot.style.backgroundColor = colourVar(runColour(run.id));
      const key = document.createElement('span');
      key.className = 'nbtrain-Chart-key';
      key.style.color = colourVar(runColour(run.id));
      key.textContent = run.label;
      name.className = 'nbtrain-Compare-run';
      name.append(dot, key);
      name.title = `${run.name}\n${run.output_dir}`;
      for (const metric of metrics) {
        const td = tr.insertCell();
        td.dataset.metric = metric;
        td.className = 'nbtrain-Compare-number';
        const value = finalValue(run, metric);
        td.textContent =
          metric === 'step' ? String(value ?? '–') : formatValue(value);
      }
      for (const field of fields) {
        const td = tr.insertCell();
        td.dataset.field = field;
        td.append(settingNode(page.diff[field][r]));
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
  private _board: ChartBoard;
  private _table: HTMLTableElement;
  private _samples: HTMLElement;
  private _status: HTMLElement;
}
