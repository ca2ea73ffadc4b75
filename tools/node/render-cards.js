#!/usr/bin/env node
// Renders Adaptive Cards with Microsoft's own renderer (npm `adaptivecards`) in headless Chromium (Debian's
// `chromium`, driven by playwright-core), as a Teams client renders them in a browser, and reports what a person
// would see.
//
//   node tools/node/render-cards.js < in.json > out.json
//   in:  {"outDir": "...", "targetVersion": "1.4", "cards": [{"name": "...", "card": <AdaptiveCard JSON>}]}
//   out: [{"name", "text" (the rendered card's innerText), "actions": [{"title", "url"}] (each button clicked,
//          the URL the renderer hands to the host), "events": [{"phase", "event", "message"}] (parse and
//          validation events against targetVersion: an element or property newer than it, an unknown type, a
//          missing required value), "screenshot" (PNG path), "width", "height"}]
//
// CHROMIUM (default /usr/bin/chromium) names the browser. Exit 2 with a message on stderr if it cannot start.
'use strict';

const fs = require('fs');
const path = require('path');
const { exitWith, launchOrExplain } = require('./chromium');

const RENDERER = require.resolve('adaptivecards/dist/adaptivecards.min.js');
// The card column of a Teams channel message on the desktop client is about this wide.
const CARD_WIDTH = 540;

async function main() {
  const input = JSON.parse(fs.readFileSync(0, 'utf8'));
  fs.mkdirSync(input.outDir, { recursive: true });
  const browser = await launchOrExplain();
  if (browser === null) return 2;
  try {
    const page = await browser.newPage({ viewport: { width: CARD_WIDTH + 40, height: 800 } });
    await page.setContent(
      `<!doctype html><html><head><style>body{margin:20px;background:#f5f5f5;font-family:'Segoe UI',sans-serif}` +
        `#card{width:${CARD_WIDTH}px;background:#fff;border-radius:4px}</style></head><body><div id="card"></div></body></html>`,
    );
    await page.addScriptTag({ path: RENDERER });
    const results = [];
    for (const item of input.cards) {
      const rendered = await page.evaluate(
        ({ card, targetVersion }) => {
          const AC = window.AdaptiveCards;
          const version = AC.Version.parse(targetVersion, new AC.SerializationContext());
          const context = new AC.SerializationContext(version);
          const adaptive = new AC.AdaptiveCard();
          adaptive.hostConfig = new AC.HostConfig({ supportsInteractivity: true });
          const opened = [];
          adaptive.onExecuteAction = (action) => opened.push(action.url || null);
          adaptive.parse(card, context);
          const events = [];
          for (let i = 0; i < context.eventCount; i++) {
            const e = context.getEventAt(i);
            events.push({ phase: AC.ValidationPhase[e.phase], event: AC.ValidationEvent[e.event], message: e.message });
          }
          for (const e of adaptive.validateProperties().validationEvents) {
            events.push({ phase: 'Validation', event: AC.ValidationEvent[e.event], message: e.message });
          }
          const host = document.getElementById('card');
          host.replaceChildren();
          const element = adaptive.render();
          if (element) host.appendChild(element);
          window.__opened = opened;
          return { events, cardVersion: String(adaptive.version) };
        },
        { card: item.card, targetVersion: input.targetVersion },
      );
      const text = await page.locator('#card').innerText();
      const actions = [];
      const buttons = page.locator('#card button');
      for (let i = 0; i < (await buttons.count()); i++) {
        const button = buttons.nth(i);
        const title = (await button.innerText()).trim();
        await button.click();
        const url = await page.evaluate(() => window.__opened.shift() ?? null);
        actions.push({ title, url });
      }
      const box = await page.locator('#card').boundingBox();
      const screenshot = path.join(input.outDir, `${item.name}.png`);
      await page.locator('#card').screenshot({ path: screenshot });
      results.push({
        name: item.name,
        text,
        actions,
        events: rendered.events,
        cardVersion: rendered.cardVersion,
        screenshot,
        width: Math.round(box.width),
        height: Math.round(box.height),
      });
    }
    process.stdout.write(JSON.stringify(results));
    return 0;
  } finally {
    await browser.close();
  }
}

exitWith(main);
