"""Write docs/api.md from the docstrings of stocaching's public names.

Run: ``python docs/gen_api.py`` (tests/test_docs.py fails when api.md is out of date).
"""

from __future__ import annotations

import inspect
import os
import re
import sys

import stocaching

HEAD = """# API reference

Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand.

"""


SECTIONS = ("Args:", "Returns:", "Raises:", "Attributes:", "Example::", "Example:")


def _doc(obj) -> str:
    """The docstring as Markdown: Google-style sections become bold headings and lists."""
    lines = inspect.cleandoc(obj.__doc__ or "").splitlines()
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
        elif section in ("Args", "Attributes", "Raises") and re.match(r"^    \S", ln):
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


def render() -> str:
    out = [HEAD]
    for name in sorted(stocaching.__all__, key=lambda n: (not inspect.isclass(
            getattr(stocaching, n)), n)):
        obj = getattr(stocaching, name)
        kind = "class" if inspect.isclass(obj) else "function"
        out.append(f"## `{name}`\n\n```python\n{kind} {_sig(name, obj)}\n```\n\n{_doc(obj)}\n")
        if not inspect.isclass(obj) or issubclass(obj, BaseException):
            continue
        for attr, member in vars(obj).items():
            if attr.startswith("_") and attr not in ("__len__", "__getitem__", "__setitem__",
                                                     "__iter__"):
                continue
            if isinstance(member, property):
                if member.__doc__:
                    out.append(f"### `{name}.{attr}` (property)\n\n{_doc(member)}\n")
            elif isinstance(member, (classmethod, staticmethod)):
                fn = member.__func__
                out.append(f"### `{name}.{_sig(attr, fn)}`\n\n{_doc(fn)}\n")
            elif inspect.isfunction(member) and member.__doc__:
                out.append(f"### `{name}.{_sig(attr, member)}`\n\n{_doc(member)}\n")
    return "\n".join(out)


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "api.md")
    with open(path, "w") as f:
        f.write(render())
    sys.stdout.write(f"wrote {path}\n")
