"""``layer.experts``: the expert store a layer composes (resident or paged, by ``page_budget``),
its interface, and the state-dict keys checkpoints saved before the stores existed rely on."""

from __future__ import annotations

import pytest
import torch

from hetcomm.errors import ConfigError
from hetcomm.moe import MoELayer
from hetcomm.moe.expert_store import ExpertStore, ResidentExperts
from hetcomm.moe.paged_experts import PagedExperts

D, E = 8, 4

#: The keys of ``MoELayer(8, 4, seed=0)``'s state dict as earlier releases saved them (the
#: experts under ``experts.experts.<local index>``): a checkpoint, a snapshot or a DCP restore
#: from before must find every one.
SAVED_KEYS = ["gate.wg.weight", "gate.calibrator.weight", "gate.calibrator.history", "gate.calibrator.num_updates"] + [
    f"experts.experts.{i}.{name}" for i in range(E) for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
]


def test_the_store_follows_page_budget_and_keeps_the_saved_keys():
    resident = MoELayer(D, E)
    paged = MoELayer(D, E, page_budget=0.5)
    assert type(resident.experts) is ResidentExperts and type(paged.experts) is PagedExperts
    assert isinstance(paged.experts, ExpertStore)
    for layer in (resident, paged):
        assert list(layer.state_dict()) == SAVED_KEYS
        assert layer.local_expert_ids == layer.experts.ids == (0, 1, 2, 3)
        assert all(p.hetcomm_expert for p in layer.expert_parameters())
    paged.load_state_dict(resident.state_dict())  # a resident layer's checkpoint loads into a paged one
    x = torch.randn(6, D)
    assert torch.equal(resident(x), paged(x))
    assert paged.pager is not None
    paged.pager.close()


def test_a_resident_store_answers_the_paging_calls_with_nothing():
    layer = MoELayer(D, E, page_budget="auto")  # a CPU rank: auto never pages
    assert type(layer.experts) is ResidentExperts and layer.config.page_budget == 0.0
    layer(torch.randn(5, D)).sum().backward()
    assert layer.pager is None and layer.page_stats() == {} and layer.take_migration_requests() == []
    assert layer.warm_pages(torch.ones(E)) == []
    layer.end_page_step()
    layer.sync_pages()
    layer.attach_optimizer(torch.optim.SGD(layer.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match=r"expected \(4,\)"):
        layer.warm_pages(torch.ones(E + 1))


def test_the_store_interface_is_declared():
    with pytest.raises(TypeError, match="abstract"):
        ExpertStore([], [])  # type: ignore[abstract]
