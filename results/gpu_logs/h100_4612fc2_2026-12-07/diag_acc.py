"""Which build is off at d = 128: a one-off diagnostic run on the H100 (diag_acc.log)."""
import torch

import loop_orders as lo
from loop_orders.microkernel import tuning

sdpa = torch.nn.functional.scaled_dot_product_attention
gen = torch.Generator(device="cuda").manual_seed(3)
for n_q, n_k, d in ((1000, 1000, 128), (1024, 1024, 128), (1000, 777, 128)):
    q = torch.randn(2, 4, n_q, d, device="cuda", generator=gen).half()
    k, v = (torch.randn(2, 4, n_k, d, device="cuda", generator=gen).half() for _ in range(2))
    ref = sdpa(q.double(), k.double(), v.double())
    theirs = float((sdpa(q, k, v).double() - ref).abs().max())
    for name, bq, bk, prod in (("q_outer", None, None, None), ("q_outer", 128, 128, "wgmma-ring"),
                               ("q_outer", 128, 64, "mma"), ("dense", None, None, None),
                               ("dense", 64, 64, "mma"), ("kv_outer", 128, 128, None)):
        for count in (False,):
            with tuning.tuned(products=prod):
                res = lo.attention(q, k, v, schedule=name, block_q=bq, block_k=bk, count=count)
                build = str(lo.get_schedule(name).layout(res.problem))
            err = float((res.out.double() - ref).abs().max())
            bad = (res.out.double() - ref).abs().amax(dim=(0, 1, 3))
            rows = torch.nonzero(bad > 2 * theirs).flatten().tolist()
            print(f"{n_q}x{n_k} d={d} {name} {res.problem.block_q}x{res.problem.block_k} {build}"
                  f" count={count}: {err:.2e} (SDPA {theirs:.2e}, ratio {err / theirs:.2f})"
                  f" rows over 2x: {len(rows)} {rows[:6]}{'...' if len(rows) > 6 else ''}",
                  flush=True)
