import { describe, expect, it } from 'vitest';

import { formatValue } from '../src/charts';
import {
  formatDuration,
  isLive,
  lossTitle,
  lossUnit,
  mergeRows,
  newestRunning,
  plurals,
  RunMetrics,
  shortPath,
  stateTitle,
  statusText,
  TrainingModel
} from '../src/model';
import { IMetricsRow, IRun, Requester } from '../src/tokens';

function makeRun(over: Partial<IRun> = {}): IRun {
  return {
    id: 'abc123',
    name: 'sft',
    output_dir: '/tmp/sft',
    state: 'running',
    step: 120,
    total_steps: 1000,
    loss: 1.234,
    tokens_per_s: 3210,
    started: 100,
    ended: null,
    host: 'node-a',
    pid: 42,
    cluster_id: null,
    world_size: 2,
    ...over
  };
}

/** A stand-in for the server extension: the same endpoints over in-memory runs and rows. */
class FakeServer {
  runs: IRun[] = [];
  rows: Record<string, IMetricsRow[]> = {};
  calls: Array<{ endPoint: string; method: string }> = [];
  pageLimit = 5000;
  failNext = false;

  request: Requester = async <T>(endPoint: string, init: RequestInit = {}) => {
    this.calls.push({ endPoint, method: init.method ?? 'GET' });
    if (this.failNext) {
      this.failNext = false;
      throw new Error('boom');
    }
    const url = new URL(endPoint, 'http://x/');
    const parts = url.pathname.slice(1).split('/');
    if (parts[0] === 'clusters') {
      return { clusters: [] } as T;
    }
    if (parts[0] === 'runs' && parts.length === 1) {
      return { runs: this.runs } as T;
    }
    const run = this.runs.find(r => r.id === parts[1]);
    if (!run) {
      throw new Error('404');
    }
    if (parts[2] === 'stop') {
      return { id: run.id, stop_requested: true } as T;
    }
    const after = Number(url.searchParams.get('after') ?? -1);
    const rest = (this.rows[run.id] ?? []).filter(r => r.step > after);
    const rows = rest.slice(0, this.pageLimit);
    return {
      run: { ...run },
      rows,
      last_step: rows.length ? rows[rows.length - 1].step : after,
      more: rest.length > rows.length
    } as T;
  };
}

function steps(from: number, to: number): IMetricsRow[] {
  const out: IMetricsRow[] = [];
  for (let s = from; s <= to; s++) {
    out.push({ step: s, loss: 3 - s / 100, tokens_per_s: 3000 + s });
  }
  return out;
}

describe('formatting', () => {
  it('writes the status bar text, naming the run', () => {
    expect(statusText(makeRun())).toBe(
      'sft · step 120/1000 · loss 1.23 · 3.21k tok/s'
    );
  });

  it('copes with unknown totals and missing numbers', () => {
    expect(
      statusText(makeRun({ total_steps: null, loss: null, tokens_per_s: null }))
    ).toBe('sft · step 120 · loss – · – tok/s');
  });

  it('writes every number one way: three significant digits, a suffix from 1000 on', () => {
    expect(formatValue(950)).toBe('950');
    expect(formatValue(999.4)).toBe('999');
    expect(formatValue(999.7)).toBe('1.00k');
    expect(formatValue(3165.6)).toBe('3.17k');
    expect(formatValue(12_000)).toBe('12.0k');
    expect(formatValue(1_460_000)).toBe('1.46M');
    expect(formatValue(4.7)).toBe('4.70');
    expect(formatValue(0.958)).toBe('0.958');
    expect(formatValue(0.04123)).toBe('0.0412');
    expect(formatValue(2e-4)).toBe('2e-4');
    expect(formatValue(1.234e-4)).toBe('1.23e-4');
    expect(formatValue(-1.5)).toBe('-1.50');
    expect(formatValue(0)).toBe('0');
    expect(formatValue(Number.NaN)).toBe('–');
    expect(formatValue(null)).toBe('–');
  });

  it('writes durations and shortens paths', () => {
    expect(formatDuration(12.4)).toBe('12s');
    expect(formatDuration(125)).toBe('2m 05s');
    expect(formatDuration(3720)).toBe('1h 02m');
    expect(formatDuration(-1)).toBe('–');
    expect(shortPath('/home/me/runs/lr-1e-2/adapter')).toBe(
      '…/lr-1e-2/adapter'
    );
    expect(shortPath('/home/me/runs/lr-1e-2/adapter', 3)).toBe(
      '…/runs/lr-1e-2/adapter'
    );
    expect(shortPath('runs/a')).toBe('runs/a');
  });
});

describe('newestRunning', () => {
  it('picks the most recently started running run', () => {
    const runs = [
      makeRun({ id: 'a', started: 300, state: 'done' }),
      makeRun({ id: 'b', started: 200 }),
      makeRun({ id: 'c', started: 100 })
    ];
    expect(newestRunning(runs)?.id).toBe('b');
    expect(newestRunning([makeRun({ state: 'failed' })])).toBeNull();
  });

  it('skips a record left running by a process that died', () => {
    const runs = [
      makeRun({ id: 'dead', started: 300, live: false, stale: 'gone' }),
      makeRun({ id: 'b', started: 200, live: true })
    ];
    expect(newestRunning(runs)?.id).toBe('b');
  });
});

describe('isLive', () => {
  it('is a running record whose process the server found', () => {
    // a server from before liveness sends no `live`: its running runs stay stoppable
    expect(isLive(makeRun())).toBe(true);
    expect(isLive(makeRun({ live: true }))).toBe(true);
    expect(
      isLive(makeRun({ live: false, stale: 'its process 7 on h is gone' }))
    ).toBe(false);
    expect(isLive(makeRun({ state: 'done' }))).toBe(false);
  });

  it("says in the state's tooltip why a dead run's record may be deleted", () => {
    const dead = makeRun({ live: false, stale: 'its process 7 on h is gone' });
    expect(stateTitle(dead)).toBe(
      'running, by its record, but its process 7 on h is gone: delete its record'
    );
    expect(stateTitle(makeRun({ live: true }))).toBe('running');
  });
});

describe('mergeRows', () => {
  it('appends only steps past the last one held', () => {
    const merged = mergeRows(steps(1, 3), steps(2, 5));
    expect(merged.map(r => r.step)).toEqual([1, 2, 3, 4, 5]);
  });

  it('returns the same array when nothing is new', () => {
    const held = steps(1, 3);
    expect(mergeRows(held, steps(1, 3))).toBe(held);
  });
});

describe('TrainingModel', () => {
  it('refreshes runs and clusters and reports errors until the next success', async () => {
    const server = new FakeServer();
    server.runs = [makeRun()];
    const model = new TrainingModel({
      request: server.request,
      runsInterval: 60_000,
      clustersInterval: 60_000,
      standby: 'never'
    });
    let emitted = 0;
    model.changed.connect(() => emitted++);
    await model.refresh();
    expect(model.runs.map(r => r.id)).toEqual(['abc123']);
    expect(model.clusters).toEqual([]);
    expect(emitted).toBeGreaterThan(0);

    server.failNext = true;
    await model.refresh().catch(() => undefined);
    expect(model.error).toBe('boom');
    await model.refresh();
    expect(model.error).toBeNull();
    model.dispose();
  });

  it('posts a stop request for the run', async () => {
    const server = new FakeServer();
    server.runs = [makeRun()];
    const model = new TrainingModel({
      request: server.request,
      runsInterval: 60_000,
      clustersInterval: 60_000,
      standby: 'never'
    });
    await model.stopRun('abc123');
    expect(server.calls).toContainEqual({
      endPoint: 'runs/abc123/stop',
      method: 'POST'
    });
    model.dispose();
  });
});

describe('RunMetrics', () => {
  function setup() {
    const server = new FakeServer();
    const run = makeRun({ step: 0 });
    server.runs = [run];
    server.rows[run.id] = [];
    const metrics = new RunMetrics({
      request: server.request,
      runId: run.id,
      interval: 60_000,
      standby: 'never'
    });
    return { server, run, metrics };
  }

  it('asks only for steps after the last one it holds', async () => {
    const { server, run, metrics } = setup();
    server.rows[run.id] = steps(1, 10);
    await metrics.refresh();
    expect(metrics.rows.map(r => r.step)).toEqual(
      steps(1, 10).map(r => r.step)
    );

    server.rows[run.id] = steps(1, 14);
    await metrics.refresh();
    expect(metrics.rows.length).toBe(14);
    const last = server.calls[server.calls.length - 1].endPoint;
    expect(last).toBe(`runs/${run.id}/metrics?after=10`);
    metrics.dispose();
  });

  it('takes every page of a long run in one tick', async () => {
    const { server, run, metrics } = setup();
    server.pageLimit = 100;
    server.rows[run.id] = steps(1, 250);
    await metrics.refresh();
    expect(metrics.rows.length).toBe(250);
    expect(
      server.calls.filter(c => c.endPoint.includes('metrics')).length
    ).toBe(3);
    metrics.dispose();
  });

  it('stops polling once the run has ended, and resumes on refresh', async () => {
    const { server, run, metrics } = setup();
    server.rows[run.id] = steps(1, 5);
    await metrics.refresh();
    expect(metrics.isPolling).toBe(true);

    run.state = 'stopped';
    await metrics.refresh();
    // Poll.stop() settles on the next microtask turn
    await new Promise(resolve => setTimeout(resolve, 0));
    expect(metrics.run?.state).toBe('stopped');
    expect(metrics.isPolling).toBe(false);
    metrics.dispose();
  });

  it('starts over when the same folder is started again', async () => {
    const { server, run, metrics } = setup();
    server.rows[run.id] = steps(1, 50);
    await metrics.refresh();
    run.started = 999;
    server.rows[run.id] = steps(1, 3);
    await metrics.refresh();
    expect(metrics.rows.map(r => r.step)).toEqual([1, 2, 3]);
    metrics.dispose();
  });
});

describe("issue 34: a run's kind and a preempted run", () => {
  it("titles the loss with the unit of the run's kind", () => {
    expect(lossUnit('sft')).toBe('nats/token');
    // DPO's and GRPO's losses have no unit: their axis says what it is
    expect(lossUnit('dpo')).toBe('loss');
    expect(lossUnit('grpo')).toBe('loss');
    expect(lossUnit('tinker')).toBe('loss');
    // records from before kinds were SFT runs
    expect(lossUnit('finetune')).toBe('nats/token');
    expect(lossUnit(undefined)).toBe('nats/token');
  });

  it('titles compared losses with their one unit, or neutrally for mixed kinds', () => {
    expect(lossTitle(['dpo', 'dpo'])).toBe('loss');
    expect(lossTitle(['sft', 'finetune'])).toBe('nats/token');
    expect(lossTitle(['sft', 'dpo'])).toBe('loss (nats/token for SFT runs)');
  });

  it('says where a preempted run can resume from', () => {
    const run = makeRun({
      state: 'preempted',
      step: 5,
      checkpoint: '/tmp/sft/checkpoint-5'
    });
    expect(stateTitle(run)).toBe(
      "preempted at step 5; checkpoint at /tmp/sft/checkpoint-5; resume with resume='latest' in its config"
    );
    expect(stateTitle(makeRun({ state: 'stopped' }))).toBe('stopped');
  });
});

describe('plurals', () => {
  it("writes the scaling report's node(s) and rank(s) as words", () => {
    expect(plurals('4 node(s) (a, b), 1 rank(s) per node')).toBe(
      '4 nodes (a, b), 1 rank per node'
    );
  });
});
