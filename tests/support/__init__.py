"""What the tests share: waiting for conditions (never for time), in-process and HTTP
clients, probe readers. No test module imports another test module."""
