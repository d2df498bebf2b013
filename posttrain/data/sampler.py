"""The order of the training prompts: posttrain's seeded shuffle (`data.shuffle`, `data.seed`), or a sampler class of
the user's (`data.sampler.class_path` / `class_name`), built and driven as verl's `create_rl_sampler` and trainer
drive it: `Class(data_source=dataset, data_config=data_config)`, iterated for dataset indices an epoch at a time, and
for a curriculum sampler `update(batch=...)` after each trained step, before the next prompts are drawn (verl's
DataLoader draws lazily, with no workers, for that reason; so do the draws here).

Every process draws for itself: torch's, Python's and NumPy's random generators are seeded from (`data.seed`,
epoch, batch) around each draw and restored after, so a sampler that draws from them gives every rank the same
indices, and a resumed run replays the epoch's draws up to where it stopped. A curriculum sampler's `update` history
is not replayed on resume (its `update` calls start again from the resumed step)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import itertools
import random
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import Sampler

from .dataset import epoch_batches
from .verl_compat import verl_imports_answered

PKG, FILE = "pkg://", "file://"


class AbstractSampler(Sampler[int]):
    """verl's interface of a sampler class: built with the training prompts and the data config."""

    def __init__(self, data_source, data_config):
        pass


class AbstractCurriculumSampler(AbstractSampler):
    """A sampler whose order depends on training: `update(batch)` sees each trained step's whole batch."""

    def update(self, batch) -> None:
        pass


def load_sampler_class(class_path: str, class_name: str) -> type:
    """The class `class_name` of the module `class_path` names (`pkg://package.module` or `pkg://package/module`, a
    file `file://path.py` or `path.py`), as verl's `load_extern_object` finds it; ValueError saying why not."""
    where = str(class_path)
    try:
        with verl_imports_answered():
            if where.startswith(PKG):
                module = importlib.import_module(where[len(PKG):].replace("/", "."))
            else:
                path = Path(where.removeprefix(FILE)).expanduser().resolve()
                if not path.is_file():
                    raise ValueError(f"no file {path}")
                spec = importlib.util.spec_from_file_location(f"_posttrain_sampler_{path.stem}", path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
                spec.loader.exec_module(module)
    except ValueError:
        raise
    except (Exception, SystemExit) as e:  # whatever the user's module raises while it imports
        raise ValueError(f"importing {where} failed: {type(e).__name__}: {e}") from None
    cls = getattr(module, str(class_name), None)
    if cls is None:
        raise ValueError(f"{where} has no {class_name!r}")
    if not isinstance(cls, type):
        raise ValueError(f"{class_name} in {where} is a {type(cls).__name__}, not a class")
    return cls


def is_curriculum(cls) -> bool:
    """Whether the sampler's order is meant to follow training (it has an `update(batch)` method)."""
    return callable(getattr(cls, "update", None))


@contextlib.contextmanager
def _seeded(seed: int):
    """torch's, Python's and NumPy's global generators seeded with `seed` inside, restored after."""
    import numpy as np

    state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(state)
            np.random.set_state(np_state)


class StepBatch:
    """What a curriculum sampler's `update(batch)` gets: the trained step's whole batch in the shape of verl's
    DataProto. `batch`: the step's tensors under posttrain's names (prompts, responses, response_mask,
    token_level_scores, token_level_rewards, advantages, ...); `non_tensor_batch`: the per-response fields as NumPy
    object arrays (uid, data_source, ground_truth, extra_info, raw_prompt, and `index`, each row's
    `extra_info["index"]`, 0 where absent, as verl's dataset sets it); `meta_info`: {}. `posttrain_batch` is the
    Batch itself."""

    def __init__(self, batch):
        import numpy as np

        def column(values: list) -> Any:
            out = np.empty(len(values), dtype=object)
            out[:] = values
            return out

        self.posttrain_batch = batch
        self.batch = dict(batch.tensors)
        self.non_tensor_batch = {k: column(v) for k, v in batch.meta.items() if not k.startswith("reward:")}
        extra = batch.meta.get("extra_info", [None] * len(batch))
        self.non_tensor_batch["index"] = column([(e or {}).get("index", 0) if isinstance(e, dict) else 0
                                                 for e in extra])
        self.meta_info: dict = {}

    def __len__(self) -> int:
        return len(self.posttrain_batch)


class PromptOrder:
    """The dataset indices of each draw of `batch_size` prompts; `batch(cursor)` is the cursor-th draw of the run
    (epoch = cursor // batches_per_epoch). Without a sampler class: the seeded shuffle of every epoch."""

    def __init__(self, dataset, data_cfg, batch_size: int):
        self.dataset, self.cfg, self.batch_size = dataset, data_cfg, batch_size
        self.sampler = None
        if data_cfg.sampler.class_path:
            from dataclasses import asdict

            from omegaconf import OmegaConf

            cls = load_sampler_class(data_cfg.sampler.class_path, data_cfg.sampler.class_name)
            try:
                with _seeded(data_cfg.seed), verl_imports_answered():
                    self.sampler = cls(data_source=dataset, data_config=OmegaConf.create(asdict(data_cfg)))
            except Exception as e:  # whatever the user's class raises
                raise ValueError(f"building it failed: {type(e).__name__}: {e}") from e
            if not hasattr(self.sampler, "__iter__") or not hasattr(self.sampler, "__len__"):
                raise ValueError(f"data.sampler.class_name={data_cfg.sampler.class_name}: a sampler must be "
                                 "iterable (dataset indices) and have a len()")
        self.batches_per_epoch = self._length() // batch_size
        self._iter: Iterator | None = None
        self._next: tuple[int, int] | None = None  # the (epoch, batch) the open iterator draws next

    def _length(self) -> int:
        return len(self.dataset) if self.sampler is None else int(len(self.sampler))

    def batch(self, cursor: int) -> list[int]:
        if self.batches_per_epoch < 1:
            raise ValueError(f"data.train_batch_size={self.batch_size} is larger than an epoch of "
                             f"{self._length()} prompts")
        epoch, pos = divmod(cursor, self.batches_per_epoch)
        if self.sampler is None:
            d = self.cfg
            return next(itertools.islice(epoch_batches(len(self.dataset), self.batch_size, shuffle=d.shuffle,
                                                       seed=d.seed, epoch=epoch), pos, None))
        if self._next != (epoch, pos):  # the first draw, a new epoch, or a resumed run: replay the epoch's draws
            with _seeded(self._seed(epoch, -1)):
                self._iter = iter(self.sampler)
            for skipped in range(pos):
                self._draw(epoch, skipped)
        indices = self._draw(epoch, pos)
        self._next = (epoch, pos + 1)  # after an epoch's last draw, nothing: the next epoch iterates afresh
        return indices

    def _seed(self, epoch: int, pos: int) -> int:
        return (self.cfg.seed * 1_000_003 + epoch * 10_007 + pos + 1) % 2**63

    def _draw(self, epoch: int, pos: int) -> list[int]:
        with _seeded(self._seed(epoch, pos)):
            indices = list(itertools.islice(self._iter, self.batch_size))
        name = self.cfg.sampler.class_name
        if len(indices) < self.batch_size:
            raise ValueError(f"data.sampler.class_name={name} gave {len(indices) + pos * self.batch_size} indices in "
                             f"epoch {epoch}, fewer than its len() of {self._length()}")
        bad = [i for i in indices if not hasattr(i, "__index__") or not 0 <= int(i) < len(self.dataset)]
        if bad:
            raise ValueError(f"data.sampler.class_name={name} gave {bad[:3]}, not indices of the "
                             f"{len(self.dataset)} training prompts")
        return [int(i) for i in indices]

    def update(self, batch) -> None:
        """A curriculum sampler sees the trained step's whole batch (the same on every rank)."""
        if self.sampler is not None and is_curriculum(self.sampler):
            with verl_imports_answered():
                self.sampler.update(batch=StepBatch(batch))
