"""The collective kvstore (``kind="collective"``): all-reduce between the workers over
``torch.distributed`` (gloo on CPU, NCCL for CUDA tensors), sliced and issued by priority; no
servers. Modules: group (who the workers are, their process groups, heartbeats), scheduler (the
agreed priority order and the cap in flight), store (the KVStore).
"""

from __future__ import annotations

from typing import Any

from tandem.kvstore.config import KVStoreConfig


def connect(config: KVStoreConfig | str, **options: Any) -> Any:
    """This worker's collective store in the job the environment describes (``tandem launch -n N -s 0``
    or torchrun); ``config`` as ``tandem.kvstore.create`` takes it."""
    from tandem.kvstore.collective.group import Group
    from tandem.kvstore.collective.store import CollectiveKVStore

    config = KVStoreConfig.of(config, **options)
    if config.dist is None or config.p3 is None or config.kind != "collective":
        raise ValueError(f"connect makes collective stores, got {config.kind!r}")
    group = Group.from_env()
    group.set_torch_threads()
    return CollectiveKVStore(group, config.dist, config.p3)
