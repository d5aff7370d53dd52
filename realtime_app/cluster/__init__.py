"""The backplane: what a process needs from the rest of the cluster (base), the in-memory
one for a single process, the Redis one (pub/sub, leases, history, probes) and the
factory that picks one from the settings."""
