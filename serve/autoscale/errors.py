"""The autoscaler's one root error: a setting or input the user can fix (one line at the CLI)."""

from __future__ import annotations

from serve.errors import PdserveError


class AutoscaleError(PdserveError):
    pass
