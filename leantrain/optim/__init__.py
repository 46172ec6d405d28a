"""Memory-lean optimizers: Gefen (AdamW with ~1 byte of state per parameter)."""

from .gefen import Gefen
from .memory import bytes_per_param, optimizer_state_nbytes

__all__ = ["Gefen", "bytes_per_param", "optimizer_state_nbytes"]
