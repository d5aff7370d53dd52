// The browser half of the twin clients: every capability listed in
// tests/vectors/client_capabilities.json exists in the browser module (the Python half is
// checked by tests/test_client.py against the same list).
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import * as realtime from "../../realtime_app/static/realtime_app/realtime.js";

const LIST = JSON.parse(readFileSync(new URL("../vectors/client_capabilities.json", import.meta.url)));
const SOURCE = readFileSync(new URL("../../realtime_app/static/realtime_app/realtime.js", import.meta.url), "utf8");

test("every listed export, method, attribute, option and event is in the browser module", () => {
  for (const { browser } of LIST.module) assert.ok(browser in realtime, `export ${browser}`);
  const client = new realtime.RealtimeClient({ url: "ws://x/realtime/", WebSocket: class {} });
  for (const { browser, argument } of LIST.methods) {
    assert.equal(typeof client[browser], "function", `RealtimeClient.${browser}()`);
    if (argument) assert.match(String(client[browser]), new RegExp(`^${browser}\\(${argument.browser}\\b`), `${browser}(${argument.browser})`);
  }
  for (const { browser } of LIST.attributes) assert.ok(browser in client, `RealtimeClient.${browser}`);
  for (const { browser } of LIST.options) assert.ok(SOURCE.includes(`options.${browser}`), `option ${browser}`);
  for (const { browser } of LIST.events) assert.ok(SOURCE.includes(`new CustomEvent("${browser}"`), `event ${browser}`);
});

test("and nothing the browser client offers is missing from the list", () => {
  const listed = new Set(LIST.methods.map((m) => m.browser));
  const methods = Object.getOwnPropertyNames(realtime.RealtimeClient.prototype).filter((n) => n !== "constructor" && !n.startsWith("_"));
  assert.deepEqual(methods.filter((n) => !listed.has(n)), []);
  const exported = new Set(LIST.module.map((m) => m.browser));
  assert.deepEqual(Object.keys(realtime).filter((n) => !exported.has(n)), []);
  const events = [...SOURCE.matchAll(/new CustomEvent\("([a-z]+)"/g)].map((m) => m[1]);
  const listedEvents = new Set(LIST.events.map((e) => e.browser));
  assert.deepEqual([...new Set(events)].filter((e) => !listedEvents.has(e)), []);
});
