"""``python -m realtime_app.client URL CHANNEL...``: subscribe and print (docs/clients.md)."""

import sys

from realtime_app.client.cli import main

sys.exit(main())
