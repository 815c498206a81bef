// Opens the built site's home page in headless Chromium (playwright-core), refusing every request
// that is not a local file, and screenshots it: `node site_check.cjs <index.html> <png>` prints
// what it saw as JSON for test_site_in_chromium.py.
const { chromium } = require("playwright-core");

(async () => {
  const [page_file, screenshot] = process.argv.slice(2);
  const browser = await chromium.launch({ executablePath: "/usr/bin/chromium", headless: true, args: ["--no-sandbox"] });
  const seen = { console_errors: [], requests: [] };
  try {
    const page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
    page.on("pageerror", (error) => seen.console_errors.push(String(error)));
    await page.route("**/*", (route) => {
      const url = route.request().url();
      if (url.startsWith("file:") || url.startsWith("data:")) return route.continue();
      seen.requests.push(url);
      return route.abort();
    });
    await page.goto("file://" + page_file);
    await page.waitForLoadState("load");
    seen.title = await page.title();
    seen.heading = await page.$eval("article h1", (h) => h.textContent);
    seen.nav = await page.$$eval("nav.md-nav--primary a.md-nav__link", (links) => links.map((a) => a.textContent.trim()));
    seen.image = await page.$eval("article img", (img) => [img.complete, img.naturalWidth]);
    await page.screenshot({ path: screenshot, fullPage: true });
  } finally {
    await browser.close();
  }
  process.stdout.write(JSON.stringify(seen));
})().catch((error) => { console.error(error); process.exit(1); });
