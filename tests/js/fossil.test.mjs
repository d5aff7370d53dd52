// Fossil deltas in the browser module's vendored codec (static/realtime_app/vendor/
// fossil-delta.js, dchest's port, BSD): it applies the deltas Fossil's own C code and the
// server's Python codec made (tests/vectors/fossil.json), and makes the very same bytes.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { applyDelta, createDelta } from "../../realtime_app/static/realtime_app/vendor/fossil-delta.js";

const { vectors } = JSON.parse(readFileSync(new URL("../vectors/fossil.json", import.meta.url)));
const bytes = (b64) => new Uint8Array(Buffer.from(b64, "base64"));

test("every vector applies, whoever made the delta", () => {
  assert.ok(vectors.length >= 10);
  for (const v of vectors) {
    const [base, target] = [bytes(v.base), bytes(v.target)];
    for (const made of ["delta_fossil", "delta_python", "delta_js"]) {
      assert.deepEqual(new Uint8Array(applyDelta(base, bytes(v[made]))), target, `${v.name} (${made})`);
    }
    assert.deepEqual(new Uint8Array(createDelta(base, target)), bytes(v.delta_fossil), v.name); // byte for byte Fossil's
  }
});

test("a delta applied to another base is refused, never a wrong target", () => {
  const v = vectors.find((x) => x.name.startsWith("a dashboard state, three"));
  const other = bytes(v.base);
  other[100] ^= 1; // one bit of a region the delta copies: not the base it was made from
  assert.throws(() => applyDelta(other, bytes(v.delta_fossil)), /checksum/);
});
