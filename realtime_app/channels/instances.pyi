# Type checkers read the deprecated alias as the module it stands for.
from realtime_app.declarations.instances import *  # noqa: F403
