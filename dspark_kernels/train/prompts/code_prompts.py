"""Code prompts: tasks on real standard-library functions, including snippets with a deterministically injected
bug whose correct version is the answer."""

from __future__ import annotations

import ast
import random
from collections.abc import Callable, Sequence
from functools import lru_cache

from .splits import SPLITS, heldout_sources, make_record, pick, seeded_rng
from .stdlib_sources import StdlibFunction, module_classes, module_functions

# Pure-Python standard-library modules (C modules have no source to read). GUI, test and side-effect modules are
# left out; the files are parsed, not imported, so an entry missing from some installation is merely skipped.
CODE_MODULES = tuple(sorted((
    "_pydecimal", "abc", "argparse", "ast", "base64", "bdb", "bisect", "calendar", "cmd", "code", "codeop",
    "collections", "colorsys", "concurrent.futures._base", "configparser", "contextlib", "copy", "copyreg", "csv",
    "dataclasses", "datetime", "difflib", "dis", "doctest", "email.header", "email.utils", "enum", "filecmp",
    "fileinput", "fnmatch", "fractions", "ftplib", "functools", "genericpath", "getopt", "gettext", "glob",
    "graphlib", "gzip", "heapq", "hmac", "html", "html.parser", "http.cookies", "imaplib", "inspect", "ipaddress",
    "json.decoder", "json.encoder", "keyword", "linecache", "locale", "logging", "mailbox", "mimetypes", "netrc",
    "ntpath", "numbers", "operator", "optparse", "pathlib", "pickletools", "pkgutil", "platform", "plistlib",
    "poplib", "posixpath", "pprint", "pstats", "py_compile", "pyclbr", "queue", "quopri", "random", "re._parser",
    "reprlib", "rlcompleter", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib",
    "socketserver", "stat", "statistics", "string", "subprocess", "symtable", "tabnanny", "tarfile", "tempfile",
    "textwrap", "threading", "timeit", "token", "tokenize", "tomllib._parser", "trace", "traceback", "types",
    "typing", "unittest.case", "unittest.mock", "urllib.parse", "urllib.request", "uuid", "warnings", "wave",
    "weakref", "wsgiref.headers", "wsgiref.util", "xml.dom.minidom", "zipapp", "zipfile",
)))

_SIGNATURE_PHRASINGS = (
    "Write a Python function with this signature and docstring:\n\n```python\n{stub}\n```",
    "Implement the following function. Keep the signature exactly as given.\n\n```python\n{stub}\n```",
    "Complete this Python function so that it does what its docstring says:\n\n```python\n{stub}\n```",
    "Here is a stub modeled on the `{module}` module of the standard library. Write the body.\n\n"
    "```python\n{stub}\n```",
    "Fill in the implementation:\n\n```python\n{stub}\n```\n\nExplain any design choices briefly.",
)
_EXPLAIN_PHRASINGS = (
    "Explain what this code does:\n\n```python\n{code}\n```",
    "What does the following Python function do? Describe it step by step.\n\n```python\n{code}\n```",
    "Read this code from Python's `{module}` module and explain how it works:\n\n```python\n{code}\n```",
    "Walk me through this function line by line:\n\n```python\n{code}\n```",
    "Describe in plain English what this function returns and what side effects it has:\n\n```python\n{code}\n```",
)
_FIX_PHRASINGS = (
    "Fix the bug in this code:\n\n```python\n{code}\n```",
    "This function has a bug. Find it, explain it, and give the corrected code.\n\n```python\n{code}\n```",
    "The following Python code does not behave as intended. Identify the mistake and fix it:\n\n"
    "```python\n{code}\n```",
    "Something is wrong with this function adapted from the `{module}` module. What is the bug and how do you fix "
    "it?\n\n```python\n{code}\n```",
)
_FIX_HINTS = {
    "off_by_one": "There is an off-by-one error in this code. Find it and fix it:\n\n```python\n{code}\n```",
    "wrong_operator": "One operator in this function is wrong. Find it and fix it:\n\n```python\n{code}\n```",
    "swapped_args": "Two arguments in one call in this function are passed in the wrong order. Fix it:\n\n"
                    "```python\n{code}\n```",
    "missing_return": "This function computes its result but does not return it in every case. Fix it:\n\n"
                      "```python\n{code}\n```",
}
_TYPE_HINT_PHRASINGS = (
    "Add type hints to this function:\n\n```python\n{code}\n```",
    "Rewrite this Python function with complete type annotations for its parameters and return value:\n\n"
    "```python\n{code}\n```",
    "Annotate this function with type hints that would pass a strict type checker:\n\n```python\n{code}\n```",
)
_DOCSTRING_PHRASINGS = (
    "Write a docstring for this function:\n\n```python\n{code}\n```",
    "Add a Google-style docstring to this Python function:\n\n```python\n{code}\n```",
    "Document this function: write a concise docstring that explains its arguments and return value.\n\n"
    "```python\n{code}\n```",
    "Add a NumPy-style docstring to this function:\n\n```python\n{code}\n```",
)
_UNIT_TEST_SNIPPET_PHRASINGS = (
    "Write a unit test for this function:\n\n```python\n{code}\n```",
    "Write pytest tests that cover the normal cases and the edge cases of this function:\n\n```python\n{code}\n```",
)
_UNIT_TEST_API_PHRASINGS = (
    "Write pytest tests for `{module}.{qualname}`, whose signature is `{signature}` and whose documentation says: "
    "\"{doc}\"",
    "Write a `unittest.TestCase` that checks `{module}.{qualname}` ({signature}). Its docstring reads: \"{doc}\"",
)
_USAGE_PHRASINGS = (
    "Show a short example of how to use `{module}.{name}` in Python.",
    "How do I use `{module}.{name}`? Give a small runnable example.",
    "Give an example that uses `{module}.{name}`, which is documented as: \"{doc}\"",
    "What is `{module}.{name}` for, and when would I use it? Include a code example.",
)
_REVIEW_PHRASINGS = (
    "Review this function and point out any edge cases it does not handle:\n\n```python\n{code}\n```",
    "Suggest how to make this code more readable, then show the improved version:\n\n```python\n{code}\n```",
    "What is the time complexity of this function? Explain your reasoning.\n\n```python\n{code}\n```",
    "Rewrite this function in a more modern Python style without changing its behavior:\n\n```python\n{code}\n```",
)

_INCLUSIVE_FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
_BINOP_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.FloorDiv: ast.Mult, ast.BitAnd: ast.BitOr,
               ast.BitOr: ast.BitAnd}
_COMPARE_SWAP = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn,
                 ast.NotIn: ast.In}
_BUGS = ("off_by_one", "wrong_operator", "swapped_args", "missing_return")


def _is_int(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def _bug_sites(tree: ast.AST) -> dict[str, list[Callable[[], None]]]:
    """Per bug kind, one closure per place in ``tree`` where it can be injected, in ``ast.walk`` order."""
    sites: dict[str, list[Callable[[], None]]] = {bug: [] for bug in _BUGS}
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            if type(node.ops[0]) in _INCLUSIVE_FLIP:
                sites["off_by_one"].append(lambda n=node: n.ops.__setitem__(0, _INCLUSIVE_FLIP[type(n.ops[0])]()))
            if type(node.ops[0]) in _COMPARE_SWAP:
                sites["wrong_operator"].append(lambda n=node: n.ops.__setitem__(0, _COMPARE_SWAP[type(n.ops[0])]()))
        elif isinstance(node, ast.BinOp):
            if isinstance(node.op, (ast.Add, ast.Sub)) and _is_int(node.right):
                sites["off_by_one"].append(lambda n=node: setattr(n.right, "value", n.right.value + 1))
            if type(node.op) in _BINOP_SWAP and not isinstance(node.left, (ast.Constant, ast.JoinedStr)):
                sites["wrong_operator"].append(lambda n=node: setattr(n, "op", _BINOP_SWAP[type(n.op)]()))
        elif isinstance(node, ast.BoolOp):
            sites["wrong_operator"].append(
                lambda n=node: setattr(n, "op", ast.Or() if isinstance(n.op, ast.And) else ast.And()))
        elif isinstance(node, ast.Call):
            if len(node.args) >= 2 and not any(isinstance(a, ast.Starred) for a in node.args[:2]) \
                    and ast.dump(node.args[0]) != ast.dump(node.args[1]):
                sites["swapped_args"].append(lambda n=node: n.args.__setitem__(slice(0, 2), [n.args[1], n.args[0]]))
        for field in ("body", "orelse", "finalbody"):
            statements = getattr(node, field, None)
            if not isinstance(statements, list):
                continue
            for i, stmt in enumerate(statements):
                if isinstance(stmt, ast.Return) and stmt.value is not None \
                        and not (isinstance(stmt.value, ast.Constant) and stmt.value.value is None):
                    sites["missing_return"].append(lambda s=statements, j=i: s.__setitem__(j, ast.Expr(s[j].value)))
    return sites


@lru_cache(maxsize=None)
def _normalized(code: str) -> str:
    return ast.unparse(ast.parse(code))


def _inject_bug(code: str, rng: random.Random) -> tuple[str, str, str] | None:
    """(buggy code, correct code, bug kind) for a snippet, both normalized by ``ast.unparse``; None if no site."""
    tree = ast.parse(code)
    sites = _bug_sites(tree)
    bugs = list(_BUGS)
    rng.shuffle(bugs)
    bug = next((b for b in bugs if sites[b]), None)
    if bug is None:
        return None
    rng.choice(sites[bug])()
    buggy, correct = ast.unparse(tree), _normalized(code)
    return (buggy, correct, bug) if buggy != correct else None


def _stub(fn: StdlibFunction) -> str:
    doc = fn.doc_line.replace("\\", "\\\\").replace('"""', "'''")
    if fn.owner:
        return f"class {fn.owner}:\n    {fn.signature}:\n        \"\"\"{doc}\"\"\"\n        ..."
    return f"{fn.signature}:\n    \"\"\"{doc}\"\"\"\n    ..."


def _code_candidates(modules: Sequence[str], rng: random.Random) -> list[dict]:
    out = []
    for module in modules:
        for fn in module_functions(module):
            fields = {"module": module, "qualname": fn.qualname, "signature": fn.signature, "doc": fn.doc_line}
            if fn.public and fn.doc_line:
                out.append(make_record("signature", module, pick(rng, _SIGNATURE_PHRASINGS, stub=_stub(fn), **fields)))
                out.append(make_record("unit_test", module, pick(rng, _UNIT_TEST_API_PHRASINGS, **fields)))
                if not fn.owner:
                    out.append(make_record("usage", module, pick(rng, _USAGE_PHRASINGS, name=fn.name, **fields)))
            if not fn.is_snippet:
                continue
            fields["code"] = fn.code
            out.append(make_record("explain", module, pick(rng, _EXPLAIN_PHRASINGS, **fields)))
            out.append(make_record("docstring", module, pick(rng, _DOCSTRING_PHRASINGS, **fields)))
            out.append(make_record("review", module, pick(rng, _REVIEW_PHRASINGS, **fields)))
            out.append(make_record("unit_test", module, pick(rng, _UNIT_TEST_SNIPPET_PHRASINGS, **fields)))
            if not fn.annotated and fn.signature != f"def {fn.name}()":
                out.append(make_record("type_hints", module, pick(rng, _TYPE_HINT_PHRASINGS, **fields)))
            bug = _inject_bug(fn.code, rng)
            if bug is not None:
                buggy, correct, kind = bug
                phrasings = _FIX_PHRASINGS + (_FIX_HINTS[kind],)
                out.append(make_record("fix", module, pick(rng, phrasings, module=module, code=buggy), correct))
        for name, doc in module_classes(module):
            fields = {"module": module, "name": name, "doc": doc}
            out.append(make_record("usage", module, pick(rng, _USAGE_PHRASINGS, **fields)))
    return out


def code_splits(seed: int) -> dict[str, list[dict]]:
    held = heldout_sources(CODE_MODULES, "code")
    return {split: _code_candidates([m for m in CODE_MODULES if (m in held) == (split == "heldout")],
                                    seeded_rng(seed, "code", split)) for split in SPLITS}
