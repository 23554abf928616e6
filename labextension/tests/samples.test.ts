import { describe, expect, it } from 'vitest';

import {
  byStep,
  mergeSamples,
  RunSamples,
  shownCompletion,
  sideBySide
} from '../src/samples';
import {
  ICompareRun,
  IRun,
  ISample,
  ISamplesPage,
  Requester
} from '../src/tokens';

function sample(
  step: number,
  index: number,
  completion = `s${step}i${index}`
): ISample {
  return {
    step,
    index,
    prompt: `prompt ${index}`,
    completion,
    reference: null,
    tokens: 4,
    seconds: 0.5
  };
}

const RUN: IRun = {
  id: 'abc123',
  name: 'sft',
  output_dir: '/tmp/sft',
  state: 'running',
  step: 0,
  total_steps: 100,
  loss: null,
  tokens_per_s: null,
  started: 100,
  ended: null,
  host: 'node-a',
  pid: 42,
  cluster_id: null,
  world_size: 1
};

/** The samples endpoint over in-memory rows: whole steps >= since, at most `maxSteps` of them. */
class FakeServer {
  run: IRun = { ...RUN };
  rows: ISample[] = [];
  maxSteps = 50;
  calls: string[] = [];

  request: Requester = async <T>(endPoint: string) => {
    this.calls.push(endPoint);
    const since = Number(
      new URL(endPoint, 'http://x/').searchParams.get('since')
    );
    const rest = this.rows.filter(r => r.step >= since);
    const steps = [...new Set(rest.map(r => r.step))];
    const kept = new Set(steps.slice(0, this.maxSteps));
    const rows = rest.filter(r => kept.has(r.step));
    const page: ISamplesPage = {
      run: { ...this.run },
      rows,
      last_step: rows.length ? rows[rows.length - 1].step : null,
      more: steps.length > kept.size
    };
    return page as T;
  };
}

describe('samples', () => {
  it('groups rows by step, newest first, prompts in order', () => {
    const steps = byStep([
      sample(0, 1),
      sample(0, 0),
      sample(10, 0),
      sample(10, 1)
    ]);
    expect(steps.map(s => s.step)).toEqual([10, 0]);
    expect(steps[1].samples.map(s => s.completion)).toEqual(['s0i0', 's0i1']);
  });

  it('replaces a step that comes again, whole', () => {
    const held = [sample(0, 0), sample(10, 0)];
    const merged = mergeSamples(held, [sample(10, 0, 'again'), sample(10, 1)]);
    expect(merged.map(s => [s.step, s.index, s.completion])).toEqual([
      [0, 0, 's0i0'],
      [10, 0, 'again'],
      [10, 1, 's10i1']
    ]);
    expect(mergeSamples(held, [])).toBe(held);
  });

  it('matches runs by prompt, in the first run’s order', () => {
    const run = (id: string, samples: ISample[]): ICompareRun => ({
      id,
      name: id,
      label: id,
      state: 'done',
      output_dir: `/r/${id}`,
      rows: [],
      final: {},
      adapter: null,
      samples
    });
    const other = { ...sample(4, 0, 'b0'), reference: 'gold' };
    const extra = { ...sample(4, 1, 'only b'), prompt: 'b alone' };
    const matched = sideBySide([
      run('a', [sample(8, 0, 'a0'), sample(8, 1, 'a1')]),
      run('b', [other, extra]),
      run('c', [])
    ]);
    expect(matched.map(m => m.prompt)).toEqual([
      'prompt 0',
      'prompt 1',
      'b alone'
    ]);
    expect(matched[0].reference).toBe('gold');
    expect(matched[0].completions.map(c => c?.completion ?? null)).toEqual([
      'a0',
      'b0',
      null
    ]);
    expect(matched[2].completions.map(c => c?.completion ?? null)).toEqual([
      null,
      'only b',
      null
    ]);
  });
});

describe('RunSamples', () => {
  function setup() {
    const server = new FakeServer();
    const samples = new RunSamples({
      request: server.request,
      runId: RUN.id,
      interval: 60_000,
      standby: 'never'
    });
    return { server, samples };
  }

  it('asks again from its newest step, so a half-written step fills in', async () => {
    const { server, samples } = setup();
    server.rows = [sample(0, 0), sample(0, 1), sample(10, 0)];
    await samples.refresh();
    expect(server.calls).toEqual([`runs/${RUN.id}/samples?since=-1`]);
    server.rows.push(sample(10, 1), sample(20, 0));
    await samples.refresh();
    expect(server.calls[1]).toBe(`runs/${RUN.id}/samples?since=10`);
    expect(samples.steps.map(s => [s.step, s.samples.length])).toEqual([
      [20, 1],
      [10, 2],
      [0, 2]
    ]);
    samples.dispose();
  });

  it('takes every page of whole steps in one tick', async () => {
    const { server, samples } = setup();
    server.maxSteps = 2;
    for (const step of [0, 5, 10, 15, 20]) {
      server.rows.push(sample(step, 0), sample(step, 1));
    }
    await samples.refresh();
    expect(samples.rows.length).toBe(10);
    expect(server.calls).toEqual([
      `runs/${RUN.id}/samples?since=-1`,
      `runs/${RUN.id}/samples?since=6`,
      `runs/${RUN.id}/samples?since=16`
    ]);
    samples.dispose();
  });

  it('starts over when the same folder is started again', async () => {
    const { server, samples } = setup();
    server.rows = [sample(0, 0), sample(30, 0)];
    await samples.refresh();
    server.run.started = 999;
    server.rows = [sample(0, 0, 'new')];
    await samples.refresh();
    expect(samples.rows.map(r => r.completion)).toEqual(['new']);
    samples.dispose();
  });
});

describe('shownCompletion', () => {
  it('marks a character cut by the token limit with … instead of �', () => {
    expect(shownCompletion('caf\uFFFD')).toEqual({ text: 'caf…', cut: true });
    expect(shownCompletion('a \uFFFD b')).toEqual({
      text: 'a \uFFFD b',
      cut: false
    });
    expect(shownCompletion('done')).toEqual({ text: 'done', cut: false });
  });
});
