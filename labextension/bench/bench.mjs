/* global process, window, console */
// Measure uPlot, Chart.js and the pre-issue-38 hand-drawn SVG chart in headless Chromium:
// bundle size (minified, gzipped), first draw, redraw and zoom of 4 runs x 10k points.
//   node labextension/bench/bench.mjs      (Chart.js is installed into a temp folder, not the lockfile)
import { execSync } from 'child_process';
import * as fs from 'fs';
import * as os from 'os';
import * as path from 'path';
import * as zlib from 'zlib';
import { fileURLToPath } from 'url';

const here = path.dirname(fileURLToPath(import.meta.url));
const lab = path.dirname(here);
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'nbtrain-bench-'));
// the hand-drawn chart as it was before uPlot replaced it
execSync(`git show b59784a:labextension/src/charts.ts > ${tmp}/svgchart.ts`, {
  cwd: lab
});
fs.copyFileSync(path.join(here, 'entries.ts'), path.join(tmp, 'entries.ts'));
execSync('npm install --no-save --no-audit --no-fund --silent chart.js@4.5.1', {
  cwd: tmp,
  stdio: 'ignore'
});
const esbuild = (
  await import(path.join(lab, 'node_modules/esbuild/lib/main.js'))
).default;
const { chromium } = (
  await import(path.join(lab, 'node_modules/playwright/index.js'))
).default;

const results = [];
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium',
  args: ['--no-sandbox', '--disable-gpu']
});
for (const lib of ['uplot', 'chartjs', 'svg']) {
  const out = path.join(tmp, `${lib}.js`);
  await esbuild.build({
    entryPoints: [path.join(tmp, 'entries.ts')],
    bundle: true,
    minify: true,
    format: 'iife',
    globalName: 'B',
    outfile: out,
    define: { LIB: JSON.stringify(lib) },
    nodePaths: [path.join(tmp, 'node_modules'), path.join(lab, 'node_modules')],
    // only the library measured goes in its bundle
    external: ['uplot', 'chart.js', './svgchart'].filter(
      m => m !== { uplot: 'uplot', chartjs: 'chart.js', svg: './svgchart' }[lib]
    ),
    logLevel: 'error'
  });
  // the library alone: its bundle minus the harness (the same harness in each)
  const code = fs.readFileSync(out);
  const page = await browser.newPage({
    viewport: { width: 1400, height: 900 }
  });
  await page.setContent('<html><body></body></html>');
  await page.addScriptTag({ content: code.toString() });
  const runs = [];
  for (let k = 0; k < 3; k++) {
    await page.setContent('<html><body></body></html>');
    await page.addScriptTag({ content: code.toString() });
    runs.push(await page.evaluate(() => window.B.bench(4, 10000, 10)));
  }
  await page.close();
  const med = key => runs.map(r => r[key]).sort((a, b) => a - b)[1];
  results.push({
    lib,
    bundle_kB: +(code.length / 1024).toFixed(1),
    gzip_kB: +(zlib.gzipSync(code).length / 1024).toFixed(1),
    first_ms: +med('first').toFixed(1),
    redraw_ms: +med('redraw').toFixed(1),
    zoom_ms: +med('zoom').toFixed(1)
  });
}
await browser.close();
console.table(results);
fs.rmSync(tmp, { recursive: true, force: true });
