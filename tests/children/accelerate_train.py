"""Two CPU ranks trained with Accelerate, as
``torchrun --nproc_per_node=2 accelerate_train.py OUT KINDS USE`` (one rank each), or as
``python accelerate_train.py OUT KINDS USE notebook`` (Accelerate's ``notebook_launcher``
starts both from this process, as in a notebook).

KINDS are ``training_data`` kinds of ``_helpers``, joined by commas, trained one after the
other; each loader, model and optimizer go through ``accelerator.prepare`` together, with
Accelerate's defaults. USE is "for_accelerate" (the loader's sampler, or the prefetcher's, is
``sampler.for_accelerate()``, the documented way) or "sampler" (the ``CacheAwareSampler``
itself: the wrong way, which warns). Each rank writes ``OUT/rank<r>.json`` (``TrainRecord``)
with the length of its prepared loaders, the indices its ``CacheAwareSampler`` planned for it
and those its prefetchers loaded.
"""

import sys

import torch
from accelerate import Accelerator, notebook_launcher
from torch.utils.data import DataLoader

from _helpers import (TRAIN_BATCH, TRAIN_EPOCHS, TrainRecord, free_port, loaded_by_prefetchers,
                      training_data)


# The models each process trained, kept to the interpreter's end (see hf_train.py's end: the
# last reference to a DDP model dropped on train()'s return can deadlock torch's teardown).
KEPT: list = []


def train(out: str, kinds: str, use: str) -> None:
    record = TrainRecord()
    accelerator = Accelerator(cpu=True)
    batches, planned, samplers = {}, {}, {}
    for kind in kinds.split(","):
        dataset, sampler, plan = training_data(kind, for_accelerate=use == "for_accelerate")
        loader = DataLoader(dataset, batch_size=TRAIN_BATCH, sampler=sampler)
        model = torch.nn.Linear(3 * 8 * 8, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for epoch in range(TRAIN_EPOCHS):
            for indices, x in loader:
                record.batch(kind, epoch, indices.tolist())
                loss = model(x.float().flatten(1)).mean()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        KEPT.append(model)
        batches[kind], samplers[kind] = len(loader), sampler
        planned[kind] = None if plan is None else \
            [plan.epoch_indices(e).tolist() for e in range(TRAIN_EPOCHS)]
    record.write(out, accelerator.process_index, batches=batches, planned=planned,
                 loaded=loaded_by_prefetchers(samplers))
    accelerator.end_training()


if __name__ == "__main__":
    if sys.argv[4:] == ["notebook"]:
        notebook_launcher(train, args=tuple(sys.argv[1:4]), num_processes=2,
                          use_port=str(free_port()))
    else:
        train(*sys.argv[1:4])
