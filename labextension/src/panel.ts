/**
 * A run's main-area panel: live charts of loss and eval loss, tokens/s and learning rate, GPU
 * memory and MFU when the run logged them (GPU runs), and its scaling report when one was saved.
 * Everything comes from the server, so a panel opens (and keeps updating) without the
 * kernel that started the run.
 */
import { Widget } from '@lumino/widgets';

import { ISeries, LineChart } from './charts';
import {
  fetchScaling,
  formatLoss,
  formatRate,
  hasMetric,
  rankMemoryKeys,
  RunMetrics,
  scalingLines
} from './model';
import { IMetricsRow, IScalingPage, Requester } from './tokens';

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
    onStop: (id: string) => void,
    request: Requester
  ) {
    super();
    this.metrics = metrics;
    this._onStop = onStop;
    this._request = request;
    this.addClass('nbtrain-RunPanel');
    this.node.dataset.runId = metrics.runId;
    this._header = document.createElement('div');
    this._header.className = 'nbtrain-RunPanel-header';
    this._summary = document.createElement('span');
    this._summary.className = 'nbtrain-RunPanel-summary';
    this._stop = document.createElement('button');
    this._stop.className =
      'jp-Button jp-mod-styled jp-mod-warn nbtrain-StopButton';
    this._stop.textContent = 'Stop run';
    this._stop.title = 'Checkpoint and end this run at its next step';
    this._stop.addEventListener('click', () => {
      this._stop.disabled = true;
      this._stop.textContent = 'Stopping…';
      this._onStop(metrics.runId);
    });
    this._header.append(this._summary, this._stop);
    this._loss = new LineChart('Loss', 'loss', { hover: true });
    this._throughput = new LineChart('Tokens/s', 'tokens_per_s', {
      hover: true
    });
    this._lr = new LineChart('Learning rate', 'learning_rate', {
      hover: true
    });
    this._memory = new LineChart('GPU peak memory (GB)', 'peak_memory_gb', {
      hover: true
    });
    this._mfu = new LineChart('MFU (%)', 'mfu', { hover: true });
    this._grid = document.createElement('div');
    this._grid.className = 'nbtrain-RunPanel-charts';
    this._grid.append(
      this._loss.node,
      this._throughput.node,
      this._lr.node,
      this._memory.node,
      this._mfu.node
    );
    this._scaling = new ScalingView();
    this.node.append(this._header, this._grid, this._scaling.node);
    metrics.changed.connect(this._render, this);
    this._render();
  }

  readonly metrics: RunMetrics;

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this.metrics.dispose();
    this._scaling.dispose();
    super.dispose();
  }

  private _render(): void {
    const run = this.metrics.run;
    const rows = this.metrics.rows;
    const isScaling = run?.kind === 'scaling';
    if (run && run.scaling && run.scaling !== this._scalingFolder) {
      this._scalingFolder = run.scaling;
      void this._loadScaling();
    }
    if (isScaling && run) {
      this.title.label = `Scaling: ${run.name}`;
      this.node.dataset.state = run.state;
      this.node.dataset.kind = 'scaling';
      this._summary.textContent = `scaling report in ${run.scaling ?? run.output_dir}${run.measured ? ` · measured ${run.measured}` : ''}`;
      this._stop.style.display = 'none';
      this._grid.style.display = 'none'; // (the hidden attribute loses to its display: grid)
      return;
    }
    if (run) {
      this.title.label = `Run: ${run.name}`;
      this.node.dataset.state = run.state;
      const last = rows.length ? rows[rows.length - 1] : null;
      const step = last ? last.step : run.step;
      const steps = run.total_steps ? `${step}/${run.total_steps}` : `${step}`;
      const parts = [
        `<span class="nbtrain-State nbtrain-State-${run.state}">${run.state}</span>`,
        `step <b class="nbtrain-RunPanel-step">${steps}</b>`,
        `loss ${formatLoss(last?.loss ?? run.loss)}`,
        `${formatRate(last?.tokens_per_s ?? run.tokens_per_s)} tok/s`,
        `${run.world_size} rank${run.world_size === 1 ? '' : 's'} on ${escapeHtml(run.host)}`
      ];
      this._summary.innerHTML = parts.join(' · ');
      this._summary.title = run.output_dir;
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
    let image: Blob | null = null;
    try {
      image = await this._request<Blob>(
        `runs/${encodeURIComponent(this.metrics.runId)}/scaling.png`
      );
    } catch {
      // the table stands without its figure
    }
    if (!this.isDisposed) {
      this._scaling.show(page, image);
    }
  }

  private _onStop: (id: string) => void;
  private _request: Requester;
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

/** The "Scaling" section: the verdict, the table (predicted sizes marked) and the figure. */
class ScalingView {
  constructor() {
    this.node = document.createElement('section');
    this.node.className = 'nbtrain-Scaling';
    this.node.hidden = true;
  }

  readonly node: HTMLElement;

  show(page: IScalingPage, image: Blob | null): void {
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
    for (const line of scalingLines(report)) {
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
    const parts: HTMLElement[] = [head, verdict, machine, table];
    this._revoke();
    if (image) {
      this._url = URL.createObjectURL(image);
      const img = document.createElement('img');
      img.className = 'nbtrain-Scaling-figure';
      img.alt = `tokens/s and efficiency against ${unit}`;
      img.src = this._url;
      parts.push(img);
    }
    this.node.replaceChildren(...parts);
    this.node.hidden = false;
  }

  showError(message: string): void {
    this.node.replaceChildren();
    const p = document.createElement('p');
    p.className = 'nbtrain-Scaling-error';
    p.textContent = `scaling report: ${message}`;
    this.node.append(p);
    this.node.hidden = false;
  }

  clear(): void {
    this._revoke();
    this.node.replaceChildren();
    this.node.hidden = true;
  }

  dispose(): void {
    this._revoke();
  }

  private _revoke(): void {
    if (this._url) {
      URL.revokeObjectURL(this._url);
      this._url = null;
    }
  }

  private _url: string | null = null;
}

function escapeHtml(text: string): string {
  const div = document.createElement('div');
  div.textContent = text;
  return div.innerHTML;
}
