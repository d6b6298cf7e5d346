"""One vLLM request as the scheduler half sees it: two small state machines, each enforced.

The request's ``Phase``::

    NEW ──begin_lookup──► LOOKING (the server prefetches from L2; vLLM is told "not known yet")
     │                       │ poll: looked
     │ looked                ▼
     └──────────────────► LOOKED (hit_chunks known, locked for the request's session)
                             │ admit (update_state_after_alloc: plan the load of the chunks vLLM
     NEW ──admit─────────────┤  lacks, unlock the ones it has; straight from NEW when no lookup was
     (nothing to look up)    ▼  needed)
                          ADMITTED ──preempt──► NEW   (also from LOOKING or LOOKED)

and, apart from it, what the server holds for the request (``Locks``: its session's lease)::

    NONE ──open_session──► HELD ──plan_load──► PLANNED ──hand_to_workers──► LOADING ──loaded──┐
     ▲                      ▲ ▲                 (op.attempt: a new number)  (a report naming   │
     │                      │ │                                              that attempt)      │
     │                      │ └────────────────────────────────────────────────────────────────┘
     │                      └── renewed by the client's heartbeat while the request is held here
     │                          (waiting in vLLM's queue, or computing a slow step)
     └── close_session (HELD, PLANNED or LOADING): request finished, preempted, lookup failed

A preempted request admitted again goes round once more (NONE -> ... -> LOADING) with a load of a new
attempt, while the workers' report of its earlier load may still be on its way (async scheduling: the
step that ran it is reported after the next schedule). Only a report of the attempt in flight
(``is_loading``) moves LOADING -> HELD and frees the locks: a stale one would free the new session's
locks before its load has read the chunks.

Each transition is a named method that checks the state it leaves and raises IllegalTransition,
changing nothing, from any other. Only the scheduler's thread moves a request (vLLM's scheduler hooks).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvdepot.errors import IllegalTransition
from kvdepot.types import ChunkHash

if TYPE_CHECKING:
    from kvdepot.connectors.vllm.metadata import LoadOp


class Phase(enum.Enum):
    NEW = "new"
    LOOKING = "looking"
    LOOKED = "looked"
    ADMITTED = "admitted"


class Locks(enum.Enum):
    NONE = "none"  # the server keeps no session for the request
    HELD = "held"  # its session holds the request's lookup locks (renewed while it is held here)
    PLANNED = "planned"  # a load of them is planned for the next step
    LOADING = "loading"  # the workers are loading them


@dataclass(slots=True)
class RequestState:
    req_id: str
    request: Any  # vllm Request: its all_token_ids grows as tokens are generated
    salt: str
    eligible: bool
    source_hint: str = ""  # a router's HOST[:PORT] of where this prompt's KV was computed (kv_transfer_params)
    agent_session: str = ""  # the conversation it is a turn of (kv_transfer_params' kvdepot_agent_session)
    root: bytes = b""  # where its hash chain starts: its LoRA adapter's root (adapters.py), b"" for the base model
    media_seen: int = 0  # its media items (vLLM's mm_features) known when its chunks were last hashed
    phase: Phase = Phase.NEW
    locks: Locks = Locks.NONE
    hashes: list[ChunkHash] = field(default_factory=list)  # chained hashes of leading complete chunks
    rank_hits: list[int | None] = field(default_factory=list)
    rank_in_l1: list[int] = field(default_factory=list)  # per rank: chunks of its hit that were in L1
    looked_at: float = 0.0
    hit_chunks: int = 0
    pending_load: LoadOp | None = None  # while PLANNED
    in_flight: LoadOp | None = None  # while LOADING
    load_failed: bool = False  # a load of its hit failed: served uncached from then on (not retried)
    stored_chunks: int = 0  # chunks [0, stored) are in kvdepot or saved by an earlier step
    saves_planned: int = 0  # save ops handed to the workers (async saves: its blocks wait for them)
    preemptions: int = 0  # vLLM's request.num_preemptions when this side last heard of a preemption
    block_ids: list[int] = field(default_factory=list)

    def __repr__(self) -> str:
        return (
            f"RequestState({self.req_id!r}, {self.phase.value}, locks={self.locks.value}, hit={self.hit_chunks}, "
            f"stored={self.stored_chunks}, blocks={len(self.block_ids)})"
        )

    # --- phase ---------------------------------------------------------------------------------------

    def begin_lookup(self) -> None:
        """NEW -> LOOKING: the server is bringing chunks in from L2."""
        self._phase(Phase.NEW, to=Phase.LOOKING)

    def looked(self, hit_chunks: int) -> None:
        """NEW or LOOKING -> LOOKED: the hit is known (0 when the lookup failed or was skipped)."""
        self._phase(Phase.NEW, Phase.LOOKING, to=Phase.LOOKED)
        self.hit_chunks = hit_chunks

    def admit(self) -> None:
        """NEW or LOOKED -> ADMITTED: vLLM gave the request its blocks."""
        self._phase(Phase.NEW, Phase.LOOKED, to=Phase.ADMITTED)

    def preempt(self) -> None:
        """LOOKING, LOOKED or ADMITTED -> NEW: vLLM dropped the request's blocks (its locks must already
        be closed); on re-admission it is looked up afresh."""
        if self.locks is not Locks.NONE:
            raise IllegalTransition(f"{self.req_id}: preempted while the server holds its locks ({self.locks.value})")
        self._phase(Phase.LOOKING, Phase.LOOKED, Phase.ADMITTED, to=Phase.NEW)
        self.block_ids = []

    # --- locks ---------------------------------------------------------------------------------------

    def open_session(self) -> None:
        """NONE -> HELD: a locking lookup is about to be sent under the request's id."""
        self._locks(Locks.NONE, to=Locks.HELD)

    def plan_load(self, op: LoadOp) -> None:
        """HELD -> PLANNED: the load of the chunks vLLM lacks goes to the workers with the next step."""
        self._locks(Locks.HELD, to=Locks.PLANNED)
        self.pending_load = op

    def hand_to_workers(self) -> LoadOp:
        """PLANNED -> LOADING: the planned load goes into this step's metadata."""
        self._locks(Locks.PLANNED, to=Locks.LOADING)
        op, self.pending_load = self.pending_load, None
        assert op is not None
        self.in_flight = op
        return op

    def is_loading(self, attempt: int) -> bool:
        """Whether the workers' report of load ``attempt`` ends this request's load in flight."""
        return self.locks is Locks.LOADING and self.in_flight is not None and self.in_flight.attempt == attempt

    def loaded(self) -> None:
        """LOADING -> HELD: the workers are done reading (they held their own locks meanwhile)."""
        self._locks(Locks.LOADING, to=Locks.HELD)
        self.in_flight = None

    def close_session(self) -> None:
        """HELD, PLANNED or LOADING -> NONE: the server keeps nothing more for the request (it ended the
        session, or it is unreachable and the TTL will)."""
        self._locks(Locks.HELD, Locks.PLANNED, Locks.LOADING, to=Locks.NONE)
        self.pending_load = self.in_flight = None

    def _phase(self, *allowed: Phase, to: Phase) -> None:
        if self.phase not in allowed:
            raise IllegalTransition(f"{self.req_id}: phase {self.phase.value} cannot become {to.value}")
        self.phase = to

    def _locks(self, *allowed: Locks, to: Locks) -> None:
        if self.locks not in allowed:
            raise IllegalTransition(f"{self.req_id}: locks {self.locks.value} cannot become {to.value}")
        self.locks = to
