// A "slow network" for demos and tests: wraps a RealtimeClient so that the handlers
// subscribed through it receive at most one frame per `delayMs`, the latest one (a state
// channel: older frames are superseded). The page then measures long gaps, as a page
// that absorbs each frame slowly would, and its adaptive cadence backs off.

/**
 * @param {import("./realtime.js").RealtimeClient} client
 * @returns {{client: object, setDelay(ms: number): void, readonly delayMs: number}}
 */
export function slowNetwork(client) {
  let delayMs = 0;
  const wrapped = new Map(); // handler -> throttled handler

  function throttle(handler) {
    let busy = false;
    let pending = null;
    const release = () => {
      if (pending && delayMs) {
        const params = pending;
        pending = null;
        handler(params);
        setTimeout(release, delayMs);
      } else {
        if (pending) { handler(pending); pending = null; }
        busy = false;
      }
    };
    return (params) => {
      if (!delayMs) { handler(params); return; }
      if (busy) { pending = params; return; }
      busy = true;
      handler(params);
      setTimeout(release, delayMs);
    };
  }

  const proxy = {
    subscribe(channel, handler) {
      if (!wrapped.has(handler)) wrapped.set(handler, throttle(handler));
      return client.subscribe(channel, wrapped.get(handler));
    },
    unsubscribe(channel, handler) {
      return client.unsubscribe(channel, handler ? wrapped.get(handler) : undefined);
    },
  };
  return {
    client: proxy,
    setDelay(ms) { delayMs = ms; },
    get delayMs() { return delayMs; },
  };
}
