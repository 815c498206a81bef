// Opens the built site's home page in headless Chromium, offline (tests/offline_page.cjs), and
// screenshots it: `node site_check.cjs <index.html> <png>` prints
// what it saw as JSON for test_site_in_chromium.py.
const { checkPage } = require("../offline_page.cjs");

checkPage(1280, async (page, seen, screenshot) => {
  await page.waitForLoadState("load");
  seen.title = await page.title();
  seen.heading = await page.$eval("article h1", (h) => h.textContent);
  seen.nav = await page.$$eval("nav.md-nav--primary a.md-nav__link", (links) => links.map((a) => a.textContent.trim()));
  seen.image = await page.$eval("article img", (img) => [img.complete, img.naturalWidth]);
  await page.screenshot({ path: screenshot, fullPage: true });
  // a menu link, clicked as a reader would from file://: it must land on the page, not a folder
  await Promise.all([page.waitForLoadState("load"), page.click("nav.md-nav--primary a.md-nav__link >> text=Install")]);
  await page.waitForLoadState("load");
  seen.clicked_url = page.url();
  seen.clicked_heading = await page.$eval("article h1", (h) => h.textContent).catch(() => null);
});
