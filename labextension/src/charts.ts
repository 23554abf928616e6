/**
 * Small SVG line charts drawn by hand: a run panel needs three of them, redrawn every second,
 * which does not justify a charting library in the bundle.
 */

/** One line on a chart: (step, value) points, in step order. */
export interface ISeries {
  label: string;
  /** A CSS class that sets the stroke colour (see style/base.css). */
  className: string;
  points: Array<[number, number]>;
  /** A faint underlay (the raw curve under a smoothed one): not in the legend nor the tooltip. */
  faint?: boolean;
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

/** Round tick values (1, 2 or 5 times a power of ten) covering [lo, hi]. */
export function niceTicks(lo: number, hi: number, count = 4): number[] {
  const span = hi - lo;
  if (!(span > 0) || !Number.isFinite(span)) {
    return [lo];
  }
  const raw = span / count;
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

/** A short label for an axis value: `2e-4`, `1.5k`, `0.93`; `extra` adds significant digits. */
export function formatTick(value: number, extra = 0): string {
  const abs = Math.abs(value);
  if (value === 0) {
    return '0';
  }
  if (abs >= 1e4) {
    return `${Number((value / 1e3).toPrecision(3 + extra))}k`;
  }
  if (abs < 1e-2) {
    // 1.5e-4 stays 1.5e-4: one digit would label two ticks alike
    return Number(value.toPrecision(2 + extra)).toExponential();
  }
  return `${Number(value.toPrecision(3 + extra))}`;
}

/**
 * Labels for one axis: as short as formatTick's, with just enough more digits that no two ticks
 * read alike (a learning rate from 4.90e-3 to 5.05e-3 would otherwise label every tick `5e-3`).
 */
export function formatTicks(ticks: number[]): string[] {
  for (let extra = 0; extra <= 6; extra++) {
    const labels = ticks.map(t => formatTick(t, extra));
    if (new Set(labels).size === labels.length) {
      return labels;
    }
  }
  return ticks.map(t => String(t));
}

const SVG_NS = 'http://www.w3.org/2000/svg';
const WIDTH = 480;
const HEIGHT = 180;
const MARGIN = { left: 48, right: 12, top: 10, bottom: 22 };
// a tick label's width per character at the ticks' 10px font (digits are about 0.55em), and the gap
// between the label and the plot
const TICK_CHAR = 6;
const TICK_GAP = 6;

/** The plot's left margin: the default, or wider where a y label (`4.999e-3`) would be clipped. */
export function leftMargin(yLabels: string[]): number {
  const longest = Math.max(0, ...yLabels.map(l => l.length));
  return Math.max(MARGIN.left, longest * TICK_CHAR + TICK_GAP + 4);
}

/** How a chart draws: a log y axis, a tooltip on hover naming the x. */
export interface IChartOptions {
  logY?: boolean;
  /** What the x axis counts, for the tooltip: `step` (the default) or `s`. */
  xName?: string;
  /** Show each series' value at the x nearest the pointer. */
  hover?: boolean;
}

/** One chart: a title, a legend and an SVG redrawn by `update`. */
export class LineChart {
  constructor(title: string, name: string, options: IChartOptions = {}) {
    this._options = { ...options };
    this.node = document.createElement('figure');
    this.node.className = 'nbtrain-Chart';
    this.node.dataset.chart = name;
    const caption = document.createElement('figcaption');
    caption.textContent = title;
    this._legend = document.createElement('span');
    this._legend.className = 'nbtrain-Chart-legend';
    caption.appendChild(this._legend);
    this._svg = document.createElementNS(SVG_NS, 'svg');
    this._svg.setAttribute('viewBox', `0 0 ${WIDTH} ${HEIGHT}`);
    this._tip = document.createElement('div');
    this._tip.className = 'nbtrain-Chart-tooltip';
    this._tip.hidden = true;
    this.node.append(caption, this._svg, this._tip);
    if (options.hover) {
      this._svg.addEventListener('mousemove', this._onMove);
      this._svg.addEventListener('mouseleave', this._onLeave);
    }
  }

  readonly node: HTMLElement;

  /** Change how the chart draws; the next `update` uses it. */
  setOptions(options: IChartOptions): void {
    this._options = { ...this._options, ...options };
  }

  /** Redraw with these series (empty series are left out of the legend). */
  update(series: ISeries[]): void {
    const logY = Boolean(this._options.logY);
    this.node.dataset.logY = String(logY);
    const shown = series
      .map(s => (logY ? { ...s, points: logPoints(s.points) } : s))
      .filter(s => s.points.length > 0);
    this._shown = shown;
    this._layout = null;
    this._onLeave();
    this._legend.replaceChildren(
      ...shown
        .filter(s => !s.faint)
        .map(s => {
          const item = document.createElement('span');
          item.className = `nbtrain-Chart-key ${s.className}`;
          const last = s.points[s.points.length - 1][1];
          item.textContent = `${s.label} ${formatTick(logY ? Math.pow(10, last) : last)}`;
          return item;
        })
    );
    const box = extent(shown);
    this._svg.replaceChildren();
    this.node.dataset.points = String(
      shown.filter(s => !s.faint).reduce((n, s) => n + s.points.length, 0)
    );
    if (!box) {
      const empty = this._el('text', {
        x: WIDTH / 2,
        y: HEIGHT / 2,
        class: 'nbtrain-Chart-empty',
        'text-anchor': 'middle'
      });
      empty.textContent = 'no data yet';
      this._svg.appendChild(empty);
      return;
    }
    const yTicks = niceTicks(box.y0, box.y1, 4);
    const yLabels = logY
      ? formatTicks(yTicks.map(t => Number(Math.pow(10, t).toPrecision(6))))
      : formatTicks(yTicks);
    const left = leftMargin(yLabels);
    const w = WIDTH - left - MARGIN.right;
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
        class: 'nbtrain-Chart-tick'
      });
      label.textContent = yLabels[i];
      plot.appendChild(label);
    }
    const xTicks = niceTicks(box.x0, box.x1, 5);
    const xLabels = formatTicks(xTicks);
    for (const [i, t] of xTicks.entries()) {
      const x = ((t - box.x0) / (box.x1 - box.x0)) * w;
      const label = this._el('text', {
        x,
        y: h + 16,
        'text-anchor': 'middle',
        class: 'nbtrain-Chart-tick'
      });
      label.textContent = xLabels[i];
      plot.appendChild(label);
    }
    // faint underlays first, so the lines people read are drawn over them
    for (const s of [
      ...shown.filter(s => s.faint),
      ...shown.filter(s => !s.faint)
    ]) {
      const points = downsample(s.points, 2 * w);
      const path = this._el('path', {
        d: linePath(points, box, w, h),
        class: `nbtrain-Chart-line ${s.className}${s.faint ? ' nbtrain-Chart-faint' : ''}`,
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

  /** The tooltip's lines at data x `x`: each series' value at its point nearest x. */
  tooltipAt(
    x: number
  ): { x: number; lines: Array<[string, string, number]> } | null {
    const logY = Boolean(this._options.logY);
    let at: number | null = null;
    const lines: Array<[string, string, number]> = [];
    for (const s of this._shown) {
      if (s.faint) {
        continue;
      }
      const p = nearestByX(s.points, x);
      if (!p) {
        continue;
      }
      if (at === null || Math.abs(p[0] - x) < Math.abs(at - x)) {
        at = p[0];
      }
      const value = logY ? Math.pow(10, p[1]) : p[1];
      lines.push([s.label, s.className, value]);
    }
    return at === null ? null : { x: at, lines };
  }

  private _onMove = (event: MouseEvent): void => {
    const layout = this._layout;
    if (!layout) {
      return;
    }
    const rect = this._svg.getBoundingClientRect();
    const scale = WIDTH / rect.width;
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
    const head = document.createElement('div');
    head.className = 'nbtrain-Chart-tooltipHead';
    head.textContent = `${this._options.xName ?? 'step'} ${formatTick(tip.x, 2)}`;
    this._tip.replaceChildren(
      head,
      ...tip.lines.map(([label, className, value]) => {
        const line = document.createElement('div');
        line.className = `nbtrain-Chart-key ${className}`;
        line.dataset.series = label;
        line.textContent = `${label}: ${formatTick(value, 2)}`;
        return line;
      })
    );
    this._tip.hidden = false;
    // beside the pointer, inside the figure
    const fig = this.node.getBoundingClientRect();
    const right = event.clientX - fig.left + 14;
    this._tip.style.left = `${Math.min(right, fig.width - this._tip.offsetWidth - 4)}px`;
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
  private _tip: HTMLElement;
  private _guide: SVGElement | null = null;
  private _options: IChartOptions;
  private _shown: ISeries[] = [];
  private _layout: { box: IExtent; left: number; w: number; h: number } | null =
    null;
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
