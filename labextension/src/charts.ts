/**
 * Line charts drawn by uPlot (chosen by measurement: docs/lab.md): drag to zoom, double-click to
 * reset, one x range and one crosshair across the charts of a view (a `ChartGroup`), a tooltip
 * with each series' own step and its raw and smoothed value, log y, PNG export. Ticks and labels
 * are nbtrain's own (1, 2, 5 x 10^n, one format per axis: format.ts), the axis ends on a tick.
 */
import uPlot from 'uplot';

import {
  axisLabels,
  formatValue,
  logAxisLabels,
  logTicks,
  nearestByX,
  niceLogRange,
  niceRange,
  niceTicks
} from './format';
import { RAW_ALPHA, withAlpha } from './metrics';
import { colourOf, colourVar, cssVar, isDark } from './palette';
import { ITooltipLine, tooltipTable } from './tooltip';

export { colourOf, colourVar, installPalette, isDark } from './palette';
export type { ITooltipLine } from './tooltip';
export {
  axisLabels,
  formatValue,
  logAxisLabels,
  logTicks,
  nearestByX,
  niceTicks
} from './format';

/** One line: (x, value) points in x order, its palette colour, and its raw points when smoothed. */
export interface ISeries {
  label: string;
  /** An index into the palette (metrics.ts PALETTE_LIGHT / PALETTE_DARK). */
  colour: number;
  points: Array<[number, number]>;
  /** Where `points` are smoothed: the raw points, drawn faint underneath and named in the tooltip. */
  raw?: Array<[number, number]>;
  dashed?: boolean;
}

/** How a chart draws. */
export interface IChartOptions {
  logY?: boolean;
  /** What the x axis counts: `step` (the default), `seconds`, `nodes`... */
  xTitle?: string;
  /** The y axis' title: the unit where there is one. */
  yTitle?: string;
  /** A remark beside the title (`smoothed 0.60`). */
  note?: string;
}

/**
 * The charts of one view: one x range (zoom one, all follow; double-click resets all) and one
 * crosshair (uPlot's cursor sync); the tooltip shows on the chart under the pointer.
 */
export class ChartGroup {
  constructor() {
    this.key = `nbtrain-${++ChartGroup._n}`;
  }

  readonly key: string;
  readonly charts = new Set<LineChart>();

  /** The x range zoomed into, or null for all of it. */
  get zoom(): [number, number] | null {
    return this._zoom;
  }

  setZoom(range: [number, number] | null): void {
    this._zoom = range;
    for (const chart of this.charts) {
      chart.applyX();
    }
  }

  /** The x range every chart of the view shows: the zoom, or the union of their data. */
  xRange(): [number, number] | null {
    if (this._zoom) {
      return this._zoom;
    }
    let x0 = Infinity;
    let x1 = -Infinity;
    for (const chart of this.charts) {
      const e = chart.xExtent();
      if (e) {
        x0 = Math.min(x0, e[0]);
        x1 = Math.max(x1, e[1]);
      }
    }
    if (!Number.isFinite(x0)) {
      return null;
    }
    return x1 > x0 ? [x0, x1] : [x0 - 1, x0 + 1];
  }

  private _zoom: [number, number] | null = null;
  private static _n = 0;
}

const HEIGHT = 200;

/** One chart: a caption (title, note, one-line legend, PNG button), the plot, a tooltip. */
export class LineChart {
  constructor(
    title: string,
    name: string,
    options: IChartOptions = {},
    group: ChartGroup = new ChartGroup()
  ) {
    this._options = { ...options };
    this._group = group;
    group.charts.add(this);
    this.node = document.createElement('figure');
    this.node.className = 'nbtrain-Chart';
    this.node.dataset.chart = name;
    this._name = name;
    this._title = title;
    const caption = document.createElement('figcaption');
    const head = document.createElement('span');
    head.className = 'nbtrain-Chart-title';
    head.textContent = title;
    head.title = name;
    this._note = document.createElement('span');
    this._note.className = 'nbtrain-Chart-note';
    this._legend = document.createElement('span');
    this._legend.className = 'nbtrain-Chart-legend';
    const png = document.createElement('button');
    png.className = 'nbtrain-Chart-png';
    png.textContent = 'PNG';
    png.title = 'Save this chart as a PNG image';
    png.addEventListener('click', () => void this.downloadPNG());
    caption.append(head, this._note, this._legend, png);
    this._plot = document.createElement('div');
    this._plot.className = 'nbtrain-Chart-plot';
    this._tip = document.createElement('div');
    this._tip.className = 'nbtrain-Chart-tooltip';
    this._tip.hidden = true;
    this.node.append(caption, this._plot, this._tip);
    if (typeof ResizeObserver !== 'undefined') {
      this._resize = new ResizeObserver(() => {
        const width = this._width();
        if (this._u && width !== this._u.width) {
          this._u.setSize({ width, height: HEIGHT });
        }
      });
      this._resize.observe(this.node);
    }
  }

  readonly node: HTMLElement;

  setOptions(options: IChartOptions): void {
    const rebuild =
      options.logY !== undefined &&
      Boolean(options.logY) !== Boolean(this._options.logY);
    this._options = { ...this._options, ...options };
    if (rebuild) {
      this._destroy();
    }
  }

  /** Draw again with the last series (after a theme change: the colours are the theme's). */
  redraw(): void {
    this._destroy();
    this.update(this._series);
  }

  dispose(): void {
    this._resize?.disconnect();
    this._destroy();
    this._group.charts.delete(this);
  }

  /** The x extent of this chart's data. */
  xExtent(): [number, number] | null {
    let x0 = Infinity;
    let x1 = -Infinity;
    for (const s of this._series) {
      for (const pts of [s.points, s.raw ?? []]) {
        if (pts.length) {
          x0 = Math.min(x0, pts[0][0]);
          x1 = Math.max(x1, pts[pts.length - 1][0]);
        }
      }
    }
    return Number.isFinite(x0) ? [x0, x1] : null;
  }

  /** Set the x range to the group's (zoom or union). */
  applyX(): void {
    const range = this._group.xRange();
    if (this._u && range) {
      this._u.setScale('x', { min: range[0], max: range[1] });
    }
    this.node.dataset.xRange = range ? range.map(formatValue).join('..') : '';
    this.node.dataset.zoomed = String(this._group.zoom !== null);
  }

  /**
   * Redraw with these series (empty ones are left out). A series with `raw` is smoothed: the raw
   * line is drawn faint underneath, the legend gives the last raw value, the tooltip both.
   */
  update(series: ISeries[]): void {
    const logY = Boolean(this._options.logY);
    const shown = series
      .map(s =>
        logY
          ? {
              ...s,
              points: s.points.filter(p => p[1] > 0),
              raw: s.raw?.filter(p => p[1] > 0)
            }
          : s
      )
      .filter(s => s.points.length > 0);
    this._series = shown;
    this.node.dataset.logY = String(logY);
    this.node.dataset.series = shown.map(s => s.label).join('|');
    this.node.dataset.points = String(
      shown.reduce((n, s) => n + s.points.length, 0)
    );
    this.node.dataset.xTitle = this._options.xTitle ?? 'step';
    this.node.dataset.yTitle = this._yTitle();
    this._note.textContent = this._options.note ?? '';
    this._legend.replaceChildren(
      ...shown.map(s => {
        const item = document.createElement('span');
        item.className = 'nbtrain-Chart-key';
        item.style.color = colourVar(s.colour);
        item.dataset.series = s.label;
        const last = (s.raw?.length ? s.raw : s.points).at(-1)![1];
        item.textContent = `${s.label} ${formatValue(last)}`;
        item.title = s.raw
          ? `${s.label}: last value ${formatValue(last)} (the line is smoothed)`
          : `${s.label}: last value`;
        return item;
      })
    );
    this._hideTip();
    if (!shown.length) {
      this._destroy();
      this._plot.textContent = 'no data yet';
      this._plot.classList.add('nbtrain-Chart-empty');
      return;
    }
    this._plot.classList.remove('nbtrain-Chart-empty');
    const data = this._aligned(shown);
    const layout = shown
      // (whether its points are marked is set when the chart is built: a series that grows past
      // 30 points rebuilds it once, without them)
      .map(
        s =>
          `${s.label}:${s.colour}:${s.dashed}:${Boolean(s.raw)}:${s.points.length <= 30}`
      )
      .join('|');
    if (!this._u || layout !== this._layout) {
      this._destroy();
      this._layout = layout;
      this._plot.textContent = '';
      this._u = new uPlot(this._opts(shown), data, this._plot);
    } else {
      this._u.setData(data, false);
    }
    // every chart of the view to the same x range (this one's data may have widened it)
    for (const chart of this._group.charts) {
      chart.applyX();
    }
  }

  /** The tooltip's lines at data x `x`: each series' own point nearest x (and its raw value). */
  tooltipAt(x: number): ITooltipLine[] {
    const lines: ITooltipLine[] = [];
    for (const s of this._series) {
      const p = nearestByX(s.points, x);
      if (!p) {
        continue;
      }
      const line: ITooltipLine = {
        label: s.label,
        colour: s.colour,
        x: p[0],
        value: p[1]
      };
      if (s.raw) {
        const r = nearestByX(s.raw, p[0]);
        if (r && r[0] === p[0]) {
          line.raw = r[1];
        }
      }
      lines.push(line);
    }
    return lines;
  }

  /** The chart as a PNG: its title and legend over the plot, on the theme's background. */
  async toPNG(): Promise<Blob | null> {
    const plot = this._u?.ctx.canvas;
    if (!plot) {
      return null;
    }
    const ratio = plot.width / this._u!.width;
    const head = 24 * ratio;
    const canvas = document.createElement('canvas');
    canvas.width = plot.width;
    canvas.height = plot.height + head;
    const ctx = canvas.getContext('2d')!;
    ctx.fillStyle = cssVar('--jp-layout-color0', '#ffffff');
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.font = `${12 * ratio}px sans-serif`;
    ctx.textBaseline = 'middle';
    ctx.fillStyle = cssVar('--jp-ui-font-color0', '#000000');
    let x = 8 * ratio;
    ctx.fillText(this._title, x, head / 2);
    x += ctx.measureText(this._title).width + 12 * ratio;
    for (const s of this._series) {
      const last = (s.raw?.length ? s.raw : s.points).at(-1)![1];
      const text = `${s.label} ${formatValue(last)}`;
      ctx.fillStyle = colourOf(s.colour);
      ctx.fillText(text, x, head / 2);
      x += ctx.measureText(text).width + 10 * ratio;
    }
    ctx.drawImage(plot, 0, head);
    return new Promise(resolve => canvas.toBlob(resolve, 'image/png'));
  }

  async downloadPNG(): Promise<void> {
    const blob = await this.toPNG();
    if (!blob) {
      return;
    }
    const url = URL.createObjectURL(blob);
    const a = document.createElement('a');
    a.href = url;
    a.download = `nbtrain-${this._name.replace(/[^\w.-]+/g, '_')}.png`;
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10_000);
  }

  private _yTitle(): string {
    const y = this._options.yTitle ?? '';
    return y && this._options.logY ? `${y} (log)` : y;
  }

  private _width(): number {
    const w = this.node.clientWidth;
    return w > 0 ? Math.round(w) : 480;
  }

  /** uPlot's aligned data: the union of the x values, each line (and raw line) null where absent. */
  private _aligned(shown: ISeries[]): uPlot.AlignedData {
    const xs = new Set<number>();
    for (const s of shown) {
      for (const [x] of s.points) {
        xs.add(x);
      }
      for (const [x] of s.raw ?? []) {
        xs.add(x);
      }
    }
    const x = Float64Array.from(xs).sort();
    const index = new Map<number, number>();
    x.forEach((v, i) => index.set(v, i));
    const column = (pts: Array<[number, number]>) => {
      const col: Array<number | null> = new Array(x.length).fill(null);
      for (const [px, py] of pts) {
        col[index.get(px)!] = py;
      }
      return col;
    };
    const cols: Array<Array<number | null>> = [];
    for (const s of shown) {
      if (s.raw) {
        cols.push(column(s.raw));
      }
    }
    for (const s of shown) {
      cols.push(column(s.points));
    }
    return [Array.from(x), ...cols] as uPlot.AlignedData;
  }

  private _opts(shown: ISeries[]): uPlot.Options {
    const logY = Boolean(this._options.logY);
    const dark = isDark();
    const ink = cssVar('--jp-ui-font-color2', dark ? '#bbbbbb' : '#616161');
    const grid = cssVar('--jp-border-color2', dark ? '#444444' : '#e0e0e0');
    const font = '11px sans-serif';
    const xTitle = this._options.xTitle ?? 'step';
    const integerX =
      xTitle === 'step' || xTitle === 'nodes' || xTitle === 'ranks';
    const few = (s: ISeries) => s.points.length <= 30;
    const raw: uPlot.Series[] = shown
      .filter(s => s.raw)
      .map(s => ({
        label: `${s.label} (raw)`,
        stroke: withAlpha(
          colourOf(s.colour),
          dark ? RAW_ALPHA.dark : RAW_ALPHA.light
        ),
        width: 1,
        spanGaps: true,
        points: { show: false }
      }));
    const lines: uPlot.Series[] = shown.map(s => ({
      label: s.label,
      stroke: colourOf(s.colour),
      width: 1.75,
      dash: s.dashed ? [6, 4] : undefined,
      spanGaps: true,
      // a sparse series (eval every N steps) shows its points: the line between is not data
      points: { show: few(s), size: 5 }
    }));
    const group = this._group;
    return {
      width: this._width(),
      height: HEIGHT,
      legend: { show: false },
      padding: [10, 12, 0, 0],
      scales: {
        x: { time: false, auto: false },
        y: logY
          ? {
              distr: 3,
              range: (_u, lo, hi) => niceLogRange(lo, hi)
            }
          : { range: (_u, lo, hi) => niceRange(lo, hi) }
      },
      axes: [
        {
          stroke: ink,
          font,
          labelFont: font,
          label: xTitle,
          labelSize: 14,
          labelGap: 0,
          size: 26,
          gap: 3,
          grid: { show: false },
          ticks: { stroke: grid },
          splits: (u, _i, lo, hi) =>
            niceTicks(
              lo,
              hi,
              Math.max(
                2,
                Math.min(10, Math.floor(u.bbox.width / devicePixelRatio / 70))
              ),
              integerX ? 1 : 0
            ),
          values: (_u, ticks) => axisLabels(ticks)
        },
        {
          stroke: ink,
          font,
          labelFont: font,
          label: this._yTitle(),
          labelSize: 18,
          grid: { stroke: grid, width: 1 },
          ticks: { stroke: grid },
          size: (u, values) => {
            const longest = Math.max(0, ...(values ?? []).map(v => v.length));
            return Math.max(36, Math.ceil(longest * 6.6) + 12);
          },
          splits: (_u, _i, lo, hi) =>
            logY ? logTicks(lo, hi, 4) : niceTicks(lo, hi, 5),
          values: (_u, ticks) => {
            const labels = logY ? logAxisLabels(ticks) : axisLabels(ticks);
            this.node.dataset.yTicks = labels.join(' ');
            return labels;
          }
        }
      ],
      series: [{ label: xTitle }, ...raw, ...lines],
      cursor: {
        sync: { key: group.key, setSeries: false },
        drag: { x: true, y: false, setScale: false },
        points: { show: false },
        bind: {
          dblclick: () => () => {
            group.setZoom(null);
            return null;
          }
        }
      },
      hooks: {
        setSelect: [
          u => {
            const { left, width } = u.select;
            if (width > 2) {
              const a = u.posToVal(left, 'x');
              const b = u.posToVal(left + width, 'x');
              group.setZoom([a, b]);
            }
            u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
          }
        ],
        setCursor: [u => this._onCursor(u)],
        ready: [
          u => {
            u.over.addEventListener('mouseenter', () => (this._hovered = true));
            u.over.addEventListener('mouseleave', () => {
              this._hovered = false;
              this._hideTip();
            });
          }
        ]
      }
    };
  }

  private _onCursor(u: uPlot): void {
    const left = u.cursor.left ?? -1;
    if (!this._hovered || left < 0) {
      this._hideTip();
      return;
    }
    const x = u.posToVal(left, 'x');
    const lines = this.tooltipAt(x);
    if (!lines.length) {
      this._hideTip();
      return;
    }
    this._tip.replaceChildren(
      tooltipTable(this._options.xTitle ?? 'step', lines)
    );
    this._tip.hidden = false;
    const fig = this.node.getBoundingClientRect();
    const over = u.over.getBoundingClientRect();
    const px = over.left - fig.left + left + 14;
    const py = over.top - fig.top + (u.cursor.top ?? 0) + 10;
    this._tip.style.left = `${Math.max(0, Math.min(px, fig.width - this._tip.offsetWidth - 4))}px`;
    this._tip.style.top = `${py}px`;
  }

  private _hideTip(): void {
    this._tip.hidden = true;
  }

  private _destroy(): void {
    this._u?.destroy();
    this._u = null;
    this._layout = '';
  }

  private _u: uPlot | null = null;
  private _layout = '';
  private _group: ChartGroup;
  private _name: string;
  private _title: string;
  private _plot: HTMLElement;
  private _legend: HTMLElement;
  private _note: HTMLElement;
  private _tip: HTMLElement;
  private _options: IChartOptions;
  private _series: ISeries[] = [];
  private _hovered = false;
  private _resize: ResizeObserver | null = null;
}
