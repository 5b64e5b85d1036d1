"""The import rules of docs/architecture.md, checked on the source: imports point down the layers, no module
imports itself back through others, and only env.py reads the environment."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Top to bottom, as docs/architecture.md lists them. A module imports only from layers below its own, never
# from a layer above; packages that share a layer (the fronts) never import each other.
LAYERS: list[tuple[str, list[str]]] = [
    ("the minisgl app", ["minisgl_cli.app"]),  # mounts commands/
    ("commands", ["commands"]),
    ("fronts", ["minisgl_cli.repl", "minisgl_cli.server", "minisgl_cli.router", "minisgl_cli.bench",
                "minisgl_cli.smoke"]),
    ("http api", ["minisgl_cli.api"]),  # what server/ and router/ share: OpenAI wire models, uvicorn, Prometheus
    ("vision chat", ["minisgl_cli.vision.vlm", "minisgl_cli.vision.image_source"]),  # transformers' VLM chat, images
    ("media", ["minisgl_cli.media"]),  # diffusion image / video pipelines
    ("package root", ["minisgl_cli"]),  # re-exports LLM lazily
    ("python api", ["minisgl_cli.llm"]),
    ("multi-process runtime", ["minisgl_cli.runtime"]),  # another EngineClient, and the processes behind it
    ("backends", ["minisgl_cli.backends"]),  # --engine: the hf and mlx EngineClients, and which one runs
    ("client", ["minisgl_cli.client"]),
    ("dispatch policies", ["minisgl_cli.dispatch"]),  # which replica takes a request (the pool and the router)
    ("vision prompts", ["minisgl_cli.vision.processor"]),  # a VLM's image prompts: chat template, HF processor
    ("tokenizer", ["minisgl_cli.tokenizer"]),
    ("chat formats", ["minisgl_cli.harmony"]),  # gpt-oss's harmony: its prompt written, its replies read
    ("scheduler", ["minisgl_cli.scheduler"]),
    ("cpu step builder", ["minisgl_cli.cpu_step.build"]),  # the child process that compiles the CPU step
    ("engine", ["minisgl_cli.engine"]),
    ("vision in the engine", ["minisgl_cli.vision.state"]),  # a step's images: positions, embeddings, their cache
    ("sampling", ["minisgl_cli.sampling"]),
    ("cpu stored step", ["minisgl_cli.cpu_step"]),  # the compiled CPU decode step, loaded by the engine
    ("engine config", ["minisgl_cli.engine.config"]),  # every knob of one engine
    ("models", ["minisgl_cli.models"]),
    ("attention", ["minisgl_cli.attention"]),
    ("layers", ["minisgl_cli.layers"]),
    ("engine step", ["minisgl_cli.engine.batch"]),  # what a step hands every layer
    ("host buffers", ["minisgl_cli.engine.host"]),  # an engine's pinned host memory
    ("kvcache", ["minisgl_cli.kvcache"]),
    ("kernels", ["minisgl_cli.kernels"]),
    ("loader", ["minisgl_cli.loader"]),
    ("distributed", ["minisgl_cli.distributed"]),
    ("pixel transport", ["minisgl_cli.vision", "minisgl_cli.vision.pixels"]),  # images between processes
    ("messages", ["minisgl_cli.messages"]),
    ("admission", ["minisgl_cli.admission"]),  # the one check every request passes (every client and scheduler)
    ("bottom", ["minisgl_cli.types", "minisgl_cli.env", "minisgl_cli.notice", "minisgl_cli.process_cpu",
                "minisgl_cli.device"]),
]


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("minisgl_cli", "commands"):
        for path in (REPO / top).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Our modules that `name` imports anywhere in its source (lazy and TYPE_CHECKING imports count too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from pkg import mod` depends on pkg.mod; `from mod import name` on mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> tuple[int, str] | None:
    """(depth, the entry of LAYERS holding module); the package root holds only itself."""
    best = None
    for depth, (_, entries) in enumerate(LAYERS):
        for e in entries:
            if module == e or (e != "minisgl_cli" and module.startswith(e + ".")):
                if best is None or len(e) > len(best[1]):
                    best = (depth, e)
    return best


def test_every_module_has_a_place_in_the_layers():
    missing = [m for m in MODULES if _layer(m) is None]
    assert not missing, f"add these to LAYERS and docs/architecture.md: {missing}"


def test_imports_point_down_the_layers():
    wrong = []
    placed = {m: layer for m in GRAPH if (layer := _layer(m)) is not None}  # the others fail the test above
    for module, targets in GRAPH.items():
        if module not in placed:
            continue
        depth, entry = placed[module]
        for t in targets & placed.keys():
            t_depth, t_entry = placed[t]
            if t_depth < depth or (t_depth == depth and t_entry != entry):
                wrong.append(f"{module} ({LAYERS[depth][0]}) imports {t} ({LAYERS[t_depth][0]})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    state: dict[str, str] = {}  # "open" while on the path, "done" after

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = "open"
        for t in sorted(GRAPH[m]):
            if state.get(t) == "open":
                return path[path.index(t):] + [m, t] if t in path else [m, t]
            if t not in state and (cycle := visit(t, path + [m])):
                return cycle
        state[m] = "done"
        return None

    for m in sorted(GRAPH):
        if m not in state:
            cycle = visit(m, [])
            assert cycle is None, " -> ".join(cycle)


def test_only_env_py_reads_the_environment():
    """Every environment variable is read in minisgl_cli/env.py (Typer reads the options' own envvar=)."""
    readers = []
    for name, path in MODULES.items():
        if name == "minisgl_cli.env":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            reads_environ = (isinstance(node, ast.Attribute) and node.attr == "get"
                             and isinstance(node.value, ast.Attribute) and node.value.attr == "environ")
            subscripts_environ = (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                                  and isinstance(node.value, ast.Attribute) and node.value.attr == "environ")
            getenv = isinstance(node, ast.Attribute) and node.attr == "getenv"
            if reads_environ or subscripts_environ or getenv:
                readers.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not readers, readers


def test_the_client_protocol_loads_no_engine():
    """A front (or the API process) gets the EngineClient interface without torch or the engine in memory."""
    import subprocess
    import sys

    code = ("import sys, minisgl_cli.client.protocol; "
            "print(' '.join(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith("
            "('minisgl_cli.engine', 'minisgl_cli.scheduler', 'minisgl_cli.models'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "", f"importing the client protocol loaded: {out.stdout.strip()}"


# The engine's own fields: above the engine, code reaches it through `Engine.spec` and its verbs (engine/engine.py).
ENGINE_INTERNALS = {"pool", "loaded", "model_cfg", "host"}
ENGINE_DEPTH = next(depth for depth, (title, _) in enumerate(LAYERS) if title == "engine")


# The CPU step's builder exports the engine's own forward (its pool and loaded model): the engine's, though a layer up.
ENGINE_FRIENDS = {"minisgl_cli.cpu_step.build"}


def _above_the_engine() -> dict[str, ast.AST]:
    return {name: ast.parse(path.read_text()) for name, path in MODULES.items()
            if (layer := _layer(name)) is not None and layer[0] < ENGINE_DEPTH and name not in ENGINE_FRIENDS}


def _names_an_engine(node: ast.expr) -> bool:
    """`engine`, `e` or `<anything>.engine`: the receivers an engine goes by."""
    return ((isinstance(node, ast.Name) and node.id in ("engine", "e"))
            or (isinstance(node, ast.Attribute) and node.attr == "engine"))


def test_the_engine_is_reached_through_its_seam_only():
    """The scheduler (and every layer above it) uses the engine's spec and verbs, never its pool, loaded model,
    model config or host buffers."""
    reached = [f"{name}:{node.lineno}: .{node.value.attr if isinstance(node.value, ast.Attribute) else 'engine'}"
               f".{node.attr}"
               for name, tree in _above_the_engine().items() for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS and _names_an_engine(node.value)]
    assert not reached, reached


# The engine's KV-memory verbs: above the engine, the scheduler's CacheManager alone calls them.
KV_VERBS = {"write_page_table", "alloc_pages", "free_pages", "alloc_req_row", "free_req_row", "num_free_pages"}


def test_only_the_cache_manager_writes_the_page_table_and_moves_pages():
    """Above the engine, page-table rows are written (and pages and rows taken and given back) by scheduler/cache.py
    alone, through the engine's verbs; nothing there touches the page-table tensor itself."""
    wrong = [f"{name}:{node.lineno}: .{node.attr}"
             for name, tree in _above_the_engine().items() for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and (node.attr == "page_table" or (
                 node.attr in KV_VERBS and _names_an_engine(node.value) and name != "minisgl_cli.scheduler.cache"))]
    assert not wrong, wrong
