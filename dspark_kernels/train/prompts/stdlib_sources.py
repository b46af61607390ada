"""Standard-library source files, parsed (never imported): functions with their signatures, docstrings and code,
and documented classes."""

from __future__ import annotations

import ast
import sysconfig
import textwrap
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

MAX_SNIPPET_CHARS = 1500


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@lru_cache(maxsize=None)
def parse_module(module: str) -> tuple[str, ast.Module] | None:
    """Source text and syntax tree of a standard-library module, or None where its file is absent or unparsable."""
    base = _stdlib_root().joinpath(*module.split("."))
    for path in (base.with_name(base.name + ".py"), base / "__init__.py"):
        if path.is_file():
            source = path.read_text(encoding="utf-8", errors="replace")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    return source, ast.parse(source)
                except SyntaxError:
                    return None
    return None


@dataclass(frozen=True)
class StdlibFunction:
    module: str
    owner: str  # enclosing class name, "" for a module-level function
    name: str
    signature: str  # "def name(args) -> returns"
    doc_line: str  # first line of the docstring, "" if none
    code: str  # dedented source without the docstring, "" if it does not stand alone
    annotated: bool

    @property
    def qualname(self) -> str:
        return f"{self.owner}.{self.name}" if self.owner else self.name

    @property
    def public(self) -> bool:
        return not self.name.startswith("_") and not self.owner.startswith("_")

    @property
    def is_snippet(self) -> bool:
        """Short enough to quote: 3-20 non-blank lines and at most ``MAX_SNIPPET_CHARS`` characters."""
        lines = sum(1 for line in self.code.splitlines() if line.strip())
        return 3 <= lines <= 20 and len(self.code) <= MAX_SNIPPET_CHARS


def _first_line(doc: str | None) -> str:
    if not doc:
        return ""
    line = doc.strip().splitlines()[0].strip()
    return line if 10 <= len(line) <= 200 else ""


def _docstring_node(node: ast.AST) -> ast.Expr | None:
    body = getattr(node, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0]
    return None


def _function_info(module: str, owner: str, node: ast.FunctionDef | ast.AsyncFunctionDef,
                   lines: list[str]) -> StdlibFunction:
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    signature = f"{prefix} {node.name}({ast.unparse(node.args)})"
    if node.returns is not None:
        signature += f" -> {ast.unparse(node.returns)}"
    doc = _docstring_node(node)
    start = min([d.lineno for d in node.decorator_list] + [node.lineno])
    kept = [lines[i - 1] for i in range(start, node.end_lineno + 1)
            if doc is None or not doc.lineno <= i <= doc.end_lineno]
    code = textwrap.dedent("\n".join(kept)).strip("\n")
    code = "\n".join(line.rstrip() for line in code.splitlines())
    if doc is not None and len(node.body) == 1:
        code = ""
    try:
        parsed = ast.parse(code) if code else None
    except SyntaxError:
        parsed = None
    if parsed is None or len(parsed.body) != 1 or not isinstance(parsed.body[0], (ast.FunctionDef,
                                                                                   ast.AsyncFunctionDef)):
        code = ""
    arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
    annotated = node.returns is not None or any(a.annotation is not None for a in arguments)
    return StdlibFunction(module, owner, node.name, signature, _first_line(ast.get_docstring(node)), code, annotated)


@lru_cache(maxsize=None)
def module_functions(module: str) -> tuple[StdlibFunction, ...]:
    """Module-level functions and methods of module-level classes, in source order."""
    parsed = parse_module(module)
    if parsed is None:
        return ()
    source, tree = parsed
    lines = source.splitlines()
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append(_function_info(module, "", node, lines))
        elif isinstance(node, ast.ClassDef):
            out.extend(_function_info(module, node.name, item, lines) for item in node.body
                       if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return tuple(out)


@lru_cache(maxsize=None)
def module_classes(module: str) -> tuple[tuple[str, str], ...]:
    """(name, first docstring line) of the public module-level classes that have a docstring."""
    parsed = parse_module(module)
    if parsed is None:
        return ()
    return tuple((node.name, _first_line(ast.get_docstring(node))) for node in parsed[1].body
                 if isinstance(node, ast.ClassDef) and not node.name.startswith("_")
                 and _first_line(ast.get_docstring(node)))
