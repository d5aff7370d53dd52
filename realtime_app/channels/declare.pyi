# Type checkers read the deprecated alias as the module it stands for.
from realtime_app.declarations.declare import *  # noqa: F403
