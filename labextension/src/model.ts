/**
 * The data layer: what the sidebar, the run panels and the status bar show, polled from the
 * server extension. No DOM here, so it is unit-tested in Node with a fake requester.
 */
import { IDisposable } from '@lumino/disposable';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import {
  ICluster,
  IMetricsPage,
  IMetricsRow,
  IRun,
  IScalingPage,
  IRunConfig,
  IScalingReport,
  Requester,
  RunKind
} from './tokens';
import { formatValue } from './format';
import { unitOf } from './metrics';
import { PolledModel, Standby } from './polled';

/** The loss axis' title for a run of `kind`: nats/token for SFT only; "loss" for the others. */
export function lossUnit(kind?: RunKind | string | null): string {
  return unitOf('loss', kind);
}

/** The loss axes' title for runs compared: their one unit, or a neutral title for mixed kinds. */
export function lossTitle(
  kinds: (RunKind | string | null | undefined)[]
): string {
  const units = new Set(kinds.map(k => lossUnit(k)));
  return units.size === 1 ? [...units][0] : 'loss (nats/token for SFT runs)';
}

/**
 * Whether a run runs now: its record says "running" and the server found its process (a killed
 * kernel leaves its record "running", with `live: false`). Only such a run can be stopped; any
 * other run's record can be deleted.
 */
export function isLive(run: IRun): boolean {
  return run.state === 'running' && run.live !== false;
}

/** A run's state pill's tooltip: for a preempted run, the step and the checkpoint to resume from. */
export function stateTitle(run: IRun): string {
  if (run.state === 'preempted') {
    const where = run.checkpoint ? `; checkpoint at ${run.checkpoint}` : '';
    return `preempted at step ${run.step}${where}; resume with resume='latest' in its config`;
  }
  if (run.state === 'running' && !isLive(run)) {
    return `running, by its record, but ${run.stale ?? 'its process is gone'}: delete its record`;
  }
  return run.state;
}

/** The status bar text for a run: `live-sft · step 120/1000 · loss 1.23 · 3.20k tok/s`. */
export function statusText(run: IRun): string {
  return `${run.name} · ${progressParts(run).join(' · ')}`;
}

/** A run's progress as the sidebar and status bar write it: step, loss, tokens/s. */
export function progressParts(run: IRun): string[] {
  const steps = run.total_steps
    ? `${run.step}/${run.total_steps}`
    : `${run.step}`;
  return [
    `step ${steps}`,
    `loss ${formatValue(run.loss)}`,
    `${formatValue(run.tokens_per_s)} tok/s`
  ];
}

/** `2m 05s`, `1h 02m`, `12s`: how long a run ran (or has been running). */
export function formatDuration(seconds: number): string {
  if (!Number.isFinite(seconds) || seconds < 0) {
    return '–';
  }
  const s = Math.round(seconds);
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const pad = (n: number) => String(n).padStart(2, '0');
  if (h) {
    return `${h}h ${pad(m)}m`;
  }
  return m ? `${m}m ${pad(s % 60)}s` : `${s}s`;
}

/** `…/runs/lr-1e-2/adapter`: a long path shortened to its last parts (the whole on hover). */
export function shortPath(path: string, parts = 2): string {
  const pieces = path.split('/').filter(p => p);
  if (pieces.length <= parts) {
    return path;
  }
  return `…/${pieces.slice(-parts).join('/')}`;
}

/** The most recently started run that is still running, if any. */
export function newestRunning(runs: IRun[]): IRun | null {
  let newest: IRun | null = null;
  for (const run of runs) {
    if (isLive(run) && (!newest || run.started > newest.started)) {
      newest = run;
    }
  }
  return newest;
}

/**
 * Append a page of rows to what a panel already holds. Steps only grow within a run; a page
 * overlapping what we hold (a retried poll) keeps only the new steps.
 */
export function mergeRows(
  held: IMetricsRow[],
  page: IMetricsRow[]
): IMetricsRow[] {
  const last = held.length ? held[held.length - 1].step : -Infinity;
  const fresh = page.filter(row => row.step > last);
  return fresh.length ? held.concat(fresh) : held;
}

/**
 * The per-rank peak memory keys present in any row (`peak_memory_gb_rank0`, ...), in rank order.
 * Only runs on GPUs log them (nbtrain/telemetry/report.py Meter.row).
 */
export function rankMemoryKeys(rows: IMetricsRow[]): string[] {
  const ranks = new Set<number>();
  for (const row of rows) {
    for (const key of Object.keys(row)) {
      const m = /^peak_memory_gb_rank(\d+)$/.exec(key);
      if (m) {
        ranks.add(Number(m[1]));
      }
    }
  }
  return [...ranks].sort((a, b) => a - b).map(r => `peak_memory_gb_rank${r}`);
}

/** True when some row has a finite number under `key`. */
export function hasMetric(rows: IMetricsRow[], key: string): boolean {
  return rows.some(
    row => typeof row[key] === 'number' && Number.isFinite(row[key])
  );
}

/** A scaling report's table as the panel shows it: one line per size, predicted ones marked. */
export interface IScalingLine {
  size: number;
  ranks: number;
  tokensPerS: string;
  efficiency: string;
  predicted: boolean;
}

export function scalingLines(report: IScalingReport): IScalingLine[] {
  return report.rows.map(row => ({
    size: (report.unit === 'nodes' ? row.nodes : row.ranks) ?? row.ranks,
    ranks: row.ranks,
    tokensPerS: formatValue(row.tokens_per_s),
    efficiency: formatValue(row.efficiency),
    predicted: Boolean(row.predicted)
  }));
}

/** A run's scaling report, or null when it has none (the server answers 404). */
export async function fetchScaling(
  request: Requester,
  runId: string
): Promise<IScalingPage | null> {
  try {
    return await request<IScalingPage>(
      `runs/${encodeURIComponent(runId)}/scaling`
    );
  } catch (error) {
    if ((error as { response?: Response }).response?.status === 404) {
      return null;
    }
    throw error;
  }
}

/** A run's settings, kind and cluster (GET runs/<id>/config). */
export function fetchRunConfig(
  request: Requester,
  runId: string
): Promise<IRunConfig> {
  return request<IRunConfig>(`runs/${encodeURIComponent(runId)}/config`);
}

/** `ui-test.ipynb` for `/home/me/work/ui-test.ipynb`: a notebook's name without its folder. */
export function baseName(path: string): string {
  const parts = path.split('/').filter(p => p);
  return parts.length ? parts[parts.length - 1] : path;
}

/** Runs whose name, kind, state or folder contains every word of `query` (case-insensitive). */
export function filterRuns(runs: IRun[], query: string): IRun[] {
  const words = query
    .toLowerCase()
    .split(/\s+/)
    .filter(w => w);
  if (!words.length) {
    return runs;
  }
  return runs.filter(run => {
    const text =
      `${run.name} ${run.kind ?? ''} ${run.state} ${run.output_dir}`.toLowerCase();
    return words.every(w => text.includes(w));
  });
}

/** `1 node`, `4 nodes` for the report's `1 node(s)`, `4 node(s)`. */
export function plurals(text: string): string {
  return text.replace(/\b(\d+) (\w+?)\(s\)/g, (_m, n: string, word: string) =>
    Number(n) === 1 ? `${n} ${word}` : `${n} ${word}s`
  );
}

/** Sidebar state: the runs and clusters on this server, refreshed on a Poll. */
export class TrainingModel implements IDisposable {
  constructor(options: TrainingModel.IOptions) {
    this._request = options.request;
    const standby = options.standby ?? 'when-hidden';
    this._runsPoll = new Poll({
      factory: () => this._fetchRuns(),
      frequency: {
        interval: options.runsInterval ?? 2000,
        backoff: true,
        max: 30 * 1000
      },
      name: 'nbtrain:runs',
      standby
    });
    this._clustersPoll = new Poll({
      factory: () => this._fetchClusters(),
      frequency: {
        interval: options.clustersInterval ?? 5000,
        backoff: true,
        max: 60 * 1000
      },
      name: 'nbtrain:clusters',
      standby
    });
  }

  /** Every registered run, newest first. */
  get runs(): IRun[] {
    return this._runs;
  }

  get clusters(): ICluster[] {
    return this._clusters;
  }

  /** The last request error, or null once a request succeeded again. */
  get error(): string | null {
    return this._error;
  }

  /** Emitted whenever runs, clusters or the error change. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  get isDisposed(): boolean {
    return this._isDisposed;
  }

  getRun(id: string): IRun | undefined {
    return this._runs.find(run => run.id === id);
  }

  /** Fetch runs and clusters now rather than at the next tick. */
  async refresh(): Promise<void> {
    await Promise.all([this._runsPoll.refresh(), this._clustersPoll.refresh()]);
    await Promise.all([this._runsPoll.tick, this._clustersPoll.tick]);
  }

  /** Forget a run's record (DELETE runs/<id>); its folder stays on disk. */
  async deleteRun(id: string): Promise<void> {
    await this._request(`runs/${encodeURIComponent(id)}`, { method: 'DELETE' });
    await this._runsPoll.refresh();
  }

  /** Ask a running run to checkpoint and end at its next step. */
  async stopRun(id: string): Promise<void> {
    await this._request(`runs/${encodeURIComponent(id)}/stop`, {
      method: 'POST'
    });
    await this._runsPoll.refresh();
  }

  dispose(): void {
    if (this._isDisposed) {
      return;
    }
    this._isDisposed = true;
    this._runsPoll.dispose();
    this._clustersPoll.dispose();
    Signal.clearData(this);
  }

  private async _fetchRuns(): Promise<void> {
    try {
      const data = await this._request<{ runs: IRun[] }>('runs');
      if (this._isDisposed) {
        return;
      }
      this._runs = data.runs;
      this._error = null;
    } catch (error) {
      this._setError(error);
      throw error; // the Poll backs off
    }
    this._changed.emit();
  }

  private async _fetchClusters(): Promise<void> {
    try {
      const data = await this._request<{ clusters: ICluster[] }>('clusters');
      if (this._isDisposed) {
        return;
      }
      this._clusters = data.clusters;
    } catch (error) {
      this._setError(error);
      throw error;
    }
    this._changed.emit();
  }

  private _setError(error: unknown): void {
    this._error = error instanceof Error ? error.message : String(error);
    this._changed.emit();
  }

  private _request: Requester;
  private _runs: IRun[] = [];
  private _clusters: ICluster[] = [];
  private _error: string | null = null;
  private _runsPoll: Poll;
  private _clustersPoll: Poll;
  private _isDisposed = false;
  private _changed = new Signal<this, void>(this);
}

export namespace TrainingModel {
  export interface IOptions {
    request: Requester;
    /** Milliseconds between runs polls (2 s by default). */
    runsInterval?: number;
    /** Milliseconds between clusters polls (5 s: listing checks every engine's pid). */
    clustersInterval?: number;
    standby?: Standby;
  }
}

/**
 * One run's metrics, fetched incrementally (`?after=<last step>`) while the run is running;
 * polling stops once the run has ended and every row is in.
 */
export class RunMetrics extends PolledModel {
  constructor(options: RunMetrics.IOptions) {
    super({
      request: options.request,
      name: `nbtrain:metrics:${options.runId}`,
      interval: options.interval ?? 1000,
      standby: options.standby
    });
    this.runId = options.runId;
  }

  readonly runId: string;

  /** The run's record as of the last poll (null before the first one answers). */
  get run(): IRun | null {
    return this._run;
  }

  get rows(): IMetricsRow[] {
    return this._rows;
  }

  protected async load(): Promise<boolean> {
    let page = await this._fetchPage();
    // a long run opened late arrives in pages; take them all in this tick
    while (page.more && !this.isDisposed) {
      page = await this._fetchPage();
    }
    return page.run.state === 'running';
  }

  private async _fetchPage(): Promise<IMetricsPage> {
    const last = this._rows.length
      ? this._rows[this._rows.length - 1].step
      : -1;
    const id = encodeURIComponent(this.runId);
    const page = await this.request<IMetricsPage>(
      `runs/${id}/metrics?after=${last}`
    );
    if (this._run && page.run.started !== this._run.started) {
      // the same folder was started again: its metrics.jsonl begins anew
      this._rows = [];
      this._run = page.run;
      return this._fetchPage();
    }
    this._run = page.run;
    this._rows = mergeRows(this._rows, page.rows);
    return page;
  }

  private _run: IRun | null = null;
  private _rows: IMetricsRow[] = [];
}

export namespace RunMetrics {
  export interface IOptions {
    request: Requester;
    runId: string;
    /** Milliseconds between polls while the run runs (1 s by default; the issue asks ≤ 2 s). */
    interval?: number;
    standby?: Standby;
  }
}
