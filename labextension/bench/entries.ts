/**
 * The three ways of drawing a chart measured by bench.mjs: uPlot, Chart.js and the hand-drawn
 * SVG LineChart that labextension/src/charts.ts held before issue 38 (taken from git by bench.mjs).
 * Each entry draws one chart of `runs` series of `n` points, then redraws it with new data and
 * zooms into a tenth of it, and reports milliseconds (layout forced, so DOM work is counted).
 */
declare const LIB: string;

type Data = Array<Array<[number, number]>>;

function makeData(runs: number, n: number, seed: number): Data {
  const out: Data = [];
  for (let r = 0; r < runs; r++) {
    const pts: Array<[number, number]> = [];
    let v = 3 + r * 0.1 + seed * 0.01;
    for (let i = 0; i < n; i++) {
      v =
        v * 0.9997 + (Math.sin(i * 0.37 + r) + Math.cos(i * 1.3 + seed)) * 0.01;
      pts.push([i + 1, v]);
    }
    out.push(pts);
  }
  return out;
}

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)];
}

const tick = () => new Promise<void>(r => setTimeout(r, 0));

async function timeIt(f: () => void): Promise<number> {
  const t0 = performance.now();
  f();
  await Promise.resolve(); // uPlot commits in a microtask
  await Promise.resolve();
  void document.body.offsetHeight; // force style + layout of what was built
  return performance.now() - t0;
}

export async function bench(runs = 4, n = 10000, reps = 10) {
  const host = document.createElement('div');
  host.style.width = '700px';
  document.body.appendChild(host);
  const draw = await setup(host, makeData(runs, n, 0));
  const first = draw.first;
  const redraws: number[] = [];
  const zooms: number[] = [];
  for (let k = 1; k <= reps; k++) {
    const d = makeData(runs, n, k);
    redraws.push(await timeIt(() => draw.update(d)));
    await tick();
    zooms.push(await timeIt(() => draw.zoom(n * 0.45, n * 0.55)));
    await tick();
    draw.unzoom();
    await tick();
  }
  return { lib: LIB, first, redraw: median(redraws), zoom: median(zooms) };
}

interface IDraw {
  first: number;
  update(d: Data): void;
  zoom(x0: number, x1: number): void;
  unzoom(): void;
}

async function setup(host: HTMLElement, data: Data): Promise<IDraw> {
  if (LIB === 'uplot') {
    const uPlot = (await import('uplot')).default;
    const toCols = (d: Data) => [
      d[0].map(p => p[0]),
      ...d.map(s => s.map(p => p[1]))
    ];
    let u: InstanceType<typeof uPlot> | null = null;
    const first = await timeIt(() => {
      u = new uPlot(
        {
          width: 700,
          height: 200,
          series: [
            {},
            ...data.map((_, i) => ({ stroke: `hsl(${i * 90},60%,45%)` }))
          ],
          scales: { x: { time: false } }
        },
        toCols(data) as never,
        host
      );
    });
    return {
      first,
      update: d => u!.setData(toCols(d) as never),
      zoom: (a, b) => u!.setScale('x', { min: a, max: b }),
      unzoom: () => u!.setData(u!.data)
    };
  }
  if (LIB === 'chartjs') {
    const { Chart, registerables } = await import('chart.js');
    Chart.register(...registerables);
    const canvas = document.createElement('canvas');
    canvas.width = 700;
    canvas.height = 200;
    host.style.height = '200px';
    host.appendChild(canvas);
    let c: InstanceType<typeof Chart> | null = null;
    const sets = (d: Data) =>
      d.map((s, i) => ({
        data: s.map(([x, y]) => ({ x, y })),
        borderColor: `hsl(${i * 90},60%,45%)`,
        pointRadius: 0,
        borderWidth: 1.5
      }));
    const first = await timeIt(() => {
      c = new Chart(canvas, {
        type: 'line',
        data: { datasets: sets(data) },
        options: {
          animation: false,
          responsive: false,
          parsing: false,
          normalized: true,
          scales: { x: { type: 'linear' } },
          plugins: { decimation: { enabled: true, algorithm: 'min-max' } }
        }
      });
    });
    return {
      first,
      update: d => {
        c!.data.datasets = sets(d) as never;
        c!.update('none');
      },
      zoom: (a, b) => {
        c!.options.scales!.x!.min = a;
        c!.options.scales!.x!.max = b;
        c!.update('none');
      },
      unzoom: () => {
        c!.options.scales!.x!.min = undefined;
        c!.options.scales!.x!.max = undefined;
        c!.update('none');
      }
    };
  }
  const { LineChart } = await import('./svgchart');
  let chart: InstanceType<typeof LineChart> | null = null;
  const series = (d: Data) =>
    d.map((points, i) => ({ label: `run ${i}`, className: `c${i}`, points }));
  const first = await timeIt(() => {
    chart = new LineChart('loss', 'loss', { hover: true });
    host.appendChild(chart.node);
    chart.update(series(data));
  });
  let held = data;
  return {
    first,
    update: d => {
      held = d;
      chart!.update(series(d));
    },
    // the hand-drawn chart has no zoom: drawing the tenth of the points is its nearest equivalent
    zoom: (a, b) =>
      chart!.update(series(held.map(s => s.filter(([x]) => x >= a && x <= b)))),
    unzoom: () => chart!.update(series(held))
  };
}
