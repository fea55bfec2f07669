"""`cacheproxy bench blocks`: archives as whole slot files against archives as blocks, on the
same states of one real llama-server, every arm in one run.

Every state the server saves is committed to three archive stores over the same folder: one
keeping whole files (`disk.blocks = false`), one cutting them into blocks
(`disk.whole_copies = false`), and one cutting them into blocks and keeping each whole file
beside them as a copy (the default with blocks; the budget here has room for all). So every arm
holds exactly the same trace:

- shared head: `--conversations` conversations of one `--head`-token head (a system prompt and
  tool list) and their own `--tail` tokens, each saved once: the disk bytes each arm holds;
- growing conversation: one conversation of `--turns` turns, saved at every turn: the bytes
  each save keeps (whole: the file; blocks: what no archive held; with copies, the file too),
  and what each arm holds;
- restores of a quarter of an archive and of all of it (`--restores` times each, arms
  alternated): the bytes the server reads and its restore time, the proxy's time putting the
  prefix together, the wait after the server's answer for the blocks' checksums (checked
  meanwhile), the wall time from asking for the file to the server's answer and that check (the
  file given back), and the prompt tokens a follow-up decodes after each arm's restore against a
  prefill of that prefix (the oracle), with the follow-up's greedy answer compared.

`cacheproxy bench blocks [--size small|large|kv-heavy] [--head N] [--tail N]
[--conversations N] [--turns N] [--restores N] [--json]`
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cacheproxy.bench.harness import HOST, BenchmarkError, ProcessSet, progress, table_row
from cacheproxy.disk.archive_types import Archive, unlink_files
from cacheproxy.disk.attached import INITIAL_ASSEMBLE_BYTES_PER_MS, INITIAL_RESTORE_BYTES_PER_MS
from cacheproxy.disk.fingerprint import compatibility_fingerprint
from cacheproxy.disk.policy import RestoreCosts, restore_read
from cacheproxy.disk.store import ArchiveIndex
from cacheproxy.plugins import load_plugin
from cacheproxy.provision.build_server import ensure_llama_server
from cacheproxy.provision.make_model import ensure_model, server_args
from cacheproxy.upstreams.managed import free_port, llama_server_args

TENANT = "t_bench"
FINGERPRINT = compatibility_fingerprint({"bench": "blocks"})
BUDGET_BYTES = 1 << 40  # nothing is evicted: what each arm holds is what it keeps
HEALTH_WAIT_S = 120.0
VOCAB = 32000
# the parts of an archive restored: a request reusing its start, and one reusing all of it
RESTORED_PARTS = {"a quarter": 0.25, "all": 1.0}
# each arm's store: how it keeps archives
ARMS: dict[str, dict[str, bool]] = {
    "whole": {"blocks": False},
    "blocks": {"blocks": True, "whole_copies": False},
    "copies": {"blocks": True, "whole_copies": True},
}
ARM_TITLES = {"whole": "whole files", "blocks": "blocks", "copies": "blocks + whole copies"}


@dataclass(frozen=True)
class BlocksBenchConfig:
    size: str = "kv-heavy"
    head: int = 1024
    tail: int = 192
    conversations: int = 6
    turns: int = 6
    turn_tokens: int = 96
    restores: int = 5
    seed: int = 1


@dataclass
class Figures:
    config: dict[str, Any]
    held: dict[str, dict[str, int]] = field(default_factory=dict)  # workload -> arm -> bytes
    kept_per_save: dict[str, list[int]] = field(default_factory=dict)  # arm -> bytes per turn
    save_stall_ms: list[float] = field(default_factory=list)  # the server's save time per save
    # restored part ("a quarter", "all") -> arm -> figure -> median
    restores: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)


class Server:
    """One llama-server, -np 1, talked to over HTTP."""

    def __init__(self, processes: ProcessSet, config: BlocksBenchConfig, folder: Path) -> None:
        port = free_port(HOST)
        self.url = f"http://{HOST}:{port}"
        self.folder = folder
        ctx = config.head + config.tail + config.turns * config.turn_tokens * 2 + 256
        args = llama_server_args(
            ensure_llama_server(),
            ensure_model(config.size),
            host=HOST,
            port=port,
            parallel=1,
            ctx_size=ctx,
            cache_ram_mib=0,
            slot_save_path=folder,
            extra_args=(*server_args(config.size), "--threads", "1"),
        )
        progress(f"starting llama-server ({config.size})")
        processes.start("llama-server", args)
        deadline = time.monotonic() + HEALTH_WAIT_S
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise BenchmarkError("llama-server did not become healthy")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as answer:
            return json.loads(answer.read())

    def complete(self, prompt: list[int], n_predict: int) -> dict[str, Any]:
        return self.post(
            "/completion",
            {
                "prompt": prompt,
                "n_predict": n_predict,
                "temperature": 0,
                "ignore_eos": True,
                "return_tokens": True,
                "id_slot": 0,
                "cache_prompt": True,
            },
        )

    def slot(self, action: str, file_name: str = "") -> dict[str, Any]:
        return self.post(f"/slots/0?action={action}", {"filename": file_name} if file_name else {})


class Arms:
    """The stores over the server's folder (`ARMS`), fed the same saved states."""

    def __init__(self, folder: Path, work: Path) -> None:
        eviction = load_plugin("eviction", "lru")
        self.stores = {
            arm: ArchiveIndex(folder, work / f"{arm}.db", eviction, BUDGET_BYTES, **options)
            for arm, options in ARMS.items()
        }
        self.whole = self.stores["whole"]

    def close(self) -> None:
        for store in self.stores.values():
            store.close()

    def save(self, server: Server) -> tuple[dict[str, Archive], dict[str, int], float]:
        """Save the slot once; commit the file to every arm (a copy to each but the first) and
        cut it where the arm keeps blocks: the archives, the bytes each arm keeps of this save
        (whole: the file; blocks: the blocks it wrote, and the copy if kept), the server's save
        time."""
        reservations = {
            arm: store.reserve(TENANT, 1, None, None) for arm, store in self.stores.items()
        }
        saved = server.slot("save", reservations["whole"].file_name)
        archives, kept = {}, {}
        for arm, store in self.stores.items():
            reservation = reservations[arm]
            if arm != "whole":
                shutil.copyfile(reservations["whole"].path, reservation.path)
            committed = store.commit(reservation, None, saved["n_written"], FINGERPRINT)
            unlink_files(committed.paths_to_unlink)
            archives[arm], kept[arm] = committed.archive, committed.archive.bytes
            if not store.blocks:
                continue
            conversion = store.convert(committed.archive.id)
            if conversion is None or conversion.kept_whole is not None:
                raise BenchmarkError(f"the saved state was not cut into blocks: {conversion}")
            copy = committed.archive.bytes if conversion.whole_copy else 0
            kept[arm] = conversion.written_bytes + copy
            archives[arm] = store.get(committed.archive.id) or committed.archive
        return archives, kept, saved["timings"]["save_ms"]

    def held(self) -> dict[str, int]:
        """Bytes each arm holds on disk: the bytes its index counts (files, each block once)
        and its whole copies."""
        return {
            arm: store.usage().bytes
            + sum(archive.bytes for archive in store.list() if archive.whole_copy)
            for arm, store in self.stores.items()
        }

    def drop_all(self) -> None:
        for store in self.stores.values():
            for archive in store.list():
                store.remove(archive.id)


def run_blocks_bench(config: BlocksBenchConfig, as_json: bool) -> int:
    with tempfile.TemporaryDirectory(prefix="cacheproxy-blocks-") as workdir:
        work = Path(workdir)
        processes = ProcessSet(work)
        folder = work / "slots"
        folder.mkdir()
        try:
            server = Server(processes, config, folder)
            arms = Arms(folder, work)
            try:
                figures = measure(server, arms, config)
            finally:
                arms.close()
        except BenchmarkError as exc:
            print(f"benchmark failed: {exc}", file=sys.stderr)
            processes.print_log_tails()
            return 1
        finally:
            processes.stop_all()
    if as_json:
        print(json.dumps(asdict(figures), indent=1))
    else:
        print(render(figures))
    return 0


def measure(server: Server, arms: Arms, config: BlocksBenchConfig) -> Figures:
    rng = random.Random(config.seed)
    figures = Figures(asdict(config))

    def tokens(count: int) -> list[int]:
        return [rng.randrange(100, VOCAB) for _ in range(count)]

    head = tokens(config.head)
    progress(f"shared head: {config.conversations} conversations of {config.head}+{config.tail}")
    longest: dict[str, Archive] | None = None
    for _ in range(config.conversations):
        prompt = head + tokens(config.tail)
        server.complete(prompt, 8)
        longest, _, stall = arms.save(server)
        figures.save_stall_ms.append(stall)
    figures.held["shared head"] = arms.held()
    assert longest is not None
    for part, fraction in RESTORED_PARTS.items():
        figures.restores[part] = restore_prefix(server, arms, longest, fraction, config)
    arms.drop_all()

    progress(f"growing conversation: {config.turns} turns, saved at each")
    history: list[int] = []
    figures.kept_per_save = {arm: [] for arm in ARMS}
    for _ in range(config.turns):
        history += tokens(config.turn_tokens)
        server.complete(history, 32)
        archives, kept, stall = arms.save(server)
        history = list(arms.whole.tokens(archives["whole"].id) or [])  # what the slot holds
        for arm, size in kept.items():
            figures.kept_per_save[arm].append(size)
        figures.save_stall_ms.append(stall)
    figures.held["growing conversation"] = arms.held()
    return figures


def restore_prefix(
    server: Server,
    arms: Arms,
    archives: dict[str, Archive],
    fraction: float,
    config: BlocksBenchConfig,
) -> dict[str, dict[str, float]]:
    """Restore `fraction` of the archive from each arm, in turn from a rotating first; a
    follow-up after each, and one after a prefill of that part (the oracle): arm -> figure ->
    median."""
    archive_tokens = arms.whole.tokens(archives["whole"].id)
    assert archive_tokens is not None
    n_tokens = int(len(archive_tokens) * fraction)
    question = list(range(200, 216))
    follow_up = archive_tokens[:n_tokens] + question
    progress(f"restores of {n_tokens} of {len(archive_tokens)} tokens, {config.restores} each")
    server.slot("erase")
    server.complete(archive_tokens[:n_tokens], 0)
    oracle = server.complete(follow_up, 8)
    samples: dict[str, dict[str, list[float]]] = {}
    for round_number in range(config.restores):
        order = [(arm, store, archives[arm]) for arm, store in arms.stores.items()]
        shift = round_number % len(order)
        for arm, store, archive in order[shift:] + order[:shift]:
            server.slot("erase")
            # as the disk tier chooses: the copy where reading it costs less at the rates
            # measured so far in this run
            from_copy = arm == "copies" and copy_pays(samples, archive, n_tokens)
            started = time.perf_counter()
            made = store.restore_file(archive, archive_tokens, n_tokens, from_copy)
            if made is None:
                raise BenchmarkError(f"the {arm} arm could not give a file to restore")
            try:
                restored = server.slot("restore", made.file_name)
                answered = time.perf_counter()
                # as the proxy does: what the server restored is used once the blocks' check
                # (running since the file was put together) has found them intact
                if not store.checked(made):
                    raise BenchmarkError(f"the {arm} arm's restore came from a damaged block")
            finally:
                store.release(made)
            wall_ms = (time.perf_counter() - started) * 1000
            check_wait_ms = (time.perf_counter() - answered) * 1000
            answer = server.complete(follow_up, 8)
            if answer["tokens"] != oracle["tokens"]:
                raise BenchmarkError(f"the {arm} arm's restore answers otherwise than a prefill")
            seen = samples.setdefault(arm, {})
            for name, value in (
                ("bytes read", restored["n_read"]),
                ("tokens restored", restored["n_restored"]),
                ("server restore ms", restored["timings"]["restore_ms"]),
                ("put together ms", made.made_ms),
                ("waited for the check ms", check_wait_ms),
                ("restore wall ms", wall_ms),
                ("follow-up decoded", answer["timings"]["prompt_n"]),
            ):
                seen.setdefault(name, []).append(float(value))
    medians = {
        arm: {name: statistics.median(values) for name, values in seen.items()}
        for arm, seen in samples.items()
    }
    medians["oracle"] = {"follow-up decoded": float(oracle["timings"]["prompt_n"])}
    return medians


def copy_pays(samples: dict[str, dict[str, list[float]]], archive: Archive, n_tokens: int) -> bool:
    """Whether the disk tier would read the archive's whole copy for `n_tokens` of it
    (`policy.restore_read`): the server's read rate from the whole-file arm's restores, the
    rate of putting files together from the blocks arm's; the tier's first guesses before."""
    whole, blocks = samples.get("whole", {}), samples.get("blocks", {})
    read_rate = _rate(whole, "server restore ms", INITIAL_RESTORE_BYTES_PER_MS)
    assemble_rate = _rate(blocks, "put together ms", INITIAL_ASSEMBLE_BYTES_PER_MS)
    costs = RestoreCosts(0.0, read_rate, 0.0, assemble_bytes_per_ms=assemble_rate)
    kept = (True, True)
    return not restore_read(archive.bytes, archive.n_tokens, n_tokens, kept, costs)[1]


def _rate(seen: dict[str, list[float]], time_figure: str, guess: float) -> float:
    """Bytes a ms over an arm's restores so far (`guess` before any)."""
    spent = sum(seen.get(time_figure, []))
    return sum(seen.get("bytes read", [])) / spent if spent > 0 else guess


def render(figures: Figures) -> str:
    config = figures.config
    titles = [ARM_TITLES[arm] for arm in ARMS]
    lines = [
        f"blocks bench: model {config['size']}, head {config['head']}, tail {config['tail']},"
        f" {config['conversations']} conversations; {config['turns']} turns of"
        f" {config['turn_tokens']}+32 tokens; {config['restores']} restores per arm",
        "",
        table_row(["disk bytes held", *titles, "blocks/whole"]),
        table_row(["---"] * (len(ARMS) + 2)),
    ]
    for workload, held in figures.held.items():
        ratio = held["blocks"] / held["whole"] if held["whole"] else 0.0
        lines.append(table_row([workload, *(f"{held[arm]:,}" for arm in ARMS), f"{ratio:.3f}"]))
    kept = figures.kept_per_save
    lines += [
        "",
        table_row(["bytes kept per save (growing conversation)", *titles]),
        table_row(["---"] * (len(ARMS) + 1)),
        *(
            table_row([f"turn {turn + 1}", *(f"{kept[arm][turn]:,}" for arm in ARMS)])
            for turn in range(len(kept["whole"]))
        ),
        table_row(["all saves", *(f"{sum(kept[arm]):,}" for arm in ARMS)]),
        "",
        f"server save stall per save (every arm, one save): median"
        f" {statistics.median(figures.save_stall_ms):.1f} ms",
    ]
    for part, restore in figures.restores.items():
        lines += [
            "",
            table_row([f"restore of {part} (median)", *titles, "oracle"]),
            table_row(["---"] * (len(ARMS) + 2)),
        ]
        for name in restore["whole"]:
            oracle = restore["oracle"].get(name)
            lines.append(
                table_row(
                    [
                        name,
                        *(f"{restore[arm][name]:,.1f}" for arm in ARMS),
                        "" if oracle is None else f"{oracle:,.0f}",
                    ]
                )
            )
    return "\n".join(lines)
