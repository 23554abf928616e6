/**
 * A run's main-area panel: a header naming the run (state, start, duration, output folder,
 * progress), live charts of loss and eval loss, tokens/s and learning rate, GPU memory and MFU when
 * the run logged them (GPU runs), the completions it sampled during training, and its scaling
 * report when one was saved.
 * Everything comes from the server, so a panel opens (and keeps updating) without the
 * kernel that started the run.
 */
import { Widget } from '@lumino/widgets';

import { ChartBoard, IRawSeries } from './board';
import { formatValue, LineChart } from './charts';
import {
  chartGroups,
  IChartSpec,
  numericKeys,
  runLineColours
} from './metrics';
import {
  fetchScaling,
  fetchRunConfig,
  formatDuration,
  isLive,
  plurals,
  RunMetrics,
  scalingLines,
  shortPath,
  stateTitle
} from './model';
import { formatSetting } from './compare';
import { ISampledStep, RunSamples, shownCompletion } from './samples';
import {
  IMetricsRow,
  IRunConfig,
  IScalingPage,
  ISample,
  Requester
} from './tokens';

/** The (step, value) points of `key` in `rows`, times `scale`. */
export function seriesPoints(
  rows: IMetricsRow[],
  key: string,
  scale = 1
): Array<[number, number]> {
  const points: Array<[number, number]> = [];
  for (const row of rows) {
    const value = row[key];
    if (typeof value === 'number' && Number.isFinite(value)) {
      points.push([row.step, value * scale]);
    }
  }
  return points;
}

/** A line's label in a run panel: `eval loss`, `rank 1`, or the key. */
function lineLabel(key: string): string {
  const rank = /^peak_memory_gb_rank(\d+)$/.exec(key);
  if (rank) {
    return `rank ${rank[1]}`;
  }
  const names: Record<string, string> = {
    eval_loss: 'eval loss',
    peak_memory_gb: 'peak',
    mfu: 'MFU'
  };
  return names[key] ?? key;
}

export class RunPanel extends Widget {
  constructor(
    metrics: RunMetrics,
    onStop: (id: string) => Promise<boolean>,
    request: Requester,
    samples?: RunSamples
  ) {
    super();
    this.metrics = metrics;
    this.samples = samples ?? new RunSamples({ request, runId: metrics.runId });
    this._onStop = onStop;
    this._request = request;
    this.addClass('nbtrain-RunPanel');
    this.node.dataset.runId = metrics.runId;
    this._header = document.createElement('header');
    this._header.className = 'nbtrain-RunPanel-header';
    const titleLine = document.createElement('div');
    titleLine.className = 'nbtrain-RunPanel-titleLine';
    this._name = document.createElement('h2');
    this._name.className = 'nbtrain-RunPanel-name';
    this._state = document.createElement('span');
    this._state.className = 'nbtrain-State';
    this._stop = document.createElement('button');
    this._stop.className =
      'jp-Button jp-mod-styled jp-mod-warn nbtrain-StopButton';
    this._stop.textContent = 'Stop run';
    this._stop.title = 'Checkpoint and end this run at its next step';
    this._stop.addEventListener('click', () => void this._stopClicked());
    titleLine.append(this._name, this._state, this._stop);
    this._about = document.createElement('div');
    this._about.className = 'nbtrain-RunPanel-about';
    this._summary = document.createElement('div');
    this._summary.className = 'nbtrain-RunPanel-summary';
    this._header.append(titleLine, this._about, this._summary);
    this._board = new ChartBoard('run');
    this._board.changed = () => this._render();
    this._grid = this._board.node;
    this._config = new ConfigView();
    this._samplesView = new SamplesView();
    this._scaling = new ScalingView();
    this.node.append(
      this._header,
      this._grid,
      this._config.node,
      this._samplesView.node,
      this._scaling.node
    );
    metrics.changed.connect(this._render, this);
    this.samples.changed.connect(this._renderSamples, this);
    this._render();
    this._renderSamples();
    // the duration of a running run moves on between polls too
    this._clock = window.setInterval(() => this._renderAbout(), 1000);
  }

  readonly metrics: RunMetrics;
  readonly samples: RunSamples;

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    window.clearInterval(this._clock);
    this.metrics.dispose();
    this.samples.dispose();
    this._scaling.dispose();
    this._board.dispose();
    super.dispose();
  }

  private async _stopClicked(): Promise<void> {
    this._stop.disabled = true;
    const asked = await this._onStop(this.metrics.runId);
    if (this.isDisposed) {
      return;
    }
    if (asked) {
      this._stop.textContent = 'Stopping…';
    } else {
      this._stop.disabled = false;
    }
  }

  /** The line under the name: when it started, how long it ran, where, and its folder. */
  private _renderAbout(): void {
    const run = this.metrics.run;
    if (!run || run.kind === 'scaling') {
      return;
    }
    const end =
      run.ended ?? (run.state === 'running' ? Date.now() / 1000 : null);
    const parts: Array<[string, string, string?]> = [
      ['started', `started ${formatStart(run.started)}`],
      [
        'duration',
        end === null
          ? ''
          : `${run.state === 'running' ? 'running for' : 'ran'} ${formatDuration(end - run.started)}`
      ],
      [
        'where',
        `${run.world_size} rank${run.world_size === 1 ? '' : 's'} on ${run.host}`
      ],
      ['folder', shortPath(run.output_dir, 3), run.output_dir]
    ];
    this._about.replaceChildren(
      ...parts
        .filter(([, text]) => text)
        .map(([key, text, title]) => {
          const span = document.createElement('span');
          span.className = `nbtrain-RunPanel-${key}`;
          span.textContent = text;
          if (title) {
            span.title = title;
          }
          return span;
        })
    );
  }

  private _renderSamples(): void {
    this._samplesView.show(this.samples.steps, this.samples.error);
  }

  private _render(): void {
    const run = this.metrics.run;
    const rows = this.metrics.rows;
    const isScaling = run?.kind === 'scaling';
    if (run && run.scaling && run.scaling !== this._scalingFolder) {
      this._scalingFolder = run.scaling;
      void this._loadScaling();
    }
    if (run) {
      this._name.textContent = run.name;
      this._name.title = run.name;
      this._state.className = `nbtrain-State nbtrain-State-${run.state}`;
      this._state.textContent = run.state;
      this._state.title = stateTitle(run);
      this.node.dataset.state = run.state;
    }
    if (isScaling && run) {
      // a scaling record's name already says "scaling: ..."
      this.title.label = /^scaling\b/i.test(run.name)
        ? run.name
        : `Scaling: ${run.name}`;
      this.node.dataset.kind = 'scaling';
      this._about.textContent = `scaling report in ${run.scaling ?? run.output_dir}${run.measured ? ` · measured ${run.measured}` : ''}`;
      this._about.title = run.scaling ?? run.output_dir;
      this._summary.textContent = 'scaling report';
      this._stop.style.display = 'none';
      this._grid.style.display = 'none'; // (the hidden attribute loses to its display: grid)
      return;
    }
    if (run) {
      this.title.label = `Run: ${run.name}`;
      if (!this._configAsked) {
        this._configAsked = true;
        void this._loadConfig();
      }
      this._renderAbout();
      const last = rows.length ? rows[rows.length - 1] : null;
      const step = last ? last.step : run.step;
      const steps = run.total_steps ? `${step}/${run.total_steps}` : `${step}`;
      const parts = [
        `step <b class="nbtrain-RunPanel-step">${steps}</b>`,
        `loss ${formatValue(last?.loss ?? run.loss)}`,
        `${formatValue(last?.tokens_per_s ?? run.tokens_per_s)} tok/s`
      ];
      this._summary.innerHTML = parts.join(' · ');
      this._summary.title = '';
      // (the hidden attribute loses to .jp-Button's display rule)
      this._stop.style.display = isLive(run) ? '' : 'none';
    }
    if (this.metrics.error) {
      this._summary.title = `last poll failed: ${this.metrics.error}`;
    }
    const keys = numericKeys(rows);
    const groups = chartGroups(keys, run?.kind, true);
    this._board.render(groups, (spec: IChartSpec) => {
      // the run's own colour first (as its sidebar dot and in compare), then the next ones
      const colours = runLineColours(this.metrics.runId, spec.keys.length);
      return spec.keys.map((key, i): IRawSeries => ({
        label: lineLabel(key),
        colour: colours[i],
        points: seriesPoints(rows, key, spec.scale),
        rows: rows.length
      }));
    });
    this.node.dataset.charts = groups
      .flatMap(g => g.charts.map(c => c.key))
      .join(',');
  }

  private async _loadConfig(): Promise<void> {
    try {
      const config = await fetchRunConfig(this._request, this.metrics.runId);
      if (!this.isDisposed) {
        this._config.show(config);
      }
    } catch (error) {
      if (!this.isDisposed) {
        this._config.showError(String(error));
      }
    }
  }

  private async _loadScaling(): Promise<void> {
    let page: IScalingPage | null = null;
    try {
      page = await fetchScaling(this._request, this.metrics.runId);
    } catch (error) {
      this._scaling.showError(String(error));
      return;
    }
    if (this.isDisposed) {
      return;
    }
    if (!page) {
      this._scaling.clear();
      return;
    }
    if (!this.isDisposed) {
      // measured in the run's own colour (its sidebar dot), predicted in the next one
      this._scaling.show(page, runLineColours(this.metrics.runId, 2));
    }
  }

  private _onStop: (id: string) => Promise<boolean>;
  private _request: Requester;
  private _clock: number;
  private _name: HTMLElement;
  private _state: HTMLElement;
  private _about: HTMLElement;
  private _samplesView: SamplesView;
  private _grid: HTMLElement;
  private _board: ChartBoard;
  private _config: ConfigView;
  private _configAsked = false;
  private _scaling: ScalingView;
  private _scalingFolder: string | null = null;
  private _header: HTMLElement;
  private _summary: HTMLElement;
  private _stop: HTMLButtonElement;
}

/**
 * The "Samples" section: the completions the run generated for its sample prompts, newest step
 * first; the newest step open, older ones folded. Hidden for a run that samples nothing.
 */
class SamplesView {
  constructor() {
    this.node = document.createElement('section');
    this.node.className = 'nbtrain-Samples';
    this.node.hidden = true;
  }

  readonly node: HTMLElement;

  show(steps: ISampledStep[], error: string | null): void {
    if (!steps.length) {
      this.node.hidden = true;
      this.node.replaceChildren();
      return;
    }
    // a step the reader opened or folded stays so through the next poll
    for (const details of this.node.querySelectorAll<HTMLDetailsElement>(
      'details[data-step]'
    )) {
      this._open.set(Number(details.dataset.step), details.open);
    }
    const head = document.createElement('h3');
    head.textContent = 'Samples';
    const note = document.createElement('p');
    note.className = 'nbtrain-Samples-note';
    const prompts = new Set(steps.flatMap(s => s.samples.map(x => x.index)));
    note.textContent = `${prompts.size} prompt${prompts.size === 1 ? '' : 's'} sampled at ${steps.length} step${steps.length === 1 ? '' : 's'}, newest first${error ? ` · last poll failed: ${error}` : ''}`;
    const blocks = steps.map((step, i) => {
      const details = document.createElement('details');
      details.className = 'nbtrain-Samples-step';
      details.dataset.step = String(step.step);
      details.open = this._open.get(step.step) ?? i === 0;
      const summary = document.createElement('summary');
      // the ranks generate a step's prompts together: its time is each row's (the same) time
      const seconds = Math.max(0, ...step.samples.map(x => x.seconds ?? 0));
      const tokens = step.samples.reduce((t, x) => t + (x.tokens ?? 0), 0);
      summary.textContent = `step ${step.step} · ${step.samples.length} completion${step.samples.length === 1 ? '' : 's'} · ${tokens} token${tokens === 1 ? '' : 's'} in ${formatValue(seconds)} s`;
      details.append(summary, ...step.samples.map(sampleBlock));
      return details;
    });
    this.node.replaceChildren(head, note, ...blocks);
    this.node.hidden = false;
  }

  private _open = new Map<number, boolean>();
}

/** The class of a completion's element, marked where the model wrote only blanks (CSS says so). */
export function blankClass(className: string, text: string): string {
  return text.trim() ? className : `${className} nbtrain-Sample-blank`;
}

/** One prompt and its completion (and reference), long text wrapped as written. */
export function sampleBlock(sample: ISample): HTMLElement {
  const div = document.createElement('div');
  div.className = 'nbtrain-Sample';
  div.dataset.index = String(sample.index);
  const prompt = document.createElement('div');
  prompt.className = 'nbtrain-Sample-prompt';
  prompt.textContent = sample.prompt;
  prompt.title = `prompt ${sample.index}`;
  const completion = document.createElement('div');
  completion.className = blankClass(
    'nbtrain-Sample-completion',
    sample.completion
  );
  const shown = shownCompletion(sample.completion);
  completion.textContent = shown.text;
  completion.title =
    (sample.tokens !== null
      ? `${sample.tokens} token${sample.tokens === 1 ? '' : 's'}`
      : '') + (shown.cut ? ' (cut mid-character at the token limit)' : '');
  div.append(prompt, completion);
  if (sample.reference !== null) {
    const reference = document.createElement('div');
    reference.className = 'nbtrain-Sample-reference';
    reference.textContent = sample.reference;
    reference.title = "the data file's completion";
    div.append(reference);
  }
  return div;
}

/**
 * The "Scaling" section: the verdict, the table (predicted sizes marked) and the figure, drawn
 * with the panel's own charts (so it follows the theme): tokens/s and efficiency against size,
 * the measured line solid and the prediction from the largest measured size on.
 */
class ScalingView {
  constructor() {
    this.node = document.createElement('section');
    this.node.className = 'nbtrain-Scaling';
    this.node.hidden = true;
  }

  readonly node: HTMLElement;

  show(page: IScalingPage, colours: number[] = [0, 1]): void {
    const report = page.report;
    const unit = report.unit === 'ranks' ? 'ranks' : 'nodes';
    const head = document.createElement('h3');
    head.textContent = `Scaling (${report.mode})`;
    const verdict = document.createElement('p');
    verdict.className = 'nbtrain-Scaling-verdict';
    verdict.dataset.nearLinear = String(report.verdict.near_linear);
    verdict.textContent = report.verdict.line;
    const machine = document.createElement('p');
    machine.className = 'nbtrain-Scaling-machine';
    machine.textContent = `${plurals(report.machine)} · ${page.folder}`;
    const table = document.createElement('table');
    table.className = 'nbtrain-Scaling-table';
    const header = table.createTHead().insertRow();
    for (const title of [unit, 'tokens/s', 'efficiency', '']) {
      const th = document.createElement('th');
      th.textContent = title;
      header.appendChild(th);
    }
    const body = table.createTBody();
    const lines = scalingLines(report);
    for (const line of lines) {
      const tr = body.insertRow();
      tr.dataset.predicted = String(line.predicted);
      if (line.predicted) {
        tr.className = 'nbtrain-Scaling-predicted';
      }
      for (const text of [
        String(line.size),
        line.tokensPerS,
        line.efficiency,
        line.predicted ? 'predicted' : 'measured'
      ]) {
        tr.insertCell().textContent = text;
      }
    }
    this._disposeCharts();
    const grid = document.createElement('div');
    grid.className = 'nbtrain-RunPanel-charts nbtrain-Scaling-charts';
    for (const [key, title, yTitle] of [
      ['tokens_per_s', 'Tokens/s', 'tokens/s'],
      ['efficiency', 'Efficiency', 'efficiency']
    ]) {
      const chart = new LineChart(title, `scaling_${key}`, {
        xTitle: unit,
        yTitle
      });
      const at = (predicted: boolean) =>
        report.rows
          .map((row, i) => ({ row, size: lines[i].size }))
          .filter(({ row }) => Boolean(row.predicted) === predicted)
          .map(({ row, size }) => [size, Number(row[key])] as [number, number])
          .filter(([, y]) => Number.isFinite(y))
          .sort((a, b) => a[0] - b[0]);
      const measured = at(false);
      const predicted = at(true);
      grid.appendChild(chart.node);
      this._charts.push(chart);
      chart.update([
        { label: 'measured', colour: colours[0], points: measured },
        {
          label: 'predicted',
          colour: colours[1],
          dashed: true,
          // from the largest measured size on, so the two lines meet
          points: predicted.length ? [...measured.slice(-1), ...predicted] : []
        }
      ]);
    }
    this.node.replaceChildren(head, verdict, machine, table, grid);
    this.node.hidden = false;
    // drawn once laid out, at their width
    requestAnimationFrame(() => {
      for (const chart of this._charts) {
        chart.redraw();
      }
    });
  }

  showError(message: string): void {
    this._disposeCharts();
    this.node.replaceChildren();
    const p = document.createElement('p');
    p.className = 'nbtrain-Scaling-error';
    p.textContent = `scaling report: ${message}`;
    this.node.append(p);
    this.node.hidden = false;
  }

  clear(): void {
    this._disposeCharts();
    this.node.replaceChildren();
    this.node.hidden = true;
  }

  dispose(): void {
    this._disposeCharts();
  }

  private _disposeCharts(): void {
    for (const chart of this._charts) {
      chart.dispose();
    }
    this._charts = [];
  }

  private _charts: LineChart[] = [];
}

/**
 * The "Config" section: what the run trained (its kind), where (its cluster: id, ranks, hosts,
 * backend, the notebook that started it) and every setting it ran with, long lists folded and
 * paths shortened (the whole on hover).
 */
class ConfigView {
  constructor() {
    this.node = document.createElement('section');
    this.node.className = 'nbtrain-Config';
    this.node.hidden = true;
  }

  readonly node: HTMLElement;

  show(page: IRunConfig): void {
    const head = document.createElement('h3');
    head.textContent = 'Config';
    const table = document.createElement('table');
    table.className = 'nbtrain-Config-table';
    const row = (key: string, value: unknown) => {
      const tr = table.insertRow();
      tr.dataset.setting = key;
      const th = document.createElement('th');
      th.textContent = key;
      tr.appendChild(th);
      tr.insertCell().append(settingNode(value));
    };
    row('kind', page.kind ?? 'sft');
    const c = page.cluster;
    if (c) {
      const hosts = c.hosts.length ? c.hosts.join(', ') : c.host;
      row(
        'cluster',
        `${c.cluster_id ?? 'no cluster'} · ${c.world_size} rank${c.world_size === 1 ? '' : 's'} on ${hosts}${c.backend ? ` · ${c.backend}` : ''}`
      );
      if (c.notebook) {
        row('notebook', c.notebook);
      }
    }
    if (page.config_file) {
      row('config file', page.config_file);
    }
    for (const [key, value] of Object.entries(page.config ?? {})) {
      row(key, value);
    }
    this.node.replaceChildren(head, table);
    this.node.hidden = false;
  }

  showError(message: string): void {
    const p = document.createElement('p');
    p.className = 'nbtrain-Config-error';
    p.textContent = `config: ${message}`;
    this.node.replaceChildren(p);
    this.node.hidden = false;
  }
}

/**
 * A setting's value as a node: a path shortened (the whole on hover), a long list or object
 * folded under its first items, anything else as formatSetting writes it.
 */
export function settingNode(value: unknown): Node {
  if (typeof value === 'string' && value.includes('/') && value.length > 32) {
    const span = document.createElement('span');
    span.className = 'nbtrain-Path';
    span.textContent = shortPath(value, 2);
    span.title = value;
    return span;
  }
  if (value !== null && typeof value === 'object') {
    const text = JSON.stringify(value);
    if (text.length <= 60) {
      return document.createTextNode(text);
    }
    const details = document.createElement('details');
    details.className = 'nbtrain-Fold';
    const summary = document.createElement('summary');
    const n = Array.isArray(value) ? value.length : Object.keys(value).length;
    summary.textContent = `${text.slice(0, 40)}… (${n} ${Array.isArray(value) ? 'items' : 'keys'})`;
    const pre = document.createElement('pre');
    pre.textContent = JSON.stringify(value, null, 1);
    details.append(summary, pre);
    return details;
  }
  return document.createTextNode(formatSetting(value));
}

/** `14:05` today, `Nov 25 14:05` another day: when a run started. */
function formatStart(seconds: number): string {
  const date = new Date(seconds * 1000);
  const time = date.toLocaleTimeString('en-GB', {
    hour: '2-digit',
    minute: '2-digit'
  });
  if (date.toDateString() === new Date().toDateString()) {
    return time;
  }
  return `${date.toLocaleDateString('en-US', { month: 'short', day: 'numeric' })} ${time}`;
}
