import { describe, expect, it } from 'vitest';

import {
  fetchScaling,
  hasMetric,
  rankMemoryKeys,
  scalingLines
} from '../src/model';
import { IMetricsRow, IScalingReport, Requester } from '../src/tokens';

describe('GPU metrics', () => {
  it('finds the per-rank memory keys in rank order, whichever rows carry them', () => {
    const rows: IMetricsRow[] = [
      { step: 1, loss: 2 },
      {
        step: 2,
        peak_memory_gb: 12,
        peak_memory_gb_rank10: 11,
        peak_memory_gb_rank2: 12
      },
      { step: 3, peak_memory_gb_rank0: 9 }
    ];
    expect(rankMemoryKeys(rows)).toEqual([
      'peak_memory_gb_rank0',
      'peak_memory_gb_rank2',
      'peak_memory_gb_rank10'
    ]);
    expect(rankMemoryKeys([{ step: 1, loss: 2 }])).toEqual([]);
  });

  it('says a metric is there only when some row has a finite number', () => {
    expect(hasMetric([{ step: 1, mfu: null }, { step: 2 }], 'mfu')).toBe(false);
    expect(
      hasMetric(
        [
          { step: 1, mfu: null },
          { step: 2, mfu: 0.4 }
        ],
        'mfu'
      )
    ).toBe(true);
  });
});

function report(unit: 'nodes' | 'ranks'): IScalingReport {
  return {
    mode: 'weak',
    unit,
    machine: 'test',
    threshold: 0.9,
    verdict: {
      limit: 'compute-bound',
      near_linear: false,
      line: 'x',
      advice: []
    },
    warnings: [],
    rows: [
      {
        nodes: 1,
        ranks: 2,
        predicted: false,
        tokens_per_s: 904.2,
        efficiency: 1
      },
      {
        nodes: 2,
        ranks: 4,
        predicted: false,
        tokens_per_s: 1236,
        efficiency: 0.6836
      },
      {
        nodes: 8,
        ranks: 16,
        predicted: true,
        tokens_per_s: 2336.4,
        efficiency: 0.323
      }
    ]
  };
}

describe('scalingLines', () => {
  it('gives each size its unit, rounded tokens/s and efficiency, predicted rows marked', () => {
    expect(scalingLines(report('nodes'))).toEqual([
      {
        size: 1,
        ranks: 2,
        tokensPerS: '904',
        efficiency: '1.00',
        predicted: false
      },
      {
        size: 2,
        ranks: 4,
        tokensPerS: '1.24k',
        efficiency: '0.684',
        predicted: false
      },
      {
        size: 8,
        ranks: 16,
        tokensPerS: '2.34k',
        efficiency: '0.323',
        predicted: true
      }
    ]);
    expect(scalingLines(report('ranks')).map(l => l.size)).toEqual([2, 4, 16]);
  });
});

describe('fetchScaling', () => {
  it('answers null for a run without a report and passes other errors on', async () => {
    const notFound: Requester = async () => {
      throw Object.assign(new Error('no report'), {
        response: new Response('', { status: 404 })
      });
    };
    expect(await fetchScaling(notFound, 'abc')).toBeNull();
    const broken: Requester = async () => {
      throw Object.assign(new Error('boom'), {
        response: new Response('', { status: 500 })
      });
    };
    await expect(fetchScaling(broken, 'abc')).rejects.toThrow('boom');
    const asked: string[] = [];
    const ok: Requester = async <T>(endPoint: string) => {
      asked.push(endPoint);
      return { folder: '/r', report: report('nodes') } as T;
    };
    expect((await fetchScaling(ok, 'ab/c'))?.folder).toBe('/r');
    expect(asked).toEqual(['runs/ab%2Fc/scaling']);
  });
});
