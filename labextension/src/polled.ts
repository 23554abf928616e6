/**
 * What a run panel's metrics and a comparison have in common: a server answer fetched on a Poll
 * while a run still writes, the last error, a `changed` signal, and a stop once nothing more will
 * be written (until someone refreshes). Subclasses say how to load and whether to go on.
 */
import { IDisposable } from '@lumino/disposable';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { Requester } from './tokens';

export type Standby = Poll.Standby | (() => boolean | Poll.Standby);

export abstract class PolledModel implements IDisposable {
  constructor(options: PolledModel.IOptions) {
    this.request = options.request;
    this._poll = new Poll({
      factory: () => this._fetch(),
      frequency: { interval: options.interval, backoff: true, max: 30 * 1000 },
      name: options.name,
      standby: options.standby ?? 'when-hidden'
    });
  }

  get error(): string | null {
    return this._error;
  }

  /** True while it still polls: a run runs, or rows remain to fetch. */
  get isPolling(): boolean {
    return this._poll.state.phase !== 'stopped' && !this._poll.isDisposed;
  }

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  get isDisposed(): boolean {
    return this._isDisposed;
  }

  /** Fetch now, and resume polling if it had stopped. */
  async refresh(): Promise<void> {
    await this._poll.refresh();
    await this._poll.tick;
  }

  dispose(): void {
    if (this._isDisposed) {
      return;
    }
    this._isDisposed = true;
    this._poll.dispose();
    Signal.clearData(this);
  }

  /** Fetch and keep the answer; true while more may still be written (a run is running). */
  protected abstract load(): Promise<boolean>;

  protected readonly request: Requester;

  private async _fetch(): Promise<void> {
    let running: boolean;
    try {
      running = await this.load();
    } catch (error) {
      if (this._isDisposed) {
        return;
      }
      this._error = error instanceof Error ? error.message : String(error);
      this._changed.emit();
      throw error;
    }
    if (this._isDisposed) {
      return;
    }
    this._error = null;
    this._changed.emit();
    if (!running) {
      // nothing more will be written: stop until someone refreshes
      void this._poll.stop();
    }
  }

  private _error: string | null = null;
  private _poll: Poll;
  private _isDisposed = false;
  private _changed = new Signal<this, void>(this);
}

export namespace PolledModel {
  export interface IOptions {
    request: Requester;
    /** The Poll's name, for debugging. */
    name: string;
    /** Milliseconds between fetches while a run runs. */
    interval: number;
    standby?: Standby;
  }
}
