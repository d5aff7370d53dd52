"""Client to server: admission (caps, buckets, refusals), the pure slot books and the
request pool, the HTTP concurrency limiter."""
