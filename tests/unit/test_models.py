"""The model zoo: shapes, float64, weight tying, .blocks, and that every model captures as a joint graph."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch._functorch.aot_autograd import aot_export_module
from torch.nn import functional as F

from tandem.models import ZOO, ZooEntry, build, classification_loss, gpt, lstm_lm, mlp, resnet, vgg

BATCH = 4
NAMES = sorted(ZOO)


class LossModule(nn.Module):
    """model + loss as one module returning a 1-tuple, the form aot_export_module's joint trace wants."""

    def __init__(self, inner: nn.Module, entry: ZooEntry) -> None:
        super().__init__()
        self.inner = inner
        self.loss_fn = entry.loss_fn

    def forward(self, *batch: Tensor) -> tuple[Tensor]:
        return (self.loss_fn(self.inner, *batch),)


def tiny(name: str, **batch_keys: Any) -> tuple[ZooEntry, nn.Module, tuple[Tensor, ...]]:
    torch.manual_seed(0)
    entry = ZOO[name]
    batch = entry.make_batch(BATCH, torch.Generator().manual_seed(0), **entry.tiny, **batch_keys)
    return entry, build(name, **entry.tiny), batch


def expected_shape(entry: ZooEntry, batch: tuple[Tensor, ...]) -> tuple[int, ...]:
    if entry.loss_fn is classification_loss:
        return (BATCH, entry.tiny.get("num_classes", 10))
    return (*batch[0].shape, entry.tiny["vocab_size"])


@pytest.mark.parametrize("name", NAMES)
def test_tiny_forward_shape_and_loss(name: str) -> None:
    entry, model, batch = tiny(name)
    assert model(batch[0]).shape == expected_shape(entry, batch)
    loss = entry.loss_fn(model, *batch)
    assert loss.shape == () and torch.isfinite(loss)


@pytest.mark.parametrize("name", NAMES)
def test_float64_copy_trains(name: str) -> None:
    entry, model, _ = tiny(name)
    model = model.double()
    batch = entry.make_batch(BATCH, torch.Generator().manual_seed(0), torch.float64, **entry.tiny)
    loss = entry.loss_fn(model, *batch)
    loss.backward()
    assert loss.dtype == torch.float64
    assert all(p.dtype == torch.float64 and p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_blocks_are_ordered_submodules(name: str) -> None:
    _, model, _ = tiny(name)
    blocks = model.blocks
    submodules = {id(module) for module in model.modules()}
    assert isinstance(blocks, list) and blocks
    assert all(isinstance(block, nn.Module) and id(block) in submodules for block in blocks)


@pytest.mark.parametrize("name", NAMES)
def test_flags_describe_tiny_instance(name: str) -> None:
    entry, model, _ = tiny(name)
    assert entry.has_dropout == any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
    assert entry.has_batchnorm == any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


@pytest.mark.parametrize("name", NAMES)
def test_joint_graph_capture(name: str) -> None:
    entry, model, batch = tiny(name)
    graph, signature = aot_export_module(
        LossModule(model, entry), batch, trace_joint=True, output_loss_index=0
    )
    assert any(node.op == "call_function" for node in graph.graph.nodes)
    # Every trainable parameter gets a gradient output (tied ones under each alias name).
    with_grad = {
        name.removeprefix("inner.") for name in signature.backward_signature.gradients_to_parameters.values()
    }
    assert {name for name, _ in model.named_parameters()} <= with_grad


@pytest.mark.parametrize(
    ("model", "shared"), [(gpt, ("wte", "lm_head")), (lstm_lm, ("embedding", "decoder"))]
)
def test_tied_weights_are_one_parameter(model: Any, shared: tuple[str, str]) -> None:
    instance = model()
    first, second = (getattr(instance, attribute).weight for attribute in shared)
    assert first is second
    names = [name for name, _ in instance.named_parameters()]
    assert sum(name.split(".")[0] in shared and name.endswith("weight") for name in names) == 1


def test_build_rejects_unknown_name_and_batch_key() -> None:
    with pytest.raises(ValueError, match="valid names.*gpt"):
        build("alexnet")
    with pytest.raises(TypeError, match="unknown config keys"):
        ZOO["mlp"].make_batch(2, torch.Generator(), in_featurs=3)


def test_make_batch_follows_bench_configs() -> None:
    generator = torch.Generator().manual_seed(0)
    x, y = ZOO["vgg"].make_batch(2, generator, image_size=64, in_channels=1, num_classes=3)
    assert x.shape == (2, 1, 64, 64) and int(y.max()) < 3
    assert ZOO["resnet"].make_batch(2, generator)[0].shape == (2, 3, 32, 32)
    tokens, targets = ZOO["gpt"].make_batch(2, generator, block_size=32)
    assert tokens.shape == targets.shape == (2, 32) and tokens.dtype == torch.long
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    assert ZOO["lstm_lm"].make_batch(2, generator, seq_len=35)[0].shape == (2, 35)


def test_resnet_depths() -> None:
    assert [len(resnet(depth, width=2).blocks) for depth in (8, 18, 34)] == [3, 8, 16]
    assert any(isinstance(m, nn.MaxPool2d) for m in resnet(width=2).modules())
    assert resnet(width=2)(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="depth=50.*8, 18, 34"):
        resnet(depth=50)


def test_vgg_classifier_dominates_parameters() -> None:
    model = vgg("vgg16", width_multiplier=0.25, classifier_width=1024)
    assert len(model.blocks) == 5
    classifier = sum(p.numel() for p in model.classifier.parameters())
    assert classifier > sum(p.numel() for p in model.stages.parameters())
    with pytest.raises(ValueError, match="multiple of 32"):
        vgg(image_size=28)
    with pytest.raises(ValueError, match="vgg19"):
        vgg("vgg19")


def test_mlp_flattens_images_and_deep_thin_variant() -> None:
    assert mlp()(torch.randn(3, 1, 8, 8)).shape == (3, 10)
    assert len(mlp(hidden=(32,) * 20).blocks) == 20


def test_unrolled_lstm_matches_nn_lstm() -> None:
    torch.manual_seed(0)
    model = lstm_lm(vocab_size=20, embed_dim=6, hidden=5, num_layers=2, tie_weights=False).double()
    reference = nn.LSTM(6, 5, num_layers=2, batch_first=True).double()
    with torch.no_grad():
        for k, layer in enumerate(model.layers):
            getattr(reference, f"weight_ih_l{k}").copy_(layer.weight_ih)
            getattr(reference, f"weight_hh_l{k}").copy_(layer.weight_hh)
            getattr(reference, f"bias_ih_l{k}").copy_(layer.bias)
            getattr(reference, f"bias_hh_l{k}").zero_()
    tokens = torch.randint(20, (3, 7))
    expected = model.decoder(reference(model.embedding(tokens))[0])
    torch.testing.assert_close(model(tokens), expected)
    with pytest.raises(ValueError, match="embed_dim == hidden"):
        lstm_lm(embed_dim=8, hidden=16)


def test_gpt_is_causal() -> None:
    torch.manual_seed(0)
    model = gpt(vocab_size=30, block_size=8, n_layer=2, n_head=2, n_embd=8).eval()
    tokens = torch.randint(30, (1, 8))
    changed = tokens.clone()
    changed[0, 5] = (tokens[0, 5] + 1) % 30
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :5], after[:, :5])
    assert not torch.allclose(before[:, 5:], after[:, 5:])
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_losses_are_cross_entropy() -> None:
    model = mlp(in_features=4, hidden=(3,), num_classes=2)
    x, y = torch.randn(5, 4), torch.randint(2, (5,))
    torch.testing.assert_close(classification_loss(model, x, y), F.cross_entropy(model(x), y))
