"""Memory-lean optimizers: Gefen (AdamW with ~1 byte of state per parameter) and GefenMuon."""

from .gefen import Gefen
from .memory import bytes_per_param, optimizer_state_nbytes
from .muon import GefenMuon, muon_param_groups, newton_schulz

__all__ = [
    "Gefen",
    "GefenMuon",
    "bytes_per_param",
    "muon_param_groups",
    "newton_schulz",
    "optimizer_state_nbytes",
]
