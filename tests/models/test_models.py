"""Tests of the reference models: shapes, ODE structure, float64, training."""

import pytest
import torch
import torch.nn.functional as F

from leantrain.models import (
    BERT,
    CNN,
    GPT,
    MLP,
    BERTConfig,
    EncDecConfig,
    EncoderDecoder,
    GPTConfig,
    ResidualStack,
    ViT,
    ViTConfig,
    lm_loss,
    mlm_mask,
    mlm_mask_reference,
    patchify,
    patchify_reference,
)
from tests._helpers.models import tiny_gpt


def tiny_bert(**kw):
    return BERT(BERTConfig(block_size=16, n_layer=2, n_head=2, d_model=32, **kw))


def tiny_vit(**kw):
    return ViT(ViTConfig(patch_size=2, n_layer=2, n_head=2, d_model=32, **kw))


def tiny_encdec(**kw):
    return EncoderDecoder(EncDecConfig(n_layer=1, n_head=2, d_model=32, **kw))


MODEL_BUILDERS = {
    "gpt": tiny_gpt,
    "bert": tiny_bert,
    "vit": tiny_vit,
    "encdec": tiny_encdec,
    "mlp": lambda: MLP((64, 64, 10)),
    "cnn": lambda: CNN(widths=(8, 16)),
}


def _inputs(name, batch=4, dtype=torch.float32):
    """Random inputs and a training loss for each model kind."""
    g = torch.Generator().manual_seed(1)
    if name in ("gpt", "bert"):
        idx = torch.randint(256, (batch, 16), generator=g)
        return (idx,), lambda out: lm_loss(out, idx)
    if name == "encdec":
        src = torch.randint(10, (batch, 6), generator=g)
        tgt = src.flip(1)
        tgt_in = torch.cat([torch.full((batch, 1), 10), tgt[:, :-1]], 1)
        return (src, tgt_in), lambda out: lm_loss(out, tgt)
    images = torch.rand(batch, 1, 8, 8, generator=g, dtype=dtype)
    labels = torch.arange(batch) % 10
    return (images,), lambda out: F.cross_entropy(out, labels)


EXPECTED_SHAPES = {
    "gpt": (4, 16, 256),
    "bert": (4, 16, 257),
    "encdec": (4, 6, 12),
    "vit": (4, 10),
    "mlp": (4, 10),
    "cnn": (4, 10),
}


@pytest.mark.parametrize("name", list(MODEL_BUILDERS))
def test_output_shapes(name, seeded):
    model = MODEL_BUILDERS[name]()
    args, _ = _inputs(name)
    assert model(*args).shape == EXPECTED_SHAPES[name]


@pytest.mark.parametrize("name", ["gpt", "bert", "vit", "encdec"])
def test_forward_is_head_of_stack_of_embed(name, seeded):
    model = MODEL_BUILDERS[name]().eval()
    args, _ = _inputs(name)
    assert isinstance(model.stack, ResidualStack)
    torch.testing.assert_close(
        model(*args), model.head(model.stack(model.embed(*args)))
    )


@pytest.mark.parametrize("name", ["gpt", "bert", "vit", "encdec"])
def test_t_final_sets_dt_and_dt_zero_stack_is_identity(name, seeded):
    model = MODEL_BUILDERS[name](t_final=2.0).eval()
    n = len(model.stack.steps)
    assert model.stack.dt == pytest.approx(2.0 / n)
    args, _ = _inputs(name)
    state = model.embed(*args)
    # Stepping each block by hand with dt = t_final / N gives the stack's output.
    ref = state
    for step in model.stack.steps:
        ref = step(ref, 2.0 / n)
    out = model.stack(state)
    if isinstance(out, tuple):
        for a, b in zip(out, ref, strict=True):
            torch.testing.assert_close(a, b)
    else:
        torch.testing.assert_close(out, ref)
    # dt = 0 everywhere: the stack is the identity, the logits only see embed.
    for step in model.stack.steps:
        out0, before = step(state, 0.0), state
        if not isinstance(state, tuple):
            out0, before = (out0,), (state,)
        assert all(torch.equal(a, b) for a, b in zip(out0, before, strict=True))


def test_gpt_is_causal(seeded):
    model = tiny_gpt(seed=None).eval()
    idx = torch.randint(256, (2, 16))
    other = idx.clone()
    other[:, 10:] = (other[:, 10:] + 1) % 256
    torch.testing.assert_close(model(idx)[:, :10], model(other)[:, :10])
    assert not torch.allclose(model(idx)[:, 10:], model(other)[:, 10:])


def test_bert_is_bidirectional(seeded):
    model = tiny_bert().eval()
    idx = torch.randint(256, (2, 16))
    other = idx.clone()
    other[:, 10:] = (other[:, 10:] + 1) % 256
    assert not torch.allclose(model(idx)[:, :10], model(other)[:, :10])


def test_encdec_decoder_is_causal_and_reads_source(seeded):
    model = tiny_encdec().eval()
    src = torch.randint(10, (2, 6))
    tgt_in = torch.randint(10, (2, 6))
    other = tgt_in.clone()
    other[:, 4:] = (other[:, 4:] + 1) % 10
    torch.testing.assert_close(model(src, tgt_in)[:, :4], model(src, other)[:, :4])
    assert not torch.allclose(model(src, tgt_in), model((src + 1) % 10, tgt_in))


@pytest.mark.parametrize("name", list(MODEL_BUILDERS))
def test_float64_forward_and_backward(name, seeded):
    model = MODEL_BUILDERS[name]().double()
    args, loss_fn = _inputs(name, dtype=torch.float64)
    out = model(*args)
    assert out.dtype == torch.float64
    loss_fn(out).backward()
    assert all(
        p.grad is not None and p.grad.dtype == torch.float64
        for p in model.parameters()
        if p.requires_grad
    )


@pytest.mark.parametrize("name", list(MODEL_BUILDERS))
def test_overfits_a_tiny_batch(name, seeded):
    model = MODEL_BUILDERS[name]()
    args, loss_fn = _inputs(name)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    with torch.no_grad():
        first = float(loss_fn(model(*args)))
    for _ in range(100):
        opt.zero_grad()
        loss = loss_fn(model(*args))
        loss.backward()
        opt.step()
    model.eval()  # BatchNorm: judge with running statistics too
    assert loss.item() < 0.1 * first
    with torch.no_grad():
        assert loss_fn(model(*args)).item() < 0.3 * first


@pytest.mark.parametrize("name", ["gpt", "bert", "vit", "encdec"])
def test_dropout_active_in_train_only(name, seeded):
    model = MODEL_BUILDERS[name](dropout=0.3)
    args, _ = _inputs(name)
    model.train()
    assert not torch.equal(model(*args), model(*args))
    model.eval()
    assert torch.equal(model(*args), model(*args))


def test_gpt_weight_tying(seeded):
    tied = tiny_gpt(seed=None, tie_weights=True)
    untied = tiny_gpt(seed=None)
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.num_params() - tied.num_params() == 256 * 32


def test_gpt_default_size():
    model = GPT.default()
    c = model.config
    assert (c.vocab_size, c.d_model, c.n_layer, c.n_head) == (256, 128, 4, 4)
    assert 0.5e6 < model.num_params() < 1.5e6


@pytest.mark.parametrize(
    "make",
    [
        lambda: GPTConfig(n_head=3),
        lambda: GPTConfig(block_size=0),
        lambda: BERTConfig(mask_token_id=300),
        lambda: ViTConfig(patch_size=3),
        lambda: MLP((64,)),
        lambda: MLP(activation="swish"),
        lambda: CNN(widths=()),
    ],
)
def test_bad_configs_raise(make):
    with pytest.raises(ValueError):
        make()


def test_too_long_inputs_raise(seeded):
    with pytest.raises(ValueError, match="block_size"):
        tiny_gpt(seed=None)(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="shape"):
        tiny_vit()(torch.zeros(1, 1, 16, 16))


def test_patchify_matches_loop():
    images = torch.randn(2, 3, 8, 12)
    for p in (1, 2, 4):
        torch.testing.assert_close(patchify(images, p), patchify_reference(images, p))
    with pytest.raises(ValueError, match="patch_size"):
        patchify(images, 3)


def test_mlm_mask_matches_loop_and_has_bert_proportions():
    idx = torch.randint(256, (64, 128))
    kw = dict(mask_token_id=256, vocab_size=256, mask_prob=0.15)
    inputs, targets = mlm_mask(idx, generator=torch.Generator().manual_seed(3), **kw)
    ref_in, ref_tg = mlm_mask_reference(
        idx[:4], generator=torch.Generator().manual_seed(3), **kw
    )
    # The reference draws only for the first 4 rows; compare the fast path on those.
    fast_in, fast_tg = mlm_mask(
        idx[:4], generator=torch.Generator().manual_seed(3), **kw
    )
    torch.testing.assert_close(fast_in, ref_in)
    torch.testing.assert_close(fast_tg, ref_tg)
    picked = targets != -100
    n = idx.numel()
    # Binomial proportions, 5 standard deviations.
    assert abs(picked.float().mean() - 0.15) < 5 * (0.15 * 0.85 / n) ** 0.5
    assert torch.equal(targets[picked], idx[picked])
    assert torch.equal(inputs[~picked], idx[~picked])
    k = int(picked.sum())
    masked = (inputs[picked] == 256).float().mean()
    assert abs(masked - 0.8) < 5 * (0.8 * 0.2 / k) ** 0.5
    unchanged = (inputs[picked] == idx[picked]).float().mean()
    # 10% kept on purpose + 10% random that happens to hit the same token (1/256).
    expect = 0.1 + 0.1 / 256
    assert abs(unchanged - expect) < 5 * (expect * (1 - expect) / k) ** 0.5


@pytest.mark.slow
def test_encdec_learns_to_reverse(seeded):
    """The reverse task's optimum (accuracy 1) is reachable by the encoder-decoder."""
    from leantrain.data import TensorBatches, sequence_task

    task = sequence_task("reverse", n_train=2048, n_val=128, length=6, n_symbols=8)
    cfg = EncDecConfig(
        src_vocab_size=task.vocab_size, tgt_vocab_size=task.vocab_size, n_layer=2
    )
    model = EncoderDecoder(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = TensorBatches(task.src, task.tgt, batch_size=64, seed=0)
    for _ in range(300):
        src, tgt = batches.sample()
        loss = lm_loss(model(src, task.decoder_input(tgt)), tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    pred = model.greedy_decode(task.val_src, 6, task.bos)
    assert (pred == task.val_tgt).all(1).float().mean() > 0.95
