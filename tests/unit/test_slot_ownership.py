"""The scheduler is the one writer of slot state: no other module assigns a slot's or a lease's
fields, or rewrites what a slot holds. (The table's own methods, and the scheduler's record of
what each event does to a slot, slot_records.py, called by the scheduler alone, do the
rewriting.)"""

from __future__ import annotations

import ast

from tests.support.imports import import_graph, package_modules

SCHEDULER = "cacheproxy.slots.scheduler"
SLOT_RECORDS = "cacheproxy.slots.slot_records"  # its writes, one place each event
OWNERS = {SCHEDULER, SLOT_RECORDS, "cacheproxy.upstreams.slot_table"}
SLOT_FIELDS = {
    "known",
    "unknown_tail",
    "tenant",
    "session",
    "busy",
    "lease_started",
    "last_used",
    "version",
    "predicted",
    "isolate",
    "previous",
    "prompt",
    "adapters",
}
SLOT_REWRITES = {"hold", "forget", "record"}


def _names_a_slot(node: ast.expr) -> bool:
    """Whether the expression is a slot or a lease by its name (`slot`, `lease.slot`...)."""
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return "slot" in name.lower() or "lease" in name.lower()


def writes_outside_the_scheduler() -> list[str]:
    found = []
    for module, path in package_modules().items():
        if module in OWNERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            for target in targets:
                for part in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if (
                        isinstance(part, ast.Attribute)
                        and part.attr in SLOT_FIELDS
                        and _names_a_slot(part.value)
                    ):
                        found.append(f"{module}:{node.lineno} assigns {ast.unparse(part)}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in SLOT_REWRITES
                and _names_a_slot(node.func.value)
            ):
                found.append(f"{module}:{node.lineno} calls {ast.unparse(node.func)}")
    return found


def test_only_the_scheduler_changes_slots_and_leases() -> None:
    assert writes_outside_the_scheduler() == []


def test_only_the_scheduler_writes_through_slot_records() -> None:
    graph = import_graph(module_level_only=False)
    assert {module for module, imported in graph.items() if SLOT_RECORDS in imported} == {SCHEDULER}
