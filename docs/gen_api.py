"""Write docs/api.md from the docstrings of stocaching's public names.

Run: ``python docs/gen_api.py`` (tests/test_docs.py fails when api.md is out of date).

The page is grouped by audience (``GROUPS``): what a user of the core meets, the opt-in parts,
then what module authors need. Every name of ``stocaching.__all__`` sits in exactly one group;
a new public name makes this script fail until it is given one.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import textwrap

import stocaching

HEAD = """# API reference

Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand. Every name is
importable from `stocaching`.
"""

# The members of BaseCache, which SharedCache and OpenSizeCache share, go to the first group, under
# this heading; the class's own text (how a kind of cache is built) goes to the module authors.
EVERY_CACHE = "What every cache offers"

GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("The cache",
     "What a user of the core meets: the two kinds of cache (`SharedCache` for samples of one "
     "shape, `OpenSizeCache` for samples whose sizes vary) and what both offer, the errors "
     "they raise, who this process is (`World`) and which indices each node caches "
     "(`CacheLayout`), and the functions that size a cache, describe a saved one, and list or "
     "remove leftover segments. The core module and its feature modules: {modules}.",
     ("SharedCache", "OpenSizeCache", EVERY_CACHE, "ReadOnlyView", "CacheCapacityError",
      "CacheConfigError",
      "CacheFileError", "CacheTimeoutError", "World", "CacheLayout", "SlotState", "plan",
      "get_shm_size", "describe_saved_file", "list_segments", "clean_segments")),
    ("The opt-in parts",
     "Modules beside the core that import only its public names (and the internal module they "
     "share, `stocaching/_common.py`), so that each also works copied next to `stocaching.py`, "
     "with `_common.py` and the other opt-ins it imports (see the README): {modules}.",
     ("CacheAwareSampler", "ideal_hit_rate", "Prefetcher", "PrefetchError", "ReadyFirstSampler",
      "ready_first_order", "MixtureDataset", "WeightedMixtureSampler", "DeviceLoader",
      "CachedDataset", "CachedStream", "ShardLayout")),
    ("For module authors",
     "For code that extends the opt-in modules or writes another: the base class of every "
     "kind of cache (its members are under [{every}](#{every_anchor})), where a batch's rows "
     "are (`SharedCache.locate`), the argument check the package raises its errors with, the "
     "helpers that tell a sampler how Accelerate or Lightning drive it, and the constants. "
     "From {modules}.",
     ("BaseCache", "BatchRows", "check_int", "dealt_by_accelerate", "accelerate_epoch",
      "in_lightnings_wrapper", "C_DTYPES", "BYTES_PER_GIB", "MAX_STAGE_TAG",
      "WIDE_WINDOW_PART")),
)

SECTIONS = ("Args:", "Returns:", "Raises:", "Attributes:", "Keywords:", "Example::", "Example:")

# The feature modules that document SharedCache's advanced keywords (their docstrings'
# "Keywords:" sections), in the order of the constructor's arguments.
KEYWORD_MODULES = ("stocaching.staging", "stocaching.persistent", "stocaching.saved",
                   "stocaching.disk_tier")

# Where a constant (an int, a dict) is defined: it carries no module of its own.
MODULES = ("stocaching.stocaching", "stocaching.staging", "stocaching.samplers", "stocaching.order",
           "stocaching.prefetch", "stocaching.mixtures", "stocaching.device")


def _doc(obj) -> str:
    """The docstring as Markdown: Google-style sections become bold headings and lists."""
    return _markdown(inspect.cleandoc(obj.__doc__ or ""))


def _markdown(text: str) -> str:
    """A docstring's text, its indentation cleaned, as Markdown (see ``_doc``)."""
    lines = text.splitlines()
    out: list[str] = []
    section = None
    for ln in lines:
        if ln.strip() in SECTIONS:
            section = ln.strip().rstrip(":")
            out += ["", f"**{section}**", ""]
        elif ln.strip().startswith(".. warning::"):
            section = "warning"
            out += ["", "> **Warning:**"]
        elif section == "warning" and ln.startswith("    "):
            out.append("> " + ln.strip())
        elif section in ("Args", "Attributes", "Raises", "Keywords") and re.match(r"^    \S", ln):
            head, _, rest = ln.strip().partition(": ")
            out.append(f"- `{head}`: {rest}" if rest else f"- {head}")
        elif section and section != "Example" and ln.startswith("        "):
            out[-1] += " " + ln.strip()
        elif section == "Returns" and ln.startswith("    "):
            out.append(ln.strip())
        else:
            if ln.strip() == "" and section not in ("Example",):
                section = None if section == "warning" else section
            out.append(ln)
    return "\n".join(out).strip()


def _sig(name: str, obj) -> str:
    try:
        if inspect.isclass(obj) and "__new__" in vars(obj) and "__init__" in vars(obj):
            # A __new__ that picks a subclass (SharedCache's, for fields) takes whatever
            # __init__ takes: show __init__'s arguments, which inspect would hide behind it.
            sig = inspect.signature(obj.__init__)
            sig = sig.replace(parameters=list(sig.parameters.values())[1:],
                              return_annotation=inspect.Signature.empty)
            return f"{name}{sig}"
        return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return name


def _module_of(name: str, obj) -> str:
    if inspect.isclass(obj) or inspect.isroutine(obj):
        return obj.__module__
    for module in MODULES:
        if re.search(rf"^{name}\s*[:=]", inspect.getsource(importlib.import_module(module)),
                     re.M):
            return module
    raise ValueError(f"gen_api: no module of {MODULES} assigns {name}")


def _constant(name: str, obj) -> str:
    """A constant: its assignment as the source writes it (with the value, for a number) and
    the comment lines right above it."""
    lines = inspect.getsource(importlib.import_module(_module_of(name, obj))).splitlines()
    at = next(i for i, ln in enumerate(lines) if re.match(rf"{name}\s*[:=]", ln))
    head = re.match(rf"({name}\s*(?::[^=]*)?)=", lines[at]).group(1).strip()
    if isinstance(obj, (int, float, str)) and not isinstance(obj, bool):
        head = f"{head} = {obj!r}"
    comment = []
    for ln in reversed(lines[:at]):
        if not ln.startswith("#"):
            break
        comment.insert(0, re.sub(r"^#:? ?", "", ln))
    text = _fill(" ".join(comment).strip())
    return f"### `{name}`\n\n```python\n{head}\n```\n" + (f"\n{text}\n" if text else "")


def _feature_keywords() -> str:
    """SharedCache's advanced keywords as their feature modules document them."""
    out = ["**The feature modules' keywords**", "",
           _fill("Each is documented in the module beside the core that serves it, loaded when "
                 "the keyword is used:")]
    for module in KEYWORD_MODULES:
        doc = inspect.cleandoc(importlib.import_module(module).__doc__)
        body = _markdown(doc[doc.index("Keywords:"):]).replace("**Keywords**", "").strip()
        out += ["", f"From `{module.replace('.', '/')}.py`:", "", body]
    return "\n".join(out)


def _members(name: str, obj, level: str) -> list[str]:
    out = []
    for attr, member in vars(obj).items():
        if type(member).__name__ == "_FromFeature":  # a method whose code is a feature's
            member = member.__get__(None, obj)
        if attr.startswith("_") and attr not in ("__len__", "__getitem__", "__setitem__",
                                                 "__iter__"):
            continue
        if isinstance(member, property):
            if member.__doc__:
                out.append(f"{level} `{name}.{attr}` (property)\n\n{_doc(member)}\n")
        elif isinstance(member, (classmethod, staticmethod)):
            fn = member.__func__
            out.append(f"{level} `{name}.{_sig(attr, fn)}`\n\n{_doc(fn)}\n")
        elif inspect.isfunction(member) and member.__doc__:
            out.append(f"{level} `{name}.{_sig(attr, member)}`\n\n{_doc(member)}\n")
    return out


def _entry(name: str) -> list[str]:
    if name == EVERY_CACHE:
        base = stocaching.BaseCache
        return [f"### {EVERY_CACHE}\n\n" + _fill(
                    "`SharedCache` and `OpenSizeCache` both have these, from their base class "
                    "[`BaseCache`](#basecache); where a kind has its own version, it is listed "
                    "under that kind above.") + "\n",
                *_members("BaseCache", base, "####")]
    obj = getattr(stocaching, name)
    if not (inspect.isclass(obj) or inspect.isroutine(obj)):
        return [_constant(name, obj)]
    kind = "class" if inspect.isclass(obj) else "function"
    out = [f"### `{name}`\n\n```python\n{kind} {_sig(name, obj)}\n```\n\n{_doc(obj)}\n"]
    if name == "SharedCache":
        out.append(_feature_keywords() + "\n")
    if name == "BaseCache":
        out.append(f"Its properties and methods: [{EVERY_CACHE}](#{_anchor(EVERY_CACHE)}).\n")
    elif inspect.isclass(obj) and not issubclass(obj, BaseException):
        out += _members(name, obj, "####")
    return out


def _fill(text: str, indent: str = "") -> str:
    """Generated prose wrapped as the hand-written pages are (96 columns), links unbroken."""
    return textwrap.fill(text, 96, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False)


def _anchor(heading: str) -> str:
    """The anchor GitHub and mkdocs give a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _check_groups() -> None:
    placed = [n for _, _, names in GROUPS for n in names if n != EVERY_CACHE]
    public = set(stocaching.__all__)
    twice = sorted({n for n in placed if placed.count(n) > 1})
    missing, unknown = sorted(public - set(placed)), sorted(set(placed) - public)
    if twice or missing or unknown:
        raise ValueError(
            f"gen_api: every public name belongs to exactly one of GROUPS in docs/gen_api.py, "
            f"but got names in no group: {missing}, names in two: {twice}, names not public: "
            f"{unknown}")


def render() -> str:
    _check_groups()
    out = [HEAD]
    contents = []
    for title, _, names in GROUPS:
        links = ", ".join(f"[{n}](#{_anchor(n)})" if n == EVERY_CACHE else f"[`{n}`](#{n.lower()})"
                          for n in names)
        contents.append(_fill(f"- [{title}](#{_anchor(title)}): {links}", indent="  "))
    out.append("\n".join(contents) + "\n")
    for title, intro, names in GROUPS:
        modules: dict[str, list[str]] = {}
        for n in names:
            if n != EVERY_CACHE:
                modules.setdefault(_module_of(n, getattr(stocaching, n)), []).append(n)
        where = ", ".join(f"`{m.replace('.', '/')}.py` (" + ", ".join(f"`{n}`" for n in ns) + ")"
                          for m, ns in modules.items()) if len(modules) > 1 else \
            f"`{next(iter(modules)).replace('.', '/')}.py`"
        text = intro.format(modules=where, every=EVERY_CACHE, every_anchor=_anchor(EVERY_CACHE))
        out.append(f"## {title}\n\n{_fill(text)}\n")
        for name in names:
            out += _entry(name)
    return "\n".join(out)


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "api.md")
    with open(path, "w") as f:
        f.write(render())
    sys.stdout.write(f"wrote {path}\n")
