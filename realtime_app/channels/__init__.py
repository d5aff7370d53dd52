"""Channels as the application declares them (the registry of families, tickers, state and
event channels), who may subscribe (policies) and the session rights behind them."""
