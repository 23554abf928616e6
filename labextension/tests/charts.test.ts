import { describe, expect, it } from 'vitest';

import {
  axisLabels,
  downsample,
  extent,
  leftMargin,
  linePath,
  logAxisLabels,
  logTicks,
  niceTicks
} from '../src/charts';

describe('downsample', () => {
  it('keeps short series as they are', () => {
    const points: Array<[number, number]> = [
      [1, 1],
      [2, 2]
    ];
    expect(downsample(points, 10)).toBe(points);
  });

  it('keeps spikes, the last point, and stays near the budget', () => {
    const points: Array<[number, number]> = [];
    for (let i = 0; i < 10_000; i++) {
      points.push([i, i === 4321 ? 50 : 1 + (i % 7) / 100]);
    }
    const thin = downsample(points, 200);
    expect(thin.length).toBeLessThanOrEqual(201);
    expect(thin).toContainEqual([4321, 50]);
    expect(thin[thin.length - 1]).toEqual([9999, points[9999][1]]);
    // still in step order
    expect(thin.every((p, i) => i === 0 || p[0] > thin[i - 1][0])).toBe(true);
  });
});

describe('axes', () => {
  it('pads a flat line so it is not drawn on the edge', () => {
    const box = extent([
      {
        label: 'x',
        className: '',
        points: [
          [1, 2],
          [2, 2]
        ]
      }
    ]);
    expect(box).toEqual({ x0: 1, x1: 2, y0: 1.8, y1: 2.2 });
    expect(extent([{ label: 'x', className: '', points: [] }])).toBeNull();
  });

  it('picks round ticks', () => {
    expect(niceTicks(0, 1, 4)).toEqual([0, 0.5, 1]);
    expect(niceTicks(0, 200, 5)).toEqual([0, 50, 100, 150, 200]);
    expect(niceTicks(0.93, 2.49, 4)).toEqual([1, 1.5, 2]);
    expect(niceTicks(3, 3)).toEqual([3]);
  });

  it('steps the x axis by whole steps', () => {
    expect(niceTicks(1, 3, 8, 1)).toEqual([1, 2, 3]);
    expect(niceTicks(1, 3, 8)).toEqual([1, 1.5, 2, 2.5, 3]);
  });

  it('labels an axis in one format: a shared suffix and the decimals its step needs', () => {
    expect(axisLabels([0, 5000, 10000])).toEqual(['0', '5k', '10k']);
    expect(axisLabels([0, 500, 1000, 1500])).toEqual([
      '0',
      '0.5k',
      '1.0k',
      '1.5k'
    ]);
    expect(axisLabels([4.5, 5, 5.5])).toEqual(['4.5', '5.0', '5.5']);
    expect(axisLabels([0, 1, 2, 3])).toEqual(['0', '1', '2', '3']);
    expect(axisLabels([0.92, 0.94, 0.96])).toEqual(['0.92', '0.94', '0.96']);
    expect(axisLabels([0, 1e-4, 2e-4])).toEqual(['0', '1e-4', '2e-4']);
    expect(axisLabels([1.5e-4, 2e-4])).toEqual(['1.5e-4', '2e-4']);
  });

  it('gives a narrow range of ticks distinct labels', () => {
    const ticks = niceTicks(0.0049, 0.00506, 4);
    const labels = axisLabels(ticks);
    expect(new Set(labels).size).toBe(ticks.length);
    expect(labels).toContain('5e-3');
    expect(labels).toContain('4.95e-3');
  });

  it('puts round ticks on a log axis', () => {
    // a loss from 4.6 to 8.1: round values, not 10^0.7, 10^0.8 (5.01, 6.31, 7.94)
    const narrow = logTicks(4.6, 8.1, 4);
    expect(narrow).toEqual([5, 6, 7, 8]);
    expect(logAxisLabels(narrow)).toEqual(['5', '6', '7', '8']);
    expect(logTicks(0.8, 12, 4)).toEqual([1, 2, 5, 10]);
    expect(logTicks(0.01, 100, 4)).toEqual([0.01, 0.1, 1, 10, 100]);
    expect(logAxisLabels([0.01, 0.1, 1, 10])).toEqual([
      '0.01',
      '0.1',
      '1',
      '10'
    ]);
    // many decades: every other power of ten
    expect(logTicks(1e-6, 1e3, 4)).toEqual([1e-6, 1e-4, 1e-2, 1, 100]);
    for (const t of logTicks(2.3, 3.9, 4)) {
      expect(Number(t.toPrecision(2))).toBe(t);
    }
  });

  it('widens the left margin for long y labels only', () => {
    const short = leftMargin(['0', '1', '2']);
    expect(leftMargin(['4.998e-3', '4.999e-3', '5e-3'])).toBeGreaterThan(short);
    // the longest label and the rotated y title fit between the SVG's left edge and the plot
    expect(leftMargin(['4.998e-3'])).toBeGreaterThanOrEqual(
      '4.998e-3'.length * 6.6 + 6 + 14
    );
  });
});

describe('linePath', () => {
  it('maps data corners to the box corners, y up', () => {
    const d = linePath(
      [
        [0, 0],
        [10, 5]
      ],
      { x0: 0, x1: 10, y0: 0, y1: 5 },
      100,
      50
    );
    expect(d).toBe('M0.0,50.0L100.0,0.0');
  });
});
