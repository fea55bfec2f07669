"""When the disk tier saves a slot and when it restores an archive: figures in, decision out.

No I/O: `cacheproxy.disk.tier` measures the rates, asks these functions, and talks to the server
and the archive store.

Costs are counted in what the requests in flight wait, summed over them (slot-milliseconds):
llama-server saves and restores inside its main loop, so a save or restore of `ms` makes every
slot busy at that moment wait `ms`; a prompt token costs the server `prefill_ms_per_token` of
that loop (its throughput across a batch, not one request's share of a shared batch), which
every busy slot waits as well. A save or restore on a request's path also makes that request
wait for the round trip (`*_overhead_ms`), and only that request. Beside busy slots it waits
first for the batch under way (the server spends that time on the others), and its request,
sent once it has answered, waits for the next batch again: a prompt sent alone waits for one
batch, a prompt behind a save or restore for two. That extra wait (`batch_wait_ms`, measured)
is the request's own cost of the action whenever other slots are busy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from cacheproxy.disk.blocks import BLOCK_TOKENS


@dataclass(frozen=True)
class Evicted:
    """What a slot held before a request was placed on it."""

    n_tokens: int  # at least this many (a tail of unknown length counts as none)
    kept: int  # tokens of it the new request keeps (its shared prefix; 0 when isolated)
    owner: str | None  # the tenant whose text it is; None: nobody known


def worth_saving(evicted: Evicted, min_tokens: int) -> bool:
    """Save a slot about to be overwritten when it is long enough, would lose at least a block
    (a restore matches whole blocks, and the slot keeps the rest) and is somebody's. The caller
    then skips it if an archive already holds all of it (a lookup: not this function's job)."""
    if evicted.owner is None:
        return False
    return evicted.n_tokens >= min_tokens and evicted.n_tokens - evicted.kept >= BLOCK_TOKENS


@dataclass(frozen=True)
class RestoreCosts:
    """Measured on the upstream: how fast it prefills and how fast it reads an archive."""

    prefill_ms_per_token: float  # the server's, across a batch
    restore_bytes_per_ms: float
    restore_overhead_ms: float  # the round trip around a restore, whatever its size
    busy_slots: float = 0.0  # other slots busy meanwhile: each waits for the read or prefill
    # how fast the proxy puts a slot file together from blocks (only the request waits)
    assemble_bytes_per_ms: float = float("inf")
    # beside busy slots, the batch the request's prompt waits for once more after the read
    batch_wait_ms: float = 0.0


def restore_pays(
    gain_tokens: int, restored_bytes: int, costs: RestoreCosts, assembled: bool = False
) -> bool:
    """Restore when reading the `restored_bytes` (the archive's file, or the prefix of it put
    together from blocks when `assembled`) costs less than prefilling the tokens it adds over
    what the slot would reuse anyway. The read and the prefill hold up every busy slot alike;
    the round trip and the putting together only the request."""
    if gain_tokens < BLOCK_TOKENS:
        return False
    waiting = 1 + max(costs.busy_slots, 0.0)
    restore_cost = restore_cost_ms(restored_bytes, costs, assembled)
    return restore_cost < gain_tokens * costs.prefill_ms_per_token * waiting


@dataclass(frozen=True)
class Restorable:
    """A tenant's archive as the disk tier would restore it into a slot of one upstream for a
    request: the prompt tokens it gives, and what restoring them costs (`restore_cost_ms`)."""

    tokens: int
    cost_ms: float


def restore_cost_ms(restored_bytes: int, costs: RestoreCosts, assembled: bool = False) -> float:
    """What a restore of `restored_bytes` costs, in the units of a prefill's (`restore_pays`)."""
    waiting = 1 + max(costs.busy_slots, 0.0)
    read_ms = restored_bytes / max(costs.restore_bytes_per_ms, 1e-9)
    restore_cost = costs.restore_overhead_ms + read_ms * waiting
    if assembled:
        restore_cost += restored_bytes / max(costs.assemble_bytes_per_ms, 1e-9)
    if costs.busy_slots > 0:
        restore_cost += costs.batch_wait_ms  # the prompt goes out a batch later
    return restore_cost


def restore_read(
    archive_bytes: int,
    archive_tokens: int,
    n_tokens: int,
    kept: tuple[bool, bool],
    costs: RestoreCosts,
) -> tuple[int, bool]:
    """What a restore of `n_tokens` of an archive reads, and whether that is put together from
    blocks first. `kept`: whether the archive is kept as blocks, and with its whole copy. A
    whole file is read whole; a block archive's prefix is put together, or its whole copy read
    where that costs less at the measured rates (all or most of it: the server reads a whole
    file about as fast as the proxy puts one together)."""
    blocks, whole_copy = kept
    if not blocks:
        return archive_bytes, False
    prefix = max(archive_bytes * min(n_tokens, archive_tokens) // archive_tokens, 1)
    if whole_copy and restore_cost_ms(archive_bytes, costs) < restore_cost_ms(prefix, costs, True):
        return archive_bytes, False
    return prefix, True


@dataclass(frozen=True)
class MoveCosts:
    """Measured: how fast the server holding the conversation saves, how fast the server the
    request was placed on restores and prefills."""

    prefill_ms_per_token: float  # here
    save_bytes_per_ms: float  # there
    save_overhead_ms: float
    restore_bytes_per_ms: float  # here
    restore_overhead_ms: float


def move_pays(gain_tokens: int, state_bytes: float, costs: MoveCosts) -> bool:
    """Move a conversation from an idle slot of another server (save it there, restore it
    here) when the save and the restore together cost less than prefilling here the tokens it
    adds. The request is here because the router found the other server's wait or load worse
    than a prefill here; the move makes that prefill cheaper still."""
    if gain_tokens < BLOCK_TOKENS:
        return False
    save_ms = costs.save_overhead_ms + state_bytes / max(costs.save_bytes_per_ms, 1e-9)
    restore_ms = costs.restore_overhead_ms + state_bytes / max(costs.restore_bytes_per_ms, 1e-9)
    return save_ms + restore_ms < gain_tokens * costs.prefill_ms_per_token


@dataclass(frozen=True)
class DiskRates:
    """What the disk and the server cost now: moving averages of real saves, restores and
    prefills on one upstream (`cacheproxy.upstreams.rates`), never constants."""

    prefill_ms_per_token: float  # the server's, across a batch (see the module docstring)
    save_bytes_per_ms: float
    restore_bytes_per_ms: float
    restore_overhead_ms: float
    save_overhead_ms: float = 0.0  # what a save on a request's path adds for that request
    busy_slots: int = 0  # other slots busy now: each waits for a save made now
    busy_at_return: float = 0.0  # other slots usually busy when a request is placed
    # False: no prompt has measured the server's prefill yet, `prefill_ms_per_token` is a guess
    prefill_measured: bool = True
    # False: too few saves have measured the disk's writes, `save_bytes_per_ms` is a guess
    # or may be one outlier
    save_measured: bool = True
    # archives are kept as blocks: a restore is put together first, which the request waits
    # for (at this rate); infinite: kept as whole files, read as they are
    assemble_bytes_per_ms: float = float("inf")
    # archives cut into blocks keep their whole copies (while the budget has room): the return
    # of a conversation reads its copy, not a file put together
    whole_copies: bool = False
    # beside busy slots, what a save or restore waited for the batch under way: its request's
    # prompt, sent after it, waits for a batch once more (the module docstring)
    batch_wait_ms: float = 0.0

    def restore_costs(self) -> RestoreCosts:
        return RestoreCosts(
            self.prefill_ms_per_token,
            self.restore_bytes_per_ms,
            self.restore_overhead_ms,
            self.busy_slots,
            self.assemble_bytes_per_ms,
            self.batch_wait_ms,
        )


@dataclass(frozen=True)
class SaveCandidate:
    """A slot the disk tier could save, and what says whether its conversation comes back."""

    evicted: Evicted
    # what the server writes (tokens times the measured bytes per token): the whole state,
    # however much of it an archive holds already (cut into blocks, only the rest is kept)
    bytes: int
    idle_s: float  # since the slot was last used
    turns: int  # requests of this conversation the slot has served in a row
    # what the owner's quota still allows before older archives of its own must leave (None:
    # no quota); a speculative save never pushes out an archive that is already there
    quota_headroom_bytes: int | None
    ahead: bool  # saved in the background, before anyone needs the slot
    # tokens of it an archive of the owner already holds (a prefix): only the rest is at stake
    archived_tokens: int = 0
    # the chance the state is gone when the conversation comes back unless saved now: 1 for a
    # slot about to be overwritten with no other copy; less when the server's RAM cache keeps
    # it (that copy dies with a restart, and under others' load)
    loss_chance: float = 1.0
    # the request that would wait for the save is another tenant's: it could time the save,
    # and so the size of a conversation that is not its own
    timed_by_other_tenant: bool = False
    # where its text branched off the text its request reused (another question on the same
    # document), and how often its owner's requests continue the whole text they reuse rather
    # than branch off it: a return is expected to reuse the one or the other
    returns_with: int | None = None  # None: nothing known to branch, all of it is at stake
    continues: float = 1.0


@dataclass(frozen=True)
class SaveModel:
    min_tokens: int
    return_half_life_s: float  # a conversation idle this long is half as likely to come back
    always: bool = False  # save whatever is worth keeping and not archived, whatever it costs


SAVE = "save"
BUSY = "busy"  # worth saving, but not while this many slots wait for the write


def return_chance(idle_s: float, turns: int, half_life_s: float) -> float:
    """How likely the conversation is to come back: the more turns it has had, the likelier
    another; the longer it has been idle, the less likely."""
    by_turns = (turns + 1) / (turns + 2)  # one turn: 2/3; ten: 11/12
    return by_turns * 0.5 ** (max(idle_s, 0.0) / half_life_s)


def decide_save(candidate: SaveCandidate, rates: DiskRates, model: SaveModel) -> str:
    """`SAVE`, or why not: the one decision for saves at eviction and ahead of it.

    Saving pays when the prefill a restore would spare (of what a return would reuse and no
    archive holds), weighed by the chance the conversation comes back, exceeds what the write
    costs the requests in flight: the server's loop decodes nothing meanwhile, so every busy
    slot waits for it, and a save on a request's path makes that request wait too. A state
    whose restore would cost more than its prefill is never worth a save; one that would be
    worth it were fewer slots busy is `"busy"` (worth trying again when the server is
    quieter). Another tenant's request never waits for a save: how long it waited would tell
    the size of a conversation not its own (`"other_tenant"`; what archiving ahead covered is
    kept all the same)."""
    evicted = candidate.evicted
    if evicted.owner is None:
        return "nobody"
    if not worth_saving(evicted, model.min_tokens):
        return "too_short"
    # the whole file counts against the quota until it is cut into blocks
    if candidate.ahead and (
        candidate.quota_headroom_bytes is not None
        and candidate.bytes > candidate.quota_headroom_bytes
    ):
        return "no_room"
    if candidate.timed_by_other_tenant and not candidate.ahead:
        return "other_tenant"
    n_tokens = evicted.n_tokens
    # what a return would reuse of it, and of that what an archive holds already
    reused: float = n_tokens
    if candidate.returns_with is not None:
        branch = min(candidate.returns_with, n_tokens)
        reused = candidate.continues * n_tokens + (1 - candidate.continues) * branch
    archived = min(max(candidate.archived_tokens, 0), reused)
    if reused <= archived:
        return "archived"  # a return would reuse no more than an archive holds
    if model.always:
        return SAVE
    measured = rates.prefill_measured and rates.save_measured
    if not measured and not candidate.ahead and candidate.loss_chance >= 1:
        # the only copy, and its write weighed by a guess (of the prefill it spares, or of
        # the write itself): a guess that prices prefill low or the write high would lose it
        # for good, a save costs one write and measures the disk
        return SAVE
    # when the conversation comes back, its read or its prefill holds up the slots busy then
    at_return = 1 + max(rates.busy_at_return, 0.0)
    read_ms_per_byte = 1 / max(rates.restore_bytes_per_ms, 1e-9)
    # a restore from blocks is put together first: the returning request waits for that too
    # (not for a whole copy, which the return reads)
    made_ms_per_byte = 0.0 if rates.whole_copies else 1 / max(rates.assemble_bytes_per_ms, 1e-9)
    restore_ms_per_byte = read_ms_per_byte * at_return + made_ms_per_byte
    restore_cost = rates.restore_overhead_ms + candidate.bytes * restore_ms_per_byte
    # beside slots busy at the return, its prompt goes out a batch after the read
    restore_cost += rates.batch_wait_ms * min(max(rates.busy_at_return, 0.0), 1.0)
    # without this save the conversation comes back from the archive it has (if any) and
    # prefills the rest: the save spares that, less the longer read
    without_cost = (reused - archived) * rates.prefill_ms_per_token * at_return
    if archived:
        archived_bytes = candidate.bytes * archived / n_tokens
        without_cost += rates.restore_overhead_ms + archived_bytes * restore_ms_per_byte
    if restore_cost >= without_cost:
        return "restore_loses"
    chance = return_chance(candidate.idle_s, candidate.turns, model.return_half_life_s)
    spared = chance * candidate.loss_chance * (without_cost - restore_cost)
    write_ms = candidate.bytes / max(rates.save_bytes_per_ms, 1e-9)
    # who waits for the write: every other busy slot, and the evicting request on its path
    # (beside busy slots, its prompt then goes out a batch later)
    on_path = 0 if candidate.ahead else 1
    batch_wait = rates.batch_wait_ms if rates.busy_slots > 0 else 0.0
    quiet_cost = (write_ms + rates.save_overhead_ms + batch_wait) * on_path
    if spared <= quiet_cost + write_ms * max(rates.busy_slots, 0):
        return BUSY if spared > quiet_cost and rates.busy_slots > 0 else "not_worth"
    return SAVE


# the room a write beside the lookup needs, in states of its size: itself, and what may take
# room meanwhile without a reservation, each about as large: the cut under way and the restores
# being put together (the store cuts one archive at a time and puts two restores together)
ROOM_FOR_WRITE_BESIDE = 4


def write_beside_lookup(
    decision: str, state_bytes: int, rates: DiskRates, lookup_ms: float, spare_bytes: int | None
) -> bool:
    """Whether the server may write an evicted slot's file while the store looks up what an
    archive holds of it and reserves its room (one turn of the store's worker, `lookup_ms` as
    measured), rather than after: the request on whose path the save is then waits for the
    longer of the two, not both. `decision` is the model's on the slot with nothing archived
    (`decide_save`): only a save it makes is begun early, and the lookup may still turn it down
    (an archive holds it, a quota refuses it). The write is then lost time, for the request and
    every busy slot alike (the server's loop does nothing else meanwhile): begun early only
    when that loss, at worst, is no more than the wait it spares the request. And only where
    the file system has room to spare for it and for what else may take room meanwhile
    (`ROOM_FOR_WRITE_BESIDE`; `spare_bytes`: beyond the saves reserved, the free space kept and
    other such writes; None: not known): written before its room is reserved, it must not take
    the room a save, a cut or a restore counted on."""
    if decision != SAVE or lookup_ms <= 0:
        return False
    if spare_bytes is None or spare_bytes < ROOM_FOR_WRITE_BESIDE * state_bytes:
        return False
    write_ms = state_bytes / max(rates.save_bytes_per_ms, 1e-9)
    return write_ms * (1 + max(rates.busy_slots, 0)) <= lookup_ms


# How many of a restored file's last tokens a request may leave out and still get the server's
# own answer from it where the state goes on after the KV cache (`restore_is_whole`)
WHOLE_STATE_SLACK = 1


def restore_is_whole(gap: int, state_after_kv: bool) -> bool:
    """Whether a restore of a file `gap` tokens longer than what the request reuses of it gives
    the server's own answer. A server whose state goes on after its KV cache (a sliding-window
    model's window cells, a hybrid model's recurrent state) restores it whole. A sliding-window
    file keeps the cells of the last `n_swa` positions (`llama_kv_cache::state_write`), and the
    first token computed after it attends over the `n_swa` positions up to its own: all there
    when it comes at most one position before the file's end. A request that branches off
    earlier gets nothing of it (the server's own check, server-context.cpp's `pos_min_thold`),
    or with `--swa-full` its sliding layers attend over a window missing its first cells:
    another answer. (A recurrent state is reused only at the file's very end, which the server
    checks itself: a restore one token short is recomputed, never wrong.)"""
    return gap <= WHOLE_STATE_SLACK or not state_after_kv


# Before the tier stops archiving from a server process none of whose restores was ever reused:
# restores recomputed whole all the same (one could be a fault; two on a server that never reused
# one are its model: a sliding-window model run without `--swa-full`), or requests that branched
# off an archive of a state restored whole or not at all (`restore_is_whole`: what such a
# workload's archives are good for, none of them restored), counted together.
RESTORES_TO_JUDGE = 2
BRANCHES_TO_JUDGE = 8

CARRIED, LOST, BRANCHED = "carried", "lost", "branched"
RestoreOutcome = Literal["carried", "lost", "branched"]


@dataclass(frozen=True)
class RestoreYield:
    """What the requests that found an archive on one server process made of it."""

    carried: int = 0  # restored, and the server reused something of it
    lost: int = 0  # restored, and the server recomputed the whole prompt
    branched: int = 0  # not restored: the request branched off a state restored whole only


def restore_seen(seen: RestoreYield, outcome: RestoreOutcome) -> RestoreYield:
    """`seen` with one more request of `outcome`."""
    return replace(seen, **{outcome: getattr(seen, outcome) + 1})


def restores_carry(seen: RestoreYield) -> bool:
    """Whether archiving from a server process is worth going on with. llama-server recomputes
    the whole prompt after a restore when its memory cannot be taken up from the file: a
    sliding-window model's file holds only the window's cells of the sliding layers, and the
    server wants one more than that (`pos_min_thold`) unless started with `--swa-full`. Where
    restores carry nothing, or the requests branch off archives that may not be restored in
    part, every save there is work for nothing: give up before long (`RESTORES_TO_JUDGE`,
    `BRANCHES_TO_JUDGE`) while no restore was ever reused."""
    if seen.carried > 0:
        return True
    return seen.lost < RESTORES_TO_JUDGE and seen.lost + seen.branched < BRANCHES_TO_JUDGE
