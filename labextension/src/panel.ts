/**
 * A run's main-area panel: a header naming the run (state, start, duration, output folder,
 * progress), live charts of loss and eval loss, tokens/s and learning rate, GPU memory and MFU when
 * the run logged them (GPU runs), the completions it sampled during training, and its scaling
 * report when one was saved.
 * Everything comes from the server, so a panel opens (and keeps updating) without the
 * kernel that started the run.
 */
import { Widget } from '@lumino/widgets';

import { formatValue, ISeries, LineChart } from './charts';
import {
  fetchScaling,
  formatDuration,
  hasMetric,
  rankMemoryKeys,
  lossUnit,
  RunMetrics,
  scalingLines,
  shortPath,
  stateTitle
} from './model';
import { ISampledStep, RunSamples } from './samples';
import { IMetricsRow, IScalingPage, ISample, Requester } from './tokens';

function series(
  rows: IMetricsRow[],
  key: string,
  label: string,
  className: string,
  scale = 1
): ISeries {
  const points: Array<[number, number]> = [];
  for (const row of rows) {
    const value = row[key];
    if (typeof value === 'number' && Number.isFinite(value)) {
      points.push([row.step, value * scale]);
    }
  }
  return { label, className, points };
}

/** Colour classes, in order (style/base.css). */
export const COLOURS = [
  'nbtrain-c1',
  'nbtrain-c2',
  'nbtrain-c3',
  'nbtrain-c4',
  'nbtrain-c5',
  'nbtrain-c6',
  'nbtrain-c7',
  'nbtrain-c8'
];

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
    this._loss = new LineChart('Loss', 'loss', {
      hover: true,
      yTitle: 'nats/token'
    });
    this._throughput = new LineChart('Tokens/s', 'tokens_per_s', {
      hover: true,
      yTitle: 'tokens/s'
    });
    this._lr = new LineChart('Learning rate', 'learning_rate', {
      hover: true,
      yTitle: 'learning rate'
    });
    this._memory = new LineChart('GPU peak memory', 'peak_memory_gb', {
      hover: true,
      yTitle: 'GB'
    });
    this._mfu = new LineChart('MFU', 'mfu', { hover: true, yTitle: '%' });
    this._grid = document.createElement('div');
    this._grid.className = 'nbtrain-RunPanel-charts';
    this._grid.append(
      this._loss.node,
      this._throughput.node,
      this._lr.node,
      this._memory.node,
      this._mfu.node
    );
    this._samplesView = new SamplesView();
    this._scaling = new ScalingView();
    this.node.append(
      this._header,
      this._grid,
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
    for (const chart of [
      this._loss,
      this._throughput,
      this._lr,
      this._memory,
      this._mfu
    ]) {
      chart.dispose();
    }
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
      this.title.label = `Scaling: ${run.name}`;
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
      // DPO's and GRPO's losses are not nats/token: the run's kind says its unit
      this._loss.setOptions({ yTitle: lossUnit(run.kind) });
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
      this._stop.style.display = run.state === 'running' ? '' : 'none';
    }
    if (this.metrics.error) {
      this._summary.title = `last poll failed: ${this.metrics.error}`;
    }
    this._loss.update([
      series(rows, 'loss', 'loss', 'nbtrain-c1'),
      series(rows, 'eval_loss', 'eval loss', 'nbtrain-c2')
    ]);
    this._throughput.update([
      series(rows, 'tokens_per_s', 'tokens/s', 'nbtrain-c3')
    ]);
    this._lr.update([series(rows, 'learning_rate', 'lr', 'nbtrain-c4')]);
    // GPU runs only: the charts stay out of the way of CPU runs
    const ranks = rankMemoryKeys(rows);
    this._memory.node.hidden =
      !ranks.length && !hasMetric(rows, 'peak_memory_gb');
    if (!this._memory.node.hidden) {
      this._memory.update(
        ranks.length
          ? ranks.map((key, i) =>
              series(
                rows,
                key,
                `rank ${key.slice('peak_memory_gb_rank'.length)}`,
                COLOURS[i % COLOURS.length]
              )
            )
          : [series(rows, 'peak_memory_gb', 'peak', 'nbtrain-c1')]
      );
    }
    this._mfu.node.hidden = !hasMetric(rows, 'mfu');
    if (!this._mfu.node.hidden) {
      this._mfu.update([series(rows, 'mfu', 'MFU', 'nbtrain-c2', 100)]);
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
      this._scaling.show(page);
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
  private _memory: LineChart;
  private _mfu: LineChart;
  private _scaling: ScalingView;
  private _scalingFolder: string | null = null;
  private _header: HTMLElement;
  private _summary: HTMLElement;
  private _stop: HTMLButtonElement;
  private _loss: LineChart;
  private _throughput: LineChart;
  private _lr: LineChart;
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
  completion.textContent = sample.completion;
  completion.title =
    sample.tokens !== null
      ? `${sample.tokens} token${sample.tokens === 1 ? '' : 's'}`
      : '';
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

  show(page: IScalingPage): void {
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
    machine.textContent = `${report.machine} · ${page.folder}`;
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
        hover: true,
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
        { label: 'measured', className: 'nbtrain-c1', points: measured },
        {
          label: 'predicted',
          className: 'nbtrain-c2 nbtrain-Chart-dashed',
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
