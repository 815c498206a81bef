// A local page in headless Chromium (playwright-core), offline: every request that is not a local
// file is refused and recorded, and every page error or console error is kept. A check script
// calls `checkPage(width, use)`; `node <check>.cjs <page file> <screenshot png>` then opens the
// page, runs `use(page, seen, screenshot)` and prints `seen` as JSON for its test
// (tests/chromium.py's `check_page`).
const { chromium } = require("playwright-core");

function checkPage(width, use) {
  (async () => {
    const [pageFile, screenshot] = process.argv.slice(2);
    const browser = await chromium.launch({ executablePath: "/usr/bin/chromium", headless: true, args: ["--no-sandbox"] });
    const seen = { console_errors: [], requests: [] };
    try {
      const page = await browser.newPage({ viewport: { width, height: 900 } });
      page.on("console", (message) => { if (message.type() === "error") seen.console_errors.push(message.text()); });
      page.on("pageerror", (error) => seen.console_errors.push(String(error)));
      await page.route("**/*", (route) => {
        const url = route.request().url();
        if (url.startsWith("file:") || url.startsWith("data:")) return route.continue();
        seen.requests.push(url);
        return route.abort();
      });
      await page.goto("file://" + pageFile);
      await use(page, seen, screenshot);
    } finally {
      await browser.close();
    }
    process.stdout.write(JSON.stringify(seen));
  })().catch((error) => { console.error(error); process.exit(1); });
}

module.exports = { checkPage };
