"""Library models (tandem.models.LIBRARY) and the CLI's language-model reporting: perplexity, progress lines."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn
from torch.utils.data import Subset, TensorDataset

from tandem import cli, models
from tandem.data import loader, pydoc_text
from tandem.models.library import LibraryEntry, positions
from tandem.progress import _ProgressLines
from tandem.testing.torchvision_compat import ensure_importable

ensure_importable()  # before importorskip imports transformers (it imports torchvision)


def test_lookup_finds_zoo_and_library_models() -> None:
    assert models.lookup("gpt") is models.ZOO["gpt"]
    assert models.lookup("hf-gpt2") is models.LIBRARY["hf-gpt2"]
    assert models.lookup("hf-llama").loss_fn is models.model_loss
    with pytest.raises(ValueError, match="valid names.*hf-gpt2"):
        models.build("hf-bloom")


def test_missing_library_names_the_models_extra() -> None:
    entry = LibraryEntry("hf-nothing", "tandem_no_such_library", "Model", "Config")
    with pytest.raises(ImportError, match=r"hf-nothing.*tandem_no_such_library.*pip install -e \.\[models\]"):
        entry.build()


@pytest.mark.parametrize(("name", "model_class"), [("hf-gpt2", "GPT2LMHeadModel"), ("hf-llama", "LlamaForCausalLM")])
def test_library_lm_trains_on_pydoc_text_with_its_own_loss(name: str, model_class: str) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    entry = models.LIBRARY[name]
    model = models.build(name)
    assert type(model).__name__ == model_class and model.config.vocab_size == 256
    assert positions(entry.config) == 64 and not any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
    batch = next(iter(loader(pydoc_text("train"), 4)))
    with torch.no_grad():
        loss = entry.loss_fn(model, batch)
        assert torch.equal(loss, model(**batch).loss)
    assert abs(float(loss) - math.log(256)) < 1.0  # a fresh byte-level LM: about uniform over 256 tokens
    assert models.build(name, num_hidden_layers=1).config.num_hidden_layers == 1  # overrides reach the config


def test_perplexity_on_language_model_data_and_no_unshifted_accuracy() -> None:
    record = {"train_loss": 2.0, "eval_loss": 1.5, "eval_accuracy": 0.1}
    text = cli._with_perplexity(dict(record), "pydoc-text")
    assert "eval_accuracy" not in text  # the model shifts its labels: evaluate's accuracy is meaningless
    assert text["eval_perplexity"] == pytest.approx(math.exp(1.5)) and text["train_perplexity"] == pytest.approx(math.exp(2))
    tokens = cli._with_perplexity(dict(record), "synthetic-tokens")  # targets shifted by the data: kept
    assert tokens["eval_accuracy"] == 0.1 and "eval_perplexity" in tokens
    assert cli._with_perplexity(dict(record), "digits") == record
    assert math.isfinite(cli._with_perplexity({"train_loss": 1e6, "eval_loss": math.inf}, "pydoc-text")["eval_perplexity"])


def test_first_samples_keep_a_tensor_dataset_fast() -> None:
    tensors = TensorDataset(torch.arange(10), torch.arange(10))
    assert isinstance(cli._first(tensors, 4), TensorDataset) and len(cli._first(tensors, 4)) == 4
    assert cli._first(tensors, None) is tensors and cli._first(tensors, 99) is tensors
    text = cli._first(pydoc_text("validation"), 5)
    assert isinstance(text, Subset) and len(text) == 5


def test_cli_rejects_a_library_model_on_other_data() -> None:
    with pytest.raises(SystemExit, match="hf-gpt2 and hf-llama take pydoc-text"):
        cli.main(["train", "--model", "hf-gpt2", "--data", "digits"])


def test_progress_bar_off_a_terminal_is_one_line_per_redraw() -> None:
    stream = io.StringIO()
    lines = _ProgressLines(stream)
    lines.write("\repoch 1:  10%|#  | 1/10 [loss=2.5]   ")
    lines.write("\r" + " " * 20 + "\r")  # tqdm clearing the bar (leave=False) writes nothing
    lines.write("\repoch 1:  20%|## | 2/10 [loss=2.4]")
    lines.write("\x1b[A\x1b[A")  # a nested bar (compiling segments) moving the cursor: nothing in a log
    lines.flush()
    assert stream.getvalue() == "epoch 1:  10%|#  | 1/10 [loss=2.5]\nepoch 1:  20%|## | 2/10 [loss=2.4]\n"
