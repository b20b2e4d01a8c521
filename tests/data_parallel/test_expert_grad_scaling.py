"""Expert gradients (EP folded onto DP: ``expert_params``) are the local gradient / d whatever the
order of the backward's autograd runs (issue 17): here the replicated parameter's gradient comes in
a first backward call, which completes the DP sync, and the expert's in a second one, as in a
zero-bubble W (one autograd call per boundary node). DDP left such an expert unscaled; ZeRO-2
reopened its sync for it (a second reduce-scatter of zeros)."""
import copy

import torch
import torch.nn as nn

from labkit.comm import CommLog
from labkit.data_parallel import DistributedDataParallel
from labkit.data_parallel.zero2 import ZeroStage2
from labkit.dist import launch

EXPERTS = ["exp.weight", "exp.bias"]


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.rep, self.exp = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x):
        return self.rep(x), self.exp(x)


def _worker(ctx, kind):
    torch.manual_seed(0)
    module = _Two()
    ref = copy.deepcopy(module)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(ctx.rank))
    a, b = ref(x)
    (a.sum() + b.sum()).backward()                       # this rank's local gradients
    if kind == "ddp":
        w = DistributedDataParallel(module, ctx.group, expert_params=EXPERTS)
    else:
        w = ZeroStage2(module, torch.optim.SGD, ctx.group, expert_params=EXPERTS, lr=0.1)
    with CommLog() as log:
        rep, exp = w(x)
        rep.sum().backward()                             # completes the DP sync of the replicated part
        exp.sum().backward()                             # the experts' gradients come after it
        w.finish_grad_sync()
    n_rs = sum(r.kind == "reduce_scatter" for r in log.records)
    return {n: (p.grad.clone(), q.grad.clone()) for (n, p), q in zip(module.named_parameters(), ref.parameters())
            if n in EXPERTS}, n_rs, len(getattr(w, "buckets", []))


def test_expert_grads_scaled_once_after_the_sync_completed():
    for kind in ("ddp", "zero2"):
        for grads, n_rs, n_buckets in launch(_worker, 2, kind, timeout=30):
            for name, (got, local) in grads.items():
                assert torch.allclose(got, local / 2, rtol=1e-6, atol=0), f"{kind}: {name} is not local / d"
            if kind == "zero2":
                assert n_rs == n_buckets, f"zero2: {n_rs} reduce-scatters for {n_buckets} bucket(s): the sync reopened"
