/**
 * UI tests in a real browser: Debian's Chromium (browsers cannot be downloaded here) against a
 * JupyterLab started by tests/ui/serve_lab.py with a fixture runs registry. Video is off;
 * screenshots land in tests/_artifacts/ui/ (and docs/images/lab-sidebar.png for the README).
 */
import * as path from 'path';

import { defineConfig } from '@playwright/test';

const repo = path.resolve(__dirname, '..');
const port = process.env.NBTRAIN_UI_PORT ?? '8897';
const token = process.env.NBTRAIN_UI_TOKEN ?? 'nbtrain-ui-test';
const uiDir = path.join(repo, 'tests', '_artifacts', 'ui');
const python = process.env.PYTHON ?? path.join(repo, '.venv', 'bin', 'python');

// the specs read these to spawn a run writer against the same registry as the server
process.env.NBTRAIN_UI_PORT = port;
process.env.NBTRAIN_UI_TOKEN = token;
process.env.NBTRAIN_UI_DIR = uiDir;
process.env.PYTHON = python;

export default defineConfig({
  testDir: 'ui-tests',
  outputDir: path.join(uiDir, 'test-results'),
  timeout: 90_000,
  expect: { timeout: 20_000 },
  fullyParallel: false,
  workers: 1,
  retries: 0,
  reporter: [['list']],
  use: {
    baseURL: `http://127.0.0.1:${port}`,
    browserName: 'chromium',
    viewport: { width: 1400, height: 900 },
    video: 'off',
    screenshot: 'only-on-failure',
    trace: 'off',
    launchOptions: {
      executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium',
      args: [
        '--no-sandbox',
        '--disable-gpu',
        '--disable-background-networking',
        '--disable-component-update'
      ]
    }
  },
  webServer: {
    command: `${python} ${path.join(repo, 'tests', 'ui', 'serve_lab.py')}`,
    url: `http://127.0.0.1:${port}/api/status?token=${token}`,
    timeout: 120_000,
    reuseExistingServer: false,
    gracefulShutdown: { signal: 'SIGTERM', timeout: 15_000 },
    stdout: 'ignore',
    stderr: 'pipe'
  }
});
