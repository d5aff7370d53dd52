"""The WebSocket endpoint: the consumer that speaks the protocol, its JSON-RPC methods, and
the client's address behind trusted proxies."""
