// Debian's Chromium (installed by scripts/bootstrap.sh) started headless by playwright-core, which cannot download
// a browser of its own here. Shared by render-cards.js and browser.js.
'use strict';

const fs = require('fs');
const { chromium } = require('playwright-core');

const EXECUTABLE = process.env.CHROMIUM || '/usr/bin/chromium';
// As the machine notes say Chromium runs here: no sandbox as root, no GPU, and no background connections (the
// network is closed, and they would only add refused connections and delays).
const FLAGS = [
  '--no-sandbox',
  '--disable-gpu',
  '--disable-quic',
  '--no-first-run',
  '--disable-background-networking',
  '--disable-component-update',
  '--disable-sync',
];

class BrowserMissing extends Error {}

// The browser, or BrowserMissing saying why not.
async function launch() {
  if (!fs.existsSync(EXECUTABLE)) {
    throw new BrowserMissing(`Chromium not found at ${EXECUTABLE}: bash scripts/bootstrap.sh installs Debian's chromium`);
  }
  try {
    return await chromium.launch({ executablePath: EXECUTABLE, headless: true, args: FLAGS });
  } catch (error) {
    throw new BrowserMissing(`Chromium at ${EXECUTABLE} did not start: ${error.message}`);
  }
}

// The browser, or null once the reason it cannot start is on stderr (the caller then exits 2).
async function launchOrExplain() {
  try {
    return await launch();
  } catch (error) {
    if (!(error instanceof BrowserMissing)) throw error;
    process.stderr.write(`${error.message}\n`);
    return null;
  }
}

// Runs a tool's main(): the process exits with the code it resolves to, or 1 with the stack of what it threw.
function exitWith(main) {
  main().then(
    (code) => {
      process.exitCode = code;
    },
    (error) => {
      process.stderr.write(`${error.stack || error}\n`);
      process.exitCode = 1;
    },
  );
}

module.exports = { launchOrExplain, exitWith };
