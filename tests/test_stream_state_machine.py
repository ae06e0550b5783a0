"""A hypothesis state machine drives ExpertStream's primitives in random orders, with manual IO
so that the test decides the order in which part reads land, and checks the invariants
I1-I10 of docs/architecture.md after every step against a small pure-Python model of the rules.

The model does not re-implement slot choice (that is the engine's business); it keeps what the
rules fix: which keys are published, protected, pinned, parked, and what each step may change.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from conftest import record_bytes_of
from strata_stream import ExpertStream, ReadClass, SlotState, StreamConfig, _core, testing
from strata_stream.errors import ArenaFullError, ExpertReadError
from strata_stream.stream import ABSENT

L, E, K = 4, 8, 2  # layers, experts, top-k of the pack below


class StreamMachine(RuleBasedStateMachine):
    pack_path: Path

    @initialize(
        n_slots=st.integers(2 * K, 12),
        publish_prefetch=st.booleans(),
    )
    def start(self, n_slots: int, publish_prefetch: bool) -> None:
        stride = _stride(self.pack_path)
        self.s = ExpertStream(
            self.pack_path,
            StreamConfig(
                arena_bytes=n_slots * stride,
                io_threads=0,
                part_bytes=16384,
                direct_io=False,
                publish_prefetch=publish_prefetch,
            ),
        )
        self.publish_prefetch = publish_prefetch
        self.layout = self.s._s.layout
        self.executing: int | None = None
        self.keep: set[int] | None = None  # executing layer's protected experts (None: all)
        self.next_protected: int | None = None
        self.pinned: dict[int, int] = {}  # key -> slot pinned by the current plan
        self.records: dict[int, bytes] = {}

    def teardown(self) -> None:
        if hasattr(self, "s"):
            self.s.close()

    # ---- helpers -------------------------------------------------------------------------
    def table(self) -> dict[str, np.ndarray]:
        return self.s.slot_table()

    def published(self) -> dict[int, int]:
        smap = testing.smap(self.s)
        return {int(k): int(smap[k]) for k in np.flatnonzero(smap != ABSENT)}

    def present(self) -> dict[int, int]:
        t = self.table()
        return {int(k): i for i, k in enumerate(t["key"]) if t["state"][i] != SlotState.FREE}

    def is_protected(self, key: int, speculative: bool) -> bool:
        layer, expert = divmod(key, E)
        if self.executing is not None:
            if layer == self.executing and (
                speculative or self.keep is None or expert in self.keep
            ):
                return True
            if speculative and layer == self.executing + 1:
                return True  # I9
        return layer == self.next_protected

    def protected_resident(self, speculative: bool) -> dict[int, int]:
        """key -> slot of every resident key that eviction must not touch (I4, I8, I9)."""
        t = self.table()
        keep = {}
        for i, k in enumerate(t["key"]):
            state = t["state"][i]
            if state in (SlotState.FREE, SlotState.LIMBO):  # limbo is unpublished: fair game
                continue
            in_flight = t["parts_started"][i] != t["parts_done"][i]
            if (
                self.is_protected(int(k), speculative)
                or in_flight
                or t["pins"][i]
                or state in (SlotState.QUEUED, SlotState.READING)
                and t["cls"][i] == ReadClass.URGENT
            ):
                keep[int(k)] = i
        return keep

    def room_for_urgent(self, requested: set[int]) -> int:
        """Slots an urgent request may take for a key it lacks, by the rules (take_slot): free,
        limbo whose reads finished, evictable (complete or failed, nothing in flight, unpinned,
        unprotected), or a queued speculative read it may cancel. Slots holding one of the
        requested keys are not counted: the request keeps those (touches, revives or retries)."""
        t = self.table()
        room = 0
        for i, k in enumerate(t["key"]):
            state = t["state"][i]
            if state == SlotState.FREE:
                room += 1
                continue
            if int(k) in requested:
                continue
            started, done = t["parts_started"][i], t["parts_done"][i]
            idle = started == done
            if state == SlotState.LIMBO:
                room += idle  # parked: its unstarted parts left the IO queue (release_limbo)
            elif state in (SlotState.COMPLETE, SlotState.FAILED):
                room += idle and not t["pins"][i] and not self.is_protected(int(k), False)
            elif state == SlotState.QUEUED and t["cls"][i] != ReadClass.URGENT:
                room += not self.is_protected(int(k), False)
        return room

    def check_arena_full(self, layer: int, experts: list[int], room: int, raised: bool) -> None:
        """ArenaFullError exactly when the request lacked more keys than the rules leave room for
        (with manual IO nothing is in flight to wait for, so the engine cannot wait instead)."""
        present = self.present_before
        need = sum(layer * E + e not in present for e in experts)
        assert raised == (need > room), (
            f"request for layer {layer} experts {experts}: {need} keys to place, room for {room}, "
            f"but ArenaFullError {'was' if raised else 'was not'} raised"
        )

    def record(self, key: int) -> bytes:
        if key not in self.records:
            self.records[key] = record_bytes_of(self.pack_path, self.layout, key)
        return self.records[key]

    # ---- rules ---------------------------------------------------------------------------
    @rule(
        layer=st.integers(0, L - 1),
        experts=st.lists(st.integers(0, E - 1), min_size=1, max_size=K, unique=True),
    )
    def urgent_request(self, layer: int, experts: list[int]) -> None:
        before_pub = self.published()
        keep = self.protected_resident(speculative=False)
        room = self.room_for_urgent({layer * E + e for e in experts})
        self.present_before = self.present()
        try:
            testing.request(self.s, layer, experts)
        except ArenaFullError:
            self.check_arena_full(layer, experts, room, raised=True)
            return
        self.check_arena_full(layer, experts, room, raised=False)
        now = self.present()
        t = self.table()
        for e in experts:  # requested keys are present, urgent, not in limbo
            k = layer * E + e
            assert k in now
            assert t["cls"][now[k]] == ReadClass.URGENT
            assert t["state"][now[k]] != SlotState.LIMBO
        for k, slot in keep.items():  # I4/I8: protected residents untouched
            assert now.get(k) == slot, f"protected key {k} was evicted"
        pub = self.published()
        for k, slot in before_pub.items():  # I3: stays published unless recycled
            if k in pub:
                assert pub[k] == slot
            else:
                assert k not in now or now[k] != slot

    @rule(
        layer=st.integers(0, L - 1),
        experts=st.lists(st.integers(0, E - 1), min_size=1, max_size=4, unique=True),
        cls=st.sampled_from([ReadClass.PRED1, ReadClass.PRED2, ReadClass.PROFILE]),
    )
    def speculative_request(self, layer: int, experts: list[int], cls: ReadClass) -> None:
        before_pub = self.published()
        keep = self.protected_resident(speculative=True)
        testing.request(self.s, layer, experts, urgent=False, cls=cls)
        now = self.present()
        for k, slot in keep.items():  # I9: never evicts the current or next layer
            assert now.get(k) == slot, f"speculation evicted protected key {k}"
        assert (
            self.published().items()
            >= {k: v for k, v in before_pub.items() if now.get(k) == v}.items()
        )
        # I2: a speculative request publishes nothing new.
        assert set(self.published()) <= set(before_pub)

    def _complete(self, index: int) -> None:
        slot, key, _part, cls = testing.pending_io(self.s)[index]
        before_pub = self.published()
        testing.run_io(self.s, index)
        pub = self.published()
        t = self.table()
        if cls != ReadClass.URGENT:  # I2: IO threads never publish speculative reads
            assert pub == before_pub
        elif t["state"][slot] == SlotState.COMPLETE:
            assert pub.get(key) == slot  # an urgent completion publishes

    @rule(data=st.data())
    def complete_a_part(self, data: st.DataObject) -> None:
        jobs = testing.pending_io(self.s)
        if jobs:
            self._complete(data.draw(st.integers(0, len(jobs) - 1), label="job"))

    @rule(order=st.randoms(use_true_random=False))
    def complete_everything(self, order: random.Random) -> None:
        """Every pending read lands, in an order hypothesis picks."""
        while jobs := testing.pending_io(self.s):
            self._complete(order.randrange(len(jobs)))

    @rule(layer=st.integers(0, L - 1))
    def publish(self, layer: int) -> None:
        t = self.table()
        expect = set(self.published())
        if self.publish_prefetch:
            for i, k in enumerate(t["key"]):
                if t["state"][i] == SlotState.COMPLETE and layer + 1 <= int(k) // E <= layer + 2:
                    expect.add(int(k))
        before = set(self.published())
        n = testing.publish(self.s, layer)
        after = set(self.published())
        assert after == expect  # exactly the l+1..l+2 completions; I10 at the last layers
        assert n == len(after - before)

    @rule(
        layer=st.integers(0, L - 1),
        experts=st.lists(st.integers(0, E - 1), min_size=1, max_size=K, unique=True),
        distance=st.sampled_from([1, 2]),
        predicted=st.lists(st.integers(0, E - 1), min_size=1, max_size=K, unique=True),
        order=st.randoms(use_true_random=False),
    )
    def handshake(
        self,
        layer: int,
        experts: list[int],
        distance: int,
        predicted: list[int],
        order: random.Random,
    ) -> None:
        """The Window's at_layer(l) order: urgent ids, publish, then speculation for l+d, with
        earlier speculation landing first so that publication has something to publish."""
        self.enter_layer(layer, experts)
        self.urgent_request(layer, experts)
        self.complete_everything(order)
        self.publish(layer)
        target = layer + distance
        if target < L:  # I10: nothing is requested beyond the last layer
            cls = ReadClass.PRED1 if distance == 1 else ReadClass.PRED2
            self.speculative_request(target, predicted, cls)
            self.complete_everything(order)
            self.publish(layer)

    @rule(layer=st.integers(0, L - 1), expert=st.integers(0, E - 1))
    def cancel(self, layer: int, expert: int) -> None:
        key = layer * E + expert
        t = self.table()
        slot = self.present().get(key)
        cancellable = (
            slot is not None
            and t["state"][slot] == SlotState.QUEUED
            and t["parts_started"][slot] == 0
        )
        assert testing.cancel(self.s, layer, expert) == cancellable  # I6: queued only
        if cancellable:
            assert testing.where(self.s, layer, expert) is None
            assert testing.smap(self.s)[key] == ABSENT

    @rule(
        layer=st.integers(0, L - 1), chosen=st.lists(st.integers(0, E - 1), max_size=K, unique=True)
    )
    def retire_unused_pre(self, layer: int, chosen: list[int]) -> None:
        t = self.table()
        expect = set()
        for i, k in enumerate(t["key"]):
            if (
                t["state"][i] in (SlotState.QUEUED, SlotState.READING, SlotState.COMPLETE)
                and int(k) // E == layer
                and int(k) % E not in chosen
                and t["cls"][i] != ReadClass.URGENT
                and not t["pins"][i]
            ):
                expect.add(i)
        assert testing.retire_unused_pre(self.s, layer, chosen) == len(expect)
        t = self.table()
        smap = testing.smap(self.s)
        for i in expect:  # I7: parked and never published
            assert t["state"][i] == SlotState.LIMBO
            assert smap[int(t["key"][i])] == ABSENT

    @rule()
    def release_limbo(self) -> None:
        t = self.table()
        releasable = {
            i
            for i in range(len(t["key"]))
            # Parking took a limbo slot's unstarted parts out of the IO queue, so once nothing
            # is in flight nothing can land in it later: releasable, read in full or not (I7).
            if t["state"][i] == SlotState.LIMBO and t["parts_started"][i] == t["parts_done"][i]
        }
        assert testing.release_limbo(self.s) == len(releasable)
        t = self.table()
        for i in releasable:  # I5/I7: recycled only after its reads finished
            assert t["state"][i] == SlotState.FREE

    @rule()
    def victim(self) -> None:
        v = testing.victim(self.s)
        t = self.table()
        if v is None:
            return
        k = int(t["key"][v])
        assert not self.is_protected(k, False)  # I4
        assert t["parts_started"][v] == t["parts_done"][v]  # no read in flight
        assert t["pins"][v] == 0  # I8
        assert t["state"][v] in (SlotState.COMPLETE, SlotState.FAILED)
        evicted = testing.evict(self.s)
        assert evicted == v
        assert (
            testing.smap(self.s)[k] == ABSENT and testing.where(self.s, k // E, k % E) is None
        )  # I5

    @rule(
        layer=st.integers(0, L - 1),
        experts=st.none() | st.lists(st.integers(0, E - 1), max_size=K, unique=True),
    )
    def enter_layer(self, layer: int, experts: list[int] | None = None) -> None:
        testing.release_plan(self.s)
        self.pinned.clear()
        testing.enter_layer(self.s, layer, experts)
        self.executing, self.next_protected = layer, None
        self.keep = None if experts is None else set(experts)

    @precondition(lambda self: self.executing is not None)
    @rule()
    def after_layer(self) -> None:
        assert self.executing is not None
        testing.after_layer(self.s, self.executing)
        self.next_protected = self.executing + 1 if self.executing + 1 < L else 0

    @rule()
    def end_turn(self) -> None:
        testing.release_plan(self.s)
        self.pinned.clear()
        testing.end_turn(self.s)
        self.executing = self.next_protected = None
        self.keep = None

    @rule(
        layer=st.integers(0, L - 1),
        experts=st.lists(st.integers(0, E - 1), min_size=1, max_size=K, unique=True),
    )
    def plan(self, layer: int, experts: list[int]) -> None:
        smap = testing.smap(self.s)
        resident = testing.plan(self.s, layer, experts)
        for e, r in zip(experts, resident, strict=True):
            key = layer * E + e
            assert r == (smap[key] != ABSENT)
            if r:
                self.pinned[key] = int(smap[key])

    @rule(
        layer=st.integers(0, L - 1),
        experts=st.lists(st.integers(0, E - 1), min_size=1, max_size=K, unique=True),
    )
    def wait(self, layer: int, experts: list[int]) -> None:
        room = self.room_for_urgent({layer * E + e for e in experts})
        self.present_before = self.present()
        try:
            testing.wait(self.s, layer, experts)
        except ArenaFullError:
            self.check_arena_full(layer, experts, room, raised=True)
            return
        self.check_arena_full(layer, experts, room, raised=False)
        for e in experts:  # waited-for experts are published with the file's bytes
            got = self.s.expert_bytes(layer, e)
            assert got is not None
            assert got.tobytes() == self.record(layer * E + e)

    @rule(layer=st.integers(0, L - 1), expert=st.integers(0, E - 1))
    def failing_wait(self, layer: int, expert: int) -> None:
        if testing.where(self.s, layer, expert) is not None:
            return
        testing.inject_fault(self.s, layer, expert, kind="eio", errno_value=5)
        room = self.room_for_urgent({layer * E + expert})
        self.present_before = self.present()
        try:
            testing.wait(self.s, layer, [expert])
        except ArenaFullError:
            self.check_arena_full(layer, [expert], room, raised=True)
            return
        except ExpertReadError as err:
            assert (err.layer, err.expert) == (layer, expert)  # type: ignore[attr-defined]
            assert err.errno == 5
            assert testing.where(self.s, layer, expert) is None  # the failed slot is recycled
            assert testing.smap(self.s)[layer * E + expert] == ABSENT
            self.check_arena_full(layer, [expert], room, raised=False)
        else:
            raise AssertionError(
                f"wait for layer {layer} expert {expert} returned although its read fails with EIO"
            )
        finally:
            testing.clear_faults(self.s)

    # ---- invariants after every step ------------------------------------------------------
    @invariant()
    def engine_invariants(self) -> None:
        if hasattr(self, "s"):
            assert testing.check_invariants(self.s) == ""

    @invariant()
    def published_slots_hold_their_bytes(self) -> None:  # I1, from outside the engine
        if not hasattr(self, "s"):
            return
        t = self.table()
        for key, slot in self.published().items():
            assert t["state"][slot] == SlotState.COMPLETE and int(t["key"][slot]) == key
            assert testing.slot_bytes(self.s, slot).tobytes() == self.record(key)

    @invariant()
    def pinned_stay_put(self) -> None:  # I8
        if not hasattr(self, "s"):
            return
        smap = testing.smap(self.s)
        for key, slot in self.pinned.items():
            assert smap[key] == slot, f"plan-resident key {key} moved"

    @rule(layer=st.integers(L, L + 2), expert=st.integers(0, E - 1), urgent=st.booleans())
    def request_beyond_the_last_layer(self, layer: int, expert: int, urgent: bool) -> None:
        """The engine itself refuses layers >= L (I10): called below the Python wrapper's check."""
        before = self.table()
        cls = ReadClass.URGENT if urgent else ReadClass.PRED1
        try:
            _core.testing.request(self.s._s, layer, np.array([expert], dtype=np.int32), cls)
        except IndexError as e:
            assert f"layer {layer} out of range" in str(e)
        else:
            raise AssertionError(f"the engine accepted a request for layer {layer} of {L}")
        after = self.table()
        assert all(np.array_equal(before[k], after[k]) for k in ("key", "state", "parts_total"))

    @invariant()
    def nothing_beyond_the_last_layer(self) -> None:  # I10
        if not hasattr(self, "s"):
            return
        t = self.table()
        held = [int(k) for i, k in enumerate(t["key"]) if t["state"][i] != SlotState.FREE]
        assert all(k < L * E for k in held), f"a slot holds key {max(held)} >= {L * E}"
        assert all(key < L * E for _slot, key, _part, _cls in testing.pending_io(self.s))
        assert len(testing.smap(self.s)) == L * E


def _stride(path: Path) -> int:
    from strata_stream import ExpertPack

    with ExpertPack.open(path) as p:
        return p.record_stride


@pytest.fixture(scope="module")
def machine_pack(make_pack):  # type: ignore[no-untyped-def]
    # hidden 64 x 48 f32 matrices: a ~37 KiB record, so three 16 KiB parts per expert.
    return make_pack(n_layers=L, n_experts=E, top_k=K, hidden=64, moe_intermediate=48)


def test_stream_state_machine(machine_pack: Path) -> None:
    StreamMachine.pack_path = machine_pack
    run = StreamMachine.TestCase()
    run.settings = settings(
        # STRATA_MACHINE_EXAMPLES=5000 for a deeper search than CI's.
        max_examples=int(os.environ.get("STRATA_MACHINE_EXAMPLES", "120")),
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    run.runTest()


class _FirstJob:
    """Stands in for hypothesis's data object: always draws the first pending job."""

    def draw(self, strategy: Any, label: str | None = None) -> int:
        return 0


def _replay(machine_pack: Path, steps: Callable[[StreamMachine], None]) -> None:
    StreamMachine.pack_path = machine_pack
    m = StreamMachine()
    try:
        steps(m)
        m.engine_invariants()
        m.published_slots_hold_their_bytes()
    finally:
        m.teardown()


def test_an_empty_expert_list_protects_no_expert(machine_pack: Path) -> None:
    # Found by the machine above: enter_layer(l, []) protected all of layer l (an empty
    # vector's data() was taken for "no list"), so an urgent request found no room.
    def steps(m: StreamMachine) -> None:
        m.start(n_slots=4, publish_prefetch=False)
        m.handshake(layer=1, experts=[0], distance=1, predicted=[0, 1], order=random.Random(0))
        m.enter_layer(experts=[], layer=1)
        m.after_layer()
        m.urgent_request(experts=[0, 1], layer=0)

    _replay(machine_pack, steps)


def test_a_partly_read_parked_slot_is_releasable(machine_pack: Path) -> None:
    # Found by the machine above: a speculative read parked after one of its parts landed is
    # released once nothing is in flight (its unstarted parts left the IO queue when parked).
    def steps(m: StreamMachine) -> None:
        m.start(n_slots=4, publish_prefetch=False)
        m.speculative_request(cls=ReadClass.PRED1, experts=[0], layer=0)
        m.complete_a_part(_FirstJob())  # type: ignore[arg-type]
        m.retire_unused_pre(chosen=[], layer=0)
        m.release_limbo()

    _replay(machine_pack, steps)
