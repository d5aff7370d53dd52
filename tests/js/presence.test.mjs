// The browser twin of realtime_app.wire.presence.apply: the member set a client keeps
// after each presence frame (tests/vectors/presence.json, which the Python rule passes too).
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { applyPresence } from "../../realtime_app/static/realtime_app/realtime.js";

const VECTORS = JSON.parse(readFileSync(new URL("../vectors/presence.json", import.meta.url)));

test("each presence frame of the vectors gives the member set they name", () => {
  let members = new Map();
  for (const step of VECTORS.steps) {
    members = applyPresence(members, step.params);
    assert.deepEqual(Object.fromEntries(members), step.members);
  }
});

test("a diff never changes the set it was applied to", () => {
  const before = new Map([["ann", { user: "ann", connections: 1 }]]);
  const after = applyPresence(before, { channel: "room", count: 0, anonymous: 0, joined: [], left: ["ann"], updated: [] });
  assert.equal(before.size, 1);
  assert.equal(after.size, 0);
});
