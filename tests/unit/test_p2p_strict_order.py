"""StrictP2P judges a group's sends to one peer in posting order, whatever order their
watcher threads flag their ready tokens in (the threads race; gloo matched the tokens in order)."""
import pytest
import torch

from h3t_ext.runtime.pipeline import p2p_strict
from h3t_ext.runtime.pipeline.p2p_strict import P2POrderError, StrictP2P, _Group, _Op


class _Flag:
    def __init__(self, done):
        self._done = done

    def done(self):
        return self._done

    def result(self, rank, what):
        return None


def _send(peer, tag, what, token_tag, ready):
    op = _Op(True, torch.zeros(2), peer, tag, what)
    op.token = torch.tensor([token_tag], dtype=torch.int64)
    op.ready = _Flag(ready)
    return op


@pytest.fixture
def posted(monkeypatch):
    sent = []
    monkeypatch.setattr(p2p_strict.dist, "isend", lambda tensor, group, group_dst, tag: sent.append((group_dst, tag)))
    monkeypatch.setattr(StrictP2P, "_watch", lambda self, work: _Flag(False))
    return sent


def _strict():
    return StrictP2P(group=None, rank=0, comm="group", timeout_s=1.0)


def test_a_later_send_flagged_first_waits_for_the_earlier_send_to_the_same_peer(posted):
    # send mb1 carries the token of the peer's second receive (its own tag), flagged before mb0's
    g = _Group(0, ops=[_send(1, 1, "mb0", 1, ready=False), _send(1, 2, "mb1", 2, ready=True)])
    assert not _strict()._advance(g)
    assert posted == [] and all(op.data is None for op in g.ops)


def test_the_crossed_order_error_names_the_first_send_even_when_the_second_is_flagged_first(posted):
    strict = _strict()
    g = _Group(0, ops=[_send(1, 1, "mb0", 2, ready=False), _send(1, 2, "mb1", 1, ready=True)])
    strict._advance(g)  # mb1's watcher won the race: nothing is judged yet
    g.ops[0].ready = _Flag(True)
    with pytest.raises(P2POrderError, match=r"^pipeline rank 0: send mb0 to pipeline rank 1 would be matched"):
        strict._advance(g)
    assert posted == []


def test_sends_to_other_peers_are_not_held_back(posted):
    g = _Group(0, ops=[_send(1, 1, "to 1", 1, ready=False), _send(2, 1, "to 2", 1, ready=True)])
    _strict()._advance(g)
    assert posted == [(2, 1)]
    assert g.ops[0].data is None and g.ops[1].data is not None
