"""Moved to tests.helpers.workerclient (kept for old imports)."""
from tests.helpers.workerclient import *  # noqa: F401,F403
from tests.helpers.workerclient import generate, metric, metrics, stream_in_background, wait_for  # noqa: F401
