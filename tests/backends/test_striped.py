"""Multi-rail striping: one gloo group per NIC port, each pair's transfers dealt over them."""

from __future__ import annotations

import pytest
import torch

from hetcomm.backends import HetcommOptions
from tests.backends.ranks import run_ranks

TWO_PORT_NODES = """\
name: two-port-nodes
node_groups:
  - name: a100
    count: 2
    device: {model: A100-SXM4-80GB, count: 2, strong: true}
    fabric: NVLINK
    nics:
      - {class: NET_ROCE_GDR, gbps: 100, count: 2}
interconnect:
  same_vendor: auto
"""


def striped_all_to_all(rank: int, n: int) -> dict:
    import torch.distributed as dist

    import hetcomm

    hetcomm.reset_stats()
    in_splits = [(rank + d + 1) * 7 for d in range(n)]  # uneven, several rows per peer
    out_splits = [(s + rank + 1) * 7 for s in range(n)]
    x = torch.cat([torch.full((c, 3), float(100 * rank + d)) for d, c in enumerate(in_splits)])
    y = torch.empty(sum(out_splits), 3)
    for _ in range(3):  # several collectives: the per-pair counters must stay in step
        dist.all_to_all_single(y, x, out_splits, in_splits)
    expect = torch.cat([torch.full((c, 3), float(100 * s + rank)) for s, c in enumerate(out_splits)])
    stats = hetcomm.stats()
    return {
        "equal": bool(torch.equal(y, expect)),
        "rails": {k: v.get("bytes_sent", 0) for k, v in stats.items()},
    }


@pytest.mark.timeout(120)
def test_cross_node_pairs_use_every_port(tmp_path):
    yaml_path = tmp_path / "two-port.yaml"
    yaml_path.write_text(TWO_PORT_NODES)
    # Both "ports" are loopback here: what is tested is the dealing, the per-port gloo groups and
    # the result; that the ports are different links is shown under `hetcomm emulate`.
    res = run_ranks(
        striped_all_to_all, world_size=4, cluster=str(yaml_path), timeout=90,
        pg_options=HetcommOptions(nic_ifnames=("lo", "lo")),
    )
    for rank, r in enumerate(res):
        assert r["equal"], rank
        rails = r["rails"]
        # ranks 0,1 on node a100-0 and 2,3 on a100-1: shm inside a node, both ports across
        assert rails.get("gloo-nic0", 0) > 0 and rails.get("gloo-nic1", 0) > 0, (rank, rails)
        assert rails.get("gloo", 0) == 0, (rank, rails)


def test_too_few_interfaces_is_a_clear_error(tmp_path):
    yaml_path = tmp_path / "two-port.yaml"
    yaml_path.write_text(TWO_PORT_NODES)
    from tests.backends.ranks import run_ranks_outcomes

    outs = run_ranks_outcomes(
        striped_all_to_all, world_size=4, cluster=str(yaml_path), timeout=60, pg_timeout=10,
        pg_options=HetcommOptions(nic_ifnames=("lo",)),
    )
    for o in outs:
        assert not o.ok
        assert "2 NIC ports" in o.error and "HETCOMM_IFNAMES lists 1" in o.error, o.error
