"""Tiny configurations of real library models (transformers, timm), for tandem's conformance suite.

Every entry builds its model from the library's own config classes or ``timm.create_model`` with
``pretrained=False``: nothing is downloaded, and the weights are the library's own initialization
under a fixed seed. The models are tiny (1-2 layers, hidden 16-64, vocab 96, sequences of 12 tokens,
32x32 images) so the whole suite runs in minutes on a CPU, but each is the library's real module
class, run with its default settings (``use_cache``, the attention implementation, tied
embeddings); only dropout probabilities (and timm's stochastic depth) are set to 0, so tandem and
eager can be compared exactly.

Two lists:

* ``NAMED``: the architectures the conformance suite promises by name (transformers GPT-2, Llama,
  Mistral, T5, BERT, ViT; timm ResNet, ConvNeXt, EfficientNet, ViT).
* ``UNNAMED``: more of the same libraries, to show the suite holds for architectures it does not
  name (other decoder LMs, an encoder-decoder, vision transformers, a mobile CNN).

Batches are what ``loss_fn(module, *batch)`` takes. Language models take one dict,
``{"input_ids", "attention_mask", "labels"}`` (a transformers collator's batch), with the last row
padded at the end (attention_mask 0, labels -100), and their loss is ``module(**batch).loss``.
Vision models take ``(images, labels)`` and their loss is the cross-entropy of the logits.

The libraries are imported only when an entry is built, so importing this module needs neither.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.models.library import LibraryEntry, model_loss
from tandem.testing.torchvision_compat import ensure_importable

VOCAB_SIZE = 96
# the batch functions read these at call time (bench/real_models.py sets longer sequences)
SEQ_LEN = 12  # encoder / decoder-only sequence length
TARGET_LEN = 8  # decoder length of encoder-decoder models
PAD_TAIL = 3  # the last row of a token batch is padded over its last PAD_TAIL positions
IMAGE_SIZE = 32
NUM_CLASSES = 10
IGNORE_INDEX = -100  # transformers' label for "no loss here"


@dataclass(frozen=True)
class RealModel:
    """One tiny real model: how to build it, feed it and compute its training loss.

    ``build(seed=0)`` returns a fresh float32 module in training mode (seeded: equal seeds give equal
    weights, and the caller's RNG state is left alone). ``make_batch(batch_size, generator, dtype)``
    returns the positional arguments of ``loss_fn(module, *batch)``; ``dtype`` applies to floating
    inputs (images), token ids and masks stay int64.
    """

    name: str
    library: str  # "transformers" or "timm": the package the model comes from
    kind: str  # "lm" (dict batches) or "vision" ((images, labels))
    factory: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator, torch.dtype], tuple[Any, ...]]
    loss_fn: Callable[..., Tensor]

    def build(self, seed: int = 0) -> nn.Module:
        ensure_importable()  # before transformers or timm import torchvision
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = self.factory()
        return module.train()


# -- losses -------------------------------------------------------------------------------------


def image_loss(module: nn.Module, images: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy of the logits (a tensor from timm, an output object's ``.logits`` from transformers)."""
    output = module(images)
    logits = output if isinstance(output, Tensor) else output.logits
    return F.cross_entropy(logits, labels)


# -- batches ------------------------------------------------------------------------------------


def _padding_mask(batch_size: int, length: int) -> Tensor:
    mask = torch.ones(batch_size, length, dtype=torch.long)
    mask[-1, length - PAD_TAIL :] = 0  # one row padded at the end, as a collator pads
    return mask


def _tokens(batch_size: int, length: int, generator: torch.Generator) -> Tensor:
    # ids from 3 up: 0-2 are the special tokens (pad, bos, eos) of the configs below
    return torch.randint(3, VOCAB_SIZE, (batch_size, length), generator=generator)


def causal_lm_batch(batch_size: int, generator: torch.Generator, dtype: torch.dtype = torch.float32
                    ) -> tuple[dict[str, Tensor]]:
    """A decoder LM's batch: labels are the input ids (the model shifts them), -100 on padding."""
    input_ids = _tokens(batch_size, SEQ_LEN, generator)
    attention_mask = _padding_mask(batch_size, SEQ_LEN)
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return ({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels},)


def masked_lm_batch(batch_size: int, generator: torch.Generator, dtype: torch.dtype = torch.float32
                    ) -> tuple[dict[str, Tensor]]:
    """An encoder's masked-LM batch: labels on a random quarter of the real tokens, -100 elsewhere."""
    input_ids = _tokens(batch_size, SEQ_LEN, generator)
    attention_mask = _padding_mask(batch_size, SEQ_LEN)
    predict = (torch.rand(batch_size, SEQ_LEN, generator=generator) < 0.25) & (attention_mask == 1)
    predict[:, 0] = True  # every row has a label
    labels = input_ids.masked_fill(~predict, IGNORE_INDEX)
    return ({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels},)


def seq2seq_batch(batch_size: int, generator: torch.Generator, dtype: torch.dtype = torch.float32
                  ) -> tuple[dict[str, Tensor]]:
    """An encoder-decoder's batch: padded source; target labels (the model shifts them right to make
    the decoder inputs), the last row's tail -100."""
    input_ids = _tokens(batch_size, SEQ_LEN, generator)
    attention_mask = _padding_mask(batch_size, SEQ_LEN)
    labels = _tokens(batch_size, TARGET_LEN, generator)
    labels[-1, TARGET_LEN - 2 :] = IGNORE_INDEX
    return ({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels},)


def image_batch(batch_size: int, generator: torch.Generator, dtype: torch.dtype = torch.float32
                ) -> tuple[Tensor, Tensor]:
    images = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=dtype)
    return images, torch.randint(NUM_CLASSES, (batch_size,), generator=generator)


# -- builders -----------------------------------------------------------------------------------


def _transformers(model_class: str, config_class: str, **config: Any) -> Callable[[], nn.Module]:
    """A factory of ``transformers.<model_class>(transformers.<config_class>(**config))``."""
    return LibraryEntry(model_class, "transformers", model_class, config_class, config).build


def _timm(name: str, **overrides: Any) -> Callable[[], nn.Module]:
    """A factory of ``timm.create_model(name, pretrained=False, num_classes=10, **overrides)``, with
    dropout and stochastic depth off (some timm defaults have them on: Swin's drop_path_rate=0.1)."""

    def factory() -> nn.Module:
        timm = importlib.import_module("timm")
        model: nn.Module = timm.create_model(name, pretrained=False, num_classes=NUM_CLASSES, drop_rate=0.0,
                                             drop_path_rate=0.0, **overrides)
        return model

    return factory


def _lm(name: str, model_class: str, config_class: str,
        batch: Callable[..., tuple[Any, ...]] = causal_lm_batch, **config: Any) -> RealModel:
    factory = _transformers(model_class, config_class, **config)
    return RealModel(name, "transformers", "lm", factory, batch, model_loss)


def _hf_vision(name: str, model_class: str, config_class: str, **config: Any) -> RealModel:
    config = {"image_size": IMAGE_SIZE, "num_channels": 3, "num_labels": NUM_CLASSES, **config}
    return RealModel(name, "transformers", "vision", _transformers(model_class, config_class, **config),
                     image_batch, image_loss)


def _timm_vision(name: str, timm_name: str, **overrides: Any) -> RealModel:
    return RealModel(name, "timm", "vision", _timm(timm_name, **overrides), image_batch, image_loss)


# the shared shape of the tiny decoder LMs (Llama-like configs)
_DECODER: dict[str, Any] = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
_SPECIAL: dict[str, Any] = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# the shared shape of the tiny vision transformers (transformers' ViT-like configs)
_HF_VIT: dict[str, Any] = dict(patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=64, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)
_TIMM_VIT: dict[str, Any] = dict(img_size=IMAGE_SIZE, patch_size=8, embed_dim=32, depth=2, num_heads=2)

NAMED: tuple[RealModel, ...] = (
    _lm("gpt2", "GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB_SIZE, n_positions=64, n_embd=32, n_layer=2,
        n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2),
    _lm("llama", "LlamaForCausalLM", "LlamaConfig", **_DECODER, num_key_value_heads=2, attention_dropout=0.0,
        **_SPECIAL),
    # a sliding window shorter than the sequence, so the model is not Llama under another name
    _lm("mistral", "MistralForCausalLM", "MistralConfig", **_DECODER, num_key_value_heads=2, sliding_window=8,
        attention_dropout=0.0, **_SPECIAL),
    # two layers each side: the first layer owns the relative attention bias, the second reuses it
    _lm("t5", "T5ForConditionalGeneration", "T5Config", seq2seq_batch, vocab_size=VOCAB_SIZE, d_model=32,
        d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=16, dropout_rate=0.0, pad_token_id=0, eos_token_id=2,
        decoder_start_token_id=0),
    _lm("bert", "BertForMaskedLM", "BertConfig", masked_lm_batch, vocab_size=VOCAB_SIZE, hidden_size=32,
        num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0),
    _hf_vision("vit", "ViTForImageClassification", "ViTConfig", **_HF_VIT),
    _timm_vision("timm_resnet", "resnet18", layers=(1, 1, 1, 1), channels=(8, 16, 32, 64), stem_width=8),
    _timm_vision("timm_convnext", "convnext_atto", depths=(1, 1, 1, 1), dims=(8, 16, 32, 64)),
    # timm's smallest EfficientNet (MBConv, fused edge-residual and squeeze-excite blocks), narrowed
    _timm_vision("timm_efficientnet", "test_efficientnet", channel_multiplier=0.5),
    _timm_vision("timm_vit", "vit_tiny_patch16_224", **_TIMM_VIT),
)

UNNAMED: tuple[RealModel, ...] = (
    _lm("qwen2", "Qwen2ForCausalLM", "Qwen2Config", **_DECODER, num_key_value_heads=2, attention_dropout=0.0,
        **_SPECIAL),
    _lm("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", **_DECODER, rotary_pct=0.5, hidden_dropout=0.0,
        attention_dropout=0.0, **_SPECIAL),
    _lm("phi", "PhiForCausalLM", "PhiConfig", **_DECODER, partial_rotary_factor=0.5, resid_pdrop=0.0,
        embd_pdrop=0.0, attention_dropout=0.0, **_SPECIAL),
    _lm("bart", "BartForConditionalGeneration", "BartConfig", seq2seq_batch, vocab_size=VOCAB_SIZE,
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=2),
    _hf_vision("deit", "DeiTForImageClassification", "DeiTConfig", **_HF_VIT),
    _hf_vision("swin", "SwinForImageClassification", "SwinConfig", patch_size=2, embed_dim=16,
               depths=[1, 1], num_heads=[1, 2], window_size=4, mlp_ratio=2.0, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, drop_path_rate=0.0),
    # hard-swish, squeeze-excite, a conv head; the one entry above 100k parameters (0.58M: create_model
    # cannot narrow its 1024-wide head), still cheap at 32x32
    _timm_vision("timm_mobilenetv3", "mobilenetv3_small_050"),
    _timm_vision("timm_deit", "deit_tiny_distilled_patch16_224", **_TIMM_VIT),
    _timm_vision("timm_swin", "swin_tiny_patch4_window7_224", img_size=IMAGE_SIZE, patch_size=2,
                 window_size=4, embed_dim=16, depths=(1, 1), num_heads=(1, 2)),
)

REAL_MODELS: dict[str, RealModel] = {entry.name: entry for entry in NAMED + UNNAMED}


def real_model(name: str) -> RealModel:
    entry = REAL_MODELS.get(name)
    if entry is None:
        raise ValueError(f"unknown real model {name!r}; valid names: {sorted(REAL_MODELS)}")
    return entry
