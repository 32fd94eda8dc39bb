"""Expert parallelism (``parallel.ep``): each MoE layer's experts split over the data-parallel
ranks, tokens sent to their experts' rank and back with all-to-all (GShard, Lepikhin et al. 2020).

    apply_ep(model, env.dp_mesh)        # from parallelize(), before activation checkpointing and DDP/FSDP2

Each rank keeps E / ep experts: ``w1, w3, w2`` become DTensors ``Shard(0)`` on the
data-parallel mesh (so DCP checkpoints, ``get_model_state_dict`` exports and the gradient clip
see the whole (E, ...) tensors and a checkpoint loads under any other layout). The router, the
shared expert and everything else stay whole, under DDP or FSDP2 as usual; the expert weights
are left out of both (DDP's ignored parameters, FSDP2's ``ignored_params``). A layer's forward:

    1. route and sort as on one device (ember/model/moe.py): rows x (N·k, C) by global expert;
    2. all-to-all of the counts (E,): each rank learns how many rows each source sends each of
       its local experts, (ep, E / ep);
    3. all-to-all of the rows (autograd: its backward is the reverse all-to-all), regrouped
       from (source, expert) order to (expert, source), each local expert's loop
       (``expert_loop``), back to (source, expert) order, and all-to-all home.

Gradients: a local expert's gradient sums the contributions of every rank's tokens, i.e. of
every rank's loss; DDP and FSDP2 average the other gradients over the ranks, so a hook divides
the experts' by the number of ranks. ep is the whole data-parallel group (ember/train/layout.py
checks it), so no expert is replicated and nothing else needs reducing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.nn.functional import all_to_all_single

from ember.model.moe import Experts, MoE, expert_loop

EXPERT_WEIGHTS = ("w1", "w3", "w2")


class ShardedExperts(Experts):
    """``Experts`` whose weights are this rank's slice of the experts (``apply_ep`` sets the
    class); the forward sends rows to the rank of their expert and back."""

    group: dist.ProcessGroup

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        ep = dist.get_world_size(self.group)
        # (E / ep, ...); in the rows' dtype, as FSDP2's mixed precision gives the weights it manages
        w1, w3, w2 = (getattr(self, w).to_local().to(x.dtype) for w in EXPERT_WEIGHTS)
        n_local = w1.size(0)
        received = torch.empty_like(counts)  # (E,) read as (ep, E / ep): rows from source r for expert e
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(ep, n_local)
        send = counts.view(ep, n_local).sum(dim=1).tolist()  # rows for each rank
        recv = received.sum(dim=1).tolist()
        rows = all_to_all_single(x.new_empty(sum(recv), x.size(1)), x, recv, send, group=self.group)
        order = by_expert(received)  # (source, expert) order -> (expert, source)
        y = expert_loop(rows[order], received.sum(dim=0), w1, w3, w2)[order.argsort()]
        return all_to_all_single(y.new_empty(x.size(0), y.size(1)), y, send, recv, group=self.group)  # (M, C)


def by_expert(received: Tensor) -> Tensor:
    """The permutation that takes rows arriving as (source rank, local expert) segments of
    ``received`` (ep, n_local) rows each to (local expert, source rank) order."""
    counts = received.cpu()  # one copy to the host, not one per segment
    starts = (counts.flatten().cumsum(0) - counts.flatten()).view_as(counts)  # (ep, n_local)
    segments = [
        torch.arange(int(starts[r, e]), int(starts[r, e] + counts[r, e]))
        for e in range(counts.size(1))
        for r in range(counts.size(0))
    ]
    return torch.cat(segments).to(received.device)


def expert_params(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    """The expert-parallel weights, which data parallelism leaves alone."""
    return {getattr(m, w) for m in model.modules() if isinstance(m, ShardedExperts) for w in EXPERT_WEIGHTS}


def apply_ep(model: torch.nn.Module, mesh) -> None:
    """Keep this rank's E / ep experts of every MoE layer, as DTensors on ``mesh`` (1-D)."""
    from torch.distributed.tensor import DTensor, Shard

    group, ep, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    for moe in [m for m in model.modules() if isinstance(m, MoE)]:
        experts = moe.experts
        for name in EXPERT_WEIGHTS:
            full = getattr(experts, name)
            local = full.detach().chunk(ep)[rank].clone()  # every rank built the same full weights
            param = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
            param.register_hook(lambda grad, ep=ep: grad / ep)  # see the module docstring
            setattr(experts, name, param)
        experts.__class__ = ShardedExperts
        experts.group = group
