"""Trainer: step, fit, evaluate, save/load on top of a captured TrainStep.

    trainer = tandem.Trainer(model, loss_fn, tandem.optim.SGD(lr=0.1, momentum=0.9))
    trainer.fit(train_set, epochs=3, eval_data=test_set)

``fit``/``evaluate`` take a ``TensorDataset`` (batched by slicing, fast), any other map-style
``Dataset`` (batched by a ``DataLoader``), or a ``DataLoader`` / any iterable of batches. A batch is
what ``loss_fn(module, *batch)`` receives: a tuple/list item is spread into positional arguments, a
dict (a transformers collator's ``{"input_ids", "labels", ...}``) or a tensor is one argument.

The optimizer is an update rule (tandem.optim) applied to all parameters in one fused call; a
torch.optim.Optimizer bound to the module's parameters works too (gradients go to ``p.grad``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from tandem import checkpoint
from tandem.checkpoint import atomic_save
from tandem.graph.batch import as_arguments, batch_size_of
from tandem.graph.capture import LossFn
from tandem.kvstore.compression import GradientCompression
from tandem.kvstore.config import KVStoreConfig
from tandem.passes.config import distributed_gradient_cut, resolve_caps
from tandem.progress import progress_options
from tandem.step import EvalStep, StepConfig, StepResult, TrainStep, compile_eval
from tandem.step import compile as compile_step
from tandem.update import DistributedUpdate, LocalUpdate, OptimizerApply, Update

CHECKPOINT_FORMAT = 1


@dataclass
class TrainerConfig:
    step: StepConfig = field(default_factory=StepConfig)
    clip_grad_norm: float | None = None  # clip the global gradient norm (one fused op) to this
    batch_size: int = 64  # fit/evaluate batch size when given a Dataset (not when given a DataLoader)
    shuffle: bool = True
    drop_last: bool = True  # keep one captured shape per epoch
    seed: int = 0  # data order and initial RNG of fit()
    progress: bool = True  # tqdm bars in fit()
    kvstore: str | KVStoreConfig | None = None  # None/"local" or "dist_sync", "dist_async", "dist_p3", "dist_p3_async"
    kvstore_options: dict[str, Any] | None = None  # the kind's kvstore.create options (heartbeat=, slice_size=, ...)
    update_on_kvstore: bool = True  # the servers run the optimizer (False: pushpull grads, update here)
    # "baseline", "overlap" or "p3" (auto: p3 on the P3 kinds, also under tandem launch --p3, else overlap)
    communication: str = "auto"
    # compress pushed gradients ({"type": "2bit", "threshold": 0.5}, "fp16", "bf16", "int8", "int4"; tandem.kvstore.compression)
    gradient_compression: str | dict[str, Any] | None = None
    store: KVStoreConfig = field(init=False, repr=False)  # kvstore and kvstore_options resolved (TANDEM_* knobs too)

    def __post_init__(self) -> None:
        from tandem.kvstore.kinds import KINDS
        from tandem.update import MODES, check_combination

        if isinstance(self.kvstore, KVStoreConfig):
            if self.kvstore_options:
                raise TypeError("pass kvstore options either in the KVStoreConfig or as kvstore_options, not both")
            self.store = self.kvstore
        elif self.kvstore is not None and self.kvstore not in KINDS:
            raise ValueError(f"unknown kvstore {self.kvstore!r}; choose one of {list(KINDS)} (or None: local)")
        else:  # resolved once, here: a bad kvstore option is refused at Trainer(...), before the job is joined
            self.store = KVStoreConfig.resolve(self.kvstore or "local", **(self.kvstore_options or {}))
        # baseline exchanges after backward and waits before forward; the other modes send each
        # gradient as its backward segment ends and (P3) start each forward segment when its
        # parameters are back, so where segments end matters to them
        per_segment = self.store.distributed and self.communication != "baseline"
        if per_segment and self.step.bulk_cut_gradient is None:
            # a large layer's gradient leaves as the op that finishes it ends, not with its segment's others
            self.step = dataclasses.replace(self.step, bulk_cut_gradient=distributed_gradient_cut(None))
        if per_segment and self.step.plan.backend == "inductor" and self.step.bulk_fwd is None \
                and self.step.bulk_bwd is None:
            # compiled segments keep the aten caps' boundaries (baseline's merge as on one machine)
            caps = resolve_caps(self.step.bulk, None, None)
            self.step = dataclasses.replace(self.step, bulk_fwd=caps.forward, bulk_bwd=caps.backward)
        if self.communication not in ("auto", *MODES):
            raise ValueError(f"unknown communication {self.communication!r}; choose one of {['auto', *MODES]}")
        check_combination(self.store, self.communication, self.update_on_kvstore)  # e.g. no async update on workers
        if GradientCompression.parse(self.gradient_compression).enabled and not self.store.distributed:
            raise ValueError(f"gradient_compression={self.gradient_compression!r} needs a distributed kvstore "
                             f"(kvstore='dist_p3' under tandem launch); training alone sends no gradients")  # fmt: skip
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be > 0, got {self.clip_grad_norm}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    @staticmethod
    def from_options(options: dict[str, Any]) -> TrainerConfig:
        step_names = {f.name for f in fields(StepConfig) if f.init}
        own = {f.name for f in fields(TrainerConfig) if f.init} - {"step"}
        unknown = sorted(set(options) - step_names - own)
        if unknown:
            raise TypeError(f"unknown Trainer option(s) {unknown}; valid: {sorted(step_names | own)}")
        step = StepConfig(**{k: v for k, v in options.items() if k in step_names})
        return TrainerConfig(step=step, **{k: v for k, v in options.items() if k in own})


class Trainer:
    """Trains ``module`` on ``loss_fn(module, *batch)``. Not thread-safe.

    ``optimizer`` is a ``tandem.optim`` update rule (all parameters in one fused call; needed where
    the servers update) or a ``torch.optim.Optimizer`` over the module's parameters. ``options`` are
    ``StepConfig``'s (``mirror``, ``bulk_fwd``, ``bulk_bwd``, ``recapture``, ...) and these:

    - ``batch_size`` (64): the batch ``fit``/``evaluate`` cut a Dataset into, per worker when distributed;
    - ``shuffle`` (True), ``drop_last`` (True), ``seed`` (0): the data order depends only on ``(seed, epoch)``;
    - ``clip_grad_norm`` (None): clip the global gradient norm, in one fused op (not with a distributed kvstore);
    - ``progress`` (True): a progress bar in ``fit``;
    - ``kvstore`` (None): ``"local"``, or ``"dist_sync"``, ``"dist_async"``, ``"dist_p3"``, ``"dist_p3_async"``
      to train data-parallel under ``tandem launch`` or torchrun (or a ``tandem.kvstore.KVStoreConfig``);
    - ``kvstore_options`` (None): the kind's ``tandem.kvstore.create`` options, e.g. ``{"slice_size": "auto"}``;
      checked here, at ``Trainer(...)``, naming the valid ones (unset ones take their TANDEM_* knobs);
    - ``update_on_kvstore`` (True): the servers run the optimizer; False: they sum gradients, each worker updates
      (refused on the asynchronous kinds, whose servers do not sum: see ``tandem.update.check_combination``);
    - ``communication`` ("auto"): ``"baseline"``, ``"overlap"`` or ``"p3"`` (auto: p3 on the P3 kinds, else overlap);
    - ``gradient_compression`` (None): ``"fp16"``, ``"bf16"``, ``"int8"``, ``"int4"``, ``"2bit"`` or ``{"type": "2bit", "threshold": 0.5}``.

    Unknown options raise ``TypeError`` listing the valid ones.

    Example:
        ```python
        trainer = tandem.Trainer(model, loss_fn, tandem.optim.SGD(lr=0.05, momentum=0.9),
                                 batch_size=64, mirror="memory-aware")
        history = trainer.fit(data.digits("train"), epochs=3, eval_data=data.digits("test"))
        trainer.evaluate(data.digits("test"))     # {"loss": ..., "accuracy": ...}
        trainer.save("ckpt.pt")                   # trainer.load("ckpt.pt") resumes the same trajectory
        ```
    """

    def __init__(self, module: nn.Module, loss_fn: LossFn, optimizer: Any, **options: Any) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"Trainer needs a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.loss_fn = loss_fn
        from tandem.optim import Optimizer

        if not isinstance(optimizer, Optimizer | torch.optim.Optimizer):
            raise TypeError(f"Trainer needs an optimizer: a tandem.optim update rule (e.g. tandem.optim.SGD(lr=0.1)) "
                            f"or a torch.optim.Optimizer over the module's parameters, got {type(optimizer).__name__}")
        self.optimizer: Any = optimizer
        self.config = TrainerConfig.from_options(options)
        self.step_count = 0
        self.epoch = 0
        self.grads: dict[str, torch.Tensor] = {}
        self._train_step: TrainStep | None = None
        self._eval_step: EvalStep | None = None
        self._checkpointed_step = -1  # the step of the last checkpoint fit wrote or resumed from
        self._server_state_to_load: Path | None = None  # a resumed checkpoint's server files, loaded at the first step
        params = dict(module.named_parameters())
        self._apply = OptimizerApply(params, optimizer, self.config.clip_grad_norm)
        self._update = self._make_update(params)

    def _make_update(self, params: dict[str, nn.Parameter]) -> Update:
        config = self.config
        if not config.store.distributed:
            return LocalUpdate(params, self._apply)
        return DistributedUpdate.join(params, self._apply, self.optimizer, config.store,
                                      communication=config.communication, update_on_kvstore=config.update_on_kvstore,
                                      gradient_compression=config.gradient_compression,
                                      clip_grad_norm=config.clip_grad_norm)  # fmt: skip

    # -- one step -----------------------------------------------------------------------------
    def step(self, *batch: Any) -> float:
        """One training step: forward, backward, (communicate), update. Returns the loss.

        ``batch`` is what ``loss_fn(module, *batch)`` receives: each element a tensor, or a
        dict / tuple / list of tensors (``trainer.step(x, y)``, ``trainer.step({"input_ids": ...,
        "labels": ...})``). Other leaves (ints, strings, None) are static: a new value captures again.

        Example:
            ```python
            loss = trainer.step(x, y)              # a float; the update is applied before it returns
            trainer.grads["head.weight"]            # training alone: the last step's gradients
            ```
        """
        if not _all_training(self.module):  # reading the flags costs a fifteenth of setting them all
            self.module.train()
        step = self._compiled(batch)
        result = step(*batch, hooks=self._update.hooks(step))
        if self._update.store is None:
            self.grads = result.grads  # training alone: kept, like torch's .grad (distributed: sent away)
        self._update.after_backward(result)  # alone: applied before it returns, like torch's step()
        self.step_count += 1
        return float(result.loss)

    def _compiled(self, batch: tuple[Any, ...]) -> TrainStep:
        if self._train_step is None:
            self._train_step = compile_step(self.module, self.loss_fn, *batch, **self.config.step.options())
        return self._train_step

    @property
    def rank(self) -> int:
        """This worker's rank in a distributed job (0 when training alone).

        Example:
            ```python
            if trainer.rank == 0:
                trainer.save("ckpt.pt")             # one worker writes the checkpoint
            ```
        """
        return self._update.rank

    @property
    def num_workers(self) -> int:
        """The number of workers of the distributed job (1 when training alone).

        Example:
            ```python
            global_batch = 64 * trainer.num_workers   # batch_size is per worker
            ```
        """
        return self._update.num_workers

    @property
    def kvstore(self) -> Any:
        """The distributed KVStore this trainer talks to, or None when training alone.

        Example:
            ```python
            if trainer.kvstore is not None:
                trainer.kvstore.barrier()           # every worker reaches this point
            ```
        """
        return self._update.store

    @property
    def train_step(self) -> TrainStep:
        """The captured training step (after the first ``step``): ``trainer.train_step.memory_report()``.

        Example:
            ```python
            trainer.step(x, y)
            trainer.train_step.memory_report()["peak_bytes"]
            ```
        """
        if self._train_step is None:
            raise RuntimeError("the step is captured on the first Trainer.step(*batch); call it first")
        return self._train_step

    def sync(self) -> None:
        """Block until pending parameter updates are written (before reading parameters here).

        Example:
            ```python
            trainer.step(x, y)
            trainer.sync()                          # model.parameters() now hold the updated values
            ```
        """
        self._update.flush()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero, in one fused op) the gradients of the last step.

        Example:
            ```python
            trainer.zero_grad()                     # trainer.grads is {}
            trainer.zero_grad(set_to_none=False)    # the gradient tensors kept, filled with zeros
            ```
        """
        self.sync()
        if set_to_none:
            self.grads = {}
            return
        from tandem.ops import reset_arrays

        reset_arrays(list(self.grads.values()))

    # -- loops --------------------------------------------------------------------------------
    def fit(self, train_data: Any, epochs: int = 1, eval_data: Any = None, checkpoint_dir: str | None = None,
            checkpoint_every: int | None = None) -> list[dict[str, float]]:  # fmt: skip
        """Train for ``epochs`` over a Dataset (batched here) or a DataLoader / iterable of batches.

        A ``TensorDataset`` or any other map-style ``Dataset`` is batched here (``batch_size``,
        ``shuffle``, ``drop_last``; the order depends only on ``(seed, epoch)``) and, in distributed
        training, sharded by rank first. A ``DataLoader`` or any other iterable is used as is (each
        worker iterates it whole: shard it yourself). Each item is a batch: a tuple/list is spread
        into ``loss_fn(module, *batch)``'s arguments, a dict or a tensor is one argument.

        With ``checkpoint_dir``, a checkpoint is written there every ``checkpoint_every`` steps
        (unset: at the end of every epoch) and at the end (``tandem.checkpoint``'s layout:
        ``checkpoint_dir/step-000120/``, the newest two complete ones kept). When that directory
        already holds a complete checkpoint ahead of this trainer (a restarted job), ``fit`` first
        resumes from it by itself: model, optimizer, step, epoch, RNG, the servers' values and
        optimizer state (a server-side optimizer), and the place in the epoch (the batches already
        taken are skipped, so the run takes the same batches as one never interrupted; the data must
        be a Dataset, or an iterable with the same order every time). ``epochs`` then counts from
        where the interrupted run started: it finishes where that one would have (a checkpoint that
        already finished them: a line saying so, nothing trained). Every worker of a distributed job
        must see the same directory (a shared filesystem across machines): a checkpoint missing a
        worker's file, or workers seeing different newest checkpoints, raise ``CheckpointError``.
        When a file of the newest checkpoint cannot be read, every worker falls back to the previous
        complete one (with a warning naming the file).

        Returns one record per epoch trained in this call: train loss, samples/s, and eval
        loss/accuracy when given.

        Example:
            ```python
            history = trainer.fit(data.digits("train"), epochs=2, eval_data=data.digits("test"))
            history[-1]["train_loss"], history[-1]["eval_accuracy"]
            trainer.fit(data.digits("train"), epochs=5, checkpoint_dir="ckpt", checkpoint_every=100)
            ```
        """
        from tqdm.auto import tqdm

        if checkpoint_every is not None and (checkpoint_dir is None or checkpoint_every < 1):
            raise ValueError(f"checkpoint_every={checkpoint_every!r} needs a checkpoint_dir and must be >= 1 (steps)")
        self._check_fit_data(train_data)  # no batch at all: an error naming batch and data size, before any step
        position = (self._resume(checkpoint_dir) if checkpoint_dir is not None else None) \
            or _FitPosition(end_epoch=self.epoch + epochs)  # fmt: skip
        history: list[dict[str, float]] = []
        while self.epoch < position.end_epoch:
            batches = self._batches(train_data, train=True)
            bar = tqdm(batches, desc=f"epoch {self.epoch + 1}", disable=not self.config.progress, leave=False,
                       **progress_options())
            timed_samples, start = 0, time.perf_counter()
            for index, item in enumerate(bar):
                if index < position.batches_done:
                    continue  # taken before the checkpoint this run resumed from: same batches, same order
                batch = as_arguments(item)
                if self._server_state_to_load is not None:
                    self._load_server_state(batch)
                loss, samples = self.step(*batch), batch_size_of(batch)
                timed_samples += samples
                position.took(loss, samples)
                bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{timed_samples / (time.perf_counter() - start):.0f}",
                                refresh=False)  # shown at the bar's next redraw (mininterval)
                if checkpoint_dir is not None and checkpoint_every is not None and self.step_count % checkpoint_every == 0:
                    self._save_checkpoint(checkpoint_dir, position)
            bar.close()
            self.epoch += 1
            elapsed = time.perf_counter() - start
            record = {"epoch": float(self.epoch), "train_loss": position.loss_sum / max(position.count, 1),
                      "samples_per_s": timed_samples / elapsed if elapsed > 0 else math.nan, "seconds": elapsed}
            position = _FitPosition(end_epoch=position.end_epoch)  # the next epoch, from its first batch
            if checkpoint_dir is not None and checkpoint_every is None:
                self._save_checkpoint(checkpoint_dir, position)
            if eval_data is not None:
                record.update({f"eval_{k}": v for k, v in self.evaluate(eval_data).items()})
            history.append(record)
        if checkpoint_dir is not None and self._checkpointed_step != self.step_count:
            self._save_checkpoint(checkpoint_dir, position)
        return history

    def evaluate(self, data: Any) -> dict[str, float]:
        """Mean loss, and accuracy where the batch has integer targets, in eval mode.

        ``data`` is batched like ``fit``'s (in order, every sample, not sharded). Accuracy is the
        argmax of the module output's last dim against integer targets of the output's shape less
        that dim, counted only where the targets are found:

        - a positional batch of two or more elements whose last is an integer tensor
          (``loss_fn(module, x, y)``);
        - a dict batch (its last positional element) with an integer ``"labels"`` tensor
          (``loss_fn(module, {"input_ids": ..., "labels": ...})``).

        Targets equal to -100 (cross_entropy's and transformers' ignore index) are not counted.
        Otherwise (float targets, other shapes, an output that is not one tensor) only the loss is
        reported. Note that a causal LM that shifts its labels inside (transformers'
        ``*ForCausalLM``) gets an unshifted, meaningless accuracy: ignore it there.

        Runs a captured inference graph (one segment; TANDEM_BULK_INFERENCE=0 bulks it like training).

        Example:
            ```python
            trainer.evaluate(data.digits("test"))   # {"loss": 0.21, "accuracy": 0.95}
            ```
        """
        self.sync()  # outstanding updates (local or from the servers) become the parameters first
        loss_sum, correct, total, batches = 0.0, 0, 0, 0
        for item in self._batches(data, train=False):
            batch = as_arguments(item)
            if self._eval_step is None:
                self._eval_step = compile_eval(self.module, self.loss_fn, *batch, **self.config.step.options())
            result = self._eval_step(*batch)
            loss_sum += float(result.loss)
            batches += 1
            targets, logits = _targets(batch), result.output
            if targets is not None and isinstance(logits, torch.Tensor) and logits.shape[:-1] == targets.shape:
                counted = targets != IGNORE_INDEX
                correct += int(((logits.argmax(dim=-1) == targets) & counted).sum())
                total += int(counted.sum())
        metrics = {"loss": loss_sum / max(batches, 1)}
        if total:
            metrics["accuracy"] = correct / total
        return metrics

    def _batches(self, data: Any, train: bool) -> Iterable[Any]:
        """The items of one epoch over ``data`` (each a batch for ``as_arguments``).

        A ``TensorDataset`` goes through ``tandem.data.batches`` (slices, no per-sample collate);
        any other map-style ``Dataset`` through ``tandem.data.loader``, a ``DataLoader`` with the
        default collate (a dataset of ``(x, y)`` gives ``[X, Y]``, of dicts a dict of stacked
        tensors). Both shuffle by ``(seed, epoch)``, so every epoch has a reproducible order of its
        own, and both are sharded by rank first when training distributed. Anything else (a
        ``DataLoader``, an ``IterableDataset``, a list of batches) is iterated as is.
        """
        if not isinstance(data, Dataset) or isinstance(data, IterableDataset):
            return data
        if train:
            data = self._update.shard(data)  # distributed: this worker's shard
        from tandem.data import batches, loader

        make = batches if isinstance(data, TensorDataset) else loader  # same arguments
        return make(data, self.config.batch_size, shuffle=train and self.config.shuffle, seed=self.config.seed,
                    epoch=self.epoch, drop_last=train and self.config.drop_last)

    def _check_fit_data(self, data: Any) -> None:
        """Refuse, before any step, data that gives ``fit`` no batch at all (it would train 0 steps and
        report a loss of 0): an empty data set, one smaller than a batch with ``drop_last`` (this worker's
        shard when distributed), an empty DataLoader or list. Other iterables cannot be counted ahead."""
        if isinstance(data, Dataset) and not isinstance(data, IterableDataset):
            size, batch_size, drop_last = len(data), self.config.batch_size, self.config.drop_last  # type: ignore[arg-type]
            mine = len(self._update.shard(data))  # distributed: this worker's shard
            if mine >= (batch_size if drop_last else 1):
                return
            where = f"; this worker's shard (of {self.num_workers}) has {mine}" if self.num_workers > 1 else ""
            raise ValueError(f"fit has no batch to train on: the data set has {size} samples{where}, and batch_size "
                             f"is {batch_size} with drop_last={drop_last}; lower batch_size (Trainer(batch_size=...), "
                             f"tandem train --batch-size) or pass more data")  # fmt: skip
        try:
            count = len(data)
        except TypeError:
            return  # an iterable of unknown length (a generator, an IterableDataset's loader)
        if count == 0:
            loader = ""
            if isinstance(data, torch.utils.data.DataLoader) and not isinstance(data.dataset, IterableDataset):
                size = len(data.dataset)  # type: ignore[arg-type]
                loader = f", batch_size {data.batch_size} of a data set of {size} samples with drop_last"
            raise ValueError(f"fit has no batch to train on: the {type(data).__name__} given has none{loader}")

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs: model, optimizer settings and state, step, epoch, RNG state.

        Example:
            ```python
            state = trainer.state_dict()            # keys: format, model, optimizer, step, epoch, rng
            trainer.load_state_dict(state)
            ```
        """
        self.sync()
        optimizer: dict[str, Any]
        if isinstance(self.optimizer, torch.optim.Optimizer):
            optimizer = {"torch": self.optimizer.state_dict()}
        else:
            optimizer = {"config": self.optimizer.to_config(), "state": self._apply.states}
        return {
            "format": CHECKPOINT_FORMAT,
            "model": self.module.state_dict(),
            "optimizer": optimizer,
            "step": self.step_count,
            "epoch": self.epoch,
            "rng": torch.get_rng_state(),  # dropout masks continue the same stream after a resume
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (``load`` reads it from a file).

        Everything is checked before anything changes (``check_checkpoint_fits``): a checkpoint of
        another format, optimizer type (SGD into an AdamW trainer), model (parameter names or shapes)
        or optimizer state raises ``ValueError`` naming what differs, and the trainer stays as it was.

        Example:
            ```python
            state = trainer.state_dict()
            trainer.load_state_dict(state)           # back to that step, optimizer state and RNG
            ```
        """
        self.sync()
        check_checkpoint_fits(state, self.module, self.optimizer)
        self.module.load_state_dict(state["model"])
        optimizer = state["optimizer"]
        if isinstance(self.optimizer, torch.optim.Optimizer):
            self.optimizer.load_state_dict(optimizer["torch"])
        else:
            self._apply.states = {n: {k: v.clone() for k, v in s.items()} for n, s in optimizer["state"].items()}
            saved = type(self.optimizer).from_config(optimizer["config"])  # every setting, not only lr
            for setting in dataclasses.fields(saved):  # type: ignore[arg-type]  # in place: whoever holds the optimizer sees them
                setattr(self.optimizer, setting.name, getattr(saved, setting.name))
        self.step_count, self.epoch = state["step"], state["epoch"]
        torch.set_rng_state(state["rng"])

    def close(self) -> None:
        """Finish outstanding communication and leave the parameter-server job (distributed only).

        Example:
            ```python
            trainer.fit(train_set, epochs=3)
            trainer.close()                         # a worker says goodbye to the servers
            ```
        """
        self._update.close()

    def save(self, path: str) -> None:
        """Write a checkpoint (model, optimizer state, step, epoch, RNG) that torch.load can read.

        Atomically (``tandem.checkpoint.atomic_save``): a process killed while saving leaves the
        previous checkpoint at ``path`` whole.

        Example:
            ```python
            trainer.save("ckpt.pt")
            ```
        """
        atomic_save(self.state_dict(), path)  # killed mid-save: the previous file at path is still whole

    def load(self, path: str) -> None:
        """Resume from save(): the run continues the trajectory it would have had without stopping.

        Example:
            ```python
            trainer = tandem.Trainer(model, loss_fn, tandem.optim.SGD(lr=0.1))   # configured as when saved
            trainer.load("ckpt.pt")
            ```
        """
        self.load_state_dict(read_checkpoint(path))


    # -- fit's checkpoint directories (tandem.checkpoint) --------------------------------------------
    def _resume(self, root: str) -> _FitPosition | None:
        """Load the newest complete checkpoint under ``root`` if it is ahead of this trainer (a restarted
        job); its place in the data, or None when there is nothing to resume from.

        Collective in a distributed job (``tandem.checkpoint.resume_point``): the workers agree through
        the kvstore's rendezvous store on the step they resume from, the newest that every one of them
        can read (a damaged file: all fall back to the previous checkpoint), and fail naming each
        worker's step when they see different checkpoints (``root`` not shared)."""

        def read(directory: Path) -> tuple[dict[str, Any], _FitPosition]:
            document = read_checkpoint(str(checkpoint.worker_file(directory, self.rank)))
            try:
                return document, _FitPosition(**document["fit"])
            except (KeyError, TypeError) as error:
                raise ValueError(f"{checkpoint.worker_file(directory, self.rank)} holds no place in the data "
                                 f"for fit ({type(error).__name__}: {error})") from None  # fmt: skip

        found = checkpoint.resume_point(root, self.step_count, read, self._gather_over_workers(), self.rank,
                                        self.num_workers)  # fmt: skip
        if found is None:
            return None  # nothing there, or this trainer wrote it itself (a later fit call of the same run)
        step, directory, marker, (document, position) = found.step, found.directory, found.marker, found.loaded
        self.load_state_dict(document)
        if marker.get("server_state"):
            self._server_state_to_load = directory
        self._checkpointed_step = step
        print(f"tandem: worker {self.rank} resumes from {directory} (step {step}, epoch {self.epoch + 1}, "
              f"{position.batches_done} batches into it)", file=sys.stderr, flush=True)  # fmt: skip
        if self.epoch >= position.end_epoch and self.rank == 0:
            print(f"tandem: checkpoint at step {step} already finished {self.epoch} epochs; nothing to train "
                  f"(fit's epochs count from where the checkpointed run started)", file=sys.stderr, flush=True)
        return position

    def _gather_over_workers(self) -> checkpoint.Gather:
        """Every worker's text in rank order (collective: each call of the returned function once on
        every worker, in the same order); alone: ``[text]``."""
        store = self.kvstore
        if store is None:
            return lambda text: [text]
        return lambda text: store.gather("checkpoint-resume", text)

    def _load_server_state(self, batch: tuple[Any, ...]) -> None:
        """Before the first step after a resume: join the kvstore's keys as that step would (the servers
        get this worker's loaded values and a fresh optimizer), then restore the servers' checkpoint."""
        directory, self._server_state_to_load = self._server_state_to_load, None
        assert directory is not None and self.kvstore is not None
        self._update.hooks(self._compiled(batch))  # init, set_optimizer, pull: once per captured step
        self.kvstore.load_server_state(str(directory.resolve()))

    def _save_checkpoint(self, root: str, position: _FitPosition) -> None:
        """Write this worker's file under ``root``'s step directory and, with a server-side optimizer, the
        servers' files (collective: every worker calls it at the same step); worker 0 then marks the
        directory complete and deletes old ones."""
        directory = checkpoint.step_directory(root, self.step_count)
        # a Trainer checkpoint (Trainer.load reads it) with the place in the data besides
        atomic_save({**self.state_dict(), "fit": dataclasses.asdict(position)}, checkpoint.worker_file(directory, self.rank))
        store = self.kvstore
        server_state = getattr(self._update, "server_optimizer", None) is not None
        if server_state:
            store.save_server_state(str(directory.resolve()))  # waits for every worker's file too (a barrier)
        elif store is not None:
            store.barrier()  # every worker's file is written before the directory counts
        if self.rank == 0:
            checkpoint.check_worker_files(directory, self.num_workers)  # not there: checkpoint_dir is not shared
            checkpoint.mark_complete(directory, {
                "step": self.step_count, "epoch": self.epoch, "workers": self.num_workers,
                "servers": store.num_servers if store is not None else 0, "server_state": server_state})  # fmt: skip
            checkpoint.prune(root)
        self._checkpointed_step = self.step_count


@dataclass
class _FitPosition:
    """Where a fit is in its data, saved with each of its checkpoints."""

    end_epoch: int  # the epoch the fit stops at (kept across a resume: the restarted run ends where the first would)
    batches_done: int = 0  # batches of the current epoch already taken
    loss_sum: float = 0.0  # over those batches, for the epoch's record
    count: int = 0
    samples: int = 0

    def took(self, loss: float, samples: int) -> None:
        self.batches_done += 1
        self.loss_sum, self.count, self.samples = self.loss_sum + loss, self.count + 1, self.samples + samples


CHECKPOINT_KEYS = ("format", "model", "optimizer", "step", "epoch", "rng")  # what Trainer.state_dict() holds


def read_checkpoint(path: str) -> dict[str, Any]:
    """The Trainer checkpoint in file ``path`` (tensors and plain containers only: ``weights_only``).

    A file that is not one (random bytes, a truncated file, a pickled object, a bare model
    ``state_dict``) raises ``ValueError`` naming the file and what it holds instead of torch's
    unpickling hints; a missing file raises ``FileNotFoundError``.

    Example:
        ```python
        state = read_checkpoint("ckpt.pt")    # what Trainer.save wrote
        trainer.load_state_dict(state)        # the same as trainer.load("ckpt.pt")
        ```
    """
    try:
        document = torch.load(path, weights_only=True)
    except OSError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the unpickler chokes on, the file is not a checkpoint
        # torch's own message is about weights_only and unsafe loading, which is no help here
        raise ValueError(f"{path} is not a tandem checkpoint: torch.load cannot read it as tensors and plain "
                         f"containers ({type(error).__name__}); Trainer.save writes one") from None  # fmt: skip
    if not isinstance(document, Mapping) or "format" not in document:
        raise ValueError(f"{path} is not a tandem checkpoint: it holds {_what_is(document)}, where Trainer.save "
                         f"writes a dict of {list(CHECKPOINT_KEYS)}")  # fmt: skip
    return dict(document)


def check_checkpoint_fits(state: Any, module: nn.Module, optimizer: Any) -> None:
    """Raise ``ValueError`` naming every difference between checkpoint ``state`` (``Trainer.state_dict()``)
    and a trainer of ``module`` and ``optimizer``; nothing is changed. Checked: the format, the
    optimizer's type (tandem.optim's by name; a torch.optim optimizer by its settings) and settings,
    the model's entries (the first few missing, unexpected and differently shaped names), and the
    optimizer state (parameter names, the state each parameter needs, shapes).

    Example:
        ```python
        check_checkpoint_fits(read_checkpoint("ckpt.pt"), model, tandem.optim.AdamW(lr=1e-3))
        # ValueError: the checkpoint does not fit this Trainer: its optimizer is 'sgd', this Trainer's 'adamw'; ...
        ```
    """
    if not isinstance(state, Mapping) or "format" not in state:
        raise ValueError(f"not a tandem checkpoint: got {_what_is(state)}, where Trainer.state_dict() gives a dict "
                         f"of {list(CHECKPOINT_KEYS)}")  # fmt: skip
    if state["format"] != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint format {state['format']} is not {CHECKPOINT_FORMAT}; "
                         "it was written by another tandem version")
    lacking = [key for key in CHECKPOINT_KEYS if key not in state]
    if lacking:
        raise ValueError(f"the checkpoint lacks {lacking}; Trainer.state_dict() writes {list(CHECKPOINT_KEYS)}")
    params = dict(module.named_parameters())
    problems = _model_differences(state["model"], module.state_dict()) + _optimizer_differences(
        state["optimizer"], optimizer, params
    )
    if problems:
        raise ValueError("the checkpoint does not fit this Trainer: " + "; ".join(problems)
                         + ". Load it into a Trainer built as the saving one was (the same model and optimizer)")  # fmt: skip


def _what_is(value: Any) -> str:
    if isinstance(value, Mapping):
        keys = [str(key) for key in value]
        return f"a dict of {len(keys)} entries ({_some(keys)}; a model's state_dict? load it with module.load_state_dict)"
    return f"a {type(value).__name__}"


def _some(names: list[str], shown: int = 3) -> str:
    """The first ``shown`` names, quoted, and how many more."""
    listed = ", ".join(repr(name) for name in names[:shown])
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _model_differences(saved: Any, current: Mapping[str, torch.Tensor]) -> list[str]:
    if not isinstance(saved, Mapping):
        return [f"its model is {_what_is(saved)}, not a state_dict"]
    missing = [name for name in current if name not in saved]
    unexpected = [str(name) for name in saved if name not in current]
    reshaped = [f"{name!r} is {tuple(saved[name].shape)} there, {tuple(value.shape)} here" for name, value in current.items()
                if isinstance(saved.get(name), torch.Tensor) and saved[name].shape != value.shape]  # fmt: skip
    problems = []
    if missing:
        problems.append(f"the model's {_some(missing)} are not in the checkpoint")
    if unexpected:
        problems.append(f"the checkpoint's model has {_some(unexpected)}, which this model has not")
    if reshaped:
        problems.append("model shapes differ: " + ", ".join(reshaped[:3]) + (f" and {len(reshaped) - 3} more" if len(reshaped) > 3 else ""))
    return problems


def _optimizer_differences(saved: Any, optimizer: Any, params: Mapping[str, torch.Tensor]) -> list[str]:
    if not isinstance(saved, Mapping) or not ("torch" in saved or "config" in saved):
        return [f"its optimizer entry is {_what_is(saved)}, not Trainer.state_dict()'s"]
    if isinstance(optimizer, torch.optim.Optimizer):
        if "torch" not in saved:
            return [f"its optimizer is tandem.optim's {saved['config'].get('name')!r}, this Trainer's "
                    f"torch.optim.{type(optimizer).__name__}"]  # fmt: skip
        return _torch_optimizer_differences(saved["torch"], optimizer)
    if "config" not in saved:
        return [f"its optimizer is a torch.optim optimizer, this Trainer's tandem.optim {optimizer.name!r}"]
    name = saved["config"].get("name") if isinstance(saved["config"], Mapping) else None
    if name != optimizer.name:
        return [f"its optimizer is {name!r}, this Trainer's {optimizer.name!r}"]
    try:
        type(optimizer).from_config(saved["config"])
    except (TypeError, ValueError) as error:
        return [f"its optimizer settings do not load: {error}"]
    states = saved.get("state", {})
    unexpected = [str(name) for name in states if name not in params]
    problems = [f"its optimizer state is kept for {_some(unexpected)}, which this model has not"] if unexpected else []
    for name, state in states.items():
        if name not in params:
            continue
        param = params[name]
        needed = sorted(set(optimizer.create_state(param)) - set(state))  # SGD's momentum appears at the first step
        wrong = [f"{key} {tuple(value.shape)}" for key, value in state.items()
                 if isinstance(value, torch.Tensor) and value.dim() and value.shape != param.shape]  # fmt: skip
        if needed or wrong:
            problems.append(f"the optimizer state of {name!r} " + (f"lacks {needed}" if needed else "")
                            + (" and " if needed and wrong else "")
                            + (f"has {', '.join(wrong)} for a {tuple(param.shape)} parameter" if wrong else ""))  # fmt: skip
            break  # one parameter says enough: the others were saved alike
    return problems


def _torch_optimizer_differences(saved: Any, optimizer: torch.optim.Optimizer) -> list[str]:
    """A torch.optim state_dict against ``optimizer``: its type shows in its settings (SGD's momentum,
    AdamW's betas), which torch's own load_state_dict takes over unchecked (and the first step then fails)."""
    groups = optimizer.state_dict()["param_groups"]
    theirs = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(theirs, list) or len(theirs) != len(groups):
        count = len(theirs) if isinstance(theirs, list) else "no"
        return [f"its torch optimizer has {count} parameter groups, this Trainer's {len(groups)}"]
    for index, (their, ours) in enumerate(zip(theirs, groups)):
        only_theirs, only_ours = sorted(set(their) - set(ours)), sorted(set(ours) - set(their))
        if only_theirs or only_ours:
            return [f"its torch optimizer has the settings {only_theirs} and lacks {only_ours} of this Trainer's "
                    f"torch.optim.{type(optimizer).__name__}: another optimizer type"]  # fmt: skip
        if len(their["params"]) != len(ours["params"]):
            return [f"parameter group {index} of its torch optimizer has {len(their['params'])} parameters, "
                    f"this Trainer's {len(ours['params'])}"]  # fmt: skip
    return []


IGNORE_INDEX = -100  # targets not counted by evaluate's accuracy (cross_entropy's default ignore_index)
_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _targets(batch: tuple[Any, ...]) -> torch.Tensor | None:
    """The integer targets evaluate's accuracy compares against, or None (see Trainer.evaluate)."""
    last = batch[-1] if batch else None
    if isinstance(last, Mapping):
        last = last.get("labels")
    elif len(batch) < 2:
        return None
    return last if isinstance(last, torch.Tensor) and last.dtype in _INTEGER_DTYPES else None


def _all_training(module: nn.Module) -> bool:
    """Whether ``module`` and every submodule are in training mode (as ``train()`` would leave them)."""
    return module.training and all(child is None or _all_training(child) for child in module._modules.values())


__all__ = ["Trainer", "TrainerConfig", "StepResult"]
