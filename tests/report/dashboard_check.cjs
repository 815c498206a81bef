// Opens the comparison page in headless Chromium (playwright-core) and uses it as a reader would:
// `node dashboard_check.cjs <page file> <screenshot png>` prints what it saw as JSON, and
// test_dashboard_in_chromium.py says what that must be (offline: tests/offline_page.cjs).
const { checkPage } = require("../offline_page.cjs");

checkPage(1400, async (page, seen, screenshot) => {
  await page.waitForSelector('body[data-ready="1"]', { timeout: 30000 });

  const rows = () => page.$$eval("#runs tbody tr", (trs) => trs.map((tr) => tr.dataset.runs));
  const headers = () => page.$$eval("#runs thead th", (ths) => ths.map((th) => th.dataset.key || th.textContent));
  seen.rows = await rows();
  seen.headers = await headers();
  seen.table_widths = await page.evaluate(() => [document.getElementById("runs").scrollWidth, document.querySelector(".scroll").clientWidth]);
  seen.table_fits = seen.table_widths[0] <= seen.table_widths[1];
  seen.groups = await page.$$eval("#group option", (options) => options.map((option) => option.value));
  seen.figures = await page.$$eval(".figures [id^=fig-]", (divs) => divs.map((div) => [div.id, div.querySelector(".main-svg") ? "plot" : "note"]));

  seen.alpha_ticks = await page.$$eval("#fig-alpha .xtick text", (texts) => texts.map((t) => t.textContent));
  seen.alpha_range = await page.evaluate(() => document.getElementById("fig-alpha")._fullLayout.yaxis.range);
  seen.alpha_title = await page.$eval("#fig-alpha .gtitle", (title) => title.textContent);
  // each figure's toolbar, shown on hover, clear of its title
  seen.toolbar_overlaps = [];
  for (const id of ["fig-rounds", "fig-upload", "fig-final", "fig-parallel", "fig-alpha", "fig-depth"]) {
    const figure = await page.$(`#${id} .main-svg`);
    if (!figure) continue;
    await figure.scrollIntoViewIfNeeded();
    const area = await figure.boundingBox();  // Plotly's layers take the pointer: move the mouse there
    await page.mouse.move(area.x + area.width / 2, area.y + area.height / 2);
    const [title, bar] = [await page.$(`#${id} .gtitle`), await page.$(`#${id} .modebar`)];
    if (!title || !bar) continue;
    const [a, b] = [await title.boundingBox(), await bar.boundingBox()];
    if (a.x < b.x + b.width && b.x < a.x + a.width && a.y < b.y + b.height && b.y < a.y + a.height) seen.toolbar_overlaps.push(id);
  }
  seen.single_point_symbols = await page.evaluate(() => document.getElementById("fig-rounds")._fullData
    .filter((trace) => trace.x.length === 1).map((trace) => trace.marker.symbol));
  seen.parallel_tick_halo = await page.$$eval("#fig-parallel .tick text", (texts) => texts.map((t) => {
    const style = getComputedStyle(t);
    return [t.textContent, style.paintOrder, style.strokeWidth];
  }));
  seen.parallel_axes = await page.evaluate(() => document.getElementById("fig-parallel")._fullData[0].dimensions.map((d) => d.label));
  seen.toggle_labels = await page.$$eval("#column-toggles label", (labels) => labels.map((l) => l.textContent.trim()));

  // a filter hides rows
  await page.click('fieldset[data-filter="method"] input[value="FedAvg"]');
  seen.rows_without_fedavg = await rows();
  await page.click('fieldset[data-filter="method"] input[value="FedAvg"]');

  // a column toggle shows a hidden column, another hides a shown one
  await page.click("#columns summary");
  await page.click('#column-toggles input[data-column="comm/bytes_down_per_client"]');
  await page.click('#column-toggles input[data-column="engine"]');
  seen.headers_toggled = await headers();

  // sorting by a header
  await page.click('#runs thead th[data-key="comm/bytes_up_per_client"]');
  seen.sorted_bytes = await page.$$eval('#runs tbody tr', (trs) => trs.map((tr) => {
    const cells = Array.from(tr.parentElement.parentElement.tHead.rows[0].cells);
    const i = cells.findIndex((th) => th.dataset.key === "comm/bytes_up_per_client");
    return [tr.dataset.group, parseFloat(tr.cells[i].dataset.value)];
  }));
  seen.group_order = await page.$$eval("#group option", (options) => options.map((option) => option.value));

  // hovering a point of the final-score figure shows its run and values
  const point = await page.$("#fig-final .scatterlayer .trace .points path");
  await point.scrollIntoViewIfNeeded();
  const box = await point.boundingBox();  // Plotly's drag layer takes the pointer: move the mouse there
  await page.mouse.move(box.x + box.width / 2, box.y + box.height / 2);
  await page.waitForSelector("#fig-final .hoverlayer .hovertext", { timeout: 5000 });
  seen.hover = await page.$eval("#fig-final .hoverlayer", (layer) => layer.textContent);

  // another group of comparable runs: the personalized one
  const personal = await page.$$eval("#group option", (options) =>
    options.filter((option) => option.textContent.includes("personalized")).map((option) => option.value));
  await page.selectOption("#group", personal[0]);
  seen.personal_axis = await page.$eval("#fig-final .ytitle", (title) => title.textContent);
  await page.selectOption("#group", seen.groups[0]);
  await page.screenshot({ path: screenshot, fullPage: true });
});
