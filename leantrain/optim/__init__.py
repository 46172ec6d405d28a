"""Memory-lean optimizers: Gefen (AdamW, ~1 byte of state per parameter), GefenMuon."""

from .gefen import Gefen
from .memory import bytes_per_param, optimizer_state_nbytes
from .muon import GefenMuon, muon_param_groups, newton_schulz
from .precision import stochastic_round

__all__ = [
    "Gefen",
    "GefenMuon",
    "bytes_per_param",
    "muon_param_groups",
    "newton_schulz",
    "optimizer_state_nbytes",
    "stochastic_round",
]
