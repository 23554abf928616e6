import { describe, expect, it } from 'vitest';

import {
  axisLabels,
  formatValue,
  logAxisLabels,
  logTicks,
  niceLogRange,
  niceRange,
  niceTicks
} from '../src/format';

describe('axes', () => {
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
    // one format per axis: the same mantissa decimals on every tick
    expect(axisLabels([1.5e-4, 2e-4])).toEqual(['1.5e-4', '2.0e-4']);
    expect(axisLabels([1.9e-3, 1.95e-3, 2e-3])).toEqual([
      '1.90e-3',
      '1.95e-3',
      '2.00e-3'
    ]);
  });

  it('gives a narrow range of ticks distinct labels', () => {
    const ticks = niceTicks(0.0049, 0.00506, 4);
    const labels = axisLabels(ticks);
    expect(new Set(labels).size).toBe(ticks.length);
    expect(labels).toContain('5.00e-3');
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

  it('ends an axis on a tick: no data above the last label', () => {
    expect(niceRange(0.93, 2.49)).toEqual([0.5, 2.5]);
    expect(niceRange(2.2, 2.61)).toEqual([2.2, 2.7]);
    const [lo, hi] = niceRange(4.61, 8.13);
    const ticks = niceTicks(lo, hi, 5);
    expect(ticks[0]).toBe(lo);
    expect(ticks[ticks.length - 1]).toBe(hi);
    // a flat series gets some height
    expect(niceRange(2, 2)[1]).toBeGreaterThan(2);
    expect(niceLogRange(0.013, 7.5)).toEqual([0.01, 10]);
    expect(niceLogRange(2.3, 3.9)).toEqual([2, 5]);
  });
});

describe('formatValue', () => {
  it('writes 3 significant digits, k/M/G, e-notation under 1e-2', () => {
    expect(formatValue(4.8547)).toBe('4.85');
    expect(formatValue(3216.6)).toBe('3.22k');
    expect(formatValue(999.7)).toBe('1.00k');
    expect(formatValue(0.00195)).toBe('1.95e-3');
    expect(formatValue(0.0002)).toBe('2e-4');
    expect(formatValue(12)).toBe('12.0');
    expect(formatValue(null)).toBe('–');
    expect(formatValue(0)).toBe('0');
  });
});
