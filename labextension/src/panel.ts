/**
 * A run's main-area panel: live charts of loss and eval loss, tokens/s and learning rate.
 * Everything comes from the server, so a panel opens (and keeps updating) without the
 * kernel that started the run.
 */
import { Widget } from '@lumino/widgets';

import { ISeries, LineChart } from './charts';
import { formatLoss, formatRate, RunMetrics } from './model';
import { IMetricsRow } from './tokens';

function series(
  rows: IMetricsRow[],
  key: string,
  label: string,
  className: string
): ISeries {
  const points: Array<[number, number]> = [];
  for (const row of rows) {
    const value = row[key];
    if (typeof value === 'number' && Number.isFinite(value)) {
      points.push([row.step, value]);
    }
  }
  return { label, className, points };
}

export class RunPanel extends Widget {
  constructor(metrics: RunMetrics, onStop: (id: string) => void) {
    super();
    this.metrics = metrics;
    this._onStop = onStop;
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
    this._loss = new LineChart('Loss', 'loss');
    this._throughput = new LineChart('Tokens/s', 'tokens_per_s');
    this._lr = new LineChart('Learning rate', 'learning_rate');
    const grid = document.createElement('div');
    grid.className = 'nbtrain-RunPanel-charts';
    grid.append(this._loss.node, this._throughput.node, this._lr.node);
    this.node.append(this._header, grid);
    metrics.changed.connect(this._render, this);
    this._render();
  }

  readonly metrics: RunMetrics;

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this.metrics.dispose();
    super.dispose();
  }

  private _render(): void {
    const run = this.metrics.run;
    const rows = this.metrics.rows;
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
  }

  private _onStop: (id: string) => void;
  private _header: HTMLElement;
  private _summary: HTMLElement;
  private _stop: HTMLButtonElement;
  private _loss: LineChart;
  private _throughput: LineChart;
  private _lr: LineChart;
}

function escapeHtml(text: string): string {
  const div = document.createElement('div');
  div.textContent = text;
  return div.innerHTML;
}
