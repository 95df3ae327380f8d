"""The import graph of services/: no cycle between modules, no service importing another service, and
nothing importing the development tooling (dfp_dev): the umbrella command finds its commands through an entry point.

Every import counts, also those inside functions. ``from pkg import name`` imports the submodule
``pkg.name`` when there is one, else it goes through ``pkg/__init__``. The generated gRPC code
(dfp_shared/rpc) is left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[1] / "services"
SKIPPED = ("dfp_shared.rpc",)
SHARED = "dfp_shared"
UMBRELLA = "dfp_cli"  # the `dflash-pipeline` command: it may import the service CLIs
DEV = "dfp_dev"  # development and demo tooling: it drives the services, and may import any of them
DEV_REGISTRY = "dfp_dev.commands"  # the command table DEV registers under the umbrella's entry point group


def module_files() -> dict[str, Path]:
    modules = {}
    for path in sorted(SERVICES.rglob("*.py")):
        parts = list(path.relative_to(SERVICES).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if not any(name == s or name.startswith(s + ".") for s in SKIPPED):
            modules[name] = path
    return modules


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of services/ that module ``name`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def nearest(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [nearest(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in modules else nearest(base))
        found.update(t for t in targets if t and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_imports_inside_functions_and_relative_ones():
    graph = import_graph()
    assert "dfp_dev.targets.tiny" in graph["dfp_dev.demo.run"]  # inside a function, relative
    assert "dfp_shared.storage.store" in graph["dfp_shared.models.loading"]
    assert not any(m.startswith("dfp_shared.rpc") for m in graph)


def test_no_import_cycle_between_modules():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_services_import_no_other_service_but_the_shared_package():
    wrong = []
    for module, targets in import_graph().items():
        own = module.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            if other in (own, SHARED) or own == DEV:
                continue
            if own == UMBRELLA and target == DEV_REGISTRY:
                continue
            if own == UMBRELLA and target == f"{other}.cli":
                continue
            wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_nothing_imports_the_development_tooling():
    wrong = []
    for module, targets in import_graph().items():
        own = module.split(".")[0]
        for target in targets:
            if own == DEV or target.split(".")[0] != DEV:
                continue
            wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_umbrella_reaches_the_development_commands_through_an_entry_point():
    """No module of the umbrella names the development package: its commands come through the
    ``dflash_pipeline.commands`` entry point the project declares, so a ``dflash-pipeline`` without dfp_dev
    (the images) works, and an installed dfp_dev's commands are offered."""
    from dfp_cli.main import ENTRY_POINTS, commands

    for path in (SERVICES / UMBRELLA).rglob("*.py"):
        assert DEV not in path.read_text(), f"{path.name} names {DEV}"
    pyproject = (SERVICES.parent / "pyproject.toml").read_text()
    assert f'[project.entry-points."{ENTRY_POINTS}"]\ndev = "{DEV_REGISTRY}"' in pyproject
    table, helps = commands()
    assert table["demo"].startswith(f"{DEV}.") and "demo" in helps


TRAINER = "dfp_trainer"
ROOMS = ("drafter", "components", "loop", "evaluate", "export", "jobs")
# plain configuration every room may read: the trainer's settings, and the run's composed config
GROUND = (f"{TRAINER}.settings", f"{TRAINER}.run_config")
# what each room may import of the trainer besides itself and GROUND (the metrics log of ``components`` runs
# mid-training evaluations)
ROOM_MAY_IMPORT = {"drafter": (), "evaluate": ("drafter",), "export": ("drafter",),
                   "components": ("drafter", "evaluate"), "loop": ("drafter", "evaluate", "components"),
                   "jobs": ("drafter", "evaluate", "export", "components", "loop")}
# the top-level modules a job handler may import besides GROUND: the run it starts and the trainer group's leases
JOBS_MAY_IMPORT_TOP = (f"{TRAINER}.run", f"{TRAINER}.group")


def trainer_place(module: str) -> str | None:
    """The room of a trainer module (``drafter``, ``loop``, ...), ``top`` for a top-level one, None outside."""
    parts = module.split(".")
    if parts[0] != TRAINER or len(parts) < 2:
        return None
    return parts[1] if parts[1] in ROOMS else "top"


def test_the_trainer_rooms_are_packages():
    modules = module_files()
    assert all(f"{TRAINER}.{room}" in modules for room in ROOMS)
    assert f"{TRAINER}.run" in modules  # ``python -m dfp_trainer.run``: what torchrun launches per rank


def test_trainer_floors_no_room_imports_upwards():
    """``drafter`` is the lowest floor; ``evaluate`` and ``export`` stand on it, ``components`` (what the training
    loop is built from: checkpoint, optimizer, loss recipe, data, metrics, distributed) on ``drafter`` and
    ``evaluate``, ``loop`` (the training loop's own modules) on them, ``jobs`` (the job types' handlers, which
    start runs) on all of them and the run; the top level (CLI, worker, run, report) on all rooms. No room imports
    a top-level module but the plain configuration."""
    wrong = []
    for module, targets in import_graph().items():
        room = trainer_place(module)
        if room in (None, "top"):
            continue
        allowed = {room, *ROOM_MAY_IMPORT[room]}
        for target in targets:
            place = trainer_place(target)
            if place is None or (target in GROUND and room != "drafter") or place in allowed:
                continue
            if room == "drafter" and target == f"{TRAINER}.settings":
                continue
            if room == "jobs" and target in JOBS_MAY_IMPORT_TOP:
                continue
            wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_shipped_modeling_file_imports_only_torch_and_transformers():
    path = module_files()[f"{TRAINER}.drafter.modeling_dflash"]
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, "the modeling file is shipped alone: no relative import"
            roots.add(node.module.split(".")[0])
    assert roots <= {"__future__", "torch", "transformers", "math", "typing"}, roots


FAMILIES = f"{TRAINER}.drafter.families"


def test_a_drafter_family_imports_only_the_shared_backbone():
    """A family (``drafter/families/<name>/``) imports its own folder and the drafter's backbone (config, model,
    masks, objective, the family registry), never another family, the registry's package or another room."""
    wrong = []
    for module, targets in import_graph().items():
        if not module.startswith(FAMILIES + "."):
            continue
        own = ".".join(module.split(".")[:4])
        for target in targets:
            if target.split(".")[0] != TRAINER or target == own or target.startswith(own + "."):
                continue
            if trainer_place(target) == "drafter" and not (target == FAMILIES or target.startswith(FAMILIES + ".")):
                continue
            wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_components_stand_below_the_loop_and_the_drafter_below_both():
    """Stated on its own, whatever the floors above allow: nothing in ``components`` imports the loop, the jobs
    or the top level (the worker, the run, the report, ...), and the drafter imports neither ``components``
    nor ``loop``."""
    wrong = []
    for module, targets in import_graph().items():
        room = trainer_place(module)
        for target in targets:
            place = trainer_place(target)
            if room == "components" and (place in ("loop", "jobs") or (place == "top" and target not in GROUND)):
                wrong.append(f"{module} imports {target}")
            if room == "drafter" and place in ("components", "loop"):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))
