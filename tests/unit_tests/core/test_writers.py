"""Every file the project writes goes through one write path (megatron_lsgd/core/output_files.py),
which turns any writer's failure into one `WriteError` naming the file and removes what was
half-written. This test reads the code (megatron_lsgd/, tools/, pretrain_gpt.py) and finds every
call that writes a file; each must sit inside `with written_or_removed(...)` or
`with replaced_atomically(...)`, or be one of the reviewed exceptions below, each with the
reason it is safe. A new writer therefore cannot skip the path without a line here.
The disk-filling half of the check is test_full_disk.py (training, export, data) and
test_tool_outputs_on_a_full_disk below (the tools' caches, pages, reports and plots)."""

from __future__ import annotations

import ast
import json
import os
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

from megatron_lsgd.core.output_files import WriteError, write_json, write_text
from tests.unit_tests.harness import no_room_for_files

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SOURCES = ("megatron_lsgd", "tools", "pretrain_gpt.py")
GUARDS = {"written_or_removed", "replaced_atomically"}

# Calls that write a file whatever their arguments (resolved through the module's imports).
WRITERS = {"torch.save", "numpy.save", "numpy.savez", "numpy.savetxt", "safetensors.torch.save_file",
           "shutil.copy", "shutil.copy2", "shutil.copyfile", "shutil.copytree",
           "torch.utils.tensorboard.SummaryWriter"}
WRITER_METHODS = {"write_text", "write_bytes", "savefig", "tofile"}  # on any object
OPENERS = {"open", "io.open", "gzip.open", "os.fdopen"}  # write when their mode says so
OS_OPEN_WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}

# path:function -> why the write may bypass the path. Reviewed: keep each reason true.
EXEMPT = {
    "megatron_lsgd/training/json_log.py:__init__":
        "--json-log appends, so a failure must not remove it; every OSError of its open and writes becomes a "
        "WriteError naming --json-log (JsonLog._error), test_full_disk.py::test_json_log_on_a_full_device",
    "megatron_lsgd/training/logging_utils.py:TensorboardWriter.__init__":
        "tensorboard's event file is a log, kept on a failure; TensorboardWriter._writing turns its writer's "
        "OSError into a WriteError naming --tensorboard-dir, test_full_disk.py::test_tensorboard_on_a_full_disk...",
    "megatron_lsgd/training/checkpointing/checkpointer.py:_commit":
        "the test-only hold marker (.holding_N, MEGATRON_LSGD_TEST_HOLD_BEFORE_COMMIT), an empty file",
    "megatron_lsgd/training/checkpointing/lock.py:SaveLock.acquire":
        "the --save lock is created with O_EXCL to claim the directory; a failure to create it is reported by "
        "take_save_lock naming the directory",
    "megatron_lsgd/core/lsgd/fault_tolerance/torchft_membership.py:TorchftMembership._record_digest":
        "the elastic membership trace appends one JSON line per event for the chaos tool; losing it on a full "
        "disk must not stop training, and it is never removed",
    "megatron_lsgd/core/datasets/index_cache.py:<lambda>":
        "writes into the file object `_atomic_write` opened under written_or_removed",
    "tools/wan/launch.py:run_jobs":
        "a launched rank's stdout/stderr log, appended by the child process while it runs",
    "tools/benchmarks/elastic/chaos.py:run_toy_job":
        "the start signal file the sites wait for (empty)",
    "tools/benchmarks/elastic/chaos.py:PretrainSite.restarted":
        "the site's log, appended between process restarts",
    "tools/benchmarks/elastic/chaos.py:PretrainSite.start":
        "a site process's stdout log, appended by the child",
    "tools/benchmarks/elastic/chaos.py:network":
        "the lighthouse process's stdout log in the emulated WAN, appended by the child",
    "tools/benchmarks/elastic/ft_site.py:run_site":
        "a toy site's JSON-lines log, appended while it runs",
    "tools/benchmarks/elastic/ft_site.py:launch":
        "a toy site process's stdout log, appended by the child",
    "megatron_lsgd/core/datasets/indexed_dataset.py:IndexedDatasetBuilder.__init__":
        "the builder's temporary .bin: written under written_or_removed (_write, finalize), removed by abort(), "
        "renamed over the output only by finalize()",
    "tools/wan/preflight.py:probe":
        "opens /dev/net/tun to learn whether TUN devices can be made; writes no file",
    "tools/wan/wire.py:open_tun_in_namespace":
        "opens a TUN device (a network interface), not a file",
    "tools/planning/pilots.py:ranks_output_to":
        "a pilot run's stdout redirected into its log file (dup2), appended",
}


def _dotted(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _imports(tree: ast.Module) -> Dict[str, str]:
    """Local name -> what it stands for (`np` -> numpy, `save_file` -> safetensors.torch.save_file)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _resolve(func: ast.AST, imports: Dict[str, str]) -> Optional[str]:
    dotted = _dotted(func)
    if dotted is None:
        return None
    head, _, rest = dotted.partition(".")
    head = imports.get(head, head)
    return f"{head}.{rest}" if rest else head


def _mode_writes(mode: Optional[ast.AST]) -> bool:
    if mode is None:
        return False  # open(path): read
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return any(c in mode.value for c in "wax+")
    if isinstance(mode, ast.IfExp):
        return _mode_writes(mode.body) or _mode_writes(mode.orelse)
    return True  # a mode computed at run time: count it as a write


def _writes(call: ast.Call, imports: Dict[str, str]) -> Optional[str]:
    """What `call` writes with, or None when it writes no file."""
    name = _resolve(call.func, imports)
    if name in WRITERS:
        return name
    if isinstance(call.func, ast.Attribute) and call.func.attr in WRITER_METHODS:
        return f".{call.func.attr}"
    if name in OPENERS:
        mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
        return name if _mode_writes(mode) else None
    if name == "os.open" and len(call.args) > 1:
        flags = {n.attr for n in ast.walk(call.args[1]) if isinstance(n, ast.Attribute)}
        return name if flags & OS_OPEN_WRITE_FLAGS else None
    return None


def _is_guard(item: ast.withitem, imports: Dict[str, str]) -> bool:
    expr = item.context_expr
    return isinstance(expr, ast.Call) and (_resolve(expr.func, imports) or "").rsplit(".", 1)[-1] in GUARDS


def write_calls(relpath: str, source: str) -> Iterator[Tuple[str, int, str, bool]]:
    """(path:function, line, writer, guarded) for every write call in one file."""
    tree = ast.parse(source)
    imports = _imports(tree)

    def visit(node: ast.AST, scope: List[str], guarded: bool) -> Iterator[Tuple[str, int, str, bool]]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = scope + [node.name]
            guarded = False  # a guard outside a function does not cover its later calls
        elif isinstance(node, ast.Lambda):
            scope = scope + ["<lambda>"]
            guarded = False
        elif isinstance(node, (ast.With, ast.AsyncWith)) and any(_is_guard(i, imports) for i in node.items):
            guarded = True
        if isinstance(node, ast.Call):
            writer = _writes(node, imports)
            if writer is not None:
                yield f"{relpath}:{'.'.join(scope) or '<module>'}", node.lineno, writer, guarded
        for child in ast.iter_child_nodes(node):
            yield from visit(child, scope, guarded)

    yield from visit(tree, [], False)


def all_write_calls() -> List[Tuple[str, int, str, bool]]:
    found = []
    for root in SOURCES:
        path = os.path.join(REPO, root)
        files = [path] if path.endswith(".py") else [os.path.join(d, f) for d, _, fs in os.walk(path)
                                                     for f in fs if f.endswith(".py")]
        for file in sorted(files):
            rel = os.path.relpath(file, REPO)
            with open(file, encoding="utf-8") as f:
                found.extend(write_calls(rel, f.read()))
    return found


def _matches(key: str, where: str) -> bool:
    """EXEMPT's `path:A.B` covers the calls whose scope holds A.B in a row (a method as
    `Class.method`, a lambda as `<lambda>`, nested functions included)."""
    key_path, _, key_scope = key.partition(":")
    path, _, scope = where.partition(":")
    want, have = key_scope.split("."), scope.split(".")
    return key_path == path and any(have[i:i + len(want)] == want for i in range(len(have) - len(want) + 1))


def test_every_writer_goes_through_the_write_path():
    calls = all_write_calls()
    assert len(calls) > 30, "the scan found too few writers: is it still reading the code?"
    unguarded = [(where, line, writer) for where, line, writer, guarded in calls if not guarded]
    bypass = [f"{where} (line {line}: {writer})" for where, line, writer in unguarded
              if not any(_matches(key, where) for key in EXEMPT)]
    assert not bypass, ("these calls write a file outside megatron_lsgd/core/output_files.py's write path "
                        "(write_text / write_json / replaced_atomically / written_or_removed); route them "
                        "through it, or add a reviewed reason to EXEMPT:\n  " + "\n  ".join(bypass))
    stale = [key for key in EXEMPT if not any(_matches(key, where) for where, _, _ in unguarded)]
    assert not stale, f"EXEMPT names writers that no longer exist or are now guarded: {stale}"


def test_the_scan_sees_each_kind_of_writer():
    """The scanner itself: each way of writing is found, a guard covers only its body."""
    source = '''
import numpy as np
import shutil
from safetensors.torch import save_file
from megatron_lsgd.core.output_files import replaced_atomically

def plain(p, fig, a):
    open(p, "w").close()
    open(p, mode="ab")
    open(p, "a" if p else "r")
    open(p)
    np.save(p, a)
    save_file({}, p)
    shutil.copy2(p, p + ".b")
    fig.savefig(p)

def guarded(p, fig):
    with replaced_atomically(p) as tmp:
        fig.savefig(tmp)
    fig.savefig(p)
'''
    calls = list(write_calls("x.py", source))
    assert [(w, writer, g) for w, _, writer, g in calls] == [
        ("x.py:plain", "open", False), ("x.py:plain", "open", False), ("x.py:plain", "open", False),
        ("x.py:plain", "numpy.save", False), ("x.py:plain", "safetensors.torch.save_file", False),
        ("x.py:plain", "shutil.copy2", False), ("x.py:plain", ".savefig", False),
        ("x.py:guarded", ".savefig", True), ("x.py:guarded", ".savefig", False)]


def test_whole_files_are_replaced_or_kept_on_a_full_disk(tmp_path):
    """write_text / write_json (the tools' caches, pages and reports): a full disk is one
    WriteError naming the file, the earlier content stays, no temporary file is left."""
    page = tmp_path / "page.md"
    write_text(str(page), "earlier\n")
    for write, value in ((write_text, "x" * 100_000), (write_json, {"cells": list(range(50_000))})):
        with no_room_for_files(1024), pytest.raises(WriteError) as err:
            write(str(page), value)
        assert str(err.value).startswith(f"cannot write {page}: [Errno 27] File too large (the disk is full")
        assert page.read_text() == "earlier\n" and os.listdir(tmp_path) == ["page.md"]
    write_json(str(page), {"a": 1})
    assert json.loads(page.read_text()) == {"a": 1}


def test_tool_outputs_on_a_full_disk(tmp_path, capsys):
    """The tools' writers, the disk filling up for real under each: a sweep's cache cell
    (quality_frontier, leaderboard, gpu_quality), a page's block (the ladder and frontier
    pages), a WAN run's results, table and plots (wan_report, through its entry point:
    one `error:` line, exit 2). Each earlier output stays as it was; no temporary file is left."""
    from tests.unit_tests.wan.test_wan_bench import fake_log
    from tools.benchmarks.quality import quality_frontier
    from tools.benchmarks import run_cache
    from tools.benchmarks.wan import wan_report

    cell = tmp_path / "cells" / "c.json"
    run_cache.load_or_run(str(cell), lambda: {"valid": [1.0]})
    with no_room_for_files(16), pytest.raises(WriteError, match=f"cannot write {cell}: .Errno 27"):
        run_cache.load_or_run(str(cell), lambda: {"valid": [2.0] * 100}, refresh=True)
    assert json.loads(cell.read_text())["valid"] == [1.0] and os.listdir(cell.parent) == ["c.json"]

    page = tmp_path / "page.md"
    page.write_text("# page\n\nprose\n")
    with no_room_for_files(16), pytest.raises(WriteError, match=f"cannot write {page}: .Errno 27"):
        quality_frontier.write_block(str(page), "| a | b |\n" * 20, "ladder")
    assert page.read_text() == "# page\n\nprose\n"

    run = tmp_path / "wan"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "ceiling.site0.jsonl").write_text("".join(json.dumps(r) + "\n"
                                                              for r in fake_log(500, [1.0, 1.0, 1.0])))
    earlier = json.dumps({"scenario": {"sites": 1, "ranks_per_site": 1, "rate_mbit": 1.0, "delay_ms": 1.0},
                          "runs": [{"algorithm": "ceiling"}]})
    (run / "results.json").write_text(earlier)
    with no_room_for_files(64):
        code = wan_report.main([str(run)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert f"cannot write {run}/results.json: [Errno 27] File too large" in err
    assert (run / "results.json").read_text() == earlier and sorted(os.listdir(run)) == ["logs", "results.json"]
