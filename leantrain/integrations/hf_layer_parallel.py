r"""Layer-parallel Hugging Face models: the layer stack as one :class:`LayerParallel`.

:func:`layer_parallel_hf` replaces the ``nn.ModuleList`` of blocks of a GPT-2, Llama,
BERT or ViT model (``transformers`` 5.x) by an :class:`HFLayerParallel`. Each HF block
``B_n`` becomes the ODE step

.. math::
    x_{n+1} = x_n + \Delta t\,(B_n(x_n, \ldots) - x_n),

so ``dt = 1`` (``t_final = N``, the default) is the original model, and a smaller
``t_final`` turns the stack into forward Euler on ``dx/dt = B(x) - x`` with
``h = t_final / N``, for which MGRIT converges (docs/layer_parallel.md).

Where it hooks in: every supported model runs its blocks in one loop,
``for block in self.layers: hidden = block(hidden, <extra inputs>)``. The replacement
iterates as a single "block", itself, so that loop calls it once with the hidden state
and the extra inputs the model computed for its blocks (causal or padding attention
mask, rotary ``(cos, sin)``, position ids, attention keyword arguments). It passes
them unchanged to every block at every MGRIT evaluation, including the coarse-level
recomputations of the adjoint in ``backward``. Everything outside the loop (embeddings,
final norm, head, loss) runs as before.

Refused, with the option named: dropout in training (``nn.Dropout`` with ``p > 0`` or an
attention dropout inside the blocks), ``output_attentions`` / ``output_hidden_states``
(they record every block call, and MGRIT calls each block many times), a key-value cache
(``use_cache=True`` or a ``past_key_values``; the conversion sets ``config.use_cache =
False``), gradient checkpointing, cross-attention (``add_cross_attention``) and extra
inputs that require grad (the adjoint returns gradients for the hidden state and the
blocks' parameters only).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from leantrain.layer_parallel import LayerParallel

__all__ = ["HFBlockStep", "HFLayerParallel", "layer_parallel_hf"]

# base model class name -> attribute path of its block ModuleList
_STACKS = {
    "GPT2Model": ("h",),
    "LlamaModel": ("layers",),
    "BertModel": ("encoder", "layer"),
    "ViTModel": ("layers",),
}
_STEP_KEY = re.compile(r"steps\.(\d+)\.block\.")
_HF_KEY = re.compile(r"(\d+)\.")


class _Extras:
    """The extra block inputs of the current call, shared by the stack's steps."""

    def __init__(self) -> None:
        self.args: tuple = ()
        self.kwargs: dict[str, Any] = {}

    def set(self, args: tuple, kwargs: dict[str, Any]) -> None:
        self.args, self.kwargs = args, kwargs


class HFBlockStep(nn.Module):
    """One HF block as the ODE step ``x + dt * (block(x, *extras) - x)``.

    Args:
        block: the HF block (``GPT2Block``, ``LlamaDecoderLayer``, ``BertLayer``,
            ``ViTLayer``); called as ``block(x, *args, **kwargs)`` with the extra inputs
            of the current call, and must return a Tensor.
        extras: the stack's shared holder of those inputs.
    """

    def __init__(self, block: nn.Module, extras: _Extras) -> None:
        super().__init__()
        self.block = block
        self._extras = extras

    def forward(self, x: torch.Tensor, dt: float) -> torch.Tensor:
        y = self.block(x, *self._extras.args, **self._extras.kwargs)
        if not isinstance(y, torch.Tensor):
            raise TypeError(
                f"{type(self.block).__name__} returned {type(y).__name__}; an ODE step "
                "needs a block that returns the hidden state as a Tensor "
                "(transformers 5.x blocks do)"
            )
        # dt = 1 returns the block's own output, so the original model is reproduced
        # to the last bit rather than through x + (y - x).
        return y if dt == 1.0 else x + dt * (y - x)


class HFLayerParallel(LayerParallel):
    """A :class:`LayerParallel` standing in for an HF model's ``ModuleList`` of blocks.

    Iterating it yields the stack itself once, so the model's own loop over its blocks
    runs the whole ODE in one call, ``stack(hidden, *extras, **extras)``; slicing the
    full range (Llama's ``layers[: num_hidden_layers]``) does the same. An integer index
    raises (running one HF block on its own would skip the ODE step); block ``n`` is
    ``stack.steps[n].block``. ``state_dict`` keys are the HF model's own
    (``h.0.attn...``), so checkpoints load either way; parameter names carry the
    wrapping (``h.steps.0.block.attn...``).

    Args:
        blocks: the HF blocks, in order.
        t_final: ODE end time; ``None`` (default) is ``N``, i.e. ``dt = 1``, the
            original model.
        **options: any :class:`LayerParallel` option (``levels``, ``cf``,
            ``fwd_iters``, ``bwd_iters``, ``chunks``, ``forward_solver``...).
    """

    def __init__(
        self, blocks: list[nn.Module], *, t_final: float | None = None, **options: Any
    ) -> None:
        extras = _Extras()
        steps = [HFBlockStep(b, extras) for b in blocks]
        t_final = float(len(steps)) if t_final is None else t_final
        super().__init__(steps, t_final=t_final, **options)
        self._extras = extras
        self.register_state_dict_post_hook(_to_hf_keys)
        self.register_load_state_dict_pre_hook(_from_hf_keys)

    def __iter__(self) -> Iterator[HFLayerParallel]:
        yield self

    def __getitem__(self, index: slice) -> list[HFLayerParallel]:
        n = len(self.steps)
        if not isinstance(index, slice):
            raise TypeError(
                f"a layer-parallel stack runs its {n} blocks as one ODE, so it is not "
                f"indexed by layer ({index!r}); HF block n is stack.steps[n].block"
            )
        if range(n)[index] != range(n):
            raise IndexError(
                f"a layer-parallel stack runs all {n} layers together; slice "
                f"{index} selects only some of them"
            )
        return [self]

    def forward(
        self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        _check_call(self, args, kwargs)
        self._extras.set(args, kwargs)
        out = super().forward(hidden_states)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            # The adjoint recomputes coarse-level blocks in backward, possibly after
            # other forward calls (gradient accumulation): give it this call's inputs.
            out.register_hook(lambda grad, a=args, k=kwargs: self._extras.set(a, k))
        return out


def layer_parallel_hf(
    model: nn.Module, *, t_final: float | None = None, **lp_options: Any
) -> HFLayerParallel:
    """Turn the block stack of an HF model into an :class:`HFLayerParallel`, in place.

    Supported: models whose base model is ``GPT2Model``, ``LlamaModel``, ``BertModel``
    or ``ViTModel`` (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``BertForMaskedLM``,
    ``ViTForImageClassification`` and the base models themselves are tested). The
    model's ``forward`` (logits, loss) works as before; ``config.use_cache`` is set to
    False (a key-value cache is refused).

    Args:
        model: the HF model; modified in place.
        t_final: ODE end time; ``None`` (default) keeps ``dt = 1``, the original model.
        **lp_options: :class:`LayerParallel` options.

    Returns:
        The new stack (also reachable in the model, e.g. ``model.transformer.h``); call
        ``.serial()`` or ``.parallel()`` on it, or spread it over ranks with
        :func:`~leantrain.layer_parallel.parallelize`.

    Raises:
        TypeError: for an unsupported model class.
        ValueError: for gradient checkpointing, cross-attention, an already converted
            model, or invalid LayerParallel options.

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(
        ...     n_layer=4, n_embd=16, n_head=2, vocab_size=32, n_positions=16,
        ...     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        >>> model = transformers.GPT2LMHeadModel(config)
        >>> stack = layer_parallel_hf(model, t_final=1.0, cf=2)
        >>> ids = torch.randint(0, 32, (2, 8))
        >>> model(ids, labels=ids).loss.backward()
        >>> stack.stats.forward.iterations, stack.stats.backward.iterations
        (2, 1)
    """
    parent, name, blocks = _find_stack(model)
    # transformers 5 renamed is_gradient_checkpointing (still there, deprecated)
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing:
        raise ValueError(
            "activation (gradient) checkpointing is on: disable it "
            "(model.activation_checkpointing_disable()); a layer-parallel stack keeps "
            "its own per-layer graphs"
        )
    config = getattr(model, "config", None)
    if getattr(config, "add_cross_attention", False):
        raise ValueError(
            "add_cross_attention=True is not supported: the encoder states would "
            "need gradients through the adjoint"
        )
    stack = HFLayerParallel(list(blocks), t_final=t_final, **lp_options)
    setattr(parent, name, stack)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False
    return stack


def _transformers():
    try:
        import transformers
    except ImportError as err:  # the bridge is optional: say what to install
        raise ImportError(
            "layer_parallel_hf needs Hugging Face transformers: pip install "
            "transformers"
        ) from err
    return transformers


def _find_stack(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    transformers = _transformers()

    base = getattr(model, "base_model", model)
    supported = {n: getattr(transformers, n) for n in _STACKS}
    kind = next((n for n, cls in supported.items() if isinstance(base, cls)), None)
    if kind is None:
        raise TypeError(
            f"layer_parallel_hf supports models built on {sorted(_STACKS)}, got "
            f"{type(model).__name__} (base {type(base).__name__})"
        )
    *path, name = _STACKS[kind]
    parent = base
    for attr in path:
        parent = getattr(parent, attr)
    blocks = getattr(parent, name)
    if isinstance(blocks, HFLayerParallel):
        raise ValueError(f"{type(model).__name__} is already layer-parallel")
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(
            f"{kind}.{'.'.join(_STACKS[kind])} is a {type(blocks).__name__}, expected "
            "the nn.ModuleList of blocks"
        )
    return parent, name, blocks


def _check_call(stack: HFLayerParallel, args: tuple, kwargs: dict[str, Any]) -> None:
    """Refuse, naming it, every input or setting the ODE cannot honour."""
    transformers = _transformers()
    named = [(f"argument {i + 1}", a) for i, a in enumerate(args)] + list(
        kwargs.items()
    )
    for key, value in named:
        if isinstance(value, transformers.Cache):
            raise ValueError(
                f"a key-value cache ({key}: {type(value).__name__}) is not supported "
                "by a layer-parallel stack: call the model with use_cache=False"
            )
        if torch.is_grad_enabled() and any(t.requires_grad for t in _tensors(value)):
            raise ValueError(
                f"the extra block input {key} requires grad; the layer-parallel "
                "adjoint returns gradients only for the hidden state and the blocks' "
                "parameters"
            )
    recorded = sorted(_recorded_outputs(kwargs))
    if recorded:
        raise ValueError(
            f"{', '.join('output_' + k for k in recorded)}=True is not supported by a "
            "layer-parallel stack (MGRIT evaluates every block several times)"
        )
    for name, m in stack.named_modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            raise ValueError(
                f"activation (gradient) checkpointing is on in {name}: disable it "
                "(model.activation_checkpointing_disable())"
            )
    if stack.training:
        _check_no_dropout(stack)


def _recorded_outputs(kwargs: dict[str, Any]) -> set[str]:
    """Which per-block outputs (attentions, hidden states) the model call records."""
    wanted = {
        k.removeprefix("output_")
        for k in ("output_attentions", "output_hidden_states")
        if kwargs.get(k)
    }
    try:  # transformers 5 records them with hooks, announced in a context variable
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return wanted
    collected = _active_collector.get() or {}
    return wanted | {k for k in collected if not k.startswith("_")}


def _check_no_dropout(stack: HFLayerParallel) -> None:
    for name, m in stack.named_modules():
        p = m.p if isinstance(m, nn.Dropout) else getattr(m, "attention_dropout", 0.0)
        if isinstance(p, float) and p > 0:
            raise ValueError(
                f"dropout p={p} in {name} ({type(m).__name__}) in training: "
                "layer-parallel HF blocks are supported without dropout; set the "
                "config's dropout probabilities to 0 or call model.eval()"
            )


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    return []


def _to_hf_keys(module, state_dict, prefix, local_metadata) -> None:
    # steps.{n}.block.<rest> -> {n}.<rest>: the keys of the ModuleList it replaced
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix) :]
        if _STEP_KEY.match(rest):
            hf = prefix + _STEP_KEY.sub(r"\1.", rest, count=1)
            state_dict[hf] = state_dict.pop(key)


def _from_hf_keys(module, state_dict, prefix, *args) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix) :]
        if _HF_KEY.match(rest):
            state_dict[prefix + _HF_KEY.sub(r"steps.\1.block.", rest, count=1)] = (
                state_dict.pop(key)
            )
