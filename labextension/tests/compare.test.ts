import { spawnSync } from 'child_process';
import * as path from 'path';

import { describe, expect, it } from 'vitest';

import {
  compareCSV,
  CompareModel,
  ema,
  formatSetting,
  nearest,
  runPoints,
  smooth
} from '../src/compare';
import { ICompareRun, IComparePage, Requester } from '../src/tokens';

const repo = path.resolve(__dirname, '..', '..');
const python = process.env.PYTHON ?? path.join(repo, '.venv', 'bin', 'python');

function run(
  label: string,
  rows: ICompareRun['rows'],
  state = 'done'
): ICompareRun {
  return {
    id: label,
    name: label,
    label,
    state: state as ICompareRun['state'],
    output_dir: `/runs/${label}`,
    rows,
    final: {},
    adapter: null
  };
}

describe('ema', () => {
  it('is the debiased EMA, worked by hand', () => {
    const out = ema([1, 2, 3], 0.5);
    expect(out[0]).toBeCloseTo(1, 12);
    expect(out[1]).toBeCloseTo(1.25 / 0.75, 12);
    expect(out[2]).toBeCloseTo(2.125 / 0.875, 12);
    expect(ema([1, 2, 3], 0)).toEqual([1, 2, 3]);
    expect(ema([2, 2, 2], 0.9)).toEqual([2, 2, 2]);
    expect(() => ema([1], 1)).toThrow(RangeError);
  });

  it('passes missing values through without moving the average', () => {
    const out = ema([1, null, 3], 0.5);
    expect(out[1]).toBeNaN();
    expect(out[2]).toBeCloseTo(ema([1, 3], 0.5)[1], 12);
  });

  it('gives the same numbers as nbtrain.compare.ema (the notebook and the sidebar agree)', () => {
    const values = [2.5, 2.31, null, 2.02, 1.7, 1.92, 1.41, 1.38, 1.5, 1.02];
    const weights = [0, 0.3, 0.6, 0.95];
    const code =
      'import json, sys\n' +
      'from nbtrain.compare import ema\n' +
      'v, ws = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n' +
      'print(json.dumps([[None if x != x else x for x in ema(v, w)] for w in ws]))';
    const r = spawnSync(
      python,
      ['-c', code, JSON.stringify(values), JSON.stringify(weights)],
      { encoding: 'utf8', cwd: repo }
    );
    expect(r.status, r.stderr).toBe(0);
    const fromPython: Array<Array<number | null>> = JSON.parse(r.stdout);
    weights.forEach((w, i) => {
      const ours = ema(values, w).map(x => (Number.isNaN(x) ? null : x));
      ours.forEach((x, j) => {
        if (x === null) {
          expect(fromPython[i][j]).toBeNull();
        } else {
          expect(x).toBeCloseTo(fromPython[i][j]!, 12);
        }
      });
    });
  });
});

describe('curves', () => {
  const a = run('a', [
    { step: 1, loss: 3, time: 1000 },
    { step: 2, loss: 2, time: 1002.5 },
    { step: 3, eval_loss: 2.5, time: 1004 },
    { step: 4, loss: 1, time: 1006 }
  ]);

  it('takes points by step, or by seconds since the first row', () => {
    expect(runPoints(a, 'loss', 'step')).toEqual([
      [1, 3],
      [2, 2],
      [4, 1]
    ]);
    expect(runPoints(a, 'loss', 'time')).toEqual([
      [0, 3],
      [2.5, 2],
      [6, 1]
    ]);
    // rows logged before nbtrain wrote a time cannot be drawn against time
    const old = run('old', [{ step: 1, loss: 2 }]);
    expect(runPoints(old, 'loss', 'step')).toEqual([[1, 2]]);
    expect(runPoints(old, 'loss', 'time')).toEqual([]);
  });

  it('smooths the values and keeps the x', () => {
    const pts = runPoints(a, 'loss', 'step');
    expect(smooth(pts, 0.5).map(p => p[0])).toEqual([1, 2, 4]);
    expect(smooth(pts, 0.5).map(p => p[1])).toEqual(ema([3, 2, 1], 0.5));
  });

  it('finds the point nearest the hovered x', () => {
    const pts: Array<[number, number]> = [
      [1, 10],
      [5, 50],
      [9, 90]
    ];
    expect(nearest(pts, -3)).toEqual([1, 10]);
    expect(nearest(pts, 2.9)).toEqual([1, 10]);
    expect(nearest(pts, 3.1)).toEqual([5, 50]);
    expect(nearest(pts, 100)).toEqual([9, 90]);
    expect(nearest([], 1)).toBeNull();
  });

  it('writes the shown curves, raw and smoothed, for every run', () => {
    const b = run('b, the "second"', [
      { step: 1, loss: 4, time: 50 },
      { step: 2, loss: 3, time: 51 }
    ]);
    const csv = compareCSV([a, b], 'step', 0.5, ['loss', 'eval_loss']);
    const lines = csv.trimEnd().split('\n');
    expect(lines[0]).toBe(
      'run,step,loss,loss_smoothed,eval_loss,eval_loss_smoothed'
    );
    const sm = ema([3, 2, 1], 0.5);
    expect(lines.slice(1, 5)).toEqual([
      `a,1,3,${sm[0]},,`,
      `a,2,2,${sm[1]},,`,
      'a,3,,,2.5,2.5',
      `a,4,1,${sm[2]},,`
    ]);
    const smB = ema([4, 3], 0.5);
    expect(lines.slice(5)).toEqual([
      `"b, the ""second""",1,4,${smB[0]},,`,
      `"b, the ""second""",2,3,${smB[1]},,`
    ]);
    const byTime = compareCSV([a], 'time', 0, ['loss']).trimEnd().split('\n');
    expect(byTime).toEqual([
      'run,time,loss,loss_smoothed',
      'a,0,3,3',
      'a,2.5,2,2',
      'a,6,1,1'
    ]);
  });

  it('writes settings briefly', () => {
    expect(formatSetting(0.0001)).toBe('1e-4');
    expect(formatSetting(0.0002)).toBe('2e-4');
    expect(formatSetting(0.01)).toBe('0.01');
    expect(formatSetting(0.001)).toBe('1e-3');
    expect(formatSetting(0.005)).toBe('5e-3');
    expect(formatSetting(1.5e-5)).toBe('1.5e-5');
    expect(formatSetting(null)).toBe('—');
    expect(formatSetting(['q_proj', 'v_proj'])).toBe('["q_proj","v_proj"]');
  });
});

describe('CompareModel', () => {
  it('asks for the runs by id and stops once none is running', async () => {
    const asked: string[] = [];
    let state = 'running';
    const request: Requester = async <T>(endPoint: string) => {
      asked.push(endPoint);
      return {
        runs: [run('a', [{ step: 1, loss: 1 }], state)],
        diff: { learning_rate: [0.01] }
      } as IComparePage as T;
    };
    const model = new CompareModel({
      request,
      runIds: ['abc', 'def'],
      interval: 50,
      standby: 'never'
    });
    await model.refresh();
    expect(asked[0]).toBe('compare?runs=abc,def');
    expect(model.page?.diff).toEqual({ learning_rate: [0.01] });
    state = 'done';
    await new Promise(r => setTimeout(r, 400));
    const count = asked.length;
    expect(count).toBeGreaterThan(1);
    await new Promise(r => setTimeout(r, 300));
    expect(asked.length).toBe(count); // stopped
    model.dispose();
  });
});
