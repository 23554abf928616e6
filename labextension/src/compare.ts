/**
 * The data layer of a run comparison: the runs fetched from `compare?runs=...`, their curves
 * against step or time, TensorBoard's smoothing, the value nearest a hovered x, and the CSV of
 * what is shown. No DOM here, so it is unit-tested in Node.
 */
import { nearestByX } from './format';
import { PolledModel, Standby } from './polled';
import { ICompareRun, IComparePage, IMetricsRow, Requester } from './tokens';

export type XAxis = 'step' | 'time';

/** The curves a comparison draws (nbtrain.compare.COMPARE_METRICS), with their chart titles. */
export const COMPARE_METRICS: Array<{ key: string; title: string }> = [
  { key: 'loss', title: 'Loss' },
  { key: 'eval_loss', title: 'Eval loss' },
  { key: 'tokens_per_s', title: 'Tokens/s' },
  { key: 'learning_rate', title: 'Learning rate' }
];

/**
 * TensorBoard's smoothing, as nbtrain.compare.ema computes it: an exponential moving average,
 * debiased. smoothed_i = last_i / (1 - weight^n_i), where last_i = weight * last_(i-1) +
 * (1 - weight) * v_i and n_i counts the finite values so far. A value that is not finite (null,
 * NaN) is passed through and does not move the average; a constant series stays as it is.
 */
export function ema(values: Array<number | null>, weight: number): number[] {
  if (!(weight >= 0 && weight < 1)) {
    throw new RangeError(
      `smoothing weight ${weight}: pass a number in [0, 1) (0 = none)`
    );
  }
  const vals = values.map(v => (v === null ? NaN : v));
  if (
    weight === 0 ||
    vals.every(v => v === vals[0]) ||
    !vals.some(v => Number.isFinite(v))
  ) {
    return vals;
  }
  let last = 0;
  let n = 0;
  return vals.map(v => {
    if (!Number.isFinite(v)) {
      return v;
    }
    last = last * weight + (1 - weight) * v;
    n += 1;
    return last / (1 - Math.pow(weight, n));
  });
}

/** The first wall-clock time among the rows: a run's time axis starts there. */
function startTime(rows: IMetricsRow[]): number | null {
  for (const row of rows) {
    if (typeof row.time === 'number' && Number.isFinite(row.time)) {
      return row.time;
    }
  }
  return null;
}

/** The x of a row: its step, or seconds since the run's first row (null when it has no time). */
function xOf(row: IMetricsRow, x: XAxis, t0: number | null): number | null {
  if (x === 'step') {
    return row.step;
  }
  if (t0 === null || typeof row.time !== 'number') {
    return null;
  }
  return row.time - t0;
}

/** One run's (x, value) points of `metric`; rows without a value (or, by time, a time) left out. */
export function runPoints(
  run: ICompareRun,
  metric: string,
  x: XAxis
): Array<[number, number]> {
  const t0 = startTime(run.rows);
  const points: Array<[number, number]> = [];
  for (const row of run.rows) {
    const value = row[metric];
    const at = xOf(row, x, t0);
    if (typeof value === 'number' && Number.isFinite(value) && at !== null) {
      points.push([at, value]);
    }
  }
  return points;
}

/** The same points with their values smoothed by `ema`. */
export function smooth(
  points: Array<[number, number]>,
  weight: number
): Array<[number, number]> {
  const values = ema(
    points.map(p => p[1]),
    weight
  );
  return points.map(([x], i) => [x, values[i]]);
}

/** The point whose x is nearest `x` (points in x order), or null for none. */
export const nearest = nearestByX;

function csvCell(value: unknown): string {
  if (value === null || value === undefined) {
    return '';
  }
  const text = String(value);
  return /[",\n\r]/.test(text) ? `"${text.replace(/"/g, '""')}"` : text;
}

/**
 * The shown curves as CSV: one line per run and logged row, columns run, x, then for each metric
 * its raw value and its smoothed value as drawn (empty where the row has none).
 */
export function compareCSV(
  runs: ICompareRun[],
  x: XAxis,
  weight: number,
  metrics: string[] = COMPARE_METRICS.map(m => m.key),
  smoothable: (metric: string, points: number, rows: number) => boolean = () =>
    true
): string {
  const header = ['run', x];
  for (const m of metrics) {
    header.push(m, `${m}_smoothed`);
  }
  const lines = [header.join(',')];
  for (const run of runs) {
    // each metric is smoothed over its own values, as its chart draws it
    const smoothed = new Map<string, Map<IMetricsRow, number>>();
    for (const m of metrics) {
      const rows = run.rows.filter(
        r => typeof r[m] === 'number' && Number.isFinite(r[m])
      );
      // as drawn: a metric never smoothed (learning rate) or too sparse (eval) is its raw value
      const values = ema(
        rows.map(r => r[m] as number),
        smoothable(m, rows.length, run.rows.length) ? weight : 0
      );
      smoothed.set(m, new Map(rows.map((r, i) => [r, values[i]])));
    }
    const t0 = startTime(run.rows);
    for (const row of run.rows) {
      const at = xOf(row, x, t0);
      if (at === null || !metrics.some(m => smoothed.get(m)!.has(row))) {
        continue;
      }
      const cells = [
        csvCell(run.label),
        csvCell(x === 'time' ? round(at) : at)
      ];
      for (const m of metrics) {
        cells.push(csvCell(row[m]), csvCell(smoothed.get(m)!.get(row)));
      }
      lines.push(cells.join(','));
    }
  }
  return lines.join('\n') + '\n';
}

function round(seconds: number): number {
  return Math.round(seconds * 1000) / 1000;
}

/** A setting's value in the differences table: `1e-3`, `true`, `—` for unset, JSON otherwise. */
export function formatSetting(value: unknown): string {
  if (value === null || value === undefined) {
    return '—';
  }
  if (typeof value === 'number') {
    return Math.abs(value) < 1e-2 && value !== 0
      ? value.toExponential().replace(/\.?0+e/, 'e')
      : String(value);
  }
  if (typeof value === 'string') {
    return value;
  }
  return JSON.stringify(value);
}

/** A run's final value of a metric, or null. */
export function finalValue(run: ICompareRun, metric: string): number | null {
  const value = run.final[metric];
  return typeof value === 'number' && Number.isFinite(value) ? value : null;
}

/** The compared runs, fetched again every couple of seconds while any of them still runs. */
export class CompareModel extends PolledModel {
  constructor(options: CompareModel.IOptions) {
    super({
      request: options.request,
      name: 'nbtrain:compare',
      interval: options.interval ?? 2000,
      standby: options.standby
    });
    this.runIds = [...options.runIds];
  }

  readonly runIds: string[];

  /** The last answer (null before the first one). */
  get page(): IComparePage | null {
    return this._page;
  }

  protected async load(): Promise<boolean> {
    const ids = this.runIds.map(encodeURIComponent).join(',');
    const page = await this.request<IComparePage>(`compare?runs=${ids}`);
    if (!this.isDisposed) {
      this._page = page;
    }
    return page.runs.some(run => run.state === 'running');
  }

  private _page: IComparePage | null = null;
}

export namespace CompareModel {
  export interface IOptions {
    request: Requester;
    runIds: string[];
    /** Milliseconds between fetches while a run runs (2 s by default). */
    interval?: number;
    standby?: Standby;
  }
}
