"""Two CPU ranks trained by Lightning, as ``python lightning_train.py OUT STRATEGY KINDS``.

STRATEGY is "ddp" (Lightning's own launcher: this process is rank 0 and starts rank 1 as its
child, running this file again) or "ddp_spawn". KINDS are ``training_data`` kinds of
``_helpers``, joined by commas: one loader each, trained on together (Lightning's combined
loader). The loaders are built in ``train_dataloader()``, once the process group exists, with
Lightning's defaults (``use_distributed_sampler=True``); with KINDS "import", a dataset is
made as the file is run instead, before any process group (the wrong place). Each rank writes
``OUT/rank<r>.json`` (``TrainRecord``) with, by kind, the type of sampler its loader used, the
indices the kind's plan had for this rank, and the indices its prefetcher loaded (if any).
"""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

from _helpers import (TRAIN_BATCH, TRAIN_EPOCHS, TrainRecord, loaded_by_prefetchers,
                      training_data)

out, strategy, kinds = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
if kinds == ["import"]:
    made_too_early = training_data("cache")[0]


class Recorded(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3 * 8 * 8, 1)

    def setup(self, stage: str) -> None:
        self.record = TrainRecord()

    def train_dataloader(self) -> dict[str, DataLoader]:
        loaders, self.plans = {}, {}
        for kind in kinds:
            dataset, sampler, self.plans[kind] = training_data(kind)
            loaders[kind] = DataLoader(dataset, batch_size=TRAIN_BATCH, sampler=sampler)
        return loaders

    def training_step(self, batch, batch_idx):
        loss = 0
        for kind, (indices, x) in batch.items():
            self.record.batch(kind, self.current_epoch, indices.tolist())
            loss = loss + self.layer(x.float().flatten(1)).mean()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        loaders = self.trainer.train_dataloader  # the loaders Lightning uses, by kind
        samplers = {kind: type(loaders[kind].sampler).__name__ for kind in kinds}
        planned = {kind: None if plan is None else
                   [plan.epoch_indices(e).tolist() for e in range(TRAIN_EPOCHS)]
                   for kind, plan in self.plans.items()}
        self.record.write(out, self.global_rank, samplers=samplers, planned=planned,
                          loaded=loaded_by_prefetchers(
                              {kind: loaders[kind].sampler for kind in kinds}))


if __name__ == "__main__":
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=TRAIN_EPOCHS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Recorded())
