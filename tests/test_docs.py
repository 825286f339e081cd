"""The docs stay true to the code: the API page is regenerated from the docstrings, the README
shows the command CI runs, and every relative link points at a file that exists."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from _helpers import CHILDREN, REPO, assert_ended_well, free_port, run_bounded, run_copied
from stocaching import cli
from stocaching import stocaching as core

ROOT = str(REPO)


def read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def test_api_page_matches_the_docstrings():
    sys.path.insert(0, os.path.join(ROOT, "docs"))
    try:
        import gen_api
    finally:
        sys.path.pop(0)
    assert read("docs", "api.md") == gen_api.render(), \
        "docs/api.md is out of date: run python docs/gen_api.py"


def test_readme_test_command_is_what_ci_runs():
    """The README's test commands, after the virtual environment, are .ci/run's lines, in
    its order (less pip's -q)."""
    readme, ci = read("README.md"), read(".ci", "run")
    block = re.search(r"## Tests\n.*?```\n(.*?)```", readme, re.S).group(1)
    commands = block.strip().splitlines()[1:]
    assert commands[0] == "python -m pip install torch==2.13.0"
    assert commands[-1] == "python -m pytest -q"
    ci_lines = [ln.strip().replace(" -q ", " ") for ln in ci.splitlines()]
    where = [ci_lines.index(c) for c in commands]  # (ValueError: not run by .ci/run)
    assert where == sorted(where), (commands, where)


def test_readme_example_is_short_and_compiles():
    code = re.search(r"```python\n(.*?)```", read("README.md"), re.S).group(1)
    assert len(code.strip().splitlines()) <= 15
    compile(code, "README example", "exec")
    assert "**Don't" in read("README.md")


def test_relative_links_resolve():
    for folder, name in [("", "README.md")] + [("docs", f) for f in
                                               os.listdir(os.path.join(ROOT, "docs"))
                                               if f.endswith(".md")]:
        text = read(folder, name) if folder else read(name)
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            path = os.path.normpath(os.path.join(ROOT, folder, target))
            assert os.path.exists(path), f"{folder}/{name} links to missing {target}"


FEATURES = ("batches", "cli", "disk_tier", "fields", "holder", "masks", "open_size",
            "persistent", "saved", "staging", "views")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("copied", ["core", "features"])
def test_module_runs_as_a_copied_single_file(copied, tmp_path, shm_dir):
    """Copy the one file into a fresh directory and import it as `stocaching`: the two lines
    work, and each feature's keyword raises naming its file, with nothing made; with the
    feature modules copied beside it, every kind of cache works."""
    for module in ("stocaching",) + (FEATURES if copied == "features" else ()):
        (tmp_path / f"{module}.py").write_text(read("stocaching", f"{module}.py"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-I", str(CHILDREN / "copied_module.py"), copied],
                       cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    n, path = r.stdout.split()
    assert n == "4" and path == str(tmp_path / "stocaching.py")


@pytest.mark.timeout(120)
def test_a_projects_own_module_under_a_features_name_is_refused_without_running_it(tmp_path):
    """A project with the core copied in and modules of its own named saved.py, fields.py and
    holder.py in the same folder: each keyword that needs the feature raises the ImportError
    that says the module is not stocaching's, none of them is run, a torchrun job starts cold
    rather than fail, and the two lines work."""
    for module in ("saved", "fields", "holder"):
        (tmp_path / f"{module}.py").write_text(
            f"open({str(tmp_path / ('ran-' + module))!r}, 'w').close()\n")
    out = run_copied(tmp_path, ("stocaching.py",), f"""
        import os, torch, stocaching
        from stocaching import SharedCache
        for kw in (dict(load_from="c.stc"), dict(data_dims={{"a": (2,)}})):
            try:
                SharedCache(**{{"size_limit_gib": 0.01, "dataset_len": 10, "data_dims": (2,),
                              "shm_dir": {str(tmp_path)!r}, **kw}})
            except ImportError as e:
                print("REFUSED", "not stocaching's" in str(e), "folder of their own" in str(e))
        os.environ["TORCHELASTIC_RUN_ID"] = "x"
        print("KEPT", stocaching._kept_for_restarts())
        c = SharedCache(0.01, 10, (2,), shm_dir={str(tmp_path)!r})
        c.set_slot(3, torch.ones(2, dtype=torch.uint8))
        print("HIT", c.get_slot(3).tolist())
        """)
    assert out.split("\n")[:4] == ["REFUSED True True", "REFUSED True True", "KEPT False",
                                   "HIT [1, 1]"], out
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("ran-")]


def _readme_copy_table() -> list[tuple[list[str], str]]:
    """The README's table of what to copy: per row with an import of its own, the files named
    before any parenthesis, and that import."""
    rows = []
    for line in read("README.md").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[2].startswith("`from ") and "stocaching import" not in cells[2]:
            files = re.findall(r"`([\w.]+\.py)`", cells[1].split("(")[0])
            rows.append((files, cells[2].strip("`")))
    return rows


@pytest.mark.parametrize("files, statement", _readme_copy_table(),
                         ids=[r[1] for r in _readme_copy_table()])
def test_each_opt_in_imports_copied_with_the_files_the_readme_lists(files, statement, tmp_path):
    """Each row of the README's table for an opt-in part: stocaching.py and the files the row
    names, copied alone into a folder, import as the row says (the copies, not the package)."""
    assert len(_readme_copy_table()) == 7
    module = statement.split()[1]
    out = run_copied(tmp_path, ("stocaching.py", *files), f"""
        import os
        {statement}
        import {module}
        print(os.path.dirname({module}.__file__) == os.getcwd())
        """)
    assert out.strip() == "True", out


def test_a_copied_core_asked_for_an_opt_in_name_says_which_file_has_it(tmp_path):
    """``from stocaching import CacheAwareSampler`` of the core copied alone raises an
    ImportError naming samplers.py and the import to use; the core's list of the opt-ins'
    names is every opt-in module's ``__all__``."""
    import importlib

    listed = {m: set(names) for m, names in core._OPT_IN_NAMES.items()}
    assert listed == {m: set(importlib.import_module(f"stocaching.{m}").__all__)
                      for m in listed}
    import stocaching
    assert set(stocaching.__all__) - set(core.__all__) - set(core._PUBLIC_IN_FEATURES) == \
        set().union(*listed.values())
    out = run_copied(tmp_path, ("stocaching.py",), """
        try:
            from stocaching import CacheAwareSampler
        except ImportError as e:
            print(e)
        import stocaching
        print(hasattr(stocaching, "no_such_name"))
        """)
    assert out.split("\n")[:2] == [
        "CacheAwareSampler is in samplers.py, an opt-in module of stocaching, not in the core "
        "stocaching.py: copy samplers.py beside it (with the files it needs: see the README) "
        "and import it from there: from samplers import CacheAwareSampler", "False"], out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("launch", ["fork", "spawn", "torchrun", "mp_spawn"])
def test_the_readme_example_runs_on_the_core_copied_alone(launch, tmp_path, shm_dir):
    """The README's Dataset, its block as written, over stocaching.py copied alone into an
    empty directory (no feature module, no PYTHONPATH): float32 batches through 2 DataLoader
    workers (fork, spawn), on 2 ranks under torchrun and torch.multiprocessing.spawn. Every
    rank uses the copy and one segment of the node; epoch 2 hits every sample; nothing is
    left in the shm directory."""
    (tmp_path / "stocaching.py").write_text(read("stocaching", "stocaching.py"))
    (tmp_path / "copied_core_job.py").write_text((CHILDREN / "copied_core_job.py").read_text())
    code = re.search(r"```python\n(.*?)```", read("README.md"), re.S).group(1)
    (tmp_path / "readme_example.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    job = [str(tmp_path / "copied_core_job.py")]
    cmd = {"torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", *job, "torchrun"],
           "mp_spawn": [sys.executable, *job, "mp_spawn", str(free_port())]}.get(
        launch, [sys.executable, *job, launch])
    r = run_bounded(cmd, env=env, timeout=500, cwd=str(tmp_path))
    assert_ended_well(r)
    world = 1 if launch in ("fork", "spawn") else 2
    results = re.findall(r"^RESULT (.*)$", r.stdout, re.M)
    assert len(results) == world, r.stdout + r.stderr[-3000:]
    for line in results:
        got = dict(kv.split("=", 1) for kv in line.split())
        assert got["file"] == str(tmp_path / "stocaching.py"), got
        assert got["world"] == str(world) and got["filled"] == "64", got
        assert got["epoch2_hits"] == str(64 * world) and got["epoch2_misses"] == "0", got
    assert [f for f in os.listdir(shm_dir) if f.startswith("stocaching")] == []


# Who may import what, for test_opt_in_modules_import_only_the_cores_public_names. Every module
# of the package is one of these (found by globbing stocaching/*.py):
# - the core: the file a user copies, and its feature modules, whose rule is their own
#   (test_feature_modules_import_only_the_cores_public_names_and_its_seam); from them other
#   modules import only their __all__ (and the core's __getattr__ names);
CORE = {"stocaching", *FEATURES}
# - the internal module the opt-in modules share, which says so in its docstring's first line:
#   they may import anything from it, and it imports from the core only;
INTERNAL = {"_common"}
# - the package's own entry points, which re-export every module's names or run the CLI;
ENTRY_POINTS = {"__init__", "__main__"}
# - opt-in modules that need no other file of the package (the standard library only);
STANDALONE = {"trainers"}
# - and the opt-in modules, every other one: from the core and from each other they import only
#   names in __all__.


def package_imports(module: str) -> dict[tuple[str, bool], set[str]]:
    """The names ``stocaching/<module>.py`` imports from its sibling modules, by (sibling,
    whether the import is relative: the package's branch, or else the copied layout's)."""
    import ast

    siblings = {os.path.basename(p)[:-3]
                for p in glob.glob(os.path.join(ROOT, "stocaching", "*.py"))}
    found: dict[tuple[str, bool], set[str]] = {}
    for node in ast.walk(ast.parse(read("stocaching", f"{module}.py"))):
        if not isinstance(node, ast.ImportFrom):
            continue
        name = node.module or ""
        if node.level == 0 and name.startswith("stocaching."):
            name = name.partition(".")[2]  # the package's module by its full name
        elif node.level > 1 or node.level == 0 and name not in siblings:
            continue  # another package (torch, numpy, ...)
        assert name in siblings, f"{module}.py imports from the package as a whole ({name!r})"
        found.setdefault((name, node.level == 1), set()).update(a.name for a in node.names)
    return found


def test_opt_in_modules_import_only_the_cores_public_names():
    """Every module of the package but the core's imports from the core only names in its
    ``__all__``, from another opt-in module only names in that one's ``__all__``, and from the
    internal module (``_common.py``, which says it is one) anything; that module imports from
    the core only. Each imports the same names in the package (relative imports) as copied
    beside the others (absolute ones), so that copying the core plus them keeps working."""
    import importlib

    modules = sorted(os.path.basename(p)[:-3]
                     for p in glob.glob(os.path.join(ROOT, "stocaching", "*.py")))
    opt_ins = [m for m in modules if m not in CORE | INTERNAL | ENTRY_POINTS]
    assert {"order", "prefetch", "device", "wrapper", "streams"} <= set(opt_ins), modules
    for internal in INTERNAL:
        doc = importlib.import_module(f"stocaching.{internal}").__doc__
        assert doc.startswith("An internal module shared by the opt-in modules: not public"), \
            internal
    wrong = []
    for module in opt_ins + sorted(INTERNAL):
        imports = package_imports(module)
        if module in STANDALONE:
            assert not imports, f"{module}.py should import nothing of the package: {imports}"
            continue
        assert any(name in CORE for name, _ in imports), f"{module}.py imports nothing of the core"
        for (name, relative), names in imports.items():
            if relative:  # both layouts import the same
                assert imports.get((name, False)) == names, (module, name)
            else:
                assert (name, True) in imports, (module, name)
            if name in INTERNAL and module not in INTERNAL:
                continue  # anything
            if module in INTERNAL and name not in CORE:
                wrong.append((module, name, "the internal module imports from the core only"))
                continue
            public = set(importlib.import_module(f"stocaching.{name}").__all__)
            if name == "stocaching":
                public |= set(core._PUBLIC_IN_FEATURES)  # (served by the core's __getattr__)
            if not names <= public:
                wrong.append((module, name, sorted(names - public)))
    assert not wrong, f"imports of names that are not their module's public ones: {wrong}"


def test_feature_modules_import_only_the_cores_public_names_and_its_seam():
    """Each feature module (disk_tier.py, saved.py, ...) imports from the core only names of
    its ``__all__`` and of ``_SEAM``, and from another feature module only that one's
    ``__all__`` and ``_SEAM``, all of them public (no leading underscore); every name of ``_SEAM``
    is used by one; the core imports no feature module at its top (it loads them through
    ``feature_module``), and the seam knows every feature module."""
    import ast

    used = set()
    for module in FEATURES:
        tree = ast.parse(read("stocaching", f"{module}.py"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.module is None:
                continue
            source = node.module.lstrip(".")
            names = {alias.name for alias in node.names}
            if source == "stocaching" or source in FEATURES:
                assert not [n for n in names if n.startswith("_")], (module, source, names)
            if source == "stocaching":
                assert names <= set(core.__all__) | core._SEAM, (
                    module, sorted(names - set(core.__all__) - core._SEAM))
                used |= names & core._SEAM
            elif source in FEATURES:
                other = __import__(f"stocaching.{source}", fromlist=["__all__"])
                allowed = set(other.__all__) | getattr(other, "_SEAM", set())
                assert names <= allowed, (module, source, sorted(names - allowed))
    assert used == core._SEAM, sorted(core._SEAM - used)
    top = {node.module for node in ast.parse(read("stocaching", "stocaching.py")).body
           if isinstance(node, ast.ImportFrom)}
    assert top == {"__future__", "typing"}, top
    assert set(core._FEATURES) == set(FEATURES)


def test_the_code_map_names_only_what_exists():
    """Every name in docs/how-it-works.md's map of the code is defined in the module of its row
    (a function, a class, a method, or an assignment), and the core's __all__ is sorted."""
    import stocaching.stocaching as core

    assert core.__all__ == sorted(core.__all__)
    text = read("docs", "how-it-works.md")
    table = text[text.index("## Map of the code"):]
    module = None
    missing = []
    for row in re.findall(r"^\|(.*)\|$", table, re.M)[2:]:
        first, *rest = row.split("|")
        path = re.search(r"`([\w/]+\.py)`", first)
        if path:
            module = read(*path.group(1).split("/"))
        elif first.strip():
            module = None  # a folder (benchmark/, tests/): not checked name by name
        if module is None:
            continue
        for name in re.findall(r"`([A-Za-z_]\w*)`", "|".join(rest)):
            defined = rf"^\s*(def|class)\s+{name}\b|^\s*{name}\s*[:=]|^[\w, ]*\b{name}\b[\w, ]*="
            if not re.search(defined, module, re.M):
                missing.append((path.group(1) if path else "?", name))
    assert not missing, f"docs/how-it-works.md's map names what its module does not define: {missing}"


def sizing_plans() -> list[tuple[str, str]]:
    """(arguments, output) of each ``$ python -m stocaching plan ...`` block of
    docs/sizing.md."""
    return re.findall(r"```\n\$ python -m stocaching (plan .*?)\n(.*?)```",
                      read("docs", "sizing.md"), re.S)


# The lines of plan's output whose sizes are the machine's: /dev/shm's and the RAM's
MACHINES = re.compile(r"^(the whole dataset needs|RAM) ")
SIZE = re.compile(r"\d+(\.\d+)? [KMGT]?i?B\b")


@pytest.mark.parametrize("command, shown", sizing_plans(),
                         ids=[c.split(" --", 2)[2] for c, _ in sizing_plans()])
def test_the_sizing_pages_plans_print_what_it_shows(command, shown, capsys, monkeypatch):
    """docs/sizing.md's ``python -m stocaching plan`` examples, run as written: each prints
    the lines shown (the sizes of /dev/shm and the RAM aside: they are the machine's), and
    exits with 1 where they end in an error. Where /dev/shm could hold the examples' 64 GiB
    segment, or a memory limit words the RAM line otherwise, they differ by design."""
    room = cli.plan(1281167, (3, 256, 256), size_limit_gib=64)
    if room["shm_free_gib"] >= room["segment_gib"] or room["memory_limit"] is not None:
        pytest.skip("the examples' 64 GiB segment fits in /dev/shm here, or a memory "
                    "limit applies: plan prints other lines than docs/sizing.md shows")
    monkeypatch.delenv("STOCACHING_SHM_DIR", raising=False)
    status = cli.main(command.split())
    lines = [SIZE.sub("N", ln) if MACHINES.match(ln) else ln for ln in shown.splitlines()]
    got = [SIZE.sub("N", ln) if MACHINES.match(ln) else ln
           for ln in capsys.readouterr().out.splitlines()]
    assert got == lines
    assert status == (1 if lines[-1].startswith("error: ") else 0)


@pytest.mark.timeout(240)
def test_the_hugging_face_recipe_runs_as_written(tmp_path, shm_dir):
    """docs/sources.md's recipe, run as a program over a folder of generated PNGs (its one
    change: data_dir)."""
    pytest.importorskip("datasets")
    from test_wrapper import make_pngs
    text = read("docs", "sources.md")
    section = text[text.index("## A Hugging Face dataset"):]
    code = section[section.index("```python\n") + 10: section.index("```\n", section.index(
        "```python\n") + 10)]
    assert 'data_dir = "images"' in code
    make_pngs(str(tmp_path / "images"), n=40)
    program = tmp_path / "recipe.py"
    program.write_text(code.replace('data_dir = "images"', f'data_dir = "{tmp_path / "images"}"'))
    env = dict(os.environ, PYTHONPATH=ROOT, HF_DATASETS_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run([sys.executable, str(program)], capture_output=True, text=True,
                       timeout=200, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.findall(r"epoch (\d): hit rate ([\d.]+)", r.stdout) == [("0", "0.00"),
                                                                      ("1", "1.00")], r.stdout


@pytest.mark.timeout(240)
def test_the_webdataset_recipe_runs_as_written(tmp_path, shm_dir):
    """docs/sources.md's CachedStream recipe, run as a program, unchanged, beside the shards
    it names (16 tar shards of 100 small JPEGs, written here with webdataset's TarWriter)."""
    wds = pytest.importorskip("webdataset")
    import io

    import numpy as np
    from PIL import Image
    text = read("docs", "sources.md")
    section = text[text.index("## Sharded streams"):]
    start = section.index("```python\n") + 10
    code = section[start: section.index("```\n", start)]
    (tmp_path / "shards").mkdir()
    for k in range(16):
        with wds.TarWriter(str(tmp_path / "shards" / f"train-{k:04d}.tar")) as sink:
            for j in range(100):
                buf = io.BytesIO()
                Image.fromarray(np.full((40, 48, 3), (k * 100 + j) % 256, np.uint8)).save(
                    buf, format="JPEG")
                sink.write({"__key__": f"{k * 100 + j:06d}", "jpg": buf.getvalue(),
                            "cls": str(j % 10).encode()})
    program = tmp_path / "recipe.py"
    program.write_text(code + "\n    print(ds.cache.stats()['hit_rate'], len(ds.cache))\n")
    r = subprocess.run([sys.executable, str(program)], capture_output=True, text=True,
                       timeout=200, env=dict(os.environ, PYTHONPATH=ROOT), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    hit_rate, slots = r.stdout.split()
    assert slots == "1600" and abs(float(hit_rate) - 2 / 3) < 1e-9, r.stdout  # epochs 2, 3


def test_the_package_imports_from_the_checkouts_parent_folder(tmp_path):
    """A project that holds its clone as stocaching/ runs from the folder above it: there the
    clone is a folder named stocaching without an __init__.py, which Python took for a
    namespace package before it asked the finder of an editable install (issue 47: 'cannot
    import name SharedCache from stocaching (unknown location)'). setup.cfg's package_dir makes
    pip install -e put the checkout on sys.path instead. Here the parent folder holds a link
    named stocaching to this checkout, and this interpreter is the suite's."""
    import stocaching
    if not stocaching.__file__.startswith(ROOT + os.sep) or "site-packages" in stocaching.__file__:
        pytest.skip("the package is not installed from this checkout with pip install -e")
    (tmp_path / "stocaching").symlink_to(ROOT, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for argv in (["-c", "from stocaching import SharedCache; print(SharedCache.__module__)"],
                 ["-m", "stocaching"]):
        r = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, (argv, r.stderr[-2000:])
    assert "stocaching segments" in r.stdout, r.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_restart_recipe_runs_as_written_and_its_second_attempt_hits(tmp_path, shm_dir):
    """docs/interruptions.md's restart_demo.py, unchanged, under the torchrun command it names:
    its ranks move in step (a barrier a step), and rank 0 (the local leader) SIGKILLs itself
    after saving its state in epoch 1; the restarted attempt reads the rest of epoch 1 and epoch
    2 from the cache (hit rate 1.00), and nothing is left."""
    text = read("docs", "interruptions.md")
    head = "# torchrun --standalone --nproc_per_node=2 --max-restarts=1 restart_demo.py\n"
    code = text[text.index(head): text.index("```", text.index(head))]
    (tmp_path / "restart_demo.py").write_text(code)
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", *head.split()[2:]]
    r = run_bounded(cmd, env=env, timeout=250, cwd=str(tmp_path))
    assert_ended_well(r)
    got = re.findall(r"^attempt (\d) rank (\d) epoch (\d): \d+ reads, hit rate ([\d.]+)$",
                     r.stdout, re.M)
    assert {(a, k, e, h) for a, k, e, h in got if a == "0" and e == "0"} == \
        {("0", "0", "0", "0.00"), ("0", "1", "0", "0.00")}, r.stdout
    second = {(k, e): h for a, k, e, h in got if a == "1"}
    assert second == {("0", "1"): "1.00", ("1", "1"): "1.00", ("0", "2"): "1.00",
                      ("1", "2"): "1.00"}, r.stdout
    assert len(re.findall(r"^attempt 1 rank \d epoch 1: 672 reads", r.stdout, re.M)) == 2
    assert os.listdir(shm_dir) == []
