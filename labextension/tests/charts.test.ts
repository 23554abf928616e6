import { describe, expect, it } from 'vitest';

import {
  downsample,
  extent,
  formatTick,
  formatTicks,
  leftMargin,
  linePath,
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

  it('labels ticks briefly', () => {
    expect(formatTick(2e-4)).toBe('2e-4');
    expect(formatTick(1.5e-4)).toBe('1.5e-4');
    expect(formatTick(32000)).toBe('32k');
    expect(formatTick(0.9312)).toBe('0.931');
  });

  it('gives a narrow range of ticks distinct labels', () => {
    const ticks = niceTicks(0.0049, 0.00506, 4);
    const labels = formatTicks(ticks);
    expect(new Set(labels).size).toBe(ticks.length);
    expect(labels).toContain('5e-3');
    expect(labels).toContain('4.95e-3');
    // a wide range keeps the short labels
    expect(formatTicks([0, 1e-4, 2e-4])).toEqual(['0', '1e-4', '2e-4']);
  });

  it('widens the left margin for long y labels only', () => {
    expect(leftMargin(['0', '1e-4', '2e-4'])).toBe(48);
    expect(leftMargin(['4.998e-3', '4.999e-3', '5e-3'])).toBeGreaterThan(48);
    // the longest label fits between the SVG's left edge and the plot
    expect(leftMargin(['4.998e-3'])).toBeGreaterThanOrEqual(
      '4.998e-3'.length * 5.5 + 6
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
