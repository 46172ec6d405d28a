"""ODE-ready building blocks: a residual step takes a step size ``dt``.

A residual network ``x_{n+1} = x_n + F_n(x_n)`` is forward Euler with step 1 on
the ODE ``dx/dt = F(x, t)``. Giving every block a ``dt`` argument (``x + dt * F(x)``)
lets the same weights run as a plain ResNet (dt = 1) or as an ODE on [0, t_final]
with N steps (dt = t_final / N), which is what layer-parallel MGRIT needs: its coarse
grids re-use the fine blocks with a larger dt.
See docs/CONTRACTS.md ("ODE-ready models").
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from leantrain.models.attention import MultiHeadAttention

State = torch.Tensor | tuple[torch.Tensor, ...]


def init_weights(module: nn.Module) -> None:
    """GPT-2 style initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm.

    Use with ``model.apply(init_weights)``. A small std keeps the residual branches
    small at start, so deep stacks begin close to the identity map.
    """
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class FeedForward(nn.Module):
    """Position-wise MLP ``Linear -> GELU -> Linear -> Dropout``, hidden ``r*d``."""

    def __init__(self, d_model: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        if not isinstance(mlp_ratio, int) or mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be a positive int, got {mlp_ratio!r}")
        self.fc = nn.Linear(d_model, mlp_ratio * d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(mlp_ratio * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class TransformerBlock(nn.Module):
    r"""Pre-LN transformer block as one Euler step of size ``dt``.

    .. math::
        x_1 &= x + dt\,\mathrm{Attn}(\mathrm{LN}(x)) \\
        x_1 &= x_1 + dt\,\mathrm{CrossAttn}(\mathrm{LN}(x_1), m)
              \quad\text{(if cross\_attention)} \\
        x_2 &= x_1 + dt\,\mathrm{MLP}(\mathrm{LN}(x_1))

    With dt = 1 this is the usual pre-LN block; dt = 0 is the identity.

    Args:
        d_model: model width.
        n_heads: attention heads (must divide ``d_model``).
        mlp_ratio: hidden width of the MLP as a multiple of ``d_model``.
        dropout: dropout on attention weights and on each residual branch.
        causal: mask future positions in self-attention (decoders, GPT).
        cross_attention: add a cross-attention sub-layer reading ``memory``.

    Example:
        >>> block = TransformerBlock(32, 4, causal=True)
        >>> x = torch.randn(2, 10, 32)
        >>> block(x, dt=0.25).shape
        torch.Size([2, 10, 32])
        >>> torch.equal(block(x, dt=0.0), x)
        True
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        causal: bool = False,
        cross_attention: bool = False,
    ) -> None:
        super().__init__()
        self.cross_attention = cross_attention
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads, dropout=dropout, causal=causal)
        if cross_attention:
            self.ln_cross = nn.LayerNorm(d_model)
            # Cross-attention never masks: every query may read all of the memory.
            self.cross = MultiHeadAttention(d_model, n_heads, dropout=dropout)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = FeedForward(d_model, mlp_ratio, dropout)

    def forward(
        self, x: torch.Tensor, dt: float = 1.0, memory: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Advance ``x`` (B, T, C) by one step of size ``dt``; memory is (B, S, C)."""
        if self.cross_attention and memory is None:
            raise ValueError("this block has cross_attention=True; pass memory=")
        if not self.cross_attention and memory is not None:
            raise ValueError("memory given to a block built with cross_attention=False")
        h = self.ln_attn(x)
        x = x + dt * self.attn(h, h)
        if self.cross_attention:
            x = x + dt * self.cross(self.ln_cross(x), memory)
        return x + dt * self.mlp(self.ln_mlp(x))


class ResidualStack(nn.Module):
    """A sequence of steps applied with one shared step size.

    Args:
        steps: modules with ``forward(state, dt) -> state``.
        t_final: final time of the ODE; ``dt = t_final / len(steps)``. ``None`` means
            ``dt = 1`` (a plain residual network).

    Raises:
        ValueError: if ``steps`` is empty or ``t_final`` is not positive.

    Example:
        >>> stack = ResidualStack([TransformerBlock(16, 2) for _ in range(4)], 1.0)
        >>> stack.dt
        0.25
        >>> stack(torch.randn(3, 5, 16)).shape
        torch.Size([3, 5, 16])
    """

    def __init__(
        self, steps: Iterable[nn.Module], t_final: float | None = None
    ) -> None:
        super().__init__()
        self.steps = nn.ModuleList(steps)
        if len(self.steps) == 0:
            raise ValueError("ResidualStack needs at least one step, got none")
        if t_final is not None and not (
            isinstance(t_final, int | float) and t_final > 0
        ):
            raise ValueError(
                f"t_final must be a positive number or None, got {t_final!r}"
            )
        self.t_final = t_final

    @property
    def dt(self) -> float:
        """Step size: ``t_final / len(steps)``, or 1.0 when ``t_final`` is None."""
        if self.t_final is None:
            return 1.0
        return float(self.t_final) / len(self.steps)

    def forward(self, state: State) -> State:
        dt = self.dt
        for step in self.steps:
            state = step(state, dt)
        return state


class EncoderStep(nn.Module):
    """Encoder step on the pair state ``(x, y)``: ``(block(x, dt), y)``.

    The decoder state ``y`` rides along unchanged, so encoder and decoder steps form one
    ODE on the pair and one ResidualStack holds both (layer-parallel splits it freely).

    Example:
        >>> step = EncoderStep(TransformerBlock(16, 2))
        >>> x, y = torch.randn(2, 5, 16), torch.randn(2, 3, 16)
        >>> x1, y1 = step((x, y), 0.5)
        >>> y1 is y
        True
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(
        self, state: tuple[torch.Tensor, torch.Tensor], dt: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = state
        return self.block(x, dt), y


class DecoderStep(nn.Module):
    """Decoder step on ``(x, y)``: ``(x, block(y, dt, memory=x))``.

    ``x`` is the (finished) encoder output and stays fixed; the block must have been
    built with ``cross_attention=True``.

    Raises:
        ValueError: if ``block`` is a TransformerBlock without cross-attention.

    Example:
        >>> block = TransformerBlock(16, 2, causal=True, cross_attention=True)
        >>> step = DecoderStep(block)
        >>> x, y = torch.randn(2, 5, 16), torch.randn(2, 3, 16)
        >>> x1, y1 = step((x, y), 0.5)
        >>> x1 is x, y1.shape
        (True, torch.Size([2, 3, 16]))
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        if isinstance(block, TransformerBlock) and not block.cross_attention:
            raise ValueError(
                "DecoderStep needs a TransformerBlock(cross_attention=True)"
            )
        self.block = block

    def forward(
        self, state: tuple[torch.Tensor, torch.Tensor], dt: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = state
        return x, self.block(y, dt, memory=x)
