"""Training over slow links: local steps, then a sparse outer synchronization summed by ZEN (``zen.outer``)."""

from .config import OuterConfig
from .sync import OuterSync, state_bytes_per_param

__all__ = ["OuterConfig", "OuterSync", "state_bytes_per_param"]
