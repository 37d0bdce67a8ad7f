"""MkDocs hooks for the documentation site (mkdocs.yml ``hooks:``).

``mkdocs build --strict`` fails on every warning. mkdocstrings hides a member that has no docstring instead of
warning, so this hook reports them: for each ``::: identifier`` block of an API page, the object and every public
function, class, method or property it renders (its ``__all__`` for a module, its own public members for a class,
``options: members:`` where the block lists them) must have a docstring. Attributes (dataclass fields, constants)
are described in their class's or module's docstring and are not required to have their own, except those that are
functions made with ``functools.partial``.

:class:`DocAssignments` (a griffe extension, also given to mkdocstrings in mkdocs.yml) reads ``name.__doc__ = "..."``
assignments, which static analysis otherwise misses (TransformerLens-style ``functools.partial`` functions).
"""

from __future__ import annotations

import ast
import inspect
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


class DocAssignments(griffe.Extension):
    """Give ``name`` the docstring of a module-level ``name.__doc__ = "..."`` assignment."""

    def on_module_members(self, *, node: ast.AST | griffe.ObjectNode, mod: griffe.Module, **kwargs: Any) -> None:
        """Called by griffe once a module's members are loaded."""
        if not isinstance(node, ast.Module):
            return
        for stmt in node.body:
            if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
                continue
            target, value = stmt.targets[0], stmt.value
            if not (isinstance(target, ast.Attribute) and target.attr == "__doc__"):
                continue
            if not isinstance(target.value, ast.Name):
                continue
            obj = mod.members.get(target.value.id)
            if obj is None or obj.is_alias or obj.docstring or not isinstance(value, ast.Constant):
                continue
            if isinstance(value.value, str):
                text = inspect.cleandoc(value.value)
                obj.docstring = griffe.Docstring(text, lineno=stmt.lineno, endlineno=stmt.end_lineno, parent=obj)


@cache
def _package(name: str) -> griffe.Object:
    """The statically loaded package (as mkdocstrings loads it, from the repository root)."""
    loaded = griffe.load(
        name,
        search_paths=[str(ROOT)],
        resolve_aliases=True,
        resolve_external=False,
        extensions=griffe.load_extensions(DocAssignments),
    )
    assert isinstance(loaded, griffe.Object)
    return loaded


def _lookup(path: str) -> griffe.Object | griffe.Alias:
    package, _, rest = path.partition(".")
    root = _package(package)
    return root[rest] if rest else root


def _target(obj: griffe.Object | griffe.Alias) -> griffe.Object:
    return obj.final_target if isinstance(obj, griffe.Alias) else obj  # type: ignore[return-value]


def _needs_docstring(obj: griffe.Object) -> bool:
    partial = obj.is_attribute and str(getattr(obj, "value", "")).startswith(("functools.partial(", "partial("))
    return obj.is_function or obj.is_class or obj.is_module or partial


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
