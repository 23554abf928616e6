/**
 * The shapes the server extension returns under /nbtrain/api/ (see nbtrain/server/handlers.py).
 */

/** How a run is or ended (nbtrain/runs.py STATES): `preempted` by SIGTERM/SIGUSR1, with a checkpoint. */
export type RunState = 'running' | 'done' | 'failed' | 'stopped' | 'preempted';

/** What a run trained (nbtrain/runs.py RUN_KINDS), `finetune` in records from before kinds. */
export type RunKind = 'sft' | 'dpo' | 'grpo' | 'finetune' | 'tinker' | string;

/** One training run from the per-user runs registry (nbtrain/runs.py). */
export interface IRun {
  id: string;
  /** sft, dpo or grpo (what the run trained), or "scaling" for a saved scaling report. */
  kind?: RunKind | 'scaling';
  name: string;
  output_dir: string;
  state: RunState;
  step: number;
  total_steps: number | null;
  loss: number | null;
  tokens_per_s: number | null;
  started: number;
  ended: number | null;
  host: string;
  pid: number;
  cluster_id: string | null;
  world_size: number;
  /** The folder of this run's scaling report, when one was saved (nbtrain.scaling(out=...)). */
  scaling?: string | null;
  /** A scaling record: the config's output_dir it measured. */
  measured?: string | null;
  /** A preempted run: the checkpoint it wrote, to resume from (its step is `step`). */
  checkpoint?: string | null;
  /** A running record: whether its process still runs (false when it died without a word). */
  live?: boolean;
  /** A running record whose process is gone: why the server says so. */
  stale?: string;
}

/** One logged step of a run's metrics.jsonl. */
export interface IMetricsRow {
  step: number;
  loss?: number | null;
  eval_loss?: number | null;
  grad_norm?: number | null;
  learning_rate?: number | null;
  tokens_per_s?: number | null;
  step_time?: number | null;
  epoch?: number | null;
  /** Unix seconds the row was logged. */
  time?: number | null;
  /** GPU only: model FLOPs utilisation, and the peak memory of the busiest rank and of each rank. */
  mfu?: number | null;
  peak_memory_gb?: number | null;
  [key: string]: number | null | undefined;
}

/** GET runs/<id>/metrics?after=K: rows with step > K. */
export interface IMetricsPage {
  run: IRun;
  rows: IMetricsRow[];
  last_step: number;
  more: boolean;
}

/** One size of a scaling report (nbtrain/cluster/scaling/report.py), measured or predicted. */
export interface IScalingRow {
  nodes: number | null;
  ranks: number;
  predicted: boolean;
  tokens_per_s: number;
  tokens_per_s_per_rank?: number;
  efficiency: number;
  step_s?: number;
  assumptions?: string;
  [key: string]: unknown;
}

/** scaling.json as the report wrote it. */
export interface IScalingReport {
  mode: string;
  unit: 'nodes' | 'ranks';
  machine: string;
  threshold: number;
  verdict: {
    limit: string;
    near_linear: boolean;
    line: string;
    advice: string[];
  };
  rows: IScalingRow[];
  warnings: string[];
}

/** GET runs/<id>/scaling. */
export interface IScalingPage {
  folder: string;
  report: IScalingReport;
}

/** One completion sampled during training (a row of the run's samples.jsonl, nbtrain.runs.SAMPLES_FILE). */
export interface ISample {
  step: number;
  /** The prompt's index among the run's sample prompts. */
  index: number;
  prompt: string;
  completion: string;
  /** The data file's completion for this prompt, where it has one. */
  reference: string | null;
  tokens: number | null;
  seconds: number | null;
}

/** GET runs/<id>/samples?since=K: the rows of steps >= K, whole steps, oldest first. */
export interface ISamplesPage {
  run: IRun;
  rows: ISample[];
  last_step: number | null;
  more: boolean;
}

/** One run as GET compare?runs=... returns it (nbtrain.compare.load_run on the server). */
export interface ICompareRun {
  id: string;
  name: string;
  /** The name, made distinct among the runs compared (nbtrain.compare.labels). */
  label: string;
  state: RunState | null;
  /** What the run trained: its loss's unit follows (lossUnit). */
  kind?: RunKind;
  output_dir: string;
  rows: IMetricsRow[];
  /** The last value of each metric. */
  final: Record<string, number | string | null>;
  /** output_dir/adapter when an adapter was exported. */
  adapter: string | null;
  /** The completions of the run's last sampled step, in prompt order ([] when it sampled none). */
  samples?: ISample[];
}

/** GET compare?runs=<id>,<id>: the runs, and the settings that differ (values in run order). */
export interface IComparePage {
  runs: ICompareRun[];
  diff: Record<string, unknown[]>;
}

/** One rank of a cluster, from nbtrain's side file. */
export interface IRank {
  rank: number;
  host: string;
  local_rank: number;
  device: string;
  pid: number;
}

/** One ipyparallel cluster, enriched with nbtrain's side file when there is one. */
export interface ICluster {
  id: string;
  cluster_id: string;
  profile: string;
  profile_dir: string;
  state: string;
  engines: number;
  backend: string | null;
  world_size: number;
  hosts: string[];
  nodes: number;
  gpus: number;
  ranks: IRank[];
  notebook: string | null;
  started: number | null;
  nbtrain: boolean;
}

/**
 * How the data layer talks to the server: `requestAPI` in the extension, a fake in unit tests.
 */
export type Requester = <T>(endPoint: string, init?: RequestInit) => Promise<T>;

/** GET runs/<id>/config: the settings a run ran with, its kind, and its cluster. */
export interface IRunConfig {
  kind: string | null;
  config: Record<string, unknown>;
  config_file: string | null;
  cluster: {
    cluster_id: string | null;
    world_size: number;
    host: string;
    hosts: string[];
    backend: string | null;
    notebook: string | null;
  } | null;
}
