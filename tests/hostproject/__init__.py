"""A Channels project of its own that adds realtime_app, as a shop would: its own consumers
on channels-redis (both layers), its own JWT-style middleware in front of the auth stack,
its own per-object channel and rules. tests/test_host_project.py runs it under daphne."""
