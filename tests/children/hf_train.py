"""Two CPU ranks trained by Hugging Face's ``Trainer`` with the recipe of docs/distributed.md,
as ``torchrun --nproc_per_node=2 hf_train.py OUT PHASE WORKERS [prefetch]``.

PHASE is "whole" (``TRAIN_EPOCHS`` epochs), "interrupt" (a checkpoint at global step
``STOP_AT``, 4 batches into epoch 1, where training stops as if the job were killed) or
"resume" (``trainer.train(resume_from_checkpoint=...)`` from that checkpoint, in new
processes). WORKERS is ``dataloader_num_workers``. With "prefetch", the sampler is a
``Prefetcher`` (2 threads, no window: a resume skips batches by count, so the order must not
depend on what was cached) over ``sampler.for_accelerate()``. An evaluation dataset with a cache of its
own runs at the end of each epoch. Each rank writes ``OUT/<PHASE>-rank<r>.json``: the indices
its model was trained on, by epoch; the indices its ``CacheAwareSampler`` planned for it;
the stocaching segments seen while training; the evaluation cache's hits; the warnings that
speak of a sampler or a cache.
"""

import json
import os
import sys
import warnings

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from _helpers import TRAIN_BATCH, TRAIN_EPOCHS, TRAIN_LEN, budget_for, value_of
from stocaching import CacheAwareSampler, Prefetcher, SharedCache, list_segments

DIMS = (3, 8, 8)
STEPS_PER_EPOCH = TRAIN_LEN // 2 // TRAIN_BATCH  # 2 ranks
STOP_AT = STEPS_PER_EPOCH + 4


class Samples(torch.utils.data.Dataset):
    """The README's two lines, items as the Trainer's collator takes them."""

    def __init__(self, n: int, name: str) -> None:
        self.cache = SharedCache(budget_for(n // 3, DIMS, dataset_len=n), n, DIMS, name=name,
                                 timeout=60)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        x = self.cache.get_slot(i)
        if x is None:
            x = load(i)
            self.cache.set_slot(i, x)
        return {"x": x, "idx": i}


def load(i: int) -> torch.Tensor:
    return value_of(i, DIMS)


# The recipe of docs/distributed.md ("Hugging Face Trainer"), as a user writes it.
class CachedTrainer(Trainer):
    prefetch = False

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        sampler = CacheAwareSampler(dataset, batch_size=self.args.per_device_train_batch_size,
                                    seed=self.args.seed).for_accelerate()
        if self.prefetch:
            return Prefetcher(sampler, dataset.cache, load, threads=2)
        return sampler


class Model(torch.nn.Module):
    """Records the indices of every training batch it sees, under the epoch being trained."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3 * 8 * 8, 1)
        self.epoch = 0
        self.trained: dict[int, list[int]] = {}

    def forward(self, x, idx):
        if self.training:
            self.trained.setdefault(self.epoch, []).extend(idx.tolist())
        return {"loss": self.linear(x.float().flatten(1)).pow(2).mean()}


class Watch(TrainerCallback):
    """Sets the model's epoch from the global step, notes the segments at the first step, and
    stops training (after the checkpoint) at ``STOP_AT`` when interrupting."""

    def __init__(self, model: Model, interrupt: bool) -> None:
        self.model, self.interrupt, self.segments = model, interrupt, None

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.model.epoch = state.global_step // STEPS_PER_EPOCH

    def on_step_begin(self, args, state, control, **kwargs):
        if self.segments is None:
            shm = os.environ.get("STOCACHING_SHM_DIR", "/dev/shm")
            names = [os.path.basename(s["path"]).split("_n0_")[-1] for s in list_segments(shm)]
            self.segments = {n: names.count(n) for n in sorted(set(names))}

    def on_step_end(self, args, state, control, **kwargs):
        if self.interrupt and state.global_step == STOP_AT:
            control.should_save = True
            control.should_training_stop = True


def main(out: str, phase: str, workers: int, prefetch: bool) -> CachedTrainer:
    CachedTrainer.prefetch = prefetch
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    train, evaluation = Samples(TRAIN_LEN, "train"), Samples(TRAIN_LEN // 2, "eval")
    model = Model()
    args = TrainingArguments(
        output_dir=os.path.join(out, "checkpoints"), use_cpu=True, seed=3,
        per_device_train_batch_size=TRAIN_BATCH, per_device_eval_batch_size=TRAIN_BATCH,
        num_train_epochs=TRAIN_EPOCHS, dataloader_num_workers=workers,
        eval_strategy="epoch", save_strategy="steps" if phase == "interrupt" else "no",
        save_steps=STOP_AT, report_to="none", logging_strategy="no", disable_tqdm=True,
        remove_unused_columns=False)
    watch = Watch(model, phase == "interrupt")
    trainer = CachedTrainer(model=model, args=args, train_dataset=train,
                            eval_dataset=evaluation, callbacks=[watch])
    resume = os.path.join(out, "checkpoints", f"checkpoint-{STOP_AT}") if phase == "resume" \
        else None
    trainer.train(resume_from_checkpoint=resume)
    rank = trainer.args.process_index
    plan = CacheAwareSampler(train, batch_size=TRAIN_BATCH, seed=3)
    eval_stats = evaluation.cache.stats()
    caught.__exit__(None, None, None)
    ours = [f"{w.category.__name__}: {w.message}" for w in seen
            if any(word in str(w.message).lower() for word in ("stocaching", "sampler", "cache"))]
    record = {"rank": rank, "world_size": trainer.args.world_size,
              "trained": {str(e): got for e, got in model.trained.items()},
              "planned": [plan.epoch_indices(e).tolist() for e in range(TRAIN_EPOCHS)],
              "segments": watch.segments,
              "eval_hits": eval_stats["hits"], "train_hits": train.cache.stats()["hits"],
              "warnings": ours}
    with open(os.path.join(out, f"{phase}-rank{rank}.json"), "w") as f:
        json.dump(record, f)
    torch.distributed.destroy_process_group()
    return trainer


if __name__ == "__main__":
    # Kept to the interpreter's end: dropping the last reference to the DDP model on main()'s
    # return runs the process group's destructor with the GIL held, while a gloo thread that
    # is still freeing the last all-gather waits for the GIL, and neither returns (a torch
    # deadlock, 1 run in 13 on this machine; see _helpers.TORCH_GLOO_EXIT_ABORT). At the
    # interpreter's end that thread is stopped instead, which is that abort.
    trainer = main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:] == ["prefetch"])
