"""Probes (one typed schema), Prometheus metrics, and logging of client-supplied text."""
