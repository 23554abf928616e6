/**
 * A view's charts: every metric in its group's section (metrics.ts chartGroups), with the controls a
 * run panel and the compare view share (smoothing, log y), one x range and one crosshair over all
 * of them (a ChartGroup), redrawn in the theme's palette when the theme changes.
 */
import { ChartGroup, LineChart } from './charts';
import { IChartGroup, IChartSpec, IRawSeries, smoothed } from './metrics';

export type { IRawSeries } from './metrics';

/** TensorBoard's default smoothing. */
export const DEFAULT_SMOOTHING = 0.6;

export class ChartBoard {
  constructor(name: string) {
    this.node = document.createElement('div');
    this.node.className = 'nbtrain-Board';
    this.node.dataset.board = name;
    this.controls = document.createElement('div');
    this.controls.className = 'nbtrain-Compare-controls nbtrain-Board-controls';
    this._smoothing = document.createElement('input');
    this._smoothing.type = 'range';
    this._smoothing.className = 'nbtrain-Compare-smoothing';
    this._smoothing.min = '0';
    this._smoothing.max = '0.99';
    this._smoothing.step = '0.01';
    this._smoothing.value = String(DEFAULT_SMOOTHING);
    this._smoothing.setAttribute('aria-label', 'smoothing');
    this._smoothingValue = document.createElement('span');
    this._smoothingValue.className = 'nbtrain-Compare-smoothingValue';
    this._log = document.createElement('input');
    this._log.type = 'checkbox';
    this._log.className = 'nbtrain-Compare-log';
    this._log.setAttribute('aria-label', 'log y');
    const hint = document.createElement('span');
    hint.className = 'nbtrain-Board-hint';
    hint.textContent = 'drag to zoom · double-click to reset';
    this.controls.append(
      label('smoothing ', this._smoothing, this._smoothingValue),
      label('', this._log, ' log y'),
      hint
    );
    this._sections = document.createElement('div');
    this._sections.className = 'nbtrain-Board-sections';
    this.node.append(this.controls, this._sections);
    for (const input of [this._smoothing, this._log]) {
      input.addEventListener('input', () => this.changed());
      input.addEventListener('change', () => this.changed());
    }
    // the palette follows the theme: redraw when Lab switches it
    this._theme = new MutationObserver(() => {
      for (const chart of this._charts.values()) {
        chart.redraw();
      }
    });
    this._theme.observe(document.body, {
      attributes: true,
      attributeFilter: ['data-jp-theme-light']
    });
  }

  readonly node: HTMLElement;
  readonly controls: HTMLElement;
  readonly group = new ChartGroup();

  /** Called when a control changes; the owner renders again. */
  changed: () => void = () => undefined;

  get smoothing(): number {
    return Number(this._smoothing.value);
  }

  get logY(): boolean {
    return this._log.checked;
  }

  /** The chart of metric `key`, if shown. */
  chart(key: string): LineChart | undefined {
    return this._charts.get(key);
  }

  /**
   * Show these groups of charts, each chart's lines from `lines(spec)`; charts are kept while their
   * layout stays, so a poll redraws them in place (and a zoom stays).
   */
  render(
    groups: IChartGroup[],
    lines: (spec: IChartSpec) => IRawSeries[],
    xTitle = 'step'
  ): void {
    const weight = this.smoothing;
    this._smoothingValue.textContent = weight.toFixed(2);
    const layout = groups
      .map(g => `${g.name}:${g.charts.map(c => c.key).join(',')}`)
      .join(';');
    if (layout !== this._layout) {
      this._layout = layout;
      this._build(groups);
    }
    for (const g of groups) {
      for (const spec of g.charts) {
        const chart = this._charts.get(spec.key)!;
        const drawn = smoothed(spec, lines(spec), weight);
        const anySmoothed = drawn.some(s => s.raw);
        chart.setOptions({
          logY: this.logY,
          xTitle,
          yTitle: spec.yTitle,
          note: anySmoothed
            ? `smoothed ${weight.toFixed(2)}`
            : weight > 0 && !spec.smoothable
              ? 'never smoothed'
              : ''
        });
        chart.update(drawn);
      }
    }
  }

  dispose(): void {
    this._theme.disconnect();
    for (const chart of this._charts.values()) {
      chart.dispose();
    }
    this._charts.clear();
  }

  private _build(groups: IChartGroup[]): void {
    const open = new Map<string, boolean>();
    for (const d of this._sections.querySelectorAll<HTMLDetailsElement>(
      'details[data-group]'
    )) {
      open.set(d.dataset.group!, d.open);
    }
    for (const chart of this._charts.values()) {
      chart.dispose();
    }
    this._charts.clear();
    this._sections.replaceChildren(
      ...groups.map(g => {
        const details = document.createElement('details');
        details.className = 'nbtrain-ChartGroup';
        details.dataset.group = g.name;
        details.open = open.get(g.name) ?? true;
        const summary = document.createElement('summary');
        summary.textContent = `${g.name} (${g.charts.length})`;
        const grid = document.createElement('div');
        grid.className = 'nbtrain-RunPanel-charts';
        for (const spec of g.charts) {
          const chart = new LineChart(spec.title, spec.key, {}, this.group);
          this._charts.set(spec.key, chart);
          grid.appendChild(chart.node);
        }
        details.append(summary, grid);
        return details;
      })
    );
  }

  private _smoothing: HTMLInputElement;
  private _smoothingValue: HTMLElement;
  private _log: HTMLInputElement;
  private _sections: HTMLElement;
  private _charts = new Map<string, LineChart>();
  private _layout = '';
  private _theme: MutationObserver;
}

export function label(
  text: string,
  ...children: Array<Node | string>
): HTMLElement {
  const node = document.createElement('label');
  node.append(text, ...children);
  return node;
}
