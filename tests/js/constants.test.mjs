// The browser module's half of the rules both clients share (tests/vectors/constants.json;
// the Python client's half is tests/test_shared_constants.py).
// Run: node --test tests/js/
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import {
  MAX_HELD, REFUSAL_CODES, RENEWAL_RETRY_REASONS, RESUME_TIMEOUT_MS, RealtimeClient, isReconnectableCloseCode,
  newerEpoch,
} from "../../realtime_app/static/realtime_app/realtime.js";

const SHARED = JSON.parse(readFileSync(new URL("../vectors/constants.json", import.meta.url)));

test("close codes, refusal codes and limits are the shared ones", () => {
  for (const code of SHARED.reconnect_close_codes) assert.equal(isReconnectableCloseCode(code), true, String(code));
  for (const code of SHARED.fatal_close_codes) assert.equal(isReconnectableCloseCode(code), false, String(code));
  assert.deepEqual([...REFUSAL_CODES], SHARED.refusal_codes);
  assert.equal(MAX_HELD, SHARED.max_held);
  assert.equal(RESUME_TIMEOUT_MS, SHARED.resume_timeout_ms);
  assert.deepEqual([...RENEWAL_RETRY_REASONS].sort(), SHARED.renewal_retry_reasons);
  const client = new RealtimeClient({ url: "ws://x/realtime/", WebSocket: class {} });
  assert.equal(client.backoffInitialMs, SHARED.backoff_initial_ms);
  assert.equal(client.backoffMaxMs, SHARED.backoff_max_ms);
});

test("epochs order alike", () => {
  for (const [epoch, than, newer] of SHARED.newer_epoch) assert.equal(newerEpoch(epoch, than), newer, `${epoch} ${than}`);
});
