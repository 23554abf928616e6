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

/** One chart: a title, a legend and an SVG redrawn by `update`. */
export class LineChart {
  constructor(title: string, name: string) {
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
    this.node.append(caption, this._svg);
  }

  readonly node: HTMLElement;

  /** Redraw with these series (empty series are left out of the legend). */
  update(series: ISeries[]): void {
    const shown = series.filter(s => s.points.length > 0);
    this._legend.replaceChildren(
      ...shown.map(s => {
        const item = document.createElement('span');
        item.className = `nbtrain-Chart-key ${s.className}`;
        const last = s.points[s.points.length - 1][1];
        item.textContent = `${s.label} ${formatTick(last)}`;
        return item;
      })
    );
    const box = extent(shown);
    this._svg.replaceChildren();
    this.node.dataset.points = String(
      shown.reduce((n, s) => n + s.points.length, 0)
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
    const yLabels = formatTicks(yTicks);
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
    for (const s of shown) {
      const points = downsample(s.points, 2 * w);
      plot.appendChild(
        this._el('path', {
          d: linePath(points, box, w, h),
          class: `nbtrain-Chart-line ${s.className}`,
          'vector-effect': 'non-scaling-stroke'
        })
      );
    }
    this._svg.appendChild(plot);
  }

  private _el(tag: string, attrs: Record<string, string | number>): SVGElement {
    const el = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) {
      el.setAttribute(k, String(v));
    }
    return el;
  }

  private _svg: SVGSVGElement;
  private _legend: HTMLElement;
}
