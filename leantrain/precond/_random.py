"""A maker's seeded random streams, one per device, made where they are drawn.

A ``torch.Generator`` is bound to one device, and a maker is built before the
user moves the model (``model.cuda()`` often follows the optimizer), so a
generator made at construction would sit on the CPU and every Monte-Carlo draw
for a CUDA tensor would fail (``Expected a 'cuda' device type for generator``).
:class:`DeviceGenerators` makes the generator of a device when a tensor there
first asks for one, from the maker's seed.

Each device keeps its own stream: the CPU's Mersenne Twister and CUDA's Philox
cannot share a state, so a run moved between devices continues on the stream of
the device it moves to (from where that stream was left, or from the seed). The
state is saved per device, as CPU byte tensors whatever ``map_location`` put
them on; a saved stream of a device this process has not used yet is kept and
applied when that device first draws.
"""

from __future__ import annotations

import torch
from torch import Tensor


def device_key(device: torch.device | str) -> str:
    """``"cpu"`` or ``"cuda:N"`` (a bare ``"cuda"`` is the current device)."""
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "current_device"):
            device = torch.device(device.type, module.current_device())
    return str(device)


class DeviceGenerators:
    """Seeded generators by device, each made on its first draw.

    Args:
        seed: the seed of every device's stream.

    Example:
        >>> g = DeviceGenerators(0)
        >>> x = torch.randn(3, generator=g.on(torch.device("cpu")))
        >>> sorted(g.get_state())
        ['cpu']
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}
        self._pending: dict[str, Tensor] = {}

    def on(self, device: torch.device | str) -> torch.Generator:
        """The generator of ``device`` (made from the seed, or from a loaded
        state, on first use)."""
        key = device_key(device)
        generator = self._generators.get(key)
        if generator is None:
            generator = torch.Generator(device=key).manual_seed(self.seed)
            if key in self._pending:
                generator.set_state(self._pending.pop(key))
            self._generators[key] = generator
        return generator

    def get_state(self) -> dict[str, Tensor]:
        """Device -> generator state (CPU byte tensors), loaded ones not yet
        used included."""
        state = {key: s.clone() for key, s in self._pending.items()}
        state.update({key: g.get_state() for key, g in self._generators.items()})
        return state

    def set_state(self, state: dict[str, Tensor] | Tensor) -> None:
        """Restore :meth:`get_state`'s dict (a bare tensor is a CPU state)."""
        if isinstance(state, Tensor):
            state = {"cpu": state}
        if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()
        ):
            raise TypeError(
                "a generator state must map device names to byte tensors, got "
                f"{type(state).__name__}"
            )
        # Devices drawn from since but absent from the state restart at the seed,
        # as they were when the state was taken.
        self._generators.clear()
        self._pending = {
            device_key(k): v.detach().to("cpu", torch.uint8).clone()
            for k, v in state.items()
        }
