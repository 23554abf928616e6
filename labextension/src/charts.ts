/**
 * Small SVG line charts drawn by hand: a run panel needs a few of them, redrawn every second,
 * which does not justify a charting library in the bundle. Each is drawn at the width it is shown
 * at (its text keeps its size), with axis titles, round ticks (on a log axis too), and numbers in
 * one format (`formatValue`, `axisLabels`).
 */

/** One line on a chart: (step, value) points, in step order. */
export interface ISeries {
  label: string;
  /** A CSS class that sets the stroke colour (see style/base.css). */
  className: string;
  points: Array<[number, number]>;
  /** Where `points` are smoothed: the raw points, drawn faint underneath and named in the tooltip. */
  raw?: Array<[number, number]>;
}

/** The points of a series on a log10 y axis: values that are not positive cannot be drawn. */
export function logPoints(
  points: Array<[number, number]>
): Array<[number, number]> {
  return points.filter(([, y]) => y > 0).map(([x, y]) => [x, Math.log10(y)]);
}

export interface IExtent {
  x0: number;
  x1: number;
  y0: number;
  y1: number;
}

/**
 * At most ~`max` points, keeping each bucket's lowest and highest value so that loss spikes
 * survive the thinning.
 */
export function downsample(
  points: Array<[number, number]>,
  max: number
): Array<[number, number]> {
  if (points.length <= max) {
    return points;
  }
  const buckets = Math.max(1, Math.floor(max / 2));
  const size = points.length / buckets;
  const out: Array<[number, number]> = [];
  for (let b = 0; b < buckets; b++) {
    const start = Math.floor(b * size);
    const end = Math.min(points.length, Math.floor((b + 1) * size));
    let lo = start;
    let hi = start;
    for (let i = start; i < end; i++) {
      if (points[i][1] < points[lo][1]) {
        lo = i;
      }
      if (points[i][1] > points[hi][1]) {
        hi = i;
      }
    }
    const pair = lo < hi ? [lo, hi] : lo > hi ? [hi, lo] : [lo];
    for (const i of pair) {
      out.push(points[i]);
    }
  }
  const last = points[points.length - 1];
  if (out[out.length - 1] !== last) {
    out.push(last);
  }
  return out;
}

/** The box every series fits in; a flat line gets some height so it is not drawn on an edge. */
export function extent(series: ISeries[]): IExtent | null {
  let x0 = Infinity;
  let x1 = -Infinity;
  let y0 = Infinity;
  let y1 = -Infinity;
  for (const s of series) {
    for (const [x, y] of s.points) {
      x0 = Math.min(x0, x);
      x1 = Math.max(x1, x);
      y0 = Math.min(y0, y);
      y1 = Math.max(y1, y);
    }
  }
  if (!Number.isFinite(x0) || !Number.isFinite(y0)) {
    return null;
  }
  if (x1 === x0) {
    x1 = x0 + 1;
  }
  if (y1 === y0) {
    const pad = Math.abs(y0) * 0.1 || 1;
    y0 -= pad;
    y1 += pad;
  }
  return { x0, x1, y0, y1 };
}

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

/** An SVG path through `points`, mapped into a `width` × `height` box. */
export function linePath(
  points: Array<[number, number]>,
  box: IExtent,
  width: number,
  height: number
): string {
  const sx = width / (box.x1 - box.x0);
  const sy = height / (box.y1 - box.y0);
  return points
    .map(([x, y], i) => {
      const px = ((x - box.x0) * sx).toFixed(1);
      const py = (height - (y - box.y0) * sy).toFixed(1);
      return `${i ? 'L' : 'M'}${px},${py}`;
    })
    .join('');
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
    // as few mantissa digits as keep the ticks distinct
    for (let digits = 1; digits <= 7; digits++) {
      const labels = ticks.map(t =>
        t === 0 ? '0' : Number(t.toPrecision(digits)).toExponential()
      );
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

const SVG_NS = 'http://www.w3.org/2000/svg';
/** The width drawn before the chart is laid out (then: its own width, so text keeps its size). */
const DEFAULT_WIDTH = 480;
const HEIGHT = 200;
const MARGIN = { left: 40, right: 12, top: 10, bottom: 36 };
// a tick label's width per character at the ticks' 11px font (digits are about 0.6em), the gap
// between the label and the plot, and the room of the rotated y title
const TICK_CHAR = 6.6;
const TICK_GAP = 6;
const Y_TITLE = 16;

/** The plot's left margin: room for the y title and the longest y label (`4.999e-3`). */
export function leftMargin(yLabels: string[]): number {
  const longest = Math.max(0, ...yLabels.map(l => l.length));
  return Math.max(
    MARGIN.left,
    Y_TITLE + Math.ceil(longest * TICK_CHAR) + TICK_GAP + 2
  );
}

/** How a chart draws: a log y axis, the axes' titles, a tooltip on hover. */
export interface IChartOptions {
  logY?: boolean;
  /** What the x axis counts: `step` (the default) or `seconds`. */
  xTitle?: string;
  /** The y axis' title, with its unit (`nats/token`, `tokens/s`, `GB`). */
  yTitle?: string;
  /** Show each series' value at the x nearest the pointer. */
  hover?: boolean;
  /** A remark beside the title (`smoothed 0.60`). */
  note?: string;
}

/** One tooltip line: a series, its value at the hovered x, and its raw value when smoothed. */
export interface ITooltipLine {
  label: string;
  className: string;
  value: number;
  raw?: number;
}

/** One chart: a title, a legend and an SVG redrawn by `update`, at its own width. */
export class LineChart {
  constructor(title: string, name: string, options: IChartOptions = {}) {
    this._options = { ...options };
    this.node = document.createElement('figure');
    this.node.className = 'nbtrain-Chart';
    this.node.dataset.chart = name;
    const caption = document.createElement('figcaption');
    const head = document.createElement('span');
    head.className = 'nbtrain-Chart-title';
    head.textContent = title;
    this._note = document.createElement('span');
    this._note.className = 'nbtrain-Chart-note';
    this._legend = document.createElement('span');
    this._legend.className = 'nbtrain-Chart-legend';
    caption.append(head, this._note, this._legend);
    this._svg = document.createElementNS(SVG_NS, 'svg');
    this._svg.setAttribute('height', String(HEIGHT));
    this._tip = document.createElement('div');
    this._tip.className = 'nbtrain-Chart-tooltip';
    this._tip.hidden = true;
    this.node.append(caption, this._svg, this._tip);
    if (options.hover) {
      this._svg.addEventListener('mousemove', this._onMove);
      this._svg.addEventListener('mouseleave', this._onLeave);
    }
    // drawn at the width it is shown at: tick labels keep their size however wide the chart is
    if (typeof ResizeObserver !== 'undefined') {
      this._resize = new ResizeObserver(() => {
        const width = this._measure();
        if (width !== this._width) {
          this.update(this._series);
        }
      });
      this._resize.observe(this.node);
    }
  }

  readonly node: HTMLElement;

  /** Change how the chart draws; the next `update` uses it. */
  setOptions(options: IChartOptions): void {
    this._options = { ...this._options, ...options };
  }

  /** Draw the last series again (at the chart's width now). */
  redraw(): void {
    this.update(this._series);
  }

  /** Stop following the chart's width. */
  dispose(): void {
    this._resize?.disconnect();
  }

  /**
   * Redraw with these series (empty series are left out of the legend). A series with `raw` is
   * smoothed: its raw curve is drawn faint underneath, its legend gives the last raw value, and
   * its tooltip both.
   */
  update(series: ISeries[]): void {
    this._series = series;
    const width = this._measure();
    this._width = width;
    this._svg.setAttribute('viewBox', `0 0 ${width} ${HEIGHT}`);
    const logY = Boolean(this._options.logY);
    this.node.dataset.logY = String(logY);
    this._note.textContent = this._options.note ?? '';
    const shown = series
      .map(s =>
        logY
          ? {
              ...s,
              points: logPoints(s.points),
              raw: s.raw ? logPoints(s.raw) : undefined
            }
          : s
      )
      .filter(s => s.points.length > 0);
    this._shown = shown;
    this._layout = null;
    this._onLeave();
    const unlog = (v: number) => (logY ? Math.pow(10, v) : v);
    this._legend.replaceChildren(
      ...shown.map(s => {
        const item = document.createElement('span');
        item.className = `nbtrain-Chart-key ${s.className}`;
        item.dataset.series = s.label;
        // the value the run ended at: the raw one where the line is smoothed
        const last = (s.raw?.length ? s.raw : s.points).at(-1)![1];
        item.textContent = `${s.label} ${formatValue(unlog(last))}`;
        item.title = s.raw
          ? `${s.label}: last value ${formatValue(unlog(last))} (the line is smoothed)`
          : `${s.label}: last value`;
        return item;
      })
    );
    const box = extent(
      shown.flatMap(s =>
        s.raw ? [s, { ...s, points: s.raw, raw: undefined }] : [s]
      )
    );
    this._svg.replaceChildren();
    this.node.dataset.points = String(
      shown.reduce((n, s) => n + s.points.length, 0)
    );
    if (!box) {
      const empty = this._el('text', {
        x: width / 2,
        y: HEIGHT / 2,
        class: 'nbtrain-Chart-empty',
        'text-anchor': 'middle'
      });
      empty.textContent = 'no data yet';
      this._svg.appendChild(empty);
      return;
    }
    let yTicks: number[];
    let yLabels: string[];
    if (logY) {
      const values = logTicks(Math.pow(10, box.y0), Math.pow(10, box.y1), 4);
      yTicks = values.map(Math.log10);
      yLabels = logAxisLabels(values);
    } else {
      yTicks = niceTicks(box.y0, box.y1, 5);
      yLabels = axisLabels(yTicks);
    }
    const left = leftMargin(yLabels);
    const w = Math.max(10, width - left - MARGIN.right);
    const h = HEIGHT - MARGIN.top - MARGIN.bottom;
    const plot = this._el('g', {
      transform: `translate(${left},${MARGIN.top})`
    });
    for (const [i, t] of yTicks.entries()) {
      const y = h - ((t - box.y0) / (box.y1 - box.y0)) * h;
      plot.appendChild(
        this._el('line', {
          x1: 0,
          x2: w,
          y1: y,
          y2: y,
          class: 'nbtrain-Chart-grid'
        })
      );
      const label = this._el('text', {
        x: -TICK_GAP,
        y: y + 4,
        'text-anchor': 'end',
        class: 'nbtrain-Chart-tick nbtrain-Chart-yTick'
      });
      label.textContent = yLabels[i];
      plot.appendChild(label);
    }
    // about one x tick per 70 px, so wide charts get more and narrow ones do not crowd
    const xTicks = niceTicks(
      box.x0,
      box.x1,
      Math.max(2, Math.min(10, Math.floor(w / 70))),
      (this._options.xTitle ?? 'step') === 'step' ? 1 : 0
    );
    const xLabels = axisLabels(xTicks);
    for (const [i, t] of xTicks.entries()) {
      const x = ((t - box.x0) / (box.x1 - box.x0)) * w;
      const label = this._el('text', {
        x,
        y: h + 15,
        'text-anchor': 'middle',
        class: 'nbtrain-Chart-tick nbtrain-Chart-xTick'
      });
      label.textContent = xLabels[i];
      plot.appendChild(label);
    }
    const xTitle = this._el('text', {
      x: w / 2,
      y: h + 31,
      'text-anchor': 'middle',
      class: 'nbtrain-Chart-axisTitle nbtrain-Chart-xTitle'
    });
    xTitle.textContent = this._options.xTitle ?? 'step';
    plot.appendChild(xTitle);
    if (this._options.yTitle) {
      const yTitle = this._el('text', {
        transform: `translate(${-left + 12},${h / 2}) rotate(-90)`,
        'text-anchor': 'middle',
        class: 'nbtrain-Chart-axisTitle nbtrain-Chart-yTitle'
      });
      yTitle.textContent = this._options.yTitle + (logY ? ' (log)' : '');
      plot.appendChild(yTitle);
    }
    // faint raw curves first, so the lines people read are drawn over them
    const lines: Array<[ISeries, Array<[number, number]>, boolean]> = [
      ...shown
        .filter(s => s.raw?.length)
        .map(
          s => [s, s.raw!, true] as [ISeries, Array<[number, number]>, boolean]
        ),
      ...shown.map(
        s => [s, s.points, false] as [ISeries, Array<[number, number]>, boolean]
      )
    ];
    for (const [s, points, faint] of lines) {
      const path = this._el('path', {
        d: linePath(downsample(points, 2 * w), box, w, h),
        class: `nbtrain-Chart-line ${s.className}${faint ? ' nbtrain-Chart-faint' : ''}`,
        'vector-effect': 'non-scaling-stroke'
      });
      path.dataset.series = s.label;
      plot.appendChild(path);
    }
    this._guide = this._el('line', {
      y1: 0,
      y2: h,
      class: 'nbtrain-Chart-guide',
      visibility: 'hidden'
    });
    plot.appendChild(this._guide);
    this._svg.appendChild(plot);
    this._layout = { box, left, w, h };
  }

  /** The tooltip's lines at data x `x`: each series' value at its point nearest x (and raw). */
  tooltipAt(x: number): { x: number; lines: ITooltipLine[] } | null {
    const logY = Boolean(this._options.logY);
    const unlog = (v: number) => (logY ? Math.pow(10, v) : v);
    let at: number | null = null;
    const lines: ITooltipLine[] = [];
    for (const s of this._shown) {
      const p = nearestByX(s.points, x);
      if (!p) {
        continue;
      }
      if (at === null || Math.abs(p[0] - x) < Math.abs(at - x)) {
        at = p[0];
      }
      const line: ITooltipLine = {
        label: s.label,
        className: s.className,
        value: unlog(p[1])
      };
      if (s.raw) {
        const r = nearestByX(s.raw, p[0]);
        if (r) {
          line.raw = unlog(r[1]);
        }
      }
      lines.push(line);
    }
    return at === null ? null : { x: at, lines };
  }

  private _measure(): number {
    const w = this.node.clientWidth;
    return w > 0 ? Math.round(w) : DEFAULT_WIDTH;
  }

  private _onMove = (event: MouseEvent): void => {
    const layout = this._layout;
    if (!layout) {
      return;
    }
    const rect = this._svg.getBoundingClientRect();
    const scale = this._width / rect.width;
    const px = (event.clientX - rect.left) * scale - layout.left;
    const { box, w } = layout;
    const x = box.x0 + (Math.min(Math.max(px, 0), w) / w) * (box.x1 - box.x0);
    const tip = this.tooltipAt(x);
    if (!tip) {
      this._onLeave();
      return;
    }
    const gx = ((tip.x - box.x0) / (box.x1 - box.x0)) * w;
    this._guide?.setAttribute('x1', String(gx));
    this._guide?.setAttribute('x2', String(gx));
    this._guide?.setAttribute('visibility', 'visible');
    this._tip.replaceChildren(
      tooltipTable(this._options.xTitle ?? 'step', tip)
    );
    this._tip.hidden = false;
    // beside the pointer, inside the figure
    const fig = this.node.getBoundingClientRect();
    const right = event.clientX - fig.left + 14;
    this._tip.style.left = `${Math.max(0, Math.min(right, fig.width - this._tip.offsetWidth - 4))}px`;
    this._tip.style.top = `${event.clientY - fig.top + 10}px`;
  };

  private _onLeave = (): void => {
    this._tip.hidden = true;
    this._guide?.setAttribute('visibility', 'hidden');
  };

  private _el(tag: string, attrs: Record<string, string | number>): SVGElement {
    const el = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) {
      el.setAttribute(k, String(v));
    }
    return el;
  }

  private _svg: SVGSVGElement;
  private _legend: HTMLElement;
  private _note: HTMLElement;
  private _tip: HTMLElement;
  private _guide: SVGElement | null = null;
  private _options: IChartOptions;
  private _series: ISeries[] = [];
  private _shown: ISeries[] = [];
  private _width = DEFAULT_WIDTH;
  private _resize: ResizeObserver | null = null;
  private _layout: { box: IExtent; left: number; w: number; h: number } | null =
    null;
}

/**
 * The tooltip's table, as TensorBoard's: the x, then a line per series with its value, and its
 * raw value beside the smoothed one where the series is smoothed.
 */
function tooltipTable(
  xTitle: string,
  tip: { x: number; lines: ITooltipLine[] }
): HTMLElement {
  const table = document.createElement('table');
  const smoothed = tip.lines.some(l => l.raw !== undefined);
  const head = table.createTHead().insertRow();
  head.className = 'nbtrain-Chart-tooltipHead';
  for (const text of [
    `${xTitle} ${formatValue(tip.x).replace(/\.0+(?=[kMG]?$)/, '')}`,
    ...(smoothed ? ['smoothed', 'value'] : ['value'])
  ]) {
    const th = document.createElement('th');
    th.textContent = text;
    head.appendChild(th);
  }
  const body = table.createTBody();
  for (const line of tip.lines) {
    const tr = body.insertRow();
    tr.className = 'nbtrain-Chart-tooltipLine';
    tr.dataset.series = line.label;
    const name = tr.insertCell();
    const key = document.createElement('span');
    key.className = `nbtrain-Chart-key ${line.className}`;
    key.textContent = line.label;
    name.appendChild(key);
    const value = tr.insertCell();
    value.className = 'nbtrain-Chart-tooltipValue';
    value.textContent = formatValue(line.value);
    if (smoothed) {
      const raw = tr.insertCell();
      raw.className = 'nbtrain-Chart-tooltipRaw';
      raw.textContent = line.raw === undefined ? '' : formatValue(line.raw);
    }
  }
  return table;
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
