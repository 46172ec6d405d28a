"""The depth axis' timing on one GPU: the serial step and the layer times there.

On the CPU the depth axis times the stack on two gloo processes
(:func:`~leantrain.layer_parallel.costs.timing.measure_two_process`). One GPU cannot
hold two ranks of a layer-parallel run (NCCL refuses two ranks on one device, and
gloo sends only CPU tensors), so on CUDA :func:`time_on_device` measures what the
simulator needs from the device itself: the serial step of the stack and the four
kinds of layer step, every timed region closed by a synchronisation
(:func:`~leantrain.compare.devices.device_clock`). Messages are not measured (there
is no second GPU to send to); the simulator is fed the GPU interconnect model
(:data:`GPU_INTERCONNECT`). The result reads like a
:class:`~leantrain.layer_parallel.costs.timing.TwoProcessTiming` whose layer-parallel
step was not measured (``parallel`` and ``speedup`` are NaN).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from leantrain.compare.devices import device_clock
from leantrain.layer_parallel.costs.simulate import CommModel, LayerTimes
from leantrain.layer_parallel.costs.timing import LayerSampler, StackSpec

# NVLink-class links between GPUs of one machine: 10 us a message, 25 GB/s.
GPU_INTERCONNECT = CommModel(latency=1e-5, bandwidth=25e9)


@dataclass(frozen=True)
class DeviceTiming:
    """What :func:`time_on_device` measured (seconds) on ``device``.

    ``serial``: median serial step of the stack (forward and backward);
    ``layers``: median per-layer step times; ``comm``: the message model the
    simulator is given (assumed, not measured: :data:`GPU_INTERCONNECT`).
    """

    serial: float
    layers: LayerTimes
    comm: CommModel
    device: str

    parallel = math.nan  # a layer-parallel step needs two devices
    speedup = math.nan


def time_on_device(
    spec: StackSpec, make_blocks: Callable[[StackSpec], list[nn.Module]], device: str
) -> DeviceTiming:
    """Time ``make_blocks(spec)`` serially on ``device`` and sample its layer steps,
    interleaved round by round; each time is the median after one warm-up round."""
    from leantrain.layer_parallel import LayerParallel

    serial = LayerParallel(make_blocks(spec), cf=spec.cf).serial().to(device)
    torch.manual_seed(spec.seed + 1)
    x = torch.randn(spec.batch, spec.tokens, spec.d_model).to(device)
    w = torch.randn(x.shape).to(device)
    clock = device_clock(device)
    sampler = LayerSampler(serial.steps[0], x, 1 / spec.n_layers, clock=clock)
    steps = []
    for _ in range(spec.repeats + 1):
        t0 = clock()
        xi = x.detach().requires_grad_()
        (serial(xi) * w).sum().backward()
        serial.zero_grad(set_to_none=True)
        steps.append(clock() - t0)
        for _ in range(max(1, spec.layer_reps // spec.repeats)):
            sampler()
    sampler.samples = sampler.samples[1:]
    return DeviceTiming(
        serial=statistics.median(steps[1:]),
        layers=sampler.times(),
        comm=GPU_INTERCONNECT,
        device=device,
    )
