/**
 * The "Training" sidebar: clusters (nodes, ranks, GPUs, state) and runs (live state).
 */
import { Widget } from '@lumino/widgets';

import { colourVar } from './charts';
import { runColour } from './metrics';
import {
  baseName,
  filterRuns,
  isLive,
  progressParts,
  stateTitle,
  TrainingModel
} from './model';
import { ICluster, IRun } from './tokens';

/** What the sidebar asks of the application: open a run's panel, stop a run, compare runs. */
export interface ISidebarActions {
  openRun(id: string): void;
  stopRun(id: string): void;
  /** Forget a run's record (asks first); its folder stays. */
  deleteRun(id: string): void;
  compareRuns(ids: string[]): void;
}

export class TrainingSidebar extends Widget {
  constructor(model: TrainingModel, actions: ISidebarActions) {
    super();
    this._model = model;
    this._actions = actions;
    this.id = 'nbtrain-training-sidebar';
    this.addClass('nbtrain-Sidebar');
    this.node.innerHTML = `
      <header class="nbtrain-Sidebar-title">Training</header>
      <div class="nbtrain-Sidebar-error" hidden></div>
      <section class="nbtrain-Sidebar-section">
        <h3>Clusters</h3>
        <ul class="nbtrain-ClusterList"></ul>
      </section>
      <section class="nbtrain-Sidebar-section">
        <h3 class="nbtrain-Runs-head">Runs
          <button class="jp-Button jp-mod-styled nbtrain-CompareButton" disabled
            title="Tick two runs or more to draw them over each other">Compare</button>
        </h3>
        <input type="search" class="nbtrain-RunFilter jp-mod-styled"
          placeholder="Filter runs (name, kind, state, folder)" aria-label="filter runs">
        <ul class="nbtrain-RunList"></ul>
      </section>`;
    this.node.addEventListener('click', this._onClick);
    this.node.addEventListener('change', this._onChange);
    this._filter =
      this.node.querySelector<HTMLInputElement>('.nbtrain-RunFilter')!;
    this._filter.addEventListener('input', () => this._render());
    model.changed.connect(this._render, this);
    this._render();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this.node.removeEventListener('click', this._onClick);
    this.node.removeEventListener('change', this._onChange);
    this._model.changed.disconnect(this._render, this);
    super.dispose();
  }

  private _render(): void {
    const error = this.node.querySelector<HTMLElement>(
      '.nbtrain-Sidebar-error'
    )!;
    error.hidden = !this._model.error;
    error.textContent = this._model.error ? `Server: ${this._model.error}` : '';
    const clusters = this.node.querySelector('.nbtrain-ClusterList')!;
    clusters.replaceChildren(
      ...(this._model.clusters.length
        ? this._model.clusters.map(renderCluster)
        : [emptyItem('No clusters. Start one with %nbtrain start.')])
    );
    const runs = this.node.querySelector('.nbtrain-RunList')!;
    // a run that left the registry leaves the selection
    const ids = new Set(this._model.runs.map(run => run.id));
    for (const id of this._selected) {
      if (!ids.has(id)) {
        this._selected.delete(id);
      }
    }
    const shown = filterRuns(this._model.runs, this._filter.value);
    runs.replaceChildren(
      ...(shown.length
        ? shown.map(run => renderRun(run, this._selected.has(run.id)))
        : [
            emptyItem(
              this._model.runs.length
                ? `No run matches "${this._filter.value}".`
                : 'No runs yet. finetune() registers each run here.'
            )
          ])
    );
    this._renderCompare();
  }

  private _renderCompare(): void {
    const button = this.node.querySelector<HTMLButtonElement>(
      '.nbtrain-CompareButton'
    )!;
    const n = this._selected.size;
    button.disabled = n < 2;
    button.textContent = n ? `Compare (${n})` : 'Compare';
  }

  private _onChange = (event: Event): void => {
    const box = (event.target as HTMLElement).closest<HTMLInputElement>(
      'input[data-select-run]'
    );
    if (!box) {
      return;
    }
    if (box.checked) {
      this._selected.add(box.dataset.selectRun!);
    } else {
      this._selected.delete(box.dataset.selectRun!);
    }
    this._renderCompare();
  };

  private _onClick = (event: MouseEvent): void => {
    const target = event.target as HTMLElement;
    if (target.closest('input[data-select-run], .nbtrain-Run-select')) {
      return; // ticking a run selects it for comparison; it does not open it
    }
    if (target.closest('.nbtrain-CompareButton')) {
      // in the registry's order (newest first), which is the order the sidebar shows
      const ids = this._model.runs
        .map(run => run.id)
        .filter(id => this._selected.has(id));
      if (ids.length >= 2) {
        this._actions.compareRuns(ids);
      }
      return;
    }
    const stop = target.closest<HTMLElement>('[data-stop-run]');
    if (stop) {
      event.stopPropagation();
      this._actions.stopRun(stop.dataset.stopRun!);
      return;
    }
    const del = target.closest<HTMLElement>('[data-delete-run]');
    if (del) {
      event.stopPropagation();
      this._actions.deleteRun(del.dataset.deleteRun!);
      return;
    }
    const item = target.closest<HTMLElement>('[data-run-id]');
    if (item) {
      this._actions.openRun(item.dataset.runId!);
    }
  };

  private _model: TrainingModel;
  private _actions: ISidebarActions;
  private _selected = new Set<string>();
  private _filter: HTMLInputElement;
}

function emptyItem(text: string): HTMLElement {
  const li = document.createElement('li');
  li.className = 'nbtrain-Sidebar-empty';
  li.textContent = text;
  return li;
}

function el(tag: string, className: string, text?: string): HTMLElement {
  const node = document.createElement(tag);
  node.className = className;
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

function renderCluster(cluster: ICluster): HTMLElement {
  const li = el('li', 'nbtrain-Cluster');
  li.dataset.clusterId = cluster.cluster_id;
  li.dataset.state = cluster.state;
  const head = el('div', 'nbtrain-Item-head');
  head.append(
    el('span', 'nbtrain-Item-name', cluster.cluster_id || cluster.profile),
    el('span', `nbtrain-State nbtrain-State-${cluster.state}`, cluster.state)
  );
  const parts = [
    `${cluster.nodes || 1} node${cluster.nodes > 1 ? 's' : ''}`,
    `${cluster.world_size || cluster.engines} rank${(cluster.world_size || cluster.engines) === 1 ? '' : 's'}`,
    `${cluster.gpus} GPU${cluster.gpus === 1 ? '' : 's'}`
  ];
  if (cluster.backend) {
    parts.push(cluster.backend);
  }
  const detail = el('div', 'nbtrain-Item-detail', parts.join(' · '));
  li.append(head, detail);
  if (cluster.notebook) {
    // the notebook's name; its folder on hover
    const from = el(
      'div',
      'nbtrain-Item-detail',
      `from ${baseName(cluster.notebook)}`
    );
    from.title = cluster.notebook;
    li.append(from);
  }
  if (cluster.hosts.length) {
    li.title = cluster.ranks.length
      ? cluster.ranks
          .map(r => `rank ${r.rank}: ${r.host} ${r.device} (pid ${r.pid})`)
          .join('\n')
      : cluster.hosts.join(', ');
  }
  return li;
}

function renderRun(run: IRun, selected: boolean): HTMLElement {
  const li = el('li', 'nbtrain-Run');
  li.dataset.runId = run.id;
  li.dataset.state = run.state;
  li.title = `${run.name}\n${run.output_dir}\nopen the run's charts`;
  const head = el('div', 'nbtrain-Item-head');
  if (run.kind !== 'scaling') {
    const box = document.createElement('input');
    box.type = 'checkbox';
    box.className = 'nbtrain-Run-select';
    box.dataset.selectRun = run.id;
    box.checked = selected;
    box.title = 'Select to compare with other runs';
    box.setAttribute('aria-label', `select ${run.name} to compare`);
    head.append(box);
  } else {
    // a report cannot be compared: an empty box keeps its name in line with the runs' names
    head.append(el('span', 'nbtrain-Run-select nbtrain-Run-noSelect'));
  }
  // the run's colour in every chart
  const dot = el('span', 'nbtrain-Dot');
  dot.style.backgroundColor = colourVar(runColour(run.id));
  dot.dataset.colour = String(runColour(run.id));
  const name = el('span', 'nbtrain-Item-name', run.name);
  // a name cut by the sidebar's width reads whole on hover
  name.title = run.name;
  const state = el(
    'span',
    `nbtrain-State nbtrain-State-${run.state}`,
    run.state
  );
  state.title = stateTitle(run);
  head.append(dot, name, state);
  const detail = el('div', 'nbtrain-Item-detail nbtrain-Run-progress');
  const text = el('span', 'nbtrain-Run-text');
  detail.append(text);
  li.append(head, detail);
  if (run.kind === 'scaling') {
    li.dataset.kind = 'scaling';
    li.title = `${run.name}\n${run.output_dir}\nopen the scaling report`;
    text.textContent = 'scaling report';
  } else {
    li.dataset.kind = run.kind ?? 'sft';
    const parts = progressParts(run);
    if (run.kind && run.kind !== 'sft' && run.kind !== 'finetune') {
      parts.unshift(run.kind.toUpperCase());
    }
    // one line: cut with an ellipsis, the whole on hover
    text.textContent = parts.join(' · ');
    text.title = parts.join(' · ');
  }
  // the buttons sit on the second line: the name keeps the first line's width
  if (isLive(run)) {
    const stop = el(
      'button',
      'jp-Button jp-mod-styled jp-mod-warn nbtrain-StopButton',
      'Stop'
    );
    stop.dataset.stopRun = run.id;
    stop.title = 'Checkpoint and end this run at its next step (asks first)';
    detail.append(stop);
    if (run.total_steps) {
      const bar = el('div', 'nbtrain-Run-bar');
      const fill = el('div', 'nbtrain-Run-barFill');
      fill.style.width = `${Math.min(100, (100 * run.step) / run.total_steps)}%`;
      bar.append(fill);
      li.append(bar);
    }
  } else {
    const del = el('button', 'nbtrain-DeleteButton', '×');
    del.dataset.deleteRun = run.id;
    // a record left "running" by a process that died: delete in place of stop
    del.title =
      run.state !== 'running'
        ? 'Delete this run from the list (asks first; its folder stays)'
        : `Its process is gone (${run.stale ?? 'no sign of life'}): delete its record (asks first; its folder stays)`;
    del.setAttribute('aria-label', `delete ${run.name} from the list`);
    detail.append(del);
  }
  return li;
}
