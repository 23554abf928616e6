/**
 * The one number format of the Lab (and, by /tmp/work/charts-contract.md, of the notebook's plots):
 * values with 3 significant digits and a k/M/G suffix, e-notation under 1e-2, and axis ticks at
 * 1, 2 or 5 x 10^n labelled in one format per axis.
 */

/**
 * Round tick values (1, 2 or 5 times a power of ten) covering [lo, hi], at least `minStep` apart
 * (1 for steps: there is no step 1.5).
 */
export function niceTicks(
  lo: number,
  hi: number,
  count = 4,
  minStep = 0
): number[] {
  const span = hi - lo;
  if (!(span > 0) || !Number.isFinite(span)) {
    return [lo];
  }
  const raw = Math.max(span / count, minStep);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const norm = raw / mag;
  // the smallest round step that gives at most `count` intervals
  const step = (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10) * mag;
  const ticks: number[] = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
    ticks.push(Number(t.toPrecision(12)));
  }
  return ticks;
}

/** The one way a value is written (legends, tooltips, tables, the sidebar, the status bar). */
export function formatValue(value: number | null | undefined): string {
  if (value === null || value === undefined || !Number.isFinite(value)) {
    return '–';
  }
  if (value === 0) {
    return '0';
  }
  const abs = Math.abs(value);
  for (const [div, suffix] of SUFFIXES) {
    // 999.7 reads 1.00k, not 1000
    if (div > 1 && Number((abs / div).toPrecision(3)) >= 1) {
      return `${(value / div).toPrecision(3)}${suffix}`;
    }
  }
  if (abs < 1e-2) {
    return Number(value.toPrecision(3)).toExponential();
  }
  return value.toPrecision(3);
}

// a thousand and more gets a suffix, on axes and in values alike
const SUFFIXES: Array<[number, string]> = [
  [1e9, 'G'],
  [1e6, 'M'],
  [1e3, 'k'],
  [1, '']
];

/** Round tick values for a log axis over [lo, hi] (values, not logs): 1-2-5 or powers of ten. */
export function logTicks(lo: number, hi: number, count = 4): number[] {
  if (!(lo > 0) || !(hi >= lo)) {
    return [];
  }
  const e0 = Math.floor(Math.log10(lo));
  const e1 = Math.ceil(Math.log10(hi));
  const within = (t: number) => t >= lo * (1 - 1e-9) && t <= hi * (1 + 1e-9);
  const decades = (e: number, mants: number[]) => {
    const out: number[] = [];
    for (let k = e0; k <= e1; k += e) {
      for (const m of mants) {
        const t = Number((m * Math.pow(10, k)).toPrecision(12));
        if (within(t)) {
          out.push(t);
        }
      }
    }
    return out;
  };
  for (const mants of [[1, 2, 5], [1]]) {
    const ticks = decades(1, mants);
    if (ticks.length >= 2 && ticks.length <= count + 1) {
      return ticks;
    }
  }
  const powers = decades(1, [1]);
  if (powers.length > count + 1) {
    // many decades: every other (or third...) power of ten
    const every = Math.ceil(powers.length / (count + 1));
    return decades(every, [1]);
  }
  // less than a decade between the ends: linear round ticks read on a log axis
  return niceTicks(lo, hi, count).filter(t => t > 0);
}

/**
 * Labels for one axis, all in one format: a shared suffix (`0, 5k, 10k`, never `5000` beside
 * `10k`), the decimals the tick step needs (`4.5, 5.0, 5.5`), `2e-4` for small values.
 */
export function axisLabels(ticks: number[]): string[] {
  if (!ticks.length) {
    return [];
  }
  const top = Math.max(...ticks.map(Math.abs));
  if (top === 0) {
    return ticks.map(() => '0');
  }
  if (top < 1e-2) {
    // the same mantissa decimals on every tick (1.90e-3, 1.95e-3, never 1.9e-3 beside 1.95e-3):
    // as few as keep the ticks distinct and exact
    for (let digits = 0; digits <= 6; digits++) {
      const labels = ticks.map(t => (t === 0 ? '0' : t.toExponential(digits)));
      if (
        new Set(labels).size === labels.length &&
        labels.every((l, i) => Math.abs(Number(l) - ticks[i]) <= 1e-9 * top)
      ) {
        return labels;
      }
    }
  }
  const [div, suffix] = SUFFIXES.find(([d]) => top >= d) ?? [1, ''];
  const scaled = ticks.map(t => t / div);
  const tiny = 1e-9 * Math.max(...scaled.map(Math.abs));
  // the decimals that tell every tick apart, and no more (on a log axis 0.01 needs 2 and 10 none:
  // there each tick has its own)
  const decimals = (values: number[]) => {
    for (let d = 0; d <= 8; d++) {
      const labels = values.map(v => v.toFixed(d));
      if (
        new Set(labels).size === labels.length &&
        values.every(v => Math.abs(Number(v.toFixed(d)) - v) <= tiny)
      ) {
        return d;
      }
    }
    return 8;
  };
  const d = decimals(scaled);
  return scaled.map(
    v => `${v === 0 ? '0' : v.toFixed(d)}${v === 0 ? '' : suffix}`
  );
}

/** Labels for a log axis: each tick written with the digits it needs (`0.01, 0.1, 1, 10`). */
export function logAxisLabels(ticks: number[]): string[] {
  const top = Math.max(...ticks.map(Math.abs));
  if (top >= 1e3) {
    return axisLabels(ticks);
  }
  return ticks.map(t =>
    t < 1e-2 ? axisLabels([t])[0] : String(Number(t.toPrecision(6)))
  );
}

/** The point whose x is nearest `x` (points in x order), or null for none. */
export function nearestByX(
  points: Array<[number, number]>,
  x: number
): [number, number] | null {
  if (!points.length) {
    return null;
  }
  let lo = 0;
  let hi = points.length - 1;
  while (hi - lo > 1) {
    const mid = (lo + hi) >> 1;
    if (points[mid][0] <= x) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return Math.abs(points[hi][0] - x) < Math.abs(points[lo][0] - x)
    ? points[hi]
    : points[lo];
}

/**
 * A linear axis' range widened to round ticks: from the tick at or below `lo` to the tick at or
 * above `hi`, so no data lies above the last labelled tick. A flat series gets some height.
 */
export function niceRange(lo: number, hi: number, count = 5): [number, number] {
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) {
    return [0, 1];
  }
  if (hi === lo) {
    const pad = Math.abs(lo) * 0.1 || 1;
    lo -= pad;
    hi += pad;
  }
  const ticks = niceTicks(lo, hi, count);
  const step = ticks.length > 1 ? ticks[1] - ticks[0] : hi - lo;
  const r = (v: number) => Number(v.toPrecision(12));
  return [
    r(Math.floor(lo / step + 1e-9) * step),
    r(Math.ceil(hi / step - 1e-9) * step)
  ];
}

/** A log axis' range widened to the tick (1, 2, 5 x 10^n) at or below `lo` and at or above `hi`. */
export function niceLogRange(lo: number, hi: number): [number, number] {
  if (!(lo > 0) || !(hi > 0)) {
    return [1e-3, 1];
  }
  const down = (v: number) => {
    const e = Math.pow(10, Math.floor(Math.log10(v) + 1e-9));
    const m = v / e;
    return (m >= 5 ? 5 : m >= 2 ? 2 : 1) * e;
  };
  const up = (v: number) => {
    const e = Math.pow(10, Math.floor(Math.log10(v) - 1e-9));
    const m = v / e;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * e;
  };
  const a = down(lo);
  let b = up(hi);
  if (b <= a) {
    b = a * 2;
  }
  return [Number(a.toPrecision(12)), Number(b.toPrecision(12))];
}
