# Type checkers read the deprecated alias as the module it stands for.
from realtime_app.declarations.coverage import *  # noqa: F403
