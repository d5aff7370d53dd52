"""Server to client: the backpressure rule (pure), the guard each connection sends through,
and the transports that read each server's queued bytes."""
