"""MkDocs hooks for the documentation site (mkdocs.yml ``hooks:``).

``mkdocs build --strict`` fails on every warning. mkdocstrings hides a member that has no docstring instead of
warning, so this hook reports them: for each ``::: identifier`` block of an API page, the object and every public
function, class, method or property it renders (its ``__all__`` for a module, its own public members for a class,
``options: members:`` where the block lists them) must have a docstring. Attributes (dataclass fields, constants)
are described in their class's or module's docstring and are not required to have their own.
"""

from __future__ import annotations

import logging
import re
from functools import cache
from pathlib import Path
from typing import Any

import griffe
import yaml

log = logging.getLogger("mkdocs.hooks.lens_aot")

ROOT = Path(__file__).resolve().parent.parent
_DIRECTIVE = re.compile(r"^::: ([\w.]+)[ \t]*\n((?:[ \t]+.*\n?)*)", re.MULTILINE)


@cache
def _package(name: str) -> griffe.Object:
    """The statically loaded package (as mkdocstrings loads it, from the repository root)."""
    loaded = griffe.load(name, search_paths=[str(ROOT)], resolve_aliases=True, resolve_external=False)
    assert isinstance(loaded, griffe.Object)
    return loaded


def _lookup(path: str) -> griffe.Object | griffe.Alias:
    package, _, rest = path.partition(".")
    root = _package(package)
    return root[rest] if rest else root


def _target(obj: griffe.Object | griffe.Alias) -> griffe.Object:
    return obj.final_target if isinstance(obj, griffe.Alias) else obj  # type: ignore[return-value]


def _needs_docstring(obj: griffe.Object) -> bool:
    return obj.is_function or obj.is_class or obj.is_module


def undocumented(path: str, members: list[str] | None = None) -> list[str]:
    """Paths of the objects a ``::: path`` block renders (with ``members`` if it names them) that lack a docstring."""
    root = _target(_lookup(path))
    missing = [] if root.docstring else [root.path]
    if root.is_module:
        public = [n for n, m in root.members.items() if not n.startswith("_") and not m.is_alias]
        names = members if members is not None else list(root.exports) if root.exports is not None else public
        children = [root[name] for name in names]
    elif root.is_class:
        names = members if members is not None else [n for n in root.members if not n.startswith("_")]
        children = [root.members[name] for name in names if not root.members[name].is_alias]
    else:
        children = []
    for child in children:
        target = _target(child)
        if target.is_module or not _needs_docstring(target):
            continue
        if not target.docstring:
            missing.append(target.path)
        if target.is_class:
            missing += [
                m.path
                for name, m in target.members.items()
                if not name.startswith("_") and not m.is_alias and _needs_docstring(m) and not m.docstring
            ]
    return missing


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Warn (an error under ``--strict``) for every undocumented public member an API block on this page renders."""
    for match in _DIRECTIVE.finditer(markdown):
        options = yaml.safe_load(match.group(2)) if match.group(2).strip() else None
        members = (options or {}).get("options", {}).get("members")
        for path in undocumented(match.group(1), members if isinstance(members, list) else None):
            log.warning(f"{page.file.src_path}: {path} has no docstring (public API; add one)")
    return markdown
