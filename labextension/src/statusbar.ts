/** The status bar item for the newest running run: `step 120/1000 · loss 1.23 · 3.2k tok/s`. */
import { Widget } from '@lumino/widgets';

import { newestRunning, statusText, TrainingModel } from './model';

export class TrainingStatus extends Widget {
  constructor(model: TrainingModel, onOpen: (id: string) => void) {
    super();
    this._model = model;
    this.addClass('nbtrain-Status');
    this.node.addEventListener('click', () => {
      const run = newestRunning(this._model.runs);
      if (run) {
        onOpen(run.id);
      }
    });
    model.changed.connect(this._render, this);
    this._render();
  }

  /** Shown only while some run is running. */
  get isActive(): boolean {
    return newestRunning(this._model.runs) !== null;
  }

  dispose(): void {
    this._model.changed.disconnect(this._render, this);
    super.dispose();
  }

  private _render(): void {
    const run = newestRunning(this._model.runs);
    this.node.textContent = run ? statusText(run) : '';
    this.node.title = run ? `${run.name}: click to open its charts` : '';
  }

  private _model: TrainingModel;
}
