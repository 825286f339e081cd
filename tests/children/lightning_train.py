"""Two CPU ranks trained by Lightning, as ``python lightning_train.py OUT STRATEGY KIND``.

STRATEGY is "ddp" (Lightning's own launcher: this process is rank 0 and starts rank 1 as its
child, running this file again) or "ddp_spawn". KIND is a ``training_data`` kind of
``_helpers``. The loader is built in ``train_dataloader()``, once the process group exists,
with Lightning's defaults (``use_distributed_sampler=True``; False for KIND "prefetch", as
docs/distributed.md says for a ``Prefetcher``); with KIND "import", the
dataset is made as the file is run instead, before any process group (the wrong place).
Each rank writes ``OUT/rank<r>.json`` (``TrainRecord``) with the type of sampler its training
loader used and the indices that sampler planned for it.
"""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

from _helpers import TRAIN_BATCH, TRAIN_EPOCHS, TrainRecord, training_data

out, strategy, kind = sys.argv[1:4]
if kind == "import":
    made_too_early = training_data("cache")[0]


class Recorded(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3 * 8 * 8, 1)

    def setup(self, stage: str) -> None:
        self.record = TrainRecord()

    def train_dataloader(self) -> DataLoader:
        dataset, sampler, self.plan = training_data(kind)
        return DataLoader(dataset, batch_size=TRAIN_BATCH, sampler=sampler)

    def training_step(self, batch, batch_idx):
        indices, x = batch
        self.record.batch(self.current_epoch, indices.tolist())
        return self.layer(x.float().flatten(1)).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        sampler = self.trainer.train_dataloader.sampler
        planned = None if self.plan is None else \
            [self.plan.epoch_indices(e).tolist() for e in range(TRAIN_EPOCHS)]
        self.record.write(out, self.global_rank, sampler=type(sampler).__name__,
                          planned=planned)


if __name__ == "__main__":
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=TRAIN_EPOCHS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=kind != "prefetch")
    trainer.fit(Recorded())
