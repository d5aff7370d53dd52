"""The shop's channels: an order's status, per order — private, as a per-object channel
almost always is (closed until a rule of POLICIES names it)."""

import realtime_app

realtime_app.event_channel("order:<int:id>")
