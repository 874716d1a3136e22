"""Capture of what real library models do: lifted constants, tied parameters with an alias no module
calls, dict batches, static batch values, torch.utils.checkpoint regions, trace checks, and capture
errors that name the user's line. Numbers against eager autograd throughout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import tandem
from tandem.errors import CaptureError
from tandem.graph.train_graph import MetaKey
from tests.conftest import assert_same_step, eager_step, twin

EXACT = dict(rtol=1e-6, atol=1e-9)


class _Cached(nn.Module):
    """Like transformers' DynamicCache: a fresh empty tensor concatenated with the keys."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = torch.tensor([], dtype=x.dtype)
        keys = torch.cat([cache.reshape(0, x.shape[-1]), self.proj(x)], dim=0)
        return keys.tanh()


def test_lifted_constants_are_folded() -> None:
    torch.manual_seed(0)
    module = _Cached().double()
    x = torch.randn(3, 6, dtype=torch.float64)
    loss_fn = lambda m, x: m(x).pow(2).sum()  # noqa: E731
    step = tandem.compile(module, loss_fn, x, mirror="memory-aware")
    assert all(n.op in ("placeholder", "call_function", "output") for n in step.graph.graph.nodes)
    assert_same_step(step(x), *eager_step(twin(module), loss_fn, (x,)), **EXACT)


class _TiedUnusedAlias(nn.Module):
    """Like T5: ``shared`` is tied to both embeddings and the head, and never called itself."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(10, 4)
        self.encoder_embed = nn.Embedding(10, 4)
        self.decoder_embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.encoder_embed.weight = self.decoder_embed.weight = self.head.weight = self.shared.weight
        self.unused = nn.Linear(4, 4)  # an untied parameter no gradient reaches

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder_embed(ids) + self.decoder_embed(ids.flip(-1)))


def test_tied_parameter_with_an_uncalled_alias() -> None:
    torch.manual_seed(0)
    module = _TiedUnusedAlias().double()
    ids = torch.randint(0, 10, (2, 5))
    loss_fn = lambda m, ids: F.cross_entropy(m(ids).flatten(0, 1), ids.flatten())  # noqa: E731
    names = [n for n, _ in module.named_parameters()]
    step = tandem.compile(module, loss_fn, ids)
    result = step(ids)
    assert list(result.grads) == ["shared.weight"], "one gradient, under the name named_parameters() gives"
    assert_same_step(result, *eager_step(twin(module), loss_fn, (ids,)), **EXACT)
    assert [n for n, _ in module.named_parameters()] == names, "capture leaves the module as it was"
    assert all(p.requires_grad for p in module.parameters())


def test_tied_alias_trains_like_torch_optim() -> None:
    torch.manual_seed(0)
    module = _TiedUnusedAlias().double()
    reference = twin(module)
    ids = torch.randint(0, 10, (2, 5))
    loss_fn = lambda m, ids: F.cross_entropy(m(ids).flatten(0, 1), ids.flatten())  # noqa: E731
    trainer = tandem.Trainer(module, loss_fn, tandem.optim.SGD(lr=0.1, momentum=0.9), progress=False)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        trainer.step(ids)
        optimizer.zero_grad()
        loss_fn(reference, ids).backward()
        optimizer.step()
    trainer.sync()
    for (name, got), (_, want) in zip(module.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(got, want, **EXACT, msg=name)


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        return self.head(hidden.sum(1) / attention_mask.sum(1, keepdim=True))


def _dict_loss(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = module(batch["input_ids"], batch["attention_mask"].to(torch.float64))
    return F.cross_entropy(logits, batch["labels"])


def _dict_batch(seed: int, length: int = 6) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(4, length, dtype=torch.long)
    mask[1, -2:] = 0  # a padded row
    return {"input_ids": torch.randint(0, 20, (4, length), generator=generator), "attention_mask": mask,
            "labels": torch.randint(0, 3, (4,), generator=generator)}


def test_dict_batches_match_eager_and_recapture_on_new_shapes() -> None:
    torch.manual_seed(0)
    module = _Classifier().double()
    batch = _dict_batch(0)
    step = tandem.compile(module, _dict_loss, batch)
    assert len(step.graph.input_specs) == 3
    assert_same_step(step(batch), *eager_step(twin(module), _dict_loss, (batch,)), **EXACT)
    longer = _dict_batch(1, length=9)
    assert_same_step(step(longer), *eager_step(twin(module), _dict_loss, (longer,)), **EXACT)
    assert len(step._compiled) == 2


def test_static_batch_values_are_part_of_the_captured_shape() -> None:
    torch.manual_seed(0)
    module = nn.Linear(4, 2).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    loss_fn = lambda m, x, options: m(x).pow(options["power"]).sum()  # noqa: E731
    step = tandem.compile(module, loss_fn, x, {"power": 2})
    assert_same_step(step(x, {"power": 2}), *eager_step(twin(module), loss_fn, (x, {"power": 2})), **EXACT)
    assert_same_step(step(x, {"power": 3}), *eager_step(twin(module), loss_fn, (x, {"power": 3})), **EXACT)
    assert len(step._compiled) == 2, "a new static value is a new capture"


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class _Stack(nn.Module):
    def __init__(self, checkpointed: bool, depth: int = 6, width: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return x


def _stack_loss(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x).pow(2).mean()


@pytest.mark.parametrize("mirror", ["off", "memory-aware", 0.5])
def test_checkpoint_regions_are_recomputed(mirror: str | float) -> None:
    x = torch.randn(256, 32, dtype=torch.float64)
    torch.manual_seed(0)
    plain = _Stack(checkpointed=False).double()
    torch.manual_seed(0)
    wrapped = _Stack(checkpointed=True).double()
    plain_step = tandem.compile(plain, _stack_loss, x, mirror=mirror)
    wrapped_step = tandem.compile(wrapped, _stack_loss, x, mirror=mirror)
    ignored_step = tandem.compile(twin(wrapped), _stack_loss, x, mirror=mirror, checkpoint_regions=False)
    result = wrapped_step(x)
    plain_step(x), ignored_step(x)
    assert_same_step(result, *eager_step(twin(wrapped), _stack_loss, (x,)), **EXACT)
    graph = wrapped_step.graph
    assert graph.notes["checkpoint_regions"] == 6
    assert any(MetaKey.CHECKPOINT in n.meta for n in graph.op_nodes())
    assert any(MetaKey.RECOMPUTE_OF in n.meta for n in graph.op_nodes()), "checkpointed values are recomputed"
    assert not any(n.target is torch.ops.tandem.checkpoint_mark.default for n in graph.op_nodes())
    peak = wrapped_step.memory_report()["peak_bytes"]
    assert peak <= plain_step.memory_report()["peak_bytes"]
    assert peak <= ignored_step.memory_report()["peak_bytes"]
    if mirror == "off":  # the regions alone lower the peak; ignoring them gives exactly the plain model's plan
        assert peak < plain_step.memory_report()["peak_bytes"]
        assert ignored_step.memory_report()["peak_bytes"] == plain_step.memory_report()["peak_bytes"]


def test_library_trace_checks_take_the_compiled_path() -> None:
    class _Checks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            if not torch.compiler.is_compiling() and bool((mask == 1).all()):  # transformers' eager-only check
                mask = None  # type: ignore[assignment]
            out = self.proj(x)
            return out if mask is None else out * mask.unsqueeze(-1)

    torch.manual_seed(0)
    module = _Checks().double()
    x, mask = torch.randn(2, 3, 4, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64)
    loss_fn = lambda m, x, mask: m(x, mask).sum()  # noqa: E731
    assert_same_step(tandem.compile(module, loss_fn, x, mask)(x, mask),
                     *eager_step(twin(module), loss_fn, (x, mask)), **EXACT)
    assert not torch.compiler.is_compiling(), "the compiling state is restored"


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        if y.sum() > 0:  # data-dependent Python branch
            return y * 2
        return y


def test_capture_error_names_the_users_line_and_leaves_the_module_usable() -> None:
    module = _Branchy()
    x = torch.randn(2, 4)
    loss_fn = lambda m, x: m(x).sum()  # noqa: E731
    with pytest.raises(CaptureError, match=r"module 'proj'|module '<root>'") as error:
        tandem.compile(module, loss_fn, x)
    message = str(error.value)
    assert "test_capture_patterns.py:" in message and "in forward" in message, message
    assert "is_compiling" in message, "the message says what to do"
    assert not module._forward_pre_hooks and not module.proj._forward_hooks, "no hook is left behind"
    loss_fn(module, x).backward()  # the same module still trains eagerly
    assert module.proj.weight.grad is not None


class _Siblings(nn.Module):
    """One checkpointed function per block that calls two modules in turn, with an op between them
    (as a transformers layer checkpointed through its forward)."""

    def __init__(self, depth: int = 3, width: int = 16) -> None:
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(width, 4 * width) for _ in range(depth))
        self.down = nn.ModuleList(nn.Linear(4 * width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(self.up, self.down):
            x = checkpoint(lambda h, up=up, down=down: h + down(torch.tanh(up(h))), x, use_reentrant=False)
        return x


def test_a_checkpointed_function_calling_several_modules_is_one_region() -> None:
    torch.manual_seed(0)
    module = _Siblings().double()
    x = torch.randn(64, 16, dtype=torch.float64)
    step = tandem.compile(module, _stack_loss, x)
    assert_same_step(step(x), *eager_step(twin(module), _stack_loss, (x,)), **EXACT)
    graph = step.graph
    assert graph.notes["checkpoint_regions"] == 3
    tanh = [n for n in graph.op_nodes() if n.target is torch.ops.aten.tanh.default and MetaKey.RECOMPUTE_OF not in n.meta]
    assert tanh and all(MetaKey.CHECKPOINT in n.meta for n in tanh), "the op between the two modules is in the region"
    recomputed = {n.meta[MetaKey.RECOMPUTE_OF] for n in graph.op_nodes() if MetaKey.RECOMPUTE_OF in n.meta}
    assert {n.name for n in tanh} <= recomputed, "values between the modules are recomputed, not kept"


class _Casting(nn.Module):
    """Like T5's layers: ``.to(dtype)`` leaves a metadata assert in the exported graph."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda h: self.proj(h.to(torch.float32)).tanh(), x, use_reentrant=False)


def test_trace_time_checks_are_dropped() -> None:
    torch.manual_seed(0)
    module = _Casting()
    x = torch.randn(4, 8, dtype=torch.float16)
    loss_fn = lambda m, x: m(x).pow(2).sum()  # noqa: E731
    step = tandem.compile(module, loss_fn, x)
    assert not any(n.target is torch.ops.aten._assert_tensor_metadata.default for n in step.graph.op_nodes())
    assert_same_step(step(x), *eager_step(twin(module), loss_fn, (x,)), rtol=1e-4, atol=1e-5)
