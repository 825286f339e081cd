"""``World``, the rank's place: what each launcher's variables (torchrun, accelerate, srun,
Lightning, Ray Train) make of it, the variables that contradict each other, and ``discover``,
which asks the process group where one is up (also ranks placed unevenly on two hosts) and
refuses a DataLoader worker its collective."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import stocaching.stocaching as core
from _helpers import LAUNCHERS, RAY_2_PLUS_1, free_port
from stocaching import World


# ----------------------------------------------------------------------------------------------
# Launcher variables
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_each_launchers_variables_give_its_world(launcher):
    env, want = LAUNCHERS[launcher]
    assert World.from_env(env) == want
    assert World.discover(env) == want  # no process group here: the variables decide


@pytest.mark.parametrize("rank", range(4))
def test_rays_variables_of_an_even_placement_give_each_rank_its_world(rank):
    env = dict(RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2",
               NODE_RANK=str(rank // 2))
    assert World.from_env(env) == World(rank=rank, world_size=4, local_rank=rank % 2,
                                        local_world_size=2, node_rank=rank // 2, num_nodes=2)


def test_torchrun_with_other_ranks_per_node_names_its_nodes_and_is_read_as_it_is():
    """torchrun may run another --nproc-per-node on each node; GROUP_WORLD_SIZE names the
    nodes then, and nothing has to be derived."""
    env = dict(RANK="2", WORLD_SIZE="3", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="1",
               GROUP_WORLD_SIZE="2")
    assert World.from_env(env) == World(rank=2, world_size=3, local_rank=0, local_world_size=1,
                                        node_rank=1, num_nodes=2)


@pytest.mark.parametrize("rank", [0, 1])
def test_on_the_node_of_two_in_a_2_plus_1_placement_the_variables_refuse_to_count_the_nodes(
        rank):
    with pytest.raises(ValueError, match=r"WORLD_SIZE should be a multiple of LOCAL_WORLD_SIZE, "
                                         r"but got WORLD_SIZE=3, LOCAL_WORLD_SIZE=2, "
                                         rf"LOCAL_RANK={rank}, NODE_RANK=0: the number of "
                                         r"nodes cannot be derived from this node's variables "
                                         r"\(the ranks may be spread unevenly.*after "
                                         r"init_process_group"):
        World.from_env(RAY_2_PLUS_1[rank])


def test_on_the_node_of_one_in_a_2_plus_1_placement_the_variables_cannot_tell():
    """Its own variables are those of an even placement of three nodes: nothing in them can
    be refused, and the other node derives one node. That is why ``discover`` asks the
    process group under Ray."""
    assert World.from_env(RAY_2_PLUS_1[2]).num_nodes == 3


@pytest.mark.parametrize("env, match", [
    (dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
          GROUP_WORLD_SIZE="2"),
     r"LOCAL_WORLD_SIZE \+ GROUP_WORLD_SIZE - 1 should be at most WORLD_SIZE \(each other node "
     r"runs a rank at least\), but got WORLD_SIZE=2, LOCAL_WORLD_SIZE=2, GROUP_WORLD_SIZE=2"),
    (dict(LOCAL_RANK="0", NODE_RANK="1", WORLD_SIZE="4"),  # Lightning's, node 1, no group yet
     r"the node rank should be below WORLD_SIZE // LOCAL_WORLD_SIZE = 1 \(with no "
     r"LOCAL_WORLD_SIZE, every rank is on this node\), but got WORLD_SIZE=4, LOCAL_RANK=0, "
     r"NODE_RANK=1"),
    (dict(SLURM_PROCID="2", SLURM_NTASKS="3", SLURM_LOCALID="0", SLURM_NODEID="1",
          SLURM_NNODES="2"),
     r"SLURM_NTASKS should be a multiple of SLURM_NNODES, but got SLURM_NTASKS=3, "
     r"SLURM_NNODES=2, SLURM_NODEID=1: the tasks on this node cannot be derived"),
], ids=["GROUP_WORLD_SIZE too many", "NODE_RANK past the nodes", "SLURM tasks uneven"])
def test_variables_that_contradict_each_other_raise_naming_them(env, match):
    with pytest.raises(ValueError, match=match):
        World.from_env(env)
    with pytest.raises(ValueError, match=match):
        World.discover(env)  # no process group here: the variables decide


# ----------------------------------------------------------------------------------------------
# The process group
# ----------------------------------------------------------------------------------------------


def test_a_process_group_overrules_variables_that_disagree_with_it(process_group_of_one):
    # SLURM variables of a task that was not started by srun (python train.py inside an
    # allocation of 8 tasks) say rank 5 of 8; the process group says rank 0 of 1.
    slurm = LAUNCHERS["srun"][0]
    assert World.discover(slurm) == World()
    # Complete variables that agree with the group are used as they are, without a collective.
    agree = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    assert World.discover(agree) == World()
    assert World.from_process_group() == World()


def _discover_as(rank: int, host: str, port: int, out) -> None:
    """One rank of a gloo group of three in a forked process, on the host it is told."""
    try:
        core._host_identity = lambda: host  # two machines cannot run here: see the test
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=3)
        w = World.discover(RAY_2_PLUS_1[rank])
        out.put((rank, [w.rank, w.world_size, w.local_rank, w.local_world_size, w.node_rank,
                        w.num_nodes]))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(e).__name__}: {e}"))


@pytest.mark.timeout(120)
def test_ranks_placed_2_plus_1_on_two_hosts_agree_on_the_nodes_through_the_process_group():
    """Three real gloo ranks with Ray's variables of a 2 + 1 placement. Their host identities
    are given by hand (ranks 0 and 1 on host A, rank 2 on host B): two machines cannot run
    here, and the exchange itself is real. Every rank finds two nodes, and its own."""
    ctx, port = mp.get_context("fork"), free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=_discover_as, args=(r, "AAB"[r], port, out)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got == {0: [0, 3, 0, 2, 0, 2], 1: [1, 3, 1, 2, 0, 2], 2: [2, 3, 0, 1, 1, 2]}


class Discovering(Dataset):
    """Each item is what ``World.discover`` says in the process that reads it."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> str:
        try:
            return repr(World.discover(dict(RAY_2_PLUS_1[0], WORLD_SIZE="1",
                                            LOCAL_WORLD_SIZE="1")))
        except RuntimeError as e:
            return str(e)


@pytest.mark.timeout(120)
def test_a_forked_dataloader_worker_is_refused_the_process_groups_collective(
        process_group_of_one):
    """A forked worker inherits the group, but a collective from it would run over the
    training process's connections; under Ray's variables the world needs one."""
    assert Discovering()[0] == repr(World())  # in the training process: asked the group
    loader = DataLoader(Discovering(), batch_size=None, num_workers=1,
                        multiprocessing_context="fork")
    (said,) = list(loader)
    assert said.startswith("a cache constructed in DataLoader worker 0 would have to ask the "
                           "process group"), said
    assert "construct the cache in the training process before the DataLoader starts" in said
