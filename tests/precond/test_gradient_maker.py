"""GradientMaker: the five model/loss patterns match plain loss.backward()."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leantrain.precond import GradientMaker


def run_maker(model, setup):
    """setup(gm, model) declares the calls; returns (output, loss) of one step."""
    gm = GradientMaker(model)
    setup(gm, model)
    return gm.forward_and_backward()


def test_logits(zoo):
    model = zoo.MLP()
    ref = zoo.twin(model)
    x, t = torch.randn(8, 5), torch.randint(0, 3, (8,))

    def setup(gm, m):
        y = gm.setup_model_call(m, x)
        gm.setup_loss_call(F.cross_entropy, y, t)

    out, loss = run_maker(model, setup)
    ref_out = ref(x)
    ref_loss = F.cross_entropy(ref_out, t)
    ref_loss.backward()
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(loss, ref_loss)
    zoo.assert_grads_close(model, ref)


def test_model_returning_logits_and_loss(zoo):
    model = zoo.LogitsAndLoss()
    ref = zoo.twin(model)
    x, t = torch.randn(8, 5), torch.randint(0, 3, (8,))

    def setup(gm, m):
        y = gm.setup_model_call(m, x, t)
        gm.setup_loss_repr(y[1])

    (logits, inner_loss), loss = run_maker(model, setup)
    ref_logits, ref_loss = ref(x, t)
    ref_loss.backward()
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(loss, ref_loss)
    assert loss is inner_loss
    zoo.assert_grads_close(model, ref)


def test_dict_output(zoo):
    model = zoo.DictOutput()
    ref = zoo.twin(model)
    x, t = torch.randn(8, 5), torch.randint(0, 3, (8,))

    def setup(gm, m):
        y = gm.setup_model_call(m, x=x)
        # Loss with a regulariser on another output: both read from the stand-in.
        gm.setup_loss_call(
            lambda logits, hidden: (
                F.cross_entropy(logits, t) + 0.1 * hidden.square().mean()
            ),
            y["logits"],
            hidden=y["hidden"],
        )

    out, _ = run_maker(model, setup)
    ref_out = ref(x)
    (
        F.cross_entropy(ref_out["logits"], t) + 0.1 * ref_out["hidden"].square().mean()
    ).backward()
    assert set(out) == {"logits", "hidden"}
    zoo.assert_grads_close(model, ref)


def test_dataclass_output_like_hugging_face(zoo):
    model = zoo.DataclassOutput()
    ref = zoo.twin(model)
    x, t = torch.randn(8, 5), torch.randint(0, 3, (8,))

    def setup(gm, m):
        y = gm.setup_model_call(m, x, labels=t)
        gm.setup_loss_repr(y.loss)

    out, loss = run_maker(model, setup)
    ref(x, labels=t).loss.backward()
    assert isinstance(out, zoo.ModelOutput) and out.loss is loss
    zoo.assert_grads_close(model, ref)


def test_language_model_with_view(zoo):
    model = zoo.TinyLM()
    ref = zoo.twin(model)
    idx = torch.randint(0, 11, (3, 9))
    inputs, targets = idx[:, :-1], idx[:, 1:]

    def setup(gm, m):
        y = gm.setup_model_call(m, inputs)
        gm.setup_loss_call(F.cross_entropy, y.view(-1, y.size(-1)), targets.reshape(-1))

    out, loss = run_maker(model, setup)
    ref_out = ref(inputs)
    ref_loss = F.cross_entropy(ref_out.view(-1, ref_out.size(-1)), targets.reshape(-1))
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    zoo.assert_grads_close(model, ref)


def test_loss_repr_of_a_recorded_torch_function(zoo):
    model = zoo.MLP()
    ref = zoo.twin(model)
    x, t = torch.randn(8, 5), torch.randint(0, 3, (8,))
    gm = GradientMaker(model)
    y = gm.setup_model_call(model, x)
    gm.setup_loss_repr(F.cross_entropy(y, t) + 1e-2 * y.pow(2).mean())
    gm.forward_and_backward()
    out = ref(x)
    (F.cross_entropy(out, t) + 1e-2 * out.pow(2).mean()).backward()
    zoo.assert_grads_close(model, ref)


def test_stand_ins_nested_in_a_list_give_real_gradients(zoo):
    # ASDL returns a stand-in as the loss here and leaves no gradient, silently.
    model = zoo.MLP()
    ref = zoo.twin(model)
    x = torch.randn(8, 5)

    def loss_of_pair(pair):
        return (pair[0] * pair[1]).mean()

    gm = GradientMaker(model)
    y = gm.setup_model_call(model, x)
    gm.setup_loss_call(loss_of_pair, [y, y])
    _, loss = gm.forward_and_backward()
    assert isinstance(loss, torch.Tensor)
    out = ref(x)
    loss_of_pair([out, out]).backward()
    zoo.assert_grads_close(model, ref)


def test_gradients_accumulate_like_backward(zoo):
    model = zoo.MLP()
    ref = zoo.twin(model)
    x, t = torch.randn(8, 5), torch.randint(0, 3, (8,))
    gm = GradientMaker(model)
    gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(model, x), t)
    gm.forward_and_backward()
    gm.forward_and_backward()
    for _ in range(2):
        F.cross_entropy(ref(x), t).backward()
    zoo.assert_grads_close(model, ref)


def test_a_plain_function_as_the_model_call(zoo):
    model = zoo.MLP()
    ref = zoo.twin(model)
    x, t = torch.randn(8, 5), torch.randint(0, 3, (8,))
    gm = GradientMaker(model)
    y = gm.setup_model_call(lambda inp, scale: model(inp) * scale, x, scale=2.0)
    gm.setup_loss_call(F.cross_entropy, y, t)
    gm.forward_and_backward()
    F.cross_entropy(ref(x) * 2.0, t).backward()
    zoo.assert_grads_close(model, ref)


# -- misuse -----------------------------------------------------------------------
def test_forward_and_backward_before_setup_raises(zoo):
    gm = GradientMaker(zoo.MLP())
    with pytest.raises(RuntimeError, match="setup_model_call"):
        gm.forward_and_backward()
    gm.setup_model_call(zoo.MLP(), torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="setup_loss_call"):
        gm.forward_and_backward()


def test_loss_setup_before_model_call_raises(zoo):
    gm = GradientMaker(zoo.MLP())
    with pytest.raises(RuntimeError, match="setup_model_call"):
        gm.setup_loss_call(F.cross_entropy, torch.zeros(1), torch.zeros(1))


def test_new_model_call_clears_the_loss_and_old_stand_ins_are_rejected(zoo):
    model = zoo.MLP()
    gm = GradientMaker(model)
    old = gm.setup_model_call(model, torch.randn(2, 5))
    gm.setup_loss_repr(old.sum())
    gm.setup_model_call(model, torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="no loss"):
        gm.forward_and_backward()
    with pytest.raises(ValueError, match="not from the current model call"):
        gm.setup_loss_repr(old.sum())
    with pytest.raises(ValueError, match="not from the current model call"):
        gm.setup_loss_call(F.mse_loss, old, torch.zeros(2, 3))


@pytest.mark.parametrize(
    "bad_loss, error, match",
    [
        (lambda out: out, ValueError, "scalar"),
        (lambda out: (out.sum(), out), TypeError, "scalar torch.Tensor"),
        (lambda out: out.sum().item(), TypeError, "scalar torch.Tensor"),
        (lambda out: out.detach().sum(), RuntimeError, "require grad"),
    ],
    ids=["not-scalar", "tuple", "float", "detached"],
)
def test_bad_losses_raise(zoo, bad_loss, error, match):
    model = zoo.MLP()
    gm = GradientMaker(model)
    gm.setup_loss_call(bad_loss, gm.setup_model_call(model, torch.randn(4, 5)))
    with pytest.raises(error, match=match):
        gm.forward_and_backward()


def test_loss_function_closing_over_a_stand_in_raises(zoo):
    model = zoo.MLP()
    gm = GradientMaker(model)
    y = gm.setup_model_call(model, torch.randn(4, 5))
    # y is passed, but the function returns an expression on the closed-over stand-in.
    gm.setup_loss_call(lambda real: y.sum(), y)
    with pytest.raises(TypeError, match="returned a stand-in"):
        gm.forward_and_backward()


def test_setup_argument_errors(zoo):
    model = zoo.MLP()
    with pytest.raises(TypeError, match="nn.Module"):
        GradientMaker(lambda x: x)
    gm = GradientMaker(model)
    with pytest.raises(TypeError, match="callable"):
        gm.setup_model_call("model", torch.randn(2, 5))
    y = gm.setup_model_call(model, torch.randn(2, 5))
    with pytest.raises(ValueError, match="stand-in"):
        gm.setup_model_call(model, y)
    y = gm.setup_model_call(model, torch.randn(2, 5))
    with pytest.raises(TypeError, match="callable"):
        gm.setup_loss_call(None, y)
    with pytest.raises(ValueError, match="no argument is a stand-in"):
        gm.setup_loss_call(F.mse_loss, torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(TypeError, match="stand-in expression"):
        gm.setup_loss_repr(torch.zeros(()))


def test_no_grad_model_call_raises(zoo):
    model = zoo.MLP()
    gm = GradientMaker(model)

    def frozen_call(x):
        with torch.no_grad():
            return model(x)

    gm.setup_loss_repr(gm.setup_model_call(frozen_call, torch.randn(2, 5)).sum())
    with pytest.raises(RuntimeError, match="no_grad"):
        gm.forward_and_backward()


def test_user_guide_examples_run():
    import pathlib
    import re

    guide = pathlib.Path(__file__).parents[2] / "docs" / "precond.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)
    assert len(blocks) >= 5
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{guide.name} block {i}", "exec"), namespace)
    assert namespace["loss"].ndim == 0


def test_grad_scaler_scales_the_backward_and_not_the_returned_loss(zoo):
    model = zoo.MLP()
    x, t = torch.randn(8, 5), torch.randint(0, 3, (8,))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    gm = GradientMaker(model)
    gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(model, x), t)
    _, loss = gm.forward_and_backward(grad_scaler=scaler)
    scaled = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _, plain = gm.forward_and_backward()
    assert torch.equal(loss, plain.detach())
    for a, p in zip(scaled, model.parameters(), strict=True):
        assert torch.equal(a, p.grad * 2.0**8)
    with pytest.raises(TypeError, match="grad_scaler must be a torch.amp.GradScaler"):
        gm.forward_and_backward(grad_scaler=2.0)
