"""The wire: the JSON-RPC protocol and close codes, channel names, rate channels, and the
history format (epochs, pages, resume plans). Pure: imports without Django."""
