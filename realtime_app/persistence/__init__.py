"""Write-behind: state accepted at once in memory and persisted behind the hot path, with
its journal for stops during a database outage."""
