/**
 * nbtrain's JupyterLab extension: the Training sidebar, run panels and the status bar item.
 */
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import {
  Dialog,
  ICommandPalette,
  InputDialog,
  MainAreaWidget,
  Notification,
  showDialog,
  WidgetTracker
} from '@jupyterlab/apputils';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';

import { CompareModel } from './compare';
import { ComparePanel } from './comparepanel';
import { newestRunning, RunMetrics, TrainingModel } from './model';
import { RunPanel } from './panel';
import { requestAPI } from './request';
import { TrainingSidebar } from './sidebar';
import { TrainingStatus } from './statusbar';
import { IRun } from './tokens';

export namespace CommandIDs {
  export const openRun = 'nbtrain:open-run';
  export const stopRun = 'nbtrain:stop-run';
  export const refresh = 'nbtrain:refresh';
  export const compareRuns = 'nbtrain:compare-runs';
}

const trainingIcon = new LabIcon({
  name: 'nbtrain:training',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16"><path class="jp-icon3" fill="#616161" d="M3 20h18v2H3zM4 17l5-6 4 3 6-9 1.6 1.2-7.2 10.6-4-3L5.6 18.2z"/></svg>'
});

async function pickRun(
  runs: IRun[],
  title: string,
  preferred: IRun | null
): Promise<string | null> {
  if (!runs.length) {
    Notification.info('nbtrain: no runs to choose from');
    return null;
  }
  const labels = runs.map(run => `${run.name} (${run.state}) [${run.id}]`);
  const current = preferred ? runs.indexOf(preferred) : 0;
  const result = await InputDialog.getItem({
    title,
    items: labels,
    current: Math.max(0, current)
  });
  if (!result.button.accept || result.value === null) {
    return null;
  }
  return runs[labels.indexOf(result.value)]?.id ?? null;
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'nbtrain:plugin',
  description: 'A Training sidebar with clusters, runs and live charts.',
  autoStart: true,
  optional: [ICommandPalette, ILayoutRestorer, IStatusBar],
  activate: (
    app: JupyterFrontEnd,
    palette: ICommandPalette | null,
    restorer: ILayoutRestorer | null,
    statusBar: IStatusBar | null
  ) => {
    const request = <T>(endPoint: string, init?: RequestInit) =>
      requestAPI<T>(endPoint, init, app.serviceManager.serverSettings);
    const model = new TrainingModel({ request });
    const tracker = new WidgetTracker<MainAreaWidget<RunPanel>>({
      namespace: 'nbtrain-run'
    });

    const compareTracker = new WidgetTracker<MainAreaWidget<ComparePanel>>({
      namespace: 'nbtrain-compare'
    });

    const compareRuns = (ids: string[]) => {
      const key = ids.join(',');
      const open = compareTracker.find(
        w => w.content.model.runIds.join(',') === key
      );
      if (open) {
        app.shell.activateById(open.id);
        return open;
      }
      const content = new ComparePanel(
        new CompareModel({ request, runIds: ids })
      );
      const widget = new MainAreaWidget({ content });
      widget.id = `nbtrain-compare-${ids.join('-')}`;
      widget.title.icon = trainingIcon;
      widget.title.closable = true;
      void compareTracker.add(widget);
      app.shell.add(widget, 'main');
      app.shell.activateById(widget.id);
      return widget;
    };

    /** Stop a run, after asking: a stop ends the run (at its next step, with a checkpoint). */
    const stopRun = async (id: string, confirm = true): Promise<boolean> => {
      const name = model.getRun(id)?.name ?? id;
      if (confirm) {
        const answer = await showDialog({
          title: `Stop run ${name}?`,
          body: "It saves a checkpoint and ends at its next step; resume it with resume='latest' in its config.",
          buttons: [
            Dialog.cancelButton(),
            Dialog.warnButton({ label: 'Stop run' })
          ]
        });
        if (!answer.button.accept) {
          return false;
        }
      }
      try {
        await model.stopRun(id);
        Notification.info(
          `nbtrain: asked run ${model.getRun(id)?.name ?? id} to stop; it ends at its next step`,
          { autoClose: 4000 }
        );
      } catch (error) {
        Notification.error(`nbtrain: could not stop run ${id}: ${error}`);
      }
      tracker.forEach(w => void w.content.metrics.refresh());
      return true;
    };

    /** Forget a run's record, after asking; its folder (metrics, checkpoints, adapter) stays. */
    const deleteRun = async (id: string): Promise<boolean> => {
      const run = model.getRun(id);
      const name = run?.name ?? id;
      const answer = await showDialog({
        title: `Delete run ${name} from the list?`,
        body: `Its record leaves the Training sidebar. Its folder stays on disk: ${run?.output_dir ?? ''}`,
        buttons: [
          Dialog.cancelButton(),
          Dialog.warnButton({ label: 'Delete record' })
        ]
      });
      if (!answer.button.accept) {
        return false;
      }
      try {
        await model.deleteRun(id);
        tracker.find(w => w.content.metrics.runId === id)?.dispose();
      } catch (error) {
        Notification.error(`nbtrain: could not delete run ${name}: ${error}`);
        return false;
      }
      return true;
    };

    const openRun = (id: string) => {
      const open = tracker.find(w => w.content.metrics.runId === id);
      if (open) {
        app.shell.activateById(open.id);
        return open;
      }
      const metrics = new RunMetrics({ request, runId: id });
      const content = new RunPanel(metrics, runId => stopRun(runId), request);
      const widget = new MainAreaWidget({ content });
      widget.id = `nbtrain-run-${id}`;
      widget.title.label = `Run: ${model.getRun(id)?.name ?? id}`;
      widget.title.icon = trainingIcon;
      widget.title.closable = true;
      void tracker.add(widget);
      app.shell.add(widget, 'main');
      app.shell.activateById(widget.id);
      return widget;
    };

    app.commands.addCommand(CommandIDs.openRun, {
      label: args => (args.id ? `Open run ${args.id}` : 'Open Training Run…'),
      caption: "Open a run's live charts",
      execute: async args => {
        let id = args.id as string | undefined;
        if (!id) {
          await model.refresh();
          id =
            (await pickRun(
              model.runs,
              'Open training run',
              newestRunning(model.runs)
            )) ?? undefined;
        }
        return id ? openRun(id) : undefined;
      }
    });

    app.commands.addCommand(CommandIDs.stopRun, {
      label: args => (args.id ? `Stop run ${args.id}` : 'Stop Training Run…'),
      caption: 'Ask a running run to checkpoint and end at its next step',
      execute: async args => {
        let id = args.id as string | undefined;
        // a run picked in the palette's dialog was chosen to stop; a click is asked about first
        const picked = !id;
        if (!id) {
          await model.refresh();
          const running = model.runs.filter(run => run.state === 'running');
          id =
            (await pickRun(
              running,
              'Stop training run',
              newestRunning(running)
            )) ?? undefined;
        }
        if (id) {
          await stopRun(id, !picked);
        }
      }
    });

    app.commands.addCommand(CommandIDs.refresh, {
      label: 'Refresh Training Runs and Clusters',
      execute: async () => {
        await model.refresh();
        tracker.forEach(w => void w.content.metrics.refresh());
      }
    });

    app.commands.addCommand(CommandIDs.compareRuns, {
      label: 'Compare Training Runs',
      caption: 'Draw the runs ticked in the Training sidebar over each other',
      execute: args => {
        const ids = (args.ids as string[] | undefined) ?? [];
        return ids.length ? compareRuns(ids) : undefined;
      }
    });

    if (palette) {
      const category = 'Training';
      palette.addItem({ command: CommandIDs.openRun, category });
      palette.addItem({ command: CommandIDs.stopRun, category });
      palette.addItem({ command: CommandIDs.refresh, category });
    }

    const sidebar = new TrainingSidebar(model, {
      openRun: id => void app.commands.execute(CommandIDs.openRun, { id }),
      stopRun: id => void app.commands.execute(CommandIDs.stopRun, { id }),
      deleteRun: id => void deleteRun(id),
      compareRuns: ids =>
        void app.commands.execute(CommandIDs.compareRuns, { ids })
    });
    sidebar.title.icon = trainingIcon;
    sidebar.title.caption = 'Training';
    app.shell.add(sidebar, 'left', { rank: 250 });

    if (restorer) {
      restorer.add(sidebar, sidebar.id);
      // reopen the run panels a reload closed: they need only the run id
      void restorer.restore(tracker, {
        command: CommandIDs.openRun,
        args: w => ({ id: w.content.metrics.runId }),
        name: w => w.content.metrics.runId
      });
      void restorer.restore(compareTracker, {
        command: CommandIDs.compareRuns,
        args: w => ({ ids: w.content.model.runIds }),
        name: w => w.content.model.runIds.join(',')
      });
    }

    if (statusBar) {
      const status = new TrainingStatus(model, id =>
        app.commands.execute(CommandIDs.openRun, { id })
      );
      statusBar.registerStatusItem('nbtrain:status', {
        item: status,
        align: 'left',
        rank: 5,
        isActive: () => status.isActive,
        activeStateChanged: model.changed
      });
    }
  }
};

export default plugin;
