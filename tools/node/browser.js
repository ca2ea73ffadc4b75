#!/usr/bin/env node
// A headless Chromium (Debian's, driven by playwright-core) that a test steers one step at a time, as a person
// would use a browser: open a page, click a button or link by its text, read the page, take a screenshot.
// tests/local/browser.py is its client.
//
//   node tools/node/browser.js      one JSON request per line on stdin, one JSON answer per line on stdout
//   request: {"id": n, "op": ..., ...}        answer: {"id": n, "ok": true, "value": ...} | {"id": n, "ok": false, "error"}
//   ops: context {javaScript}                 -> {context}     a browser profile of its own (cookies, JavaScript on/off)
//        page {context}                       -> {page}        a tab in it
//        goto {page, url}                     -> navigation    follows redirects like a typed address
//        click {page, text}                   -> navigation    the button or link with this text; waits for the page
//        clickTogether {pages, text}          -> [navigation]  the same click in several tabs at once
//        dblclick {page, text}                -> navigation    a double click
//        read {page}                          -> navigation    the page as it is now
//        textOf {page, selector}              -> text          the innerText of the element the CSS selector names
//        arrive {page, url}                   -> navigation    once the page is at url (a navigation the page made)
//        screenshot {page, path}              -> {path}        the whole page as PNG
//        fetch {context, url, accept}         -> {status, contentType, body}   a script's GET with the context's cookies
//   navigation: {url, status (the last document's), text (the body's innerText), posts (form POSTs the page sent
//                since the previous step), answers (the HTTP status of each of those POSTs' answers, in order; null
//                for one whose navigation was aborted before its answer reached the page: the server may have
//                answered it, the browser never shows it)}
//
// Exit 2 with a message on stderr if Chromium cannot start; CHROMIUM names the browser (default /usr/bin/chromium).
'use strict';

const readline = require('readline');
const { exitWith, launchOrExplain } = require('./chromium');

const VIEWPORT = { width: 1280, height: 800 };
const TIMEOUT_MS = 30000;

async function main() {
  const browser = await launchOrExplain();
  if (browser === null) return 2;
  const contexts = new Map();
  const pages = new Map();
  const status = new Map(); // page id -> status of its last main-document response
  const posts = new Map(); // page id -> form POSTs sent since the last step
  const answers = new Map(); // page id -> [request, its answer's status, or null once it failed] per POST
  let next = 0;

  async function navigation(id) {
    const page = pages.get(id);
    await page.waitForLoadState('load');
    const sent = posts.get(id);
    const answered = answers.get(id).map(([, answer]) => (answer === undefined ? null : answer));
    posts.set(id, 0);
    answers.set(id, []);
    return { url: page.url(), status: status.get(id), text: await page.innerText('body'), posts: sent, answers: answered };
  }

  async function clickable(page, text) {
    const target = page.getByRole('button', { name: text, exact: true }).or(page.getByRole('link', { name: text, exact: true }));
    await target.first().waitFor({ timeout: TIMEOUT_MS });
    return target.first();
  }

  const ops = {
    async context({ javaScript }) {
      const id = `c${++next}`;
      contexts.set(id, await browser.newContext({ javaScriptEnabled: javaScript, viewport: VIEWPORT }));
      return { context: id };
    },
    async page({ context }) {
      const id = `p${++next}`;
      const page = await contexts.get(context).newPage();
      page.setDefaultTimeout(TIMEOUT_MS);
      page.on('response', (response) => {
        if (response.request().isNavigationRequest() && response.frame() === page.mainFrame()) {
          status.set(id, response.status());
          const entry = answers.get(id).find(([request]) => request === response.request());
          if (entry) entry[1] = response.status();
        }
      });
      page.on('request', (request) => {
        if (request.method() === 'POST' && request.isNavigationRequest()) {
          posts.set(id, (posts.get(id) || 0) + 1);
          answers.get(id).push([request, undefined]);
        }
      });
      // A submit the next one replaced (a double click) fails in the page with no answer it could show.
      page.on('requestfailed', (request) => {
        const entry = answers.get(id).find(([sent]) => sent === request);
        if (entry && entry[1] === undefined) entry[1] = null;
      });
      pages.set(id, page);
      posts.set(id, 0);
      answers.set(id, []);
      return { page: id };
    },
    async goto({ page, url }) {
      await pages.get(page).goto(url);
      return navigation(page);
    },
    async click({ page, text }) {
      const target = await clickable(pages.get(page), text);
      await Promise.all([pages.get(page).waitForNavigation(), target.click()]);
      return navigation(page);
    },
    async clickTogether({ pages: ids, text }) {
      // Every tab's click at once: their requests reach the server together, as two people's (or two tabs') would.
      const targets = await Promise.all(ids.map((id) => clickable(pages.get(id), text)));
      await Promise.all(ids.map((id, i) => Promise.all([pages.get(id).waitForNavigation(), targets[i].click()])));
      return Promise.all(ids.map((id) => navigation(id)));
    },
    async dblclick({ page, text }) {
      const target = await clickable(pages.get(page), text);
      // The second submit replaces the first navigation, which Chromium may report as aborted (net::ERR_ABORTED)
      // when the second leaves before the first answer has loaded: that abort is the double click itself.
      const first = pages.get(page).waitForNavigation().catch((error) => {
        if (!String(error).includes('ERR_ABORTED')) throw error;
      });
      await Promise.all([first, target.dblclick()]);
      // Wait until nothing is loading any more. The page shown is the last navigation's: when the first answer loads
      // before the second click, that click lands on the answer page (and may follow a link there); every submit's
      // own answer is in `answers`.
      await pages.get(page).waitForLoadState('networkidle');
      return navigation(page);
    },
    async read({ page }) {
      return navigation(page);
    },
    async textOf({ page, selector }) {
      return pages.get(page).locator(selector).innerText();
    },
    async arrive({ page, url }) {
      await pages.get(page).waitForURL(url);
      return navigation(page);
    },
    async screenshot({ page, path }) {
      await pages.get(page).screenshot({ path, fullPage: true });
      return { path };
    },
    async fetch({ context, url, accept }) {
      const response = await contexts.get(context).request.get(url, { headers: { Accept: accept }, maxRedirects: 0 });
      return { status: response.status(), contentType: response.headers()['content-type'] || '', body: await response.text() };
    },
  };

  const lines = readline.createInterface({ input: process.stdin });
  for await (const line of lines) {
    if (!line.trim()) continue;
    const request = JSON.parse(line);
    let answer;
    try {
      const op = ops[request.op];
      if (!op) throw new Error(`unknown op ${request.op}`);
      answer = { id: request.id, ok: true, value: await op(request) };
    } catch (error) {
      answer = { id: request.id, ok: false, error: String((error && error.stack) || error) };
    }
    process.stdout.write(`${JSON.stringify(answer)}\n`);
  }
  await browser.close();
  return 0;
}

exitWith(main);
