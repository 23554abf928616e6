/**
 * The data layer of samples, the completions a run generated for its sample prompts during
 * training (`SFTConfig.sample_prompts`, the run folder's samples.jsonl): a run's samples fetched
 * while it runs, grouped by step (newest first), and several runs' last samples matched by prompt.
 * No DOM here, so it is unit-tested in Node.
 */
import { PolledModel, Standby } from './polled';
import { ICompareRun, IRun, ISample, ISamplesPage, Requester } from './tokens';

/** One sampled step: its completions in prompt order. */
export interface ISampledStep {
  step: number;
  samples: ISample[];
}

/**
 * The held rows, with a page merged in: a step the page holds replaces the held one (the newest
 * step comes again, whole, on the next poll: its rows may have been written half when first read).
 */
export function mergeSamples(held: ISample[], page: ISample[]): ISample[] {
  if (!page.length) {
    return held;
  }
  const steps = new Set(page.map(r => r.step));
  return held.filter(r => !steps.has(r.step)).concat(page);
}

/** The rows grouped by step, newest step first, each step's rows in prompt order. */
export function byStep(rows: ISample[]): ISampledStep[] {
  const steps = new Map<number, Map<number, ISample>>();
  for (const row of rows) {
    if (!steps.has(row.step)) {
      steps.set(row.step, new Map());
    }
    steps.get(row.step)!.set(row.index, row);
  }
  return [...steps.keys()]
    .sort((a, b) => b - a)
    .map(step => ({
      step,
      samples: [...steps.get(step)!.values()].sort((a, b) => a.index - b.index)
    }));
}

/** One prompt across runs: its reference, and each run's last completion (null: not sampled). */
export interface ISideBySide {
  prompt: string;
  reference: string | null;
  completions: Array<ISample | null>;
}

/**
 * The runs' last samples matched by prompt text (runs may sample different prompt files): in the
 * first run's prompt order, then the prompts only later runs have (nbtrain.compare.side_by_side).
 */
export function sideBySide(runs: ICompareRun[]): ISideBySide[] {
  const out = new Map<string, ISideBySide>();
  runs.forEach((run, r) => {
    for (const sample of run.samples ?? []) {
      let entry = out.get(sample.prompt);
      if (!entry) {
        entry = {
          prompt: sample.prompt,
          reference: null,
          completions: runs.map(() => null)
        };
        out.set(sample.prompt, entry);
      }
      entry.reference = entry.reference ?? sample.reference;
      entry.completions[r] = sample;
    }
  });
  return [...out.values()];
}

/** A run's samples, fetched every few seconds while it runs (a step is sampled rarely). */
export class RunSamples extends PolledModel {
  constructor(options: RunSamples.IOptions) {
    super({
      request: options.request,
      name: `nbtrain:samples:${options.runId}`,
      interval: options.interval ?? 3000,
      standby: options.standby
    });
    this.runId = options.runId;
  }

  readonly runId: string;

  /** Every sampled row so far. */
  get rows(): ISample[] {
    return this._rows;
  }

  /** The rows by step, newest first. */
  get steps(): ISampledStep[] {
    return byStep(this._rows);
  }

  protected async load(): Promise<boolean> {
    let page = await this._fetchPage(this._newest());
    // a long run opened late arrives in pages of whole steps
    while (page.more && page.last_step !== null && !this.isDisposed) {
      page = await this._fetchPage(page.last_step + 1);
    }
    return page.run.state === 'running';
  }

  private _newest(): number {
    return this._rows.reduce((m, r) => Math.max(m, r.step), -1);
  }

  private async _fetchPage(since: number): Promise<ISamplesPage> {
    const id = encodeURIComponent(this.runId);
    const page = await this.request<ISamplesPage>(
      `runs/${id}/samples?since=${since}`
    );
    if (this._run && page.run.started !== this._run.started) {
      // the same folder was started again: its samples.jsonl begins anew
      this._rows = [];
      this._run = page.run;
      return this._fetchPage(-1);
    }
    this._run = page.run;
    this._rows = mergeSamples(this._rows, page.rows);
    return page;
  }

  private _run: IRun | null = null;
  private _rows: ISample[] = [];
}

export namespace RunSamples {
  export interface IOptions {
    request: Requester;
    runId: string;
    /** Milliseconds between polls while the run runs (3 s by default). */
    interval?: number;
    standby?: Standby;
  }
}

/**
 * A completion as shown: a multi-byte character cut by the token limit (decoded as U+FFFD at the
 * end) is dropped and the cut marked with "…", rather than shown as "�". Replacement characters
 * inside the text (the model wrote them) stay.
 */
export function shownCompletion(text: string): { text: string; cut: boolean } {
  const m = /\uFFFD+$/.exec(text);
  return m
    ? { text: `${text.slice(0, m.index)}…`, cut: true }
    : { text, cut: false };
}
