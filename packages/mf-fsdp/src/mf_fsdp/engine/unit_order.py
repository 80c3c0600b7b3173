"""Agreeing on a new units' order when a rank runs a unit before one that came first.

[Note: ranks that skip units] Every rank walks the FSDP units in one order
(``engine/hooks.py``: first the registration order, then as agreed, ``_reorder``)
and issues each unit's collectives in it: a unit it skips gets, in the same place,
the gathers and releases (forward) and the gathers, zero-grad reductions and
releases (backward) a rank running it issues (``_stand_in_forward``,
``_finish_before``). So every rank issues the same collectives, windows and
coalesced batches included, whichever units it ran. A unit run again while
gathered (``_may_run_again``) issues nothing, so ranks may run it unequally often;
run again after release, all ranks must. The order starts as the registration
order; a model whose forward calls its units in another order, the same on every
rank (a decoder registered before its encoder, block 2 called before block 1),
makes every rank meet a unit behind its walk at the same call. There the ranks agree on a new order
(:class:`OrderAgreement`) and keep it for the following steps, so a step that
repeats the previous one costs nothing.

[Note: agreeing on an order] Each rank that meets such a unit posts, to the
default process group's store, where its walk is and the units it ran in this
forward followed by that unit (its *chain*), and waits for the other ranks of
its data-parallel group to post theirs. When all have, each computes the same
result from the same posts (:func:`merge_chains`): the new order runs first
the units any rank ran, then the units that came early, then the others,
keeping every chain's order and otherwise the old order. Ranks that skipped
different units agree as well, as long as each met the change at the same
place of its walk: a rank further on has issued a gather the others have not,
and waits in it. They cannot agree, and every rank stops with
``UnitOrderError``, when their walks stand at different places, when their
chains contradict each other (two ranks ran two units in opposite orders), or
when a rank does not post within a quarter of the process group's timeout (30 s
at most): it
kept the old order (it ran the units in the old order, or skipped the units
that changed). No collective runs here, and nothing runs on a rank that never
meets a unit behind its walk.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Mapping, Sequence

import torch.distributed as dist

__all__ = ["Chain", "OrderAgreement", "merge_chains"]

_WAIT_SHARE = 4
_WAIT_MAX = 30.0
"""A rank waits for the other ranks' posts a quarter of the process group's timeout (the
store's, which ``init_process_group`` sets to it), at most ``_WAIT_MAX`` seconds, before it
concludes that they kept the old order: long enough for ranks that meet one change apart in
time (a late batch, a first step's compilation), short enough that the peers, stuck in a
collective, get its message before their collective times out, and that a program whose
ranks run units in contradicting orders stops in seconds, not in minutes (gloo's default
timeout is 30 minutes)."""

_POLL = 0.01
_SERIAL = itertools.count()
"""Tells apart the agreements of several engines built in one process (in the same order on
every rank, as their collectives require)."""

Chain = tuple[int, tuple[str, ...]]
"""A rank's post: its walk's position, and the names of the units it ran in this forward
followed by the unit that came early."""


def merge_chains(old: Sequence[str], chains: Mapping[int, Chain]) -> tuple[list[str], int] | str:
    """The new order and the length of its part already run, or why the chains disagree.

    ``old`` is the current order (unit names); ``chains`` every rank's post, by rank. Pure:
    every rank computes the same result from the same posts.
    """
    places = {rank: place for rank, (place, _) in chains.items()}
    if len(set(places.values())) > 1:
        return f"the ranks' walks stood at different units (rank: units walked, {places})"
    ran = {unit for _, chain in chains.values() for unit in chain[:-1]}
    early = {chain[-1] for _, chain in chains.values()}
    for rank, (_, chain) in chains.items():
        if chain[-1] in ran:
            return f"unit {chain[-1]!r}, early on rank {rank}, had already run on another rank"
    before: dict[str, set[str]] = {unit: set() for unit in old}
    for _, chain in chains.values():
        for first, then in itertools.pairwise(chain):
            before[then].add(first)
    place_of = {unit: place for place, unit in enumerate(old)}
    order: list[str] = []
    placed: set[str] = set()
    while len(order) < len(old):
        ready = [u for u in old if u not in placed and before[u] <= placed]
        # Never empty: each chain ran in the old order up to its last unit, which no
        # chain ran before it (checked above), so the chains cannot form a cycle.
        assert ready  # internal invariant
        unit = min(ready, key=lambda u: (u not in ran, u not in early, place_of[u]))
        order.append(unit)
        placed.add(unit)
    return order, len(ran)


class OrderAgreement:
    """The rendezvous of one engine's data-parallel ranks on the store (see the Note).

    Args:
        store: the default process group's store (None: only a group of one can agree).
        peers: the global ranks of the data-parallel group, this rank among them.
    """

    def __init__(self, store: dist.Store | None, peers: Sequence[int]) -> None:
        self._store = store
        self._peers = list(peers)
        self._rank = dist.get_rank() if dist.is_initialized() else self._peers[0]
        self._prefix = f"mf_fsdp/unit_order/{next(_SERIAL)}/{'-'.join(map(str, self._peers))}"
        self._round = itertools.count()
        # Store.timeout is a property at run time that torch's stubs leave out.
        timeout = None if store is None else store.timeout  # type: ignore[attr-defined]
        self._wait = (
            0.0 if timeout is None else min(timeout.total_seconds() / _WAIT_SHARE, _WAIT_MAX)
        )

    def new_order(self, old: Sequence[str], post: Chain) -> tuple[list[str], int] | str:
        """Exchange ``post`` and merge every rank's chain into the new order (see the Note).

        Returns the order and the length of its part already run, or why the ranks
        cannot agree (to follow "unit X ran after unit Y, which comes after it").
        """
        posts = self.exchange(post)
        chains = {rank: chain for rank, chain in posts.items() if chain is not None}
        missing = sorted(set(posts) - set(chains))
        if missing:
            return (
                f", and rank(s) {missing} kept that order (ran those units in it, or skipped "
                "the ones that changed)"
            )
        merged = merge_chains(old, chains)
        return f": {merged}" if isinstance(merged, str) else merged

    def odd(self, post: Chain) -> list[int]:
        """Exchange ``post``; the ranks that posted another one, or none in time."""
        return sorted(rank for rank, got in self.exchange(post).items() if got != post)

    def exchange(self, post: Chain) -> dict[int, Chain | None]:
        """Every peer's post, by rank; None for a peer that posted nothing in time."""
        if len(self._peers) == 1:
            return {self._rank: post}
        if self._store is None:
            return {peer: post if peer == self._rank else None for peer in self._peers}
        prefix = f"{self._prefix}/{next(self._round)}"
        self._store.set(f"{prefix}/{self._rank}", json.dumps(post))
        keys = {peer: f"{prefix}/{peer}" for peer in self._peers}
        deadline = time.monotonic() + self._wait
        # Polled, not store.wait(): a wait that times out logs C++ warnings.
        while not self._store.check(list(keys.values())) and time.monotonic() < deadline:
            time.sleep(_POLL)
        posts: dict[int, Chain | None] = {}
        for peer, key in keys.items():
            if self._store.check([key]):
                place, chain = json.loads(self._store.get(key))
                posts[peer] = (place, tuple(chain))
            else:
                posts[peer] = None
        return posts
