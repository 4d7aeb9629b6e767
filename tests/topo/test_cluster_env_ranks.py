"""``$HETCOMM_CLUSTER`` reaches every rank (issue 14 item 8): a hostile cluster file makes every
rank of a real hetcomm group fail with the same ConfigError, quickly, instead of hanging or
exhausting memory in each of them."""

from __future__ import annotations

from tests.backends.ranks import run_ranks_outcomes
from tests.topo.test_yaml_bounds import alias_bomb


def _never_reached(rank: int, world_size: int) -> None:
    raise AssertionError("init_process_group should have refused the cluster file")


def test_alias_bomb_in_hetcomm_cluster_fails_on_every_rank(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    outcomes = run_ranks_outcomes(_never_reached, world_size=2, cluster=str(path), timeout=120, pg_timeout=30)
    for o in outcomes:
        assert o.error_type == "ConfigError", (o.rank, o.error_type, o.error, o.traceback)
        assert f"{path}:2" in o.error and "aliases expand" in o.error
