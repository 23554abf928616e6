/**
 * Which charts a run gets: every numeric metric it logged, grouped by prefix as TensorBoard groups
 * tags, the most watched first for its kind, each with its unit where it has one; whether a series
 * may be smoothed; and the colour of each run (the same in every view). No DOM here: unit-tested.
 * The rules are shared with the notebook's plots (/tmp/work/charts-contract.md, docs/lab.md).
 */
import type { ISeries } from './charts';
import { ema } from './compare';
import { IMetricsRow } from './tokens';

/** Light-theme colours (each >= 4.6:1 on white) and dark-theme ones (>= 7.5:1 on #111111). */
export const PALETTE_LIGHT = [
  '#1f6fb4',
  '#c4501e',
  '#2a7f39',
  '#8e5bb8',
  '#8a6d00',
  '#c2407f',
  '#137a84',
  '#666666'
];
export const PALETTE_DARK = [
  '#5aa9f2',
  '#f2884f',
  '#5cc96e',
  '#c19bf0',
  '#e3c04a',
  '#f27fb3',
  '#4cc9d4',
  '#b0b0b0'
];

/** FNV-1a (32 bit) of a string's UTF-8 bytes: the hash the notebook's plots use too. */
export function fnv1a(text: string): number {
  let h = 0x811c9dc5;
  for (const b of new TextEncoder().encode(text)) {
    h ^= b;
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  return h >>> 0;
}

/** A run's colour index: from its id alone, so it is the same whatever runs are shown with it. */
export function runColour(runId: string): number {
  return fnv1a(runId) % PALETTE_LIGHT.length;
}

/**
 * The colour indexes of one run's `n` lines in a chart of its own panel: the run's colour (the
 * sidebar's dot, its colour in compare) for the first (the loss, or the chart's first series), then
 * the next palette colours after it, so no colour is used twice in a chart of up to 8 lines.
 */
export function runLineColours(runId: string, n: number): number[] {
  const first = runColour(runId);
  return Array.from(
    { length: n },
    (_, i) => (first + i) % PALETTE_LIGHT.length
  );
}

/**
 * How opaque a raw (unsmoothed) line is behind its smoothed one, per theme. Dark: 0.6, so the raw
 * line reads on #111111 (>= 3:1 for every palette colour) and the smoothed line still stands out
 * from it (>= 2:1); at 0.45 the raw lines faded into the background. Light: 0.35, as the notebook.
 */
export const RAW_ALPHA = { light: 0.35, dark: 0.6 };

/** `#rrggbb` at `alpha` as `#rrggbbaa` (uPlot's canvas strokes). */
export function withAlpha(hex: string, alpha: number): string {
  const a = Math.round(Math.min(1, Math.max(0, alpha)) * 255);
  return hex + a.toString(16).padStart(2, '0');
}

/**
 * Each run's colour index (metrics.runColour: from its id, the same in every view); where two runs
 * share a colour, the later one is drawn dashed.
 */
export function runStyles(
  runs: Array<{ id: string }>
): Array<{ colour: number; dashed: boolean }> {
  const seen = new Set<number>();
  return runs.map(run => {
    const colour = runColour(run.id);
    const dashed = seen.has(colour);
    seen.add(colour);
    return { colour, dashed };
  });
}

/** The metric keys that are not charted: the x axes. */
const NOT_CHARTED = new Set(['step', 'time']);

/** Every key with a finite number in some row, in the order first seen. */
export function numericKeys(rows: IMetricsRow[]): string[] {
  const keys = new Set<string>();
  for (const row of rows) {
    for (const [key, value] of Object.entries(row)) {
      if (
        !NOT_CHARTED.has(key) &&
        typeof value === 'number' &&
        Number.isFinite(value)
      ) {
        keys.add(key);
      }
    }
  }
  return [...keys];
}

/** A key's group, TensorBoard's prefix rule with a few names joined (memory, timings, reward). */
export function groupOf(key: string): string {
  if (key.startsWith('eval_')) {
    return 'eval';
  }
  if (key.includes('/')) {
    return key.slice(0, key.indexOf('/'));
  }
  if (/^peak_memory_gb(_rank\d+)?$/.test(key)) {
    return 'memory';
  }
  if (
    key === 'reward' ||
    key === 'reward_std' ||
    key.endsWith('_reward_zero_std')
  ) {
    return 'reward';
  }
  if (
    key !== 'tokens_per_s' &&
    (key.endsWith('_time') || key.endsWith('_s') || key.endsWith('_seconds'))
  ) {
    return 'timings';
  }
  return key;
}

/** Groups in this order, then any other A-Z. */
const GROUP_ORDER = [
  'loss',
  'eval',
  'reward',
  'rewards',
  'logps',
  'completions',
  'kl',
  'clip_ratio',
  'grad_norm',
  'learning_rate',
  'tokens_per_s',
  'mfu',
  'memory',
  'timings',
  'epoch'
];

/** The charts watched most, per kind, drawn first ("overview"). */
export function overviewKeys(
  kind: string | null | undefined,
  keys: string[]
): string[] {
  const has = new Set(keys);
  let wanted: string[];
  if (kind === 'dpo') {
    wanted = ['loss', 'rewards/margins', 'rewards/accuracies', 'eval_loss'];
  } else if (kind === 'grpo') {
    const perFunction = keys.filter(k => /^rewards\/.+\/mean$/.test(k));
    wanted = [
      ...perFunction,
      'reward',
      'completions/mean_length',
      'kl',
      'loss'
    ];
  } else if (!kind || kind === 'sft' || kind === 'finetune') {
    wanted = ['loss', 'eval_loss'];
  } else {
    // a kind this Lab does not know (e.g. "tinker"): every chart in its group, none put first
    wanted = [];
  }
  return wanted.filter(k => has.has(k));
}

/** One chart: its key (the `data-chart` of its figure), title, unit and the keys it draws. */
export interface IChartSpec {
  key: string;
  title: string;
  /** The y axis' title: the unit where it is true, else the metric's name. */
  yTitle: string;
  /** The metrics drawn on it (a run panel draws eval_loss over loss, memory a line per rank). */
  keys: string[];
  /** A factor applied to values (MFU is logged as a fraction, drawn in %). */
  scale: number;
  /** Whether it may be smoothed at all (never the learning rate, memory, MFU, epoch). */
  smoothable: boolean;
}

/** One group of charts under a heading. */
export interface IChartGroup {
  name: string;
  charts: IChartSpec[];
}

const NEVER_SMOOTHED = /^(learning_rate|epoch|mfu|peak_memory_gb.*)$/;

/** The y title of `key`: its unit where it is true (nats/token is SFT's loss only). */
export function unitOf(key: string, kind?: string | null): string {
  if (key === 'loss' || key === 'eval_loss') {
    return !kind || kind === 'sft' || kind === 'finetune'
      ? 'nats/token'
      : 'loss';
  }
  if (key === 'tokens_per_s') {
    return 'tokens/s';
  }
  if (key.startsWith('peak_memory_gb')) {
    return 'GB';
  }
  if (key === 'mfu') {
    return '%';
  }
  if (groupOf(key) === 'timings') {
    return 's';
  }
  if (key === 'completions/mean_length') {
    return 'tokens';
  }
  if (key.startsWith('logps/') || key.startsWith('eval_logps/')) {
    return 'nats';
  }
  return key;
}

const TITLES: Record<string, string> = {
  loss: 'Loss',
  eval_loss: 'Eval loss',
  tokens_per_s: 'Tokens/s',
  learning_rate: 'Learning rate',
  grad_norm: 'Grad norm',
  mfu: 'MFU',
  peak_memory_gb: 'GPU peak memory',
  kl: 'KL',
  'rewards/margins': 'Reward margin',
  'rewards/accuracies': 'Reward accuracy',
  reward: 'Reward',
  'completions/mean_length': 'Completion length'
};

function spec(
  key: string,
  kind: string | null | undefined,
  keys = [key]
): IChartSpec {
  return {
    key,
    title: TITLES[key] ?? key,
    yTitle: unitOf(key, kind),
    keys,
    scale: key === 'mfu' ? 100 : 1,
    smoothable: !NEVER_SMOOTHED.test(key)
  };
}

/**
 * The charts of the metrics in `keys`, grouped: "overview" first (the kind's most watched), then
 * each group in GROUP_ORDER. `perRun`: a run panel, where eval loss is drawn over loss and each
 * rank's memory in one chart; a comparison draws one metric per chart, a line per run.
 */
export function chartGroups(
  keys: string[],
  kind: string | null | undefined,
  perRun: boolean
): IChartGroup[] {
  const has = new Set(keys);
  const ranks = keys.filter(k => /^peak_memory_gb_rank\d+$/.test(k));
  ranks.sort((a, b) => Number(a.slice(19)) - Number(b.slice(19)));
  const folded = new Set<string>();
  const make = (key: string): IChartSpec => {
    if (perRun && key === 'loss' && has.has('eval_loss')) {
      folded.add('eval_loss');
      return spec('loss', kind, ['loss', 'eval_loss']);
    }
    if (perRun && key === 'peak_memory_gb' && ranks.length) {
      ranks.forEach(r => folded.add(r));
      return spec(key, kind, ranks);
    }
    return spec(key, kind);
  };
  // a run panel charts memory once: the busiest rank's key stands for the per-rank chart
  const chartable = keys.filter(
    k => !(perRun && ranks.includes(k) && has.has('peak_memory_gb'))
  );
  const done = new Set<string>();
  const groups: IChartGroup[] = [];
  const overview = overviewKeys(kind, chartable)
    .filter(k => !(perRun && k === 'eval_loss' && has.has('loss')))
    .map(make);
  overview.forEach(c => c.keys.forEach(k => done.add(k)));
  if (overview.length) {
    groups.push({ name: 'overview', charts: overview });
  }
  const byGroup = new Map<string, string[]>();
  for (const key of chartable) {
    if (done.has(key) || folded.has(key)) {
      continue;
    }
    const g = groupOf(key);
    byGroup.set(g, [...(byGroup.get(g) ?? []), key]);
  }
  const rank = (g: string) => {
    const i = GROUP_ORDER.indexOf(g);
    return i < 0 ? GROUP_ORDER.length : i;
  };
  const names = [...byGroup.keys()].sort(
    (a, b) => rank(a) - rank(b) || a.localeCompare(b)
  );
  for (const name of names) {
    const charts: IChartSpec[] = [];
    for (const key of byGroup.get(name)!.sort(keyOrder)) {
      if (!folded.has(key) && !done.has(key)) {
        const c = make(key);
        c.keys.forEach(k => done.add(k));
        charts.push(c);
      }
    }
    if (charts.length) {
      groups.push({ name, charts });
    }
  }
  return groups;
}

/** Within a group: means before their std, then A-Z. */
function keyOrder(a: string, b: string): number {
  const std = (k: string) => (/(^|[/_])std$/.test(k) ? 1 : 0);
  return std(a) - std(b) || a.localeCompare(b);
}

/**
 * Whether a series logged on `present` of `rows` rows may be smoothed by index: only when it is
 * logged at (nearly) every row. A sparse series (eval every N steps) is drawn as logged: an EMA
 * over its few points would weigh a gap of 25 steps like a gap of one.
 */
export function denseEnough(present: number, rows: number): boolean {
  return rows > 0 && present >= 0.5 * rows;
}

/** A line as logged, and how many rows its run logged (a series on few of them is sparse). */
export interface IRawSeries extends ISeries {
  rows: number;
}

/**
 * The lines of a chart as drawn at smoothing `weight`: smoothed (raw kept for the faint line and
 * the tooltip) only where the chart may be smoothed and the series is logged at nearly every row.
 */
export function smoothed(
  spec: IChartSpec,
  lines: IRawSeries[],
  weight: number
): ISeries[] {
  return lines.map(({ rows, ...line }) => {
    if (
      !(weight > 0) ||
      !spec.smoothable ||
      !denseEnough(line.points.length, rows)
    ) {
      return line;
    }
    const values = ema(
      line.points.map(p => p[1]),
      weight
    );
    return {
      ...line,
      points: line.points.map(([x], i) => [x, values[i]] as [number, number]),
      raw: line.points
    };
  });
}
